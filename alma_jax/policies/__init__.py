"""Policies of the stream loop: how a learner starts a stage, and when it trains.

A stage policy (`StagePolicy`, chosen by `config.stream.warm_start`) says how
a learner starts each training stage: from what it has learnt (finetune) or
afresh (scratch); the loop applies it to every learner of every method
through its one hook, `StagePolicy.start_stage`. A waiting policy
(`WaitPolicy`, chosen by `config.stream.wait_policy`) says at which time
steps the learner trains (`WaitPolicy.decide`): fixed (every w mega-batches,
the default), geometric (at ceil(w0 * r^k)) or triggered (when the new
data's error, or the share of unseen data, calls for it).

Every module of this package is imported here, so a policy defined (and
`@register`ed) in a new file `alma_jax/policies/<name>.py` is available by
its name without further edits.
"""

from __future__ import annotations

import importlib
import pkgutil

from alma_jax.policies.base import (Decision, StagePolicy, Started, WaitPolicy, check_stage,
                                    check_wait, make_stage, make_wait, register, stage_names,
                                    wait_class, wait_names)

for _info in pkgutil.iter_modules(__path__):
  importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["Decision", "StagePolicy", "Started", "WaitPolicy", "check_stage", "check_wait",
           "make_stage", "make_wait", "register", "stage_names", "wait_class", "wait_names"]

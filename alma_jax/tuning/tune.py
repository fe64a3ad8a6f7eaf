"""The speed choices of a run, behind one entry point.

A speed choice changes how fast a run goes, never what it learns (at most the
order of float summation). Two moments apply them:

  `process_flags(...)`    glibc's allocator (`train.cpu_allocator`), the XLA:CPU fusion flags,
                          XLA:GPU's autotuning level and the GPU's Threefry hash
                          (`train.gpu_threefry`), before JAX starts its backend;
  `run_choices(...)`      the fields left to be chosen (`model.conv_impl='auto'`,
                          `method.strategy='auto'`, `train.steps_per_call=0`,
                          `train.eval_fusion='auto'`), measured once
                          per machine and remembered (`autotune.py`), with the fusion decision
                          recorded beside them.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
from absl import logging

from alma_jax import models
from alma_jax.configuration import fields as F
from alma_jax.outputs import workdir as wd
from alma_jax.tuning import autotune
from alma_jax.tuning import cpu_fusion
from alma_jax.tuning import cpu_tuning
from alma_jax.tuning import gpu_autotune
from alma_jax.tuning import gpu_threefry

signature = autotune.signature
with_choices = autotune.with_choices
example_unit = autotune.example_unit  # what a speed counts: tokens for text, images


def process_flags(config, workdir: str | None, *, shapes, multiprocess: bool,
                  debug: bool = False) -> None:
  """Tunes glibc's allocator for `config.train.cpu_allocator` (by rule) and sets XLA_FLAGS for
  `config.train.cpu_fusion` (measured in a child process or by rule).

  Args:
    config: the run's config.
    workdir: where an earlier run's choice may be remembered (None: measure afresh).
    shapes: the data set's input shape, when known before loading it.
    multiprocess: the run spans several processes (they must agree: by rule).
    debug: raise a failed measurement instead of falling back to the rule.
  """
  try:
    allocator, how = cpu_tuning.choose(F.get(config.train, cpu_tuning.FIELD),
                                       conv_heavy=models.spec(config.model.name).conv_heavy,
                                       accelerator=cpu_fusion.accelerator_expected())
  except Exception as e:  # pylint: disable=broad-except  (the run's validation names the field)
    if debug:
      raise
    allocator, how = "glibc", f"by default ({type(e).__name__}: {e})"
  if allocator == "tuned" and not cpu_tuning.apply():
    allocator, how = "glibc", f"{how}; not applied (not glibc)"
  logging.info("%s: %r %s", cpu_tuning.FIELD, allocator, how)
  try:
    value, how = cpu_fusion.choose(config, workdir, shapes=shapes, multiprocess=multiprocess)
  except Exception as e:  # pylint: disable=broad-except  (a speed choice never stops a run)
    if debug:
      raise
    value, how = cpu_fusion.RULE, f"by rule ({type(e).__name__}: {e})"
  cpu_fusion.apply(value)
  logging.info("%s: %r %s; XLA_FLAGS=%r", cpu_fusion.FIELD, value, how,
               os.environ.get("XLA_FLAGS", ""))
  _gpu_level.clear()
  try:
    level, how = gpu_autotune.choose(config, cpu_fusion.accelerator_expected())
  except Exception as e:  # pylint: disable=broad-except  (a speed choice never stops a run)
    if debug:
      raise
    level, how = None, f"not set ({type(e).__name__}: {e})"
  if level is not None:
    gpu_autotune.apply(level)
    _gpu_level.append(level)
    logging.info("%s: %r %s", gpu_autotune.FIELD, level, how)
  threefry = F.get(config.train, gpu_threefry.FIELD)
  if threefry in gpu_threefry.CHOICES:  # a setting of JAX's; the run's validation names a bad one
    gpu_threefry.apply(threefry)


def resumed(config, workdir: str | None, log: bool = True):
  """`config` with the fields it leaves to be chosen that the run held by `workdir` (the run
  it resumes) set, at the values that run had (`autotune.kept_from`), each logged where
  `log`; `config` itself where there are none."""
  kept = autotune.kept_from(config, None if workdir is None else wd.previous_config(workdir))
  for path, value in kept.items() if log else ():
    logging.info("%s: %r as the resumed run had it (the config leaves it to be chosen)",
                 path, value)
  return with_choices(config, kept) if kept else config


def allocator_for(backbones, setting: str = "auto") -> bool:
  """Tunes glibc's allocator if a run of every backbone named would, on a CPU, under
  `train.cpu_allocator=setting`: for a benchmark that times these backbones in one process,
  before JAX starts its backend. Returns whether the allocator is tuned."""
  if all(cpu_tuning.choose(setting, conv_heavy=models.spec(b).conv_heavy,
                           accelerator=False)[0] == "tuned" for b in backbones):
    return cpu_tuning.apply()
  return cpu_tuning.is_applied()


_gpu_level: list[str] = []  # the autotuning level this process set (`process_flags`)


def run_choices(config, input_shape, build_steps: Callable[[Any], Any],
                workdir: str) -> tuple[dict[str, Any], tuple]:
  """(the values of the fields left to be chosen and the fusion flags in effect, what the
  workdir is to remember of them: pass it to `remember_in_workdir` once the run owns it).

  Args:
    config: the run's config.
    input_shape: one example's shape.
    build_steps: config -> its compiled steps (a measured candidate's serve the run).
    workdir: the run's folder; its `autotune.json` remembers the choices.
  """
  mine, deferred = os.path.join(workdir, autotune.FILE), []
  choices = autotune.choose(config, input_shape, build_steps, mode=config.train.autotune,
                            workdir_file=mine, given=cpu_fusion.measured_with_flags(),
                            deferred=deferred)
  fusion = cpu_fusion.decision(config, input_shape)  # made by `process_flags` before JAX started
  if fusion is not None:
    if jax.process_count() == 1:
      deferred.append(fusion)
    choices[cpu_fusion.FIELD] = fusion[1]
  if _gpu_level:
    choices[gpu_autotune.FIELD] = _gpu_level[0]
  if cpu_tuning.is_applied():  # glibc's defaults, the state of a process that did not choose
    choices[cpu_tuning.FIELD] = "tuned"
  return choices, tuple(deferred)


def remember_in_workdir(workdir: str, entries: tuple) -> None:
  """Writes the (key, value) entries of `run_choices` to the workdir's `autotune.json`."""
  for key, value in entries:
    autotune.remember(os.path.join(workdir, autotune.FILE), key, value)

"""Whether a backbone is being traced for an evaluation program.

The evaluation programs (`alma_jax.engine.programs.Programs.eval_body`) trace the learner's
prediction inside `evaluation()`. There a backbone may compute the same function in a form
that only inference allows, equal up to float round-off: the reduced VGG folds each
BatchNorm's running statistics into its convolution (`alma_jax.models.vgg`). Everything else
traces outside it and sees the network as it is defined: training, the passes that growth runs
(some of them differentiate it) and the FLOP counts of Comp, which count that network.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_EVALUATING = contextvars.ContextVar("alma_jax_evaluation_program", default=False)


@contextlib.contextmanager
def raised(flag: contextvars.ContextVar) -> Iterator[None]:
  """A block in which the boolean context variable `flag` is true (as it was after it): how
  a caller tells the traces it makes, and only those, to take another form."""
  token = flag.set(True)
  try:
    yield
  finally:
    flag.reset(token)


def evaluation() -> contextlib.AbstractContextManager[None]:
  """Traces inside it are of an evaluation program (`folds()` is true)."""
  return raised(_EVALUATING)


def folds() -> bool:
  """Whether a backbone applied at inference may fold its normalisation into its weights."""
  return _EVALUATING.get()

"""The waiting policy `geometric`: waits that grow with the data seen.

The learner trains at t_k = ceil(w0 * r^k), k = 0, 1, 2, ... (each time once,
up to B), w0 = `config.stream.geometric_w0` and r = `config.stream.
geometric_ratio` > 1: the k-th stage adds about a fraction (r - 1) / r of
new data to what the learner has seen, so early stages come quickly, while
the model changes fast, and later ones rarely. The waits are never shorter
than one mega-batch (a time that repeats trains once).

w0 * r^k is rounded to 9 decimal places before the ceiling, so a product
that is an integer in exact arithmetic (10 * 1.1 = 11) is not pushed to the
next integer by float round-off (11.000000000000002).
"""

from __future__ import annotations

import functools
import math

from alma_jax.configuration.plugins import policies as declared
from alma_jax.errors import ConfigError
from alma_jax.policies.base import Decision, WaitPolicy, register

ROUND_DIGITS = 9


def _time(w0: float, ratio: float, k: int) -> float:
  """ceil(w0 * ratio^k) (rounded first, see the module docstring); inf when it overflows."""
  try:
    x = w0 * ratio**k
  except OverflowError:
    return math.inf
  return math.inf if math.isinf(x) else math.ceil(round(x, ROUND_DIGITS))


def geometric_times(num_megabatches: int, w0: float, ratio: float) -> list[int]:
  """The distinct times ceil(w0 * ratio^k) <= `num_megabatches`, k = 0, 1, ..., in order.

  The time never decreases with k, so after each time the next k that gives a later one is
  found by doubling steps and then halving them (O(log k) times computed per time listed,
  not one per k: a ratio close to 1 repeats each time for many k).
  """
  if w0 < 1 or ratio <= 1:
    raise ValueError(f"geometric times need w0 >= 1 and ratio > 1, got {w0} and {ratio}")
  times, k, t = [], 0, _time(w0, ratio, 0)
  while t <= num_megabatches:
    times.append(t)
    lo, step = k, 1  # _time(lo) <= t < _time(hi)
    while _time(w0, ratio, k + step) <= t:
      lo, step = k + step, step * 2
    hi = k + step
    while hi - lo > 1:
      mid = (lo + hi) // 2
      lo, hi = (mid, hi) if _time(w0, ratio, mid) <= t else (lo, mid)
    k, t = hi, _time(w0, ratio, hi)
  return times


@register
class GeometricWait(declared.Geometric, WaitPolicy):
  """geometric: trains at t_k = ceil(w0 * r^k) (see the module docstring)."""

  @classmethod
  def check(cls, config) -> None:
    s = config.stream
    if s.geometric_w0 > s.num_megabatches:
      raise ConfigError(f"config.stream.geometric_w0={s.geometric_w0} is after the last time "
                        f"step (config.stream.num_megabatches={s.num_megabatches}): the learner "
                        f"would never train; allowed values: [1, {s.num_megabatches}]")

  @functools.cached_property
  def times(self) -> list[int]:
    s = self.config.stream
    return geometric_times(s.num_megabatches, s.geometric_w0, s.geometric_ratio)

  def trains_at(self, t: int, state) -> bool:
    del state
    return t in self.times

  def planned_times(self, num_megabatches: int) -> list[int]:
    return [t for t in self.times if t <= num_megabatches]

  def decide(self, t: int, state, probe) -> Decision:
    train = self.trains_at(t, state)
    nxt = next((x for x in self.times if x > t), None)
    reason = (f"scheduled: stage {self.times.index(t) + 1} of {len(self.times)}" if train else
              f"waiting for t={nxt}" if nxt is not None else "no stage left before B")
    fields = {"wait_decision": "trained" if train else "waited", "wait_reason": reason}
    return Decision(train, reason, tuple(dict(fields) for _ in range(probe.num_seeds)))

"""The waiting policy `triggered`: train when the new data shows the model is out of date.

After each mega-batch t arrives, with g = t - (the time of the last stage)
mega-batches waiting, the decision is, in this order:

  1. wait, while g < `stream.trigger_min_wait`;
  2. train, once g reaches `stream.trigger_max_wait` (0: no maximum);
  3. train, when the unseen training examples (those of the g waiting
     mega-batches) are at least a fraction rho = `stream.trigger_fraction`
     of every training example seen so far (before the first stage all are
     unseen, so the first stage comes at g = min_wait);
  4. otherwise evaluate the current model on mega-batch t's validation split
     and train when its error exceeds the model's last post-training
     validation error (its stage's best epoch on that stage's validation
     set) by more than delta = `stream.trigger_margin`; else wait.

Only step 4 evaluates, so a decision that the counts settle costs nothing.
The evaluation's FLOPs (the prediction's FLOPs per example times the
examples) and multiply-adds are the record fields `trigger_flops` and
`trigger_macs`; the run's Comp adds them to the training FLOPs (and
`comp_paper` the multiply-adds), as the evaluation is compute that the
learner spends deciding. Each record holds the decision: `wait_decision`
("trained" or "waited"), `wait_reason`, the waiting mega-batches
`wait_gap`, their share of the training examples `unseen_fraction`, and,
when step 4 ran, `trigger_error` and `trigger_reference`; a trained record
also holds its stage's `stage_val_error`, the next reference.

The decision reads only the stream and the records so far (the reference is
the last trained record's `stage_val_error`), so a resumed run, which gets
its records back from its checkpoint, decides as the uninterrupted one did.
Each seed decides from its own model and data, so the seeds of a population
cannot train together: `config.num_seeds` must be 1.
"""

from __future__ import annotations

import numpy as np

from alma_jax.configuration.plugins import policies as declared
from alma_jax.errors import ConfigError
from alma_jax.policies.base import Decision, WaitPolicy, register


@register
class TriggeredWait(declared.Triggered, WaitPolicy):
  """triggered: trains when the new data's error or the unseen share calls for it."""

  same_times_for_every_seed = False

  @classmethod
  def check(cls, config) -> None:
    s = config.stream
    if s.trigger_max_wait and s.trigger_max_wait < s.trigger_min_wait:
      raise ConfigError(f"config.stream.trigger_max_wait={s.trigger_max_wait} is below "
                        f"config.stream.trigger_min_wait={s.trigger_min_wait}; allowed values: "
                        f"0 (no maximum) or >= {s.trigger_min_wait}")
    if s.trigger_min_wait > s.num_megabatches:
      raise ConfigError(f"config.stream.trigger_min_wait={s.trigger_min_wait} is after the last "
                        f"time step (config.stream.num_megabatches={s.num_megabatches}): the "
                        f"learner would never train; allowed values: [1, {s.num_megabatches}]")

  def trains_at(self, t: int, state) -> bool:
    raise NotImplementedError("the triggered policy decides from the data: use `decide`")

  def planned_times(self, num_megabatches: int) -> list[int]:
    """The stages the counts alone call for (steps 1-3): the error adds stages to these."""
    s, times, last = self.config.stream, [], 0
    for t in range(1, num_megabatches + 1):
      gap = t - last
      if gap >= s.trigger_min_wait and ((s.trigger_max_wait and gap >= s.trigger_max_wait)
                                        or gap >= s.trigger_fraction * t):
        times.append(t)
        last = t
    return times

  def decide(self, t: int, state, probe) -> Decision:
    s = self.config.stream
    last = state.last_stage_t
    gap = t - last
    sizes = probe.sizes(t)
    unseen, seen = sum(sizes[last:]), sum(sizes)
    fields = {"wait_gap": gap, "unseen_fraction": unseen / seen if seen else 1.0}
    zero = np.zeros(probe.num_seeds)
    flops, macs = zero, zero
    if gap < s.trigger_min_wait:
      train, reason = False, f"minimum wait ({gap} < {s.trigger_min_wait})"
    elif s.trigger_max_wait and gap >= s.trigger_max_wait:
      train, reason = True, f"maximum wait ({gap} >= {s.trigger_max_wait})"
    elif unseen >= s.trigger_fraction * seen:
      train = True
      reason = f"unseen fraction {fields['unseen_fraction']:.4f} >= {s.trigger_fraction}"
    else:
      err, n = probe.val_error(state.learner, t)
      if not n:
        train, reason = False, "no validation data in the new mega-batch"
      else:
        ref = _reference(state)
        cost = probe.flops(state.learner)
        flops = np.full(probe.num_seeds, cost["inference_per_example"] * n)
        macs = np.full(probe.num_seeds, cost["inference_macs_per_example"] * n)
        fields.update(trigger_error=err, trigger_reference=ref)
        train = err > ref + s.trigger_margin
        reason = (f"new data's error {err:.4f} {'>' if train else '<='} {ref:.4f} + margin "
                  f"{s.trigger_margin}")
    fields.update(wait_decision="trained" if train else "waited", wait_reason=reason)
    return Decision(train, reason, tuple(dict(fields) for _ in range(probe.num_seeds)), flops,
                    macs)

  def stage_fields(self, decision: Decision, state) -> list[dict]:
    out = [dict(f, trigger_flops=float(decision.flops[i]), trigger_macs=float(decision.macs[i]))
           for i, f in enumerate(decision.fields)]
    if state.trained:
      for i, f in enumerate(out):
        f["stage_val_error"] = float(1.0 - state.stats.best_val_accuracy[i])
    return out


def _reference(state) -> float:
  """The last trained record's `stage_val_error` (the first seed's: one seed per run)."""
  for r in reversed(state.logs[0].records):
    if r.trained:
      return float(r.extra["stage_val_error"])
  raise ValueError("the triggered policy evaluates only after a stage")

"""Metrics of the ALMA setting: per-step records folded into an immutable log.

The paper (section 3.1) judges a learner on its whole trajectory over the
stream: the cumulative error rate (CER) is the sum of the test error over
t = 0 ... B (t = 0 is the untrained model), memory (Mem) is the sum of the
parameter counts, and compute (Comp) is the sum of the training FLOPs. A waiting policy that
evaluates the learner to decide when to train (`alma_jax.policies.triggered`)
records that evaluation's FLOPs and multiply-adds as `trigger_flops` and
`trigger_macs`; Comp includes them. Growth's own passes over data (gMoE's
expert scores, Firefly's candidates) are recorded apart (`growth_flops`,
`growth_macs`); `comp_total` and `comp_paper_total` add them to Comp, so that a
growing method's compute counts its growth.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

RECORD_KEYS = (
    "t",
    "test_error",
    "num_params",
    "train_flops",
    "train_flops_forward",
    "train_macs",
    "growth_flops",
    "growth_macs",
    "inference_flops_per_example",
    "trained",
    "wall_s",
)


# Plasticity diagnostics (`log.plasticity`) whose last value the summary holds (`final_<k>`).
PLASTICITY_FINAL = ("dormant_fraction", "feature_rank", "param_norm", "init_distance")


@dataclasses.dataclass(frozen=True)
class Record:
  """What the environment measures at time step `t` of the stream.

  Attributes:
    t: time step, 0 (untrained model) ... B.
    test_error: error rate on the test set of the model at time t.
    num_params: number of parameters of the model at time t (all members,
      experts and gates).
    train_flops: FLOPs spent training at this step (compiled train step,
      forward + backward + update, times the number of steps run).
    train_flops_forward: forward-only FLOPs of the same steps.
    train_macs: forward multiply-adds times the real training examples
      processed (no padding, no evaluation or growth passes): the unit of the
      paper's "training FLOPs" and of its released code.
    growth_flops: FLOPs of the passes over data that growth ran at this step
      (gMoE's expert scores, Firefly's candidates), not part of train_flops.
    growth_macs: the multiply-adds of the same passes (real examples alone,
      like growth_flops), not part of train_macs. A record written before
      this field existed reads as 0.0 when its growth_flops is 0 (no growth
      pass ran, so none of its multiply-adds can be missing) and as NaN
      otherwise (unknown: the sums that use it, comp_growth_macs and
      comp_paper_total, then say so instead of understating growth).
    inference_flops_per_example: FLOPs to predict one example at time t.
    trained: whether the model was updated at this step.
    wall_s: wall-clock seconds spent on this step (training and evaluation).
    extra: fields of the task's own (`Task.record_metrics`), written after
      the others (language models: `test_nll`, `test_perplexity`,
      `test_bits_per_byte`, `forward_macs_per_token`,
      `inference_flops_per_token`; empty for images), then the waiting
      policy's (`WaitPolicy.stage_fields`; none for the fixed wait).
  """

  t: int
  test_error: float
  num_params: int
  train_flops: float
  train_flops_forward: float
  train_macs: float
  growth_flops: float
  growth_macs: float
  inference_flops_per_example: float
  trained: bool
  wall_s: float
  extra: dict = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict[str, Any]:
    return {**{k: getattr(self, k) for k in RECORD_KEYS}, **self.extra}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Record":
    if "growth_macs" not in d and "growth_flops" in d:  # a log of older code
      d = dict(d, growth_macs=0.0 if float(d["growth_flops"]) == 0.0 else float("nan"))
    missing = [k for k in RECORD_KEYS if k not in d]
    if missing:
      raise ValueError(f"log record is missing keys {missing}; expected {list(RECORD_KEYS)}")
    return cls(
        t=int(d["t"]),
        test_error=float(d["test_error"]),
        num_params=int(d["num_params"]),
        train_flops=float(d["train_flops"]),
        train_flops_forward=float(d["train_flops_forward"]),
        train_macs=float(d["train_macs"]),
        growth_flops=float(d["growth_flops"]),
        growth_macs=float(d["growth_macs"]),
        inference_flops_per_example=float(d["inference_flops_per_example"]),
        trained=bool(d["trained"]),
        wall_s=float(d["wall_s"]),
        extra={k: v for k, v in d.items() if k not in RECORD_KEYS},
    )


@dataclasses.dataclass(frozen=True)
class Log:
  """An immutable sequence of records; `append` returns a new log."""

  records: tuple[Record, ...] = ()

  def append(self, record: Record) -> "Log":
    expected = len(self.records)
    if record.t != expected:
      raise ValueError(f"record t={record.t} appended to a log of {expected} records; "
                       f"records must arrive in order t = 0, 1, 2, ...")
    return Log(self.records + (record,))

  @classmethod
  def from_records(cls, records: Iterable[Record]) -> "Log":
    log = cls()
    for r in records:
      log = log.append(r)
    return log

  def __len__(self) -> int:
    return len(self.records)

  @property
  def cer(self) -> float:
    """Cumulative error rate: sum of test errors over t = 0 ... B."""
    return float(sum(r.test_error for r in self.records))

  @property
  def mean_error(self) -> float:
    return self.cer / len(self.records) if self.records else float("nan")

  @property
  def mem(self) -> int:
    """Cumulative memory: sum of parameter counts over t = 0 ... B."""
    return int(sum(r.num_params for r in self.records))

  @property
  def comp(self) -> float:
    """Cumulative compute: sum of training FLOPs over the stream (and of the evaluations a
    waiting policy ran to decide, `trigger_flops`)."""
    return float(sum(_with(r, r.train_flops, "trigger_flops") for r in self.records))

  @property
  def comp_forward(self) -> float:
    """`comp` counting forward passes alone (a policy's evaluations are forward passes)."""
    return float(sum(_with(r, r.train_flops_forward, "trigger_flops") for r in self.records))

  @property
  def comp_paper(self) -> float:
    """Cumulative forward multiply-adds x training examples (the paper's compute unit), and
    those of a waiting policy's evaluations (`trigger_macs`)."""
    return float(sum(_with(r, r.train_macs, "trigger_macs") for r in self.records))

  @property
  def comp_trigger(self) -> float | None:
    """FLOPs of a waiting policy's evaluations (part of `comp`); None: it ran none."""
    if not any("trigger_flops" in r.extra for r in self.records):
      return None
    return float(sum(r.extra.get("trigger_flops", 0.0) for r in self.records))

  @property
  def comp_growth(self) -> float:
    """Cumulative FLOPs of growth's passes over data."""
    return float(sum(r.growth_flops for r in self.records))

  @property
  def comp_growth_macs(self) -> float:
    """Cumulative multiply-adds of growth's passes over data."""
    return float(sum(r.growth_macs for r in self.records))

  @property
  def comp_total(self) -> float:
    """All the FLOPs the learner spent: `comp` and growth's passes over data (`comp_growth`)."""
    return self.comp + self.comp_growth

  @property
  def comp_paper_total(self) -> float:
    """`comp_paper` and the multiply-adds of growth's passes over data (`comp_growth_macs`)."""
    return self.comp_paper + self.comp_growth_macs

  @property
  def final_error(self) -> float:
    return self.records[-1].test_error if self.records else float("nan")

  @property
  def num_stages(self) -> int:
    """Number of training stages (steps at which the model was updated)."""
    return int(sum(r.trained for r in self.records))

  def summary(self) -> dict[str, Any]:
    """The run's summary; a task adds fields of its own (`Task.summary`)."""
    return {
        "cer": self.cer,
        "cer_percent": 100.0 * self.cer,
        "mean_error": self.mean_error,
        "mem": self.mem,
        "comp": self.comp,
        "comp_forward": self.comp_forward,
        "comp_paper": self.comp_paper,
        "comp_growth": self.comp_growth,
        "comp_growth_macs": self.comp_growth_macs,
        "comp_total": self.comp_total,
        "comp_paper_total": self.comp_paper_total,
        "final_error": self.final_error,
        "num_stages": self.num_stages,
        "wall_s": float(sum(r.wall_s for r in self.records)),
        **({} if self.comp_trigger is None else {"comp_trigger": self.comp_trigger}),
        **{f"final_{k}": float(self.records[-1].extra[k]) for k in PLASTICITY_FINAL
           if self.records and k in self.records[-1].extra},
    }


def _with(r: Record, value: float, field: str) -> float:
  """`value` plus the record's `extra[field]` when it has one (else `value` itself)."""
  return value + float(r.extra[field]) if field in r.extra else value

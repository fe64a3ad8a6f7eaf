"""Weights & Biases logging of a run, with the methods of `alma_jax.outputs.tensorboard.Writer`.

Optional: `pip install -e ".[wandb]"`; the `wandb` package is imported only
when a writer is made. One writer per seed's output folder (`seed_<k>/` of a
`num_seeds` run), each a W&B run, grouped by the workdir:

* `step(record)`: the per-step scalars of the event files (`stream/test_error`,
  `stream/cer`, `stream/num_params`, `stream/comp_paper_tflops`,
  `stream/comp_tflops`, `stream/comp_total_tflops`, `stream/comp_paper_total_tflops`,
  `stream/wall_s`) against `stream/t`;
* `epoch(t, scalars)`: `epoch/train_loss`, `epoch/val_accuracy`, `epoch/t`
  against `epoch/index` (epochs trained so far over the run);
* `config(config)`: the resolved config, as the W&B run's config;
* `summary(summary)`: every number of the summary into the W&B run's summary,
  then the W&B run is finished.

Process 0 alone logs (the others' writers do nothing). The W&B run's id is
kept in `<folder>/wandb_run.json` with the last step and epoch logged, so a
resumed run resumes the same W&B run (`resume="allow"`) and does not log
again the records it had logged before it stopped. W&B's own files go to
`<folder>/wandb/`. The project is the config field `log.wandb`; W&B's
environment (`WANDB_ENTITY`, `WANDB_MODE=offline`, `WANDB_API_KEY`) applies
as usual.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
from typing import Sequence

from alma_jax.outputs import io_utils
from alma_jax.outputs import tensorboard

STATE_FILE = "wandb_run.json"
DIR = "wandb"


class WandbUnavailableError(ValueError):
  """W&B cannot log: the `wandb` package is not installed, or it has no account to log to."""


NO_ACCOUNT = ("config.log.wandb is set but W&B has no API key: run `wandb login` or set "
              "WANDB_API_KEY to log to your account, or set WANDB_MODE=offline to log without one "
              "(into <workdir>/wandb/; `wandb sync <that folder>/offline-run-*` uploads it later), "
              "or set config.log.wandb=''")


def _import_wandb():
  try:
    import wandb  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise WandbUnavailableError(
        "config.log.wandb is set but the wandb package is not installed; install it with "
        "`pip install -e \".[wandb]\"` (or `pip install wandb`), or set config.log.wandb=''")\
        from e
  return wandb


def new_run_id(length: int = 8) -> str:
  """A random W&B run id (lower-case letters and digits)."""
  return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(length))


def _primary() -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_index() == 0


class Writer:
  """Logs one seed's run to a W&B run of `project`, resumed across restarts."""

  def __init__(self, directory: str, records: Sequence[dict], *, project: str,
               name: str | None = None, group: str | None = None, primary: bool | None = None):
    """Starts (or resumes) the W&B run of `directory`; logs those of `records` (the records
    resumed with) that it did not log before."""
    self.directory = directory
    self.active = _primary() if primary is None else primary
    if not self.active:
      return
    wandb = _import_wandb()
    self.state_path = os.path.join(directory, STATE_FILE)
    state = self._read_state()
    self.state = {"id": state.get("id") or new_run_id(),
                  "last_t": int(state.get("last_t", -1)), "epochs": int(state.get("epochs", 0))}
    os.makedirs(os.path.join(directory, DIR), exist_ok=True)
    try:
      self.run = wandb.init(project=project, id=self.state["id"], resume="allow", dir=directory,
                            name=name or os.path.basename(os.path.normpath(directory)),
                            group=group, reinit="create_new")
    except Exception as e:  # pylint: disable=broad-except
      if "api key" in str(e).lower():  # wandb.errors.UsageError: no account configured
        raise WandbUnavailableError(f"{NO_ACCOUNT} ({e})") from e
      raise
    self.run.define_metric("stream/t")
    self.run.define_metric("stream/*", step_metric="stream/t")
    self.run.define_metric("epoch/index")
    self.run.define_metric("epoch/*", step_metric="epoch/index")
    self.totals = tensorboard._Totals()  # pylint: disable=protected-access
    for r in records:
      self._log_record(r)
    self._write_state()

  def _read_state(self) -> dict:
    try:
      state = io_utils.read_json(self.state_path)
    except (OSError, ValueError):
      return {}
    return state if isinstance(state, dict) else {}

  def _write_state(self) -> None:
    io_utils.write_json_atomic(self.state_path, self.state)

  def _log_record(self, record: dict) -> None:
    scalars = self.totals.scalars(record)  # the running sums count every record
    t = int(record["t"])
    if t > self.state["last_t"]:
      self.run.log(dict(scalars, **{"stream/t": t}))
      self.state["last_t"] = t

  def step(self, record: dict) -> None:
    """The per-step scalars of `record` (a Record dict, the one after the last written)."""
    if self.active:
      self._log_record(record)
      self._write_state()

  def epoch(self, t: int, scalars: dict[str, float]) -> None:
    """Per-epoch scalars (non-finite ones left out) of an epoch of the stage at `t`."""
    if not self.active:
      return
    self.state["epochs"] += 1
    values = {f"{tensorboard.EPOCH}{k}": float(v) for k, v in dict(scalars, t=t).items()
              if math.isfinite(float(v))}
    self.run.log(dict(values, **{"epoch/index": self.state["epochs"]}))

  def config(self, config: dict) -> None:
    """The resolved config (`workdir.config_dict`) as the W&B run's config."""
    if self.active:
      self.run.config.update(json.loads(json.dumps(config, default=repr)),
                             allow_val_change=True)

  def stage_resumed(self, t: int, epoch: int) -> None:
    """Nothing: the W&B run keeps the epochs it logged before the stop (the event files,
    rewritten on resume, write them again)."""
    del t, epoch

  def summary(self, summary: dict) -> None:
    """Every number of `summary` (nested ones by dotted path) into the W&B run's summary;
    finishes the W&B run."""
    if not self.active:
      return
    self.run.summary.update({k: v for k, v in tensorboard.flatten(summary).items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})
    self._write_state()
    self.close()

  def close(self) -> None:
    """Finishes the W&B run (a later writer of the folder resumes it)."""
    if self.active and self.run is not None:
      self.run.finish()
      self.run = None

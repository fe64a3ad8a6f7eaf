"""config.json and log.jsonl: the resolved config and one record per time step."""

from __future__ import annotations

import os

from alma_jax.configuration import config_lib
from alma_jax.observers.base import Observer, RunContext
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir as wd


class RecordLog(Observer):
  """The workdir's config.json and each seed's log.jsonl (with several seeds, each seed's
  config.json and log.jsonl go to its `seed_<seed>/` folder); process 0 writes them."""

  def __init__(self, setup: RunContext):
    self.setup = setup

  def on_start(self, state, snapshot) -> None:
    """config.json and the logs up to the restored step."""
    s = self.setup
    if not s.primary:
      return
    io_utils.write_json_atomic(os.path.join(s.workdir, wd.CONFIG_FILE), wd.config_dict(s.config))
    for out, sd, log in zip(s.out_dirs, s.seeds, state.logs):
      os.makedirs(out, exist_ok=True)
      if out != s.workdir:
        io_utils.write_json_atomic(os.path.join(out, wd.CONFIG_FILE),
                                   wd.config_dict(config_lib.seed_config(s.config, sd)))
      io_utils.write_jsonl_atomic(os.path.join(out, wd.LOG_FILE),
                                  [r.to_dict() for r in log.records])

  def on_record(self, state, records) -> None:
    for out, r in zip(self.setup.out_dirs if self.setup.primary else (), records):
      io_utils.append_record(os.path.join(out, wd.LOG_FILE), r.to_dict())

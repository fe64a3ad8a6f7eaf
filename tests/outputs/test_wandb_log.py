"""Tests of the W&B writer (alma_jax/outputs/wandb_log.py): its calls on a stand-in of `wandb`, and a
real offline W&B run where `wandb` is installed."""

import glob
import json
import os
import re
import sys
import types

import pytest

from alma_jax.outputs import wandb_log
from alma_jax.stream import run
from tests import helpers
from tests.conftest import requires_mnist


def _record(t, err):
  return {"t": t, "test_error": err, "num_params": 7, "train_flops": 3e12 * (t > 0),
          "train_macs": 1e12 * (t > 0), "wall_s": 0.5}


class _FakeRun:
  def __init__(self, kwargs):
    self.init = kwargs
    self.logged, self.metrics, self.config_updates, self.finished = [], [], [], False
    self.summary = {}
    self.config = types.SimpleNamespace(update=lambda d, **k: self.config_updates.append(d))

  def define_metric(self, name, step_metric=None):
    self.metrics.append((name, step_metric))

  def log(self, values):
    self.logged.append(values)

  def finish(self):
    self.finished = True


@pytest.fixture(name="fake_wandb")
def _fake_wandb(monkeypatch):
  runs = []

  def init(**kwargs):
    runs.append(_FakeRun(kwargs))
    return runs[-1]

  module = types.SimpleNamespace(init=init)
  monkeypatch.setitem(sys.modules, "wandb", module)
  return runs


def test_a_writer_logs_records_epochs_config_and_summary(tmp_path, fake_wandb):
  w = wandb_log.Writer(str(tmp_path), [_record(0, 0.9)], project="alma", group="sweep_point",
                       primary=True)
  w.config({"method": {"name": "sm"}, "stream": {"wait": 1}})
  w.epoch(1, {"train_loss": 2.5, "val_accuracy": float("nan")})
  w.step(_record(1, 0.5))
  w.summary({"cer": 1.4, "timings": {"train_s": 2.0}, "choices": {}, "num_stages": 1})
  (run,) = fake_wandb
  assert run.init["project"] == "alma" and re.fullmatch(r"[a-z0-9]{8}", run.init["id"])
  assert run.init["resume"] == "allow" and run.init["group"] == "sweep_point"
  assert run.init["dir"] == str(tmp_path) and run.init["name"] == os.path.basename(tmp_path)
  assert ("stream/*", "stream/t") in run.metrics and ("epoch/*", "epoch/index") in run.metrics
  assert run.logged[0]["stream/t"] == 0 and run.logged[0]["stream/test_error"] == 0.9
  assert run.logged[1] == {"epoch/train_loss": 2.5, "epoch/t": 1.0, "epoch/index": 1}
  assert run.logged[2]["stream/t"] == 1 and run.logged[2]["stream/cer"] == pytest.approx(1.4)
  assert run.logged[2]["stream/comp_paper_tflops"] == 1.0
  assert run.config_updates == [{"method": {"name": "sm"}, "stream": {"wait": 1}}]
  assert run.summary == {"cer": 1.4, "timings.train_s": 2.0, "num_stages": 1}
  assert run.finished
  state = json.loads((tmp_path / wandb_log.STATE_FILE).read_text())
  assert state == {"id": run.init["id"], "last_t": 1, "epochs": 1}


def test_a_resumed_run_resumes_the_w_and_b_run_without_logging_a_step_twice(tmp_path, fake_wandb):
  w = wandb_log.Writer(str(tmp_path), [_record(0, 0.9)], project="alma", primary=True)
  w.step(_record(1, 0.5))
  w.step(_record(2, 0.4))  # logged, then the run is killed; its checkpoint is t=1
  w = wandb_log.Writer(str(tmp_path), [_record(0, 0.9), _record(1, 0.5)], project="alma",
                       primary=True)
  w.epoch(2, {"train_loss": 1.0})
  w.step(_record(2, 0.4))  # recomputed: logged before
  w.step(_record(3, 0.3))
  first, resumed = fake_wandb
  assert resumed.init["id"] == first.init["id"]
  assert [r["stream/t"] for r in first.logged] == [0, 1, 2]
  assert [r.get("stream/t") for r in resumed.logged] == [None, 3]
  assert resumed.logged[1]["stream/cer"] == pytest.approx(0.9 + 0.5 + 0.4 + 0.3)
  assert resumed.logged[0]["epoch/index"] == 1


def test_only_process_0_logs(tmp_path, fake_wandb):
  w = wandb_log.Writer(str(tmp_path), [_record(0, 0.9)], project="alma", primary=False)
  w.step(_record(1, 0.5))
  w.epoch(1, {"train_loss": 1.0})
  w.config({"a": 1})
  w.summary({"cer": 1.0})
  assert not fake_wandb and not os.listdir(tmp_path)


def test_without_wandb_the_error_says_how_to_install_it(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)
  with pytest.raises(wandb_log.WandbUnavailableError, match=r"config\.log\.wandb is set but the "
                     r"wandb package is not installed; install it with `pip install -e "):
    wandb_log.Writer(str(tmp_path), [], project="alma", primary=True)


def test_an_offline_w_and_b_run_is_resumed_by_its_id(tmp_path, monkeypatch):
  import wandb  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  folder = str(tmp_path / "seed_0")
  os.makedirs(folder)
  w = wandb_log.Writer(folder, [_record(0, 0.9)], project="alma", primary=True)
  w.config({"method": {"name": "sm"}, "model": {"width": 8}})
  w.epoch(1, {"train_loss": 2.5})
  w.step(_record(1, 0.5))
  w.close()  # stopped before its summary
  run_id = json.loads(open(os.path.join(folder, wandb_log.STATE_FILE)).read())["id"]
  w = wandb_log.Writer(folder, [_record(0, 0.9), _record(1, 0.5)], project="alma", primary=True)
  w.step(_record(2, 0.25))
  w.summary({"cer": 1.65, "cer_percent": 165.0})
  assert json.loads(open(os.path.join(folder, wandb_log.STATE_FILE)).read())["id"] == run_id
  # W&B's service process writes the run files after `finish` returns: stopping it waits until
  # they are written.
  wandb.teardown()
  # In the order they were written: by name, a resumption in the same second as its first run
  # (`offline-run-<second>-<id>-1`) would sort before it (`offline-run-<second>-<id>`).
  logs = sorted(glob.glob(os.path.join(folder, wandb_log.DIR, "offline-run-*",
                                       f"run-{run_id}.wandb")), key=os.path.getmtime)
  assert len(logs) == 2  # the first run and its resumption, one W&B run id
  first, second = (open(p, "rb").read() for p in logs)
  for key in (b"stream/test_error", b"epoch/train_loss", b"method", b"width"):
    assert key in first, key
  assert b"cer_percent" in second and b"stream/t" in second


@requires_mnist
def test_a_run_with_log_wandb_logs_each_seed_and_resumes_its_w_and_b_runs(tmp_path, monkeypatch):
  import wandb  # pylint: disable=g-import-not-at-top,unused-import
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  workdir = str(tmp_path / "run")
  c = helpers.smoke(stream__num_megabatches=2, num_seeds=2, log__wandb="alma-tests")
  run.run(c, workdir)
  ids = []
  for seed in (0, 1):
    state = json.loads(open(os.path.join(workdir, f"seed_{seed}", wandb_log.STATE_FILE)).read())
    assert state["last_t"] == 2
    ids.append(state["id"])
  run.run(c, workdir)  # resumed from its last checkpoint: the same W&B runs
  for seed, run_id in zip((0, 1), ids):
    state = json.loads(open(os.path.join(workdir, f"seed_{seed}", wandb_log.STATE_FILE)).read())
    assert state["id"] == run_id


def test_without_an_account_the_error_names_offline_mode(tmp_path, monkeypatch):
  module = types.ModuleType("wandb")

  def init(**kwargs):
    del kwargs
    raise RuntimeError("No API key configured. Use `wandb login` to log in.")

  module.init = init
  monkeypatch.setitem(sys.modules, "wandb", module)
  with pytest.raises(wandb_log.WandbUnavailableError,
                     match=r"no API key: run `wandb login` or set WANDB_API_KEY .* "
                           r"WANDB_MODE=offline .*wandb sync"):
    wandb_log.Writer(str(tmp_path), [], project="alma", primary=True)

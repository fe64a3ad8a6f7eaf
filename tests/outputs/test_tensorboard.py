"""Tests of the event files (alma_jax/outputs/tensorboard.py) and of those a run writes."""

import glob
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from alma_jax.outputs import io_utils
from alma_jax.outputs import tensorboard as tb
from alma_jax.outputs import workdir as wd
from alma_jax.stream import run
from tests import helpers
from tests import kill_points
from tests.conftest import requires_mnist

ROOT = helpers.ROOT


def _tf_events(directory):
  """[(step, {tag: value})] of the event files in `directory`, read by TensorFlow."""
  (path,) = glob.glob(os.path.join(directory, "events.out.tfevents.*"))
  return [(e.step, {v.tag: v.simple_value for v in e.summary.value})
          for e in tf.compat.v1.train.summary_iterator(path)]


def _record(t, err):
  return {"t": t, "test_error": err, "num_params": 7, "train_flops": 3e12 * (t > 0),
          "train_macs": 1e12 * (t > 0), "growth_flops": 2e12 * (t > 0),
          "growth_macs": 0.5e12 * (t > 0), "wall_s": 0.5}


def test_crc32c_of_the_standard_check_string():
  assert tb.crc32c(b"123456789") == 0xE3069283


def test_events_read_back_by_tensorflow(tmp_path):
  w = tb.Writer(str(tmp_path), [_record(0, 0.9)])
  w.epoch(1, {"train_loss": 2.5, "val_accuracy": 0.25})
  w.epoch(1, {"train_loss": float("nan"), "val_accuracy": 0.5})
  w.step(_record(1, 0.5))
  events = _tf_events(tmp_path)
  assert events[0] == (0, {})  # the file-version header
  assert events[1][0] == 0 and events[1][1]["stream/test_error"] == pytest.approx(0.9)
  assert events[2] == (1, {"epoch/train_loss": 2.5, "epoch/val_accuracy": 0.25, "epoch/t": 1.0})
  assert events[3] == (2, {"epoch/val_accuracy": 0.5, "epoch/t": 1.0})
  step, last = events[4]
  assert step == 1
  assert last["stream/cer"] == pytest.approx(1.4) and last["stream/comp_paper_tflops"] == 1.0
  assert last["stream/comp_tflops"] == 3.0 and last["stream/num_params"] == 7
  assert last["stream/comp_total_tflops"] == 5.0  # train_flops and growth_flops
  assert last["stream/comp_paper_total_tflops"] == 1.5  # train_macs and growth_macs
  assert [e[1:] for e in tb.read_events(str(tmp_path))] == events


def test_reopening_keeps_what_precedes_the_records_and_drops_the_rest(tmp_path):
  d = str(tmp_path)
  w = tb.Writer(d, [_record(0, 0.9)])
  w.epoch(1, {"train_loss": 1.0})
  w.step(_record(1, 0.5))
  w.epoch(2, {"train_loss": 0.5})  # a stage cut short: t=2 never logged
  with open(w.path, "ab") as f:
    f.write(tb.frame(tb.event(0.0, 9, {"epoch/train_loss": 9.0}))[:-3])  # a torn record
  w = tb.Writer(d, [_record(0, 0.9), _record(1, 0.5)])  # resumed after t=1
  w.epoch(2, {"train_loss": 0.4})
  w.step(_record(2, 0.2))
  events = [e for e in _tf_events(d) if e[1]]
  stream = [(s, v["stream/test_error"]) for s, v in events if "stream/test_error" in v]
  np.testing.assert_allclose(stream, [(0, 0.9), (1, 0.5), (2, 0.2)], rtol=1e-6)
  epochs = [(s, v["epoch/train_loss"], v["epoch/t"]) for s, v in events if "epoch/t" in v]
  np.testing.assert_allclose(epochs, [(1, 1.0, 1), (2, 0.4, 2)], rtol=1e-6)
  assert len(tb.event_files(d)) == 1


def test_a_stage_that_continues_from_its_save_gets_its_earlier_epochs_back(tmp_path):
  d = str(tmp_path)
  w = tb.Writer(d, [_record(0, 0.9)])
  w.epoch(1, {"train_loss": 1.0})
  w.step(_record(1, 0.5))
  for loss in (0.9, 0.8, 0.7):  # stage 2: saved after its second epoch, stopped in its third
    w.epoch(2, {"train_loss": loss})
  w = tb.Writer(d, [_record(0, 0.9), _record(1, 0.5)])  # resumed after t=1
  w.stage_resumed(2, 3)  # continues at epoch 3: epochs 1 and 2 ran before
  w.stage_resumed(2, 3)  # told once per run: nothing more
  w.epoch(2, {"train_loss": 0.65})
  w.step(_record(2, 0.2))
  epochs = [(s, v["epoch/train_loss"], v["epoch/t"]) for s, v in _tf_events(d) if "epoch/t" in v]
  np.testing.assert_allclose(epochs, [(1, 1.0, 1), (2, 0.9, 2), (3, 0.8, 2), (4, 0.65, 2)],
                             rtol=1e-6)
  # Stopped again before the next record (a long stage, preempted twice): the epochs of the
  # stages the records hold stay, wherever the rewrite put them; another stage's save, or
  # one at its first epoch, brings nothing back.
  for t, epoch in ((3, 5), (2, 1)):
    w = tb.Writer(d, [_record(0, 0.9), _record(1, 0.5)])
    w.stage_resumed(t, epoch)
    assert [s for s, v in _tf_events(d) if "epoch/t" in v] == [1]


# -- real runs ------------------------------------------------------------------------------------
def _stream_errors(directory):
  return [(s, v["stream/test_error"]) for s, v in _tf_events(directory)
          if "stream/test_error" in v]


@requires_mnist
def test_a_run_writes_events_of_its_records_and_epochs(tmp_path):
  workdir = str(tmp_path / "run")
  run.run(helpers.smoke(stream__num_megabatches=2, num_seeds=2), workdir)
  for seed in (0, 1):
    out = wd.seed_dir(workdir, seed)
    log = io_utils.read_jsonl(os.path.join(out, wd.LOG_FILE))
    np.testing.assert_allclose(_stream_errors(out), [(r["t"], r["test_error"]) for r in log],
                               rtol=1e-6)
    epochs = [(s, v) for s, v in _tf_events(out) if "epoch/t" in v]
    assert [s for s, _ in epochs] == list(range(1, len(epochs) + 1))
    assert {v["epoch/t"] for _, v in epochs} == {1.0, 2.0}
    assert all(0.0 <= v["epoch/val_accuracy"] <= 1.0 for _, v in epochs)
  assert not tb.event_files(workdir)  # the seeds are the runs TensorBoard shows
  for seed in (0, 1):  # the run's config and its summary reach each seed's events
    tags = set().union(*(t for _, _, t in tb.read_events(wd.seed_dir(workdir, seed))))
    assert "summary/cer" in tags, sorted(tags)[:20]
    texts = open(tb.event_files(wd.seed_dir(workdir, seed))[0], "rb").read()
    assert b"method.name" in texts or b"method" in texts
  off = str(tmp_path / "off")
  run.run(helpers.smoke(stream__num_megabatches=2, log__tensorboard=False), off)
  assert not tb.event_files(off)


@requires_mnist
def test_a_killed_run_resumes_without_duplicate_events(tmp_path):
  workdir = str(tmp_path / "run")
  args = [sys.executable, "-m", "alma_jax.main", f"--workdir={workdir}",
          "--config=configs/mnist_sm.py:smoke", "--config.mesh.num_devices=1",
          "--config.train.progress_every_s=0", helpers.NO_FIGURE]
  env = kill_points.env(dict(os.environ, ALMA_JAX_TEST_KILL_AT="t=3:epoch"))
  proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == -9, proc.stderr[-2000:]
  env.pop("ALMA_JAX_TEST_KILL_AT")
  proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  log = io_utils.read_jsonl(os.path.join(workdir, wd.LOG_FILE))
  np.testing.assert_allclose(_stream_errors(workdir), [(r["t"], r["test_error"]) for r in log],
                             rtol=1e-6)
  epochs = [(s, v["epoch/t"]) for s, v in _tf_events(workdir) if "epoch/t" in v]
  assert [s for s, _ in epochs] == list(range(1, len(epochs) + 1))
  ts = [t for _, t in epochs]
  assert ts == sorted(ts) and set(ts) == {1.0, 2.0, 3.0, 4.0}


# -- the config as text and hyperparameters, the summary as metrics --------------------------------
CONFIG = {"method": {"name": "sm"}, "model": {"width": 8}, "stream": {"replay": 0.5, "iid": False},
          "optimizer": {"kwargs": {"b": [0.9, 0.99]}}, "data": {"bpe_dir": None}}
SUMMARY = {"cer": 1.4, "cer_percent": 140.0, "timings": {"train_s": 2.0}, "choices": {},
           "diverged": float("nan")}


def _hparams_run(directory):
  w = tb.Writer(directory, [_record(0, 0.9)])
  w.config(CONFIG)
  w.step(_record(1, 0.5))
  w.summary(SUMMARY)
  return w


def test_the_config_is_text_and_hyperparameters_and_the_summary_metrics(tmp_path):
  _hparams_run(str(tmp_path))
  (path,) = glob.glob(os.path.join(str(tmp_path), "events.out.tfevents.*"))
  values = {v.tag: (e.step, v) for e in tf.compat.v1.train.summary_iterator(path)
            for v in e.summary.value}
  step, text = values["config"]
  assert step == 0 and text.metadata.plugin_data.plugin_name == "text"
  (table,) = text.tensor.string_val
  assert table.decode().startswith("| field | value |\n|---|---|\n")
  assert "| `model.width` | `8` |" in table.decode()
  assert "| `optimizer.kwargs.b` | `[0.9, 0.99]` |" in table.decode()
  _, start = values[tb.HPARAMS_START_TAG]
  assert start.metadata.plugin_data.plugin_name == "hparams"
  (info,) = [v for n, v in tb._fields(start.metadata.plugin_data.content) if n == 3]  # pylint: disable=protected-access
  hparams = {}
  for n, entry in tb._fields(info):  # pylint: disable=protected-access
    if n == 1:
      parts = dict(tb._fields(entry))  # pylint: disable=protected-access
      hparams[parts[1].decode()] = dict(tb._fields(parts[2]))  # pylint: disable=protected-access
  assert set(hparams) == {"method.name", "model.width", "stream.replay", "stream.iid",
                          "optimizer.kwargs.b", "data.bpe_dir"}
  assert hparams["method.name"] == {3: b"sm"} and hparams["stream.iid"] == {4: 0}
  assert hparams["model.width"] == {2: struct.pack("<d", 8.0)}
  assert hparams["optimizer.kwargs.b"] == {3: b"[0.9, 0.99]"}
  step, end = values[tb.HPARAMS_END_TAG]
  assert step == 1 and end.metadata.plugin_data.plugin_name == "hparams"
  metrics = {tag: (s, v.simple_value) for tag, (s, v) in values.items()
             if tag.startswith("summary/")}
  assert metrics == {"summary/cer": (1, pytest.approx(1.4)), "summary/cer_percent": (1, 140.0),
                     "summary/timings.train_s": (1, 2.0)}
  # A resumed run's file keeps its records and epochs; the run writes its config again.
  tb.Writer(str(tmp_path), [_record(0, 0.9), _record(1, 0.5)])
  assert [tags for _, _, tags in tb.read_events(str(tmp_path)) if tags][-1].keys() == {
      "stream/test_error", "stream/cer", "stream/num_params", "stream/comp_paper_tflops",
      "stream/comp_tflops", "stream/comp_total_tflops", "stream/comp_paper_total_tflops",
      "stream/wall_s"}


def test_tensorboard_shows_the_hyperparameters_and_metrics(tmp_path):
  # TensorBoard itself (the `tensorboard` extra) reads the text and the HParams session.
  import tensorboard  # pylint: disable=g-import-not-at-top,unused-import
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  from tensorboard.plugins.hparams import metadata  # pylint: disable=g-import-not-at-top
  _hparams_run(str(tmp_path))
  acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
  acc.Reload()
  assert {"config", tb.HPARAMS_START_TAG, tb.HPARAMS_END_TAG} <= set(acc.Tags()["tensors"])
  content = acc.PluginTagToContent("hparams")
  start = metadata.parse_session_start_info_plugin_data(content[tb.HPARAMS_START_TAG])
  assert start.hparams["method.name"].string_value == "sm"
  assert start.hparams["model.width"].number_value == 8.0
  assert start.hparams["stream.iid"].bool_value is False
  end = metadata.parse_session_end_info_plugin_data(content[tb.HPARAMS_END_TAG])
  assert end.status == tb.STATUS_SUCCESS
  assert [(e.step, e.value) for e in acc.Scalars("summary/cer_percent")] == [(1, 140.0)]

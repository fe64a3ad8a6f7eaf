"""Tests of the loop's observers (alma_jax/observers/): the fan-out and what a run tells them."""

import signal

import numpy as np
import pytest

from alma_jax.engine import timing
from alma_jax.engine.metrics import Log, Record
from alma_jax.observers.base import Observer, Observers
from alma_jax.outputs import interrupts
from alma_jax.outputs import io_utils
from alma_jax.state import RunState
from alma_jax.stream import run
from tests import helpers
from tests.conftest import requires_mnist


class Recorder(Observer):
  """Notes every call it gets."""

  def __init__(self, name="recorder", calls=None, on_record=None, summary=None):
    self.name, self.calls = name, [] if calls is None else calls
    self._on_record, self._summary = on_record, summary
    self.records: list[Record] = []

  def on_start(self, state, snapshot):
    self.calls.append((self.name, "start", state.t, None if snapshot is None else snapshot.t))

  def on_epoch(self, t, epoch, loss, val_accuracy, ran):
    self.calls.append((self.name, "epoch", t, epoch))

  def on_record(self, state, records):
    self.calls.append((self.name, "record", state.t))
    self.records += records
    if self._on_record is not None:
      self._on_record()

  def on_step(self, state):
    self.calls.append((self.name, "step", state.t, state.trained))

  def on_end(self, state):
    self.calls.append((self.name, "end", state.t))
    return self._summary

  def close(self):
    self.calls.append((self.name, "close"))


def _record(t):
  return Record(t=t, test_error=0.5, num_params=1, train_flops=0.0, train_flops_forward=0.0,
                train_macs=0.0, growth_flops=0.0, growth_macs=0.0,
                inference_flops_per_example=0.0,
                trained=False, wall_s=0.0)


def test_a_signal_during_a_record_acts_after_every_observer_wrote_it():
  signals = interrupts.Signals()
  calls = []
  arrives = lambda: signals._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
  first = Recorder("first", calls, on_record=arrives)
  second = Recorder("second", calls)
  observers = Observers([first, second], signals, timing.Breakdown())
  state = RunState(logs=[Log.from_records([_record(0)])])
  with signals.deferred():
    with pytest.raises(interrupts.RunInterrupted):
      observers.record(state, [_record(0)])
  assert calls == [("first", "record", 0), ("second", "record", 0)]


def test_the_summary_comes_from_its_observer_and_every_observer_closes():
  calls = []

  class Failing(Recorder):
    def close(self):
      super().close()
      raise OSError("disk gone")

  observers = Observers([Failing("a", calls), Recorder("b", calls, summary={"cer": 1.0}),
                         Recorder("c", calls)], interrupts.Signals(), timing.Breakdown())
  state = RunState(logs=[Log.from_records([_record(0)])])
  assert observers.end(state) == {"cer": 1.0}
  with pytest.raises(OSError, match="disk gone"):
    observers.close()
  assert [c for c in calls if c[1] == "close"] == [("a", "close"), ("b", "close"), ("c", "close")]


@requires_mnist
def test_an_observer_of_a_run_receives_every_record_and_step(tmp_path):
  wd = str(tmp_path / "wd")
  recorder = Recorder()
  summary = run.run(helpers.smoke(), wd, observers=[recorder])
  log = io_utils.read_jsonl(f"{wd}/log.jsonl")
  assert [r.to_dict() for r in recorder.records] == log
  kinds = [c[1] for c in recorder.calls]
  assert kinds[0] == "start" and recorder.calls[0][2:] == (-1, None)
  assert kinds[-2:] == ["end", "close"]
  steps = [c for c in recorder.calls if c[1] == "step"]
  assert steps == [("recorder", "step", t, t > 0) for t in range(5)]
  epochs = [c[2:] for c in recorder.calls if c[1] == "epoch"]
  assert epochs == [(t, e) for t in range(1, 5) for e in (1, 2)]  # smoke: 2 epochs per stage
  # Each record reaches the observer before its step ends, and the step after the stage.
  t2 = recorder.calls.index(("recorder", "record", 2))
  assert recorder.calls[t2 - 2:t2 + 2] == [("recorder", "epoch", 2, 1),
                                           ("recorder", "epoch", 2, 2),
                                           ("recorder", "record", 2),
                                           ("recorder", "step", 2, True)]
  # A finished run resumes from its last checkpoint: no new records, the same summary.
  again = Recorder()
  assert helpers.strip_wall_times(run.run(helpers.smoke(), wd, observers=[again])) == (
      helpers.strip_wall_times(summary))
  assert again.calls[0][2:] == (4, 4) and not again.records
  assert np.isclose(summary["cer"], sum(r["test_error"] for r in log))

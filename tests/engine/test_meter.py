"""Tests of the progress lines (alma_jax/engine/meter.py) and of what a run says with them."""

import logging
import os
import re
import time

import pytest

from alma_jax.configuration import config_lib
from alma_jax.engine import meter as meter_lib
from alma_jax.engine import programs
from alma_jax.errors import ConfigError
from alma_jax.methods import ensemble
from alma_jax.methods import gmoe
from alma_jax.outputs import io_utils
from alma_jax.stream import run
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import requires_mnist


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now

  def advance(self, seconds):
    self.now += seconds


def _meter(level="full", every_s=10.0, **kwargs):
  clock, lines = FakeClock(), []
  m = meter_lib.Meter(level, every_s=every_s, now=clock, say=lines.append, **kwargs)
  # Two stages of 10 steps per epoch at t=1 and t=2 of B=2, 2 epochs each, 32 examples a step.
  m.plan = meter_lib.Plan(num_t=2, stages={1: 10, 2: 10}, epochs=2, examples_per_step=32)
  return m, clock, lines


def test_duration_formats():
  assert [meter_lib.duration(s) for s in (0, 0.3, 0.6, 42.4, 185, 7800, 100800,
                                          float("nan"))] == [
      "0s", "<1s", "1s", "42s", "3m05s", "2h10m", "1d04h", "?"]


def test_running_line_has_the_fields_and_an_eta_from_the_measured_speed():
  m, clock, lines = _meter()
  m.at(1)
  m.stage_start(1, 2, 10)
  clock.advance(5.0)
  m.trained(1, 5, 5)  # 5 s since the last line: not due
  assert lines == []
  clock.advance(5.0)
  m.trained(1, 10, 5)
  # 10 steps in 10 s: 1 s/step, 32 examples/s. Left: epoch 2 of this stage (10 steps) and
  # both epochs of the stage at t=2 (20 steps).
  assert lines == ["  t=1/2 (50%) epoch 1/2 step 10/10 32 examples/s stage_eta=10s run_eta=30s"]
  # The speed halves: 5 steps in 10 s. The estimate moves towards 2 s/step by the weight of
  # a 10 s interval with a 30 s half-life: 1 + (1 - 0.5 ** (10 / 30)) * (2 - 1).
  clock.advance(10.0)
  m.trained(2, 5, 5)
  expected = 1.0 + (1.0 - 0.5 ** (10.0 / 30.0))
  assert m.seconds_per_step == pytest.approx(expected, rel=1e-12)  # float round-off only
  assert lines[-1] == (f"  t=1/2 (50%) epoch 2/2 step 5/10 {32 / expected:,.0f} examples/s "
                       f"stage_eta={meter_lib.duration(5 * expected)} "
                       f"run_eta={meter_lib.duration(25 * expected)}")


def test_compilation_is_not_counted_as_training_time():
  m, clock, lines = _meter()
  m.at(1)
  m.stage_start(1, 2, 10)
  m.compiling("the train step", "first use")
  clock.advance(100.0)
  m.compiled("the train step", 100.0)
  clock.advance(10.0)
  m.trained(1, 10, 10)
  assert m.seconds_per_step == 1.0  # (110 s - 100 s compiling) / 10 steps, exact in binary
  assert lines[:2] == ["compiling the train step (first use)",
                       "compiled the train step in 100.0s"]


def test_finished_stages_set_the_expected_epochs_of_the_next():
  m, clock, lines = _meter(every_s=0.0)
  m.at(1)
  m.stage_start(1, 2, 10)
  clock.advance(10.0)
  m.trained(1, 10, 10, last=True)
  clock.advance(3.0)  # the epoch's validation
  m.epoch_end(lambda: "  t=1 epoch 1/2 loss=1.0")
  # Left: epoch 2 (10 steps at 1 s/step, 3 s of validation), then the stage at t=2 (2 epochs).
  assert lines[-1] == "  t=1 epoch 1/2 loss=1.0 32 examples/s stage_eta=13s run_eta=39s"
  m.stage_end(1)  # early stopping after 1 of 2 epochs: the next stage is expected to run 1
  assert m.expected_epochs() == 1.0
  assert m.run_eta() == 13.0  # 10 steps and one validation; no time step has ended yet


def test_nothing_is_left_of_a_stage_after_its_last_epoch():
  m, clock, lines = _meter(every_s=0.0)
  m.at(1)
  m.stage_start(1, 1, 10)
  clock.advance(10.0)
  m.trained(1, 10, 10, last=True)
  m.epoch_end(lambda: "  t=1 epoch 1/1")
  assert m.stage_left() == (0.0, 0.0)
  # The stage at t=2: 2 epochs of 10 steps at 1 s/step, their validations 0 s.
  assert lines[-1] == "  t=1 epoch 1/1 32 examples/s stage_eta=0s run_eta=20s"


def test_time_outside_the_stages_adds_to_the_run_eta():
  m, clock, _ = _meter()
  m.at(0)
  clock.advance(4.0)  # t=0: evaluation only
  m.at(1)
  m.stage_start(1, 2, 10)
  clock.advance(10.0)
  m.trained(1, 10, 10)
  clock.advance(10.0)
  m.trained(2, 10, 10, last=True)
  m.stage_end(2)
  clock.advance(2.0)  # t=1 after its stage
  m.at(2)
  # Outside the stages: 4 s (t=0) and 2 s (t=1), a mean of 3 s for the 0 time steps after
  # t=2; 20 steps at 1 s/step for its stage.
  assert m.run_eta() == 20.0
  m.at(1)  # (a stream at t=1 again: one time step left at the mean 3 s, and t=2's stage)
  assert m.run_eta() == pytest.approx(20.0 + 1 * (4.0 + 2.0 + 0.0) / 3)


def test_the_heartbeat_names_a_long_compilation():
  m, clock, lines = _meter()
  m.compiling("the train step", "new slot count: 4 -> 8 member slots")
  assert m.heartbeat_s == 15.0  # 5 s after a running line (every 10 s) would be due
  clock.advance(14.0)
  m.beat()
  assert len(lines) == 1
  clock.advance(2.0)
  m.beat()
  assert lines[-1] == ("  ... compiling the train step (new slot count: 4 -> 8 member slots) "
                       "(16s); t=0/2 (0%)")


def test_the_heartbeat_thread_speaks_while_the_main_thread_is_busy():
  lines = []
  m = meter_lib.Meter("full", every_s=0.0, heartbeat_s=0.1, say=lines.append).start()
  try:
    m.compiling("the train step", "first use")
    time.sleep(1.0)  # a compilation that blocks the main thread
  finally:
    m.close()
  beats = [l for l in lines if l.startswith("  ... compiling the train step")]
  assert beats, lines


@pytest.mark.parametrize("level,said", [("off", 0), ("stage", 1), ("full", 5)])
def test_levels_and_processes(level, said):
  for primary in (True, False):
    m, clock, lines = _meter(level, primary=primary)
    m.compiling("the train step", "first use")
    m.compiled("the train step", 2.0)
    m.stage_start(1, 2, 10)
    clock.advance(20.0)
    m.trained(1, 10, 10)
    m.beat()  # nothing said since: 0 s (the running line just now)
    clock.advance(30.0)
    m.beat()
    m.say("a stage line", level="stage")
    assert len(lines) == (said if primary else 0), lines


def test_unknown_level_is_refused():
  with pytest.raises(ValueError, match="valid levels"):
    meter_lib.Meter("verbose")


def test_the_config_field_takes_the_meters_levels():
  field = config_lib.BASE_FIELDS_BY_PATH["log.progress"]
  for level in meter_lib.LEVELS:
    assert field.check("log.progress", level) == level
  c = helpers.smoke(log__progress="loud")
  with pytest.raises(ConfigError, match=r"config\.log\.progress='loud' is unknown; valid levels: "
                     r"\['full', 'off', 'stage'\]"):
    validation.validate(c)


def test_compile_reasons():
  class Fake:
    method = ensemble.GrowingEnsemble.__new__(ensemble.GrowingEnsemble)
    _cache = {}

  fake = Fake()

  def describe(key):
    return programs.Programs.describe(fake, key)

  assert describe(("train", (4, 1), 1)) == ("the train step", "first use; structure (4, 1)")
  fake._cache = {("train", (4, 1), 1): None}  # pylint: disable=protected-access
  assert describe(("train", (8, 1), 1)) == ("the train step",
                                            "new slot count: 4 -> 8 member slots")
  assert describe(("train", (4, 1), 2)) == ("the train step of 2 learners", "new population of 2")
  assert describe(("eval", (4, 1), 1))[1] == "first use; structure (4, 1)"
  moe = gmoe.GrowingMoE.__new__(gmoe.GrowingMoE)
  moe.own = None
  old, new = ((8, ("slots", 2)), (8, ("slots", 2))), ((8, ("slots", 4)), (8, ("slots", 2)))
  assert moe.program_change(old, new) == ("new slot count: [2, 2] -> [4, 2] expert slots per "
                                          "mixture layer")


# -- what a run says ---------------------------------------------------------------------------
def _progress_lines(text: str) -> list[str]:
  return [l for l in text.splitlines()
          if re.search(r"compil|examples/s|run_eta|\.\.\. ", l)]


@requires_mnist
@pytest.mark.parametrize("stage_program, compiled", [
    ("per_epoch", "the train step"), ("whole", "the whole training stage")])
def test_a_run_says_compilations_and_running_lines_and_off_silences_them(
    tmp_path, caplog, stage_program, compiled):
  with caplog.at_level(logging.INFO):
    run.run(helpers.smoke(train__progress_every_s=0.0, train__stage_program=stage_program),
            str(tmp_path / "full"))
  text = caplog.text
  assert f"compiling {compiled} (first use)" in text
  assert "compiling the evaluation (first use)" in text
  # An epoch line (every epoch with progress_every_s=0) and a stage line per stage.
  assert re.search(r"t=1 epoch 1/2 loss=\S+ val_acc=\S+ best=\S+ [\d,]+ examples/s "
                   r"stage_eta=\S+ run_eta=\S+", text), text[-3000:]
  for t in (1, 2, 3, 4):
    assert re.search(rf"t={t}/4 \({25 * t}%\) epochs=\d+ .* [\d,]+ examples/s run_eta=\S+",
                     text), text[-3000:]
  full = helpers.outputs(str(tmp_path / "full"))
  caplog.clear()
  with caplog.at_level(logging.INFO):
    run.run(helpers.smoke(train__progress_every_s=0.0, log__progress="off",
                          train__stage_program=stage_program), str(tmp_path / "off"))
  assert caplog.text and not _progress_lines(caplog.text), _progress_lines(caplog.text)
  assert helpers.outputs(str(tmp_path / "off")) == full  # the records do not change
  config = io_utils.read_json(os.path.join(tmp_path, "off", "config.json"))
  assert config["log"]["progress"] == "off"

"""A whole training stage as one compiled program (`train.stage_program='whole'`): the same
results as the stage driven epoch by epoch from the host, and no programs beyond its own."""

import logging
import os
import time

import chex
import jax
import numpy as np
import pytest

from alma_jax import errors
from alma_jax import tasks
from alma_jax.configuration import config_lib
from alma_jax.engine import epoch
from alma_jax.engine import population
from alma_jax.engine import train
from alma_jax.stream import run
from alma_jax.stream import validation
from alma_jax.tuning import autotune
from tests import helpers
from tests.conftest import requires_mnist


def _population_stage(steps, method, whole, *, n_train=300, n_val=60, t=0):
  """fit_stage of two members with their own data; returns (best, opt_state, stats, epochs)."""
  learner = population.stack([helpers.init(method, 0), helpers.init(method, 1)])
  train_idx = np.stack([np.arange(i * 10, i * 10 + n_train) for i in range(2)])
  val_idx = np.stack([np.arange(400, 400 + n_val) + 20 * i for i in range(2)])
  epochs = []
  data = train.StageData(train_idx.astype(np.int32), val_idx.astype(np.int32),
                         population.stack_keys([jax.random.key(3), jax.random.key(4)]), t)
  best, opt, stats = train.fit_stage(steps, learner, data,
                                     hooks=train.StageHooks(on_epoch=lambda *a: epochs.append(a)),
                                     whole=whole)
  return best, opt, stats, epochs


def _assert_same_stage(a, b):
  """The results of two stages are bitwise equal: best learners, optimizer state, stats and
  every epoch's (epoch, mean loss, validation accuracy, members trained)."""
  chex.assert_trees_all_equal(a[0].params, b[0].params)
  chex.assert_trees_all_equal(a[0].model_state, b[0].model_state)
  chex.assert_trees_all_equal(a[1], b[1])
  for field in ("epochs_run", "best_epoch", "best_val_accuracy", "steps_run", "diverged",
                "examples_run"):
    np.testing.assert_array_equal(getattr(a[2], field), getattr(b[2], field), err_msg=field)
  assert len(a[3]) == len(b[3])
  for x, y in zip(a[3], b[3]):
    assert x[0] == y[0]
    for u, v in zip(x[1:], y[1:]):
      np.testing.assert_array_equal(u, v)


# With a small model, batches and patience the two members stop early at epochs of their own;
# a delta makes some small gains not count.
@pytest.mark.parametrize("k,delta", [(1, 0.0), (3, 0.02)])
def test_whole_stage_gives_the_results_of_the_stage_driven_per_epoch(k, delta):
  ds = helpers.synthetic_dataset(n_train=512)
  c = helpers.small_config(width=8, epochs=12, patience=2, steps_per_call=k,
                           patience_delta=delta)
  c.train.batch_size = 32
  c.optimizer.kwargs = {"learning_rate": 0.1}
  method, steps = helpers.make_steps(c, ds)
  per_epoch = _population_stage(steps, method, False)
  whole = _population_stage(steps, method, True)
  _assert_same_stage(per_epoch, whole)
  assert per_epoch[2].epochs_run.min() < 12  # early stopping happened
  assert len(set(per_epoch[2].epochs_run.tolist())) == 2  # at different epochs


def test_whole_stage_rolls_back_a_diverged_stage_as_per_epoch():
  ds = helpers.synthetic_dataset(n_train=512)
  c = helpers.small_config(width=8, epochs=4, patience=4, on_divergence="rollback")
  c.optimizer.kwargs = {"learning_rate": float("nan")}
  method, steps = helpers.make_steps(c, ds)
  per_epoch = _population_stage(steps, method, False)
  whole = _population_stage(steps, method, True)
  _assert_same_stage(per_epoch, whole)
  assert per_epoch[2].diverged.all() and per_epoch[2].epochs_run.tolist() == [1, 1]


def test_whole_stage_raises_on_divergence_with_stage_and_epoch():
  ds = helpers.synthetic_dataset(n_train=512)
  c = helpers.small_config(width=8)
  c.optimizer.kwargs = {"learning_rate": float("nan")}
  method, steps = helpers.make_steps(c, ds)
  with pytest.raises(errors.DivergenceError, match="stage t=7 epoch 1"):
    _population_stage(steps, method, True, t=7)


def test_a_whole_stage_compiles_one_program_shared_by_stages_of_other_sizes():
  ds = helpers.synthetic_dataset(n_train=512)
  c = helpers.small_config(width=8, epochs=3, patience=3)
  c.train.batch_size = 32
  method, steps = helpers.make_steps(c, ds)
  _population_stage(steps, method, True)
  assert [key[0] for key in steps.compiled] == ["stage"]
  # Fewer training examples (9 calls of 32 instead of 10: both padded to 16) and validation
  # examples (one evaluation batch): the same program.
  _population_stage(steps, method, True, n_train=260, n_val=50)
  assert [key[0] for key in steps.compiled] == ["stage"]


@pytest.mark.parametrize("m,delta", [(1, 0.0), (7, 0.0), (60, 0.02), (1000, 0.001), (3, 0.5)])
def test_improvement_thresholds_match_the_float64_comparison(m, delta):
  table = epoch.improvement_thresholds(m, delta)
  acc = np.arange(m + 1) / m
  for b, best in enumerate([-1.0] + acc.tolist()):
    improves = acc > best + delta
    assert (np.arange(m + 1) >= table[b]).tolist() == improves.tolist()
  assert len(table) & (len(table) - 1) == 0  # a power of two: sizes share programs


def test_whole_refuses_a_task_whose_examples_are_not_right_or_wrong():
  c = config_lib.base_config("tiny_shakespeare", "lm_sm")
  c.train.stage_program = "whole"
  with pytest.raises(errors.ConfigError, match=r"config\.train\.stage_program='whole' needs a "
                     r"task whose examples are right or wrong; for task 'text'"):
    validation._check_rules(validation.complete(c))  # pylint: disable=protected-access


def test_a_stage_runs_as_one_program_only_for_a_task_whose_examples_are_right_or_wrong():
  assert tasks.ImageTask.right_or_wrong() and not tasks.TextTask.right_or_wrong()
  ds = helpers.synthetic_dataset(n_train=512)
  method, steps = helpers.make_steps(helpers.small_config(width=8, epochs=2), ds)

  class Graded(type(steps.task)):  # a task with its own per-example error
    def per_example(self, logp, y):
      return super().per_example(logp, y)

  steps.task.__class__ = Graded
  with pytest.raises(ValueError, match="whole-stage program needs a task whose examples are "
                     "right or wrong; task Graded trains per epoch"):
    _population_stage(steps, method, True)


@pytest.mark.parametrize("name,model,expected", [
    ("sm", "mlp", "whole"),  # an MLP on a CPU: a stage as one program
    ("gmoe", "mlp", "per_epoch"),  # a growing method
    ("sm", "vgg", "per_epoch"),  # a convolution-heavy backbone
    ("lm_sm", "switch", "per_epoch"),  # text: examples are not right or wrong
])
def test_the_stage_program_rule(name, model, expected):
  dataset = "tiny_shakespeare" if model == "switch" else "mnist"
  c = validation.complete(config_lib.base_config(dataset, name))
  c.model.name = model
  assert autotune.stage_program_rule(c) == expected
  assert "train.stage_program" in [t.path for t in autotune.pending(c)]


@requires_mnist
def test_whole_stage_runs_write_the_records_of_per_epoch_runs(tmp_path):
  outputs = {}
  for choice in ("per_epoch", "whole"):
    wd = str(tmp_path / choice)
    summary = run.run(helpers.smoke(train__stage_program=choice), wd)
    outputs[choice] = helpers.outputs(wd)
    # train + evaluation, or the stage program + evaluation (of the test set): nothing more.
    assert summary["num_compilations"] == 2, choice
  # By rule the per-epoch loop's calls run 8 of the MLP's short steps each, the stage program
  # one per iteration: a speed choice, the records the same.
  choices = {c: outputs[c][1].pop("choices") for c in outputs}
  assert choices["per_epoch"]["train.steps_per_call"] == 8
  assert choices["whole"]["train.steps_per_call"] == 1
  assert outputs["whole"] == outputs["per_epoch"]


@pytest.mark.parametrize("whole", [False, True])
def test_a_stage_that_keeps_its_starting_parameters_is_warned_of(whole, caplog):
  ds = helpers.synthetic_dataset(n_train=512)
  c = helpers.small_config(width=8, epochs=3, patience=2, patience_delta=0.0)
  c.train.batch_size = 32
  method, steps = helpers.make_steps(c, ds)
  with caplog.at_level(logging.WARNING):
    _population_stage(steps, method, whole, t=4)
  assert "no epoch improved" not in caplog.text
  c.train.patience_delta = 2.0  # past its bound: no accuracy improves on the start by 2
  method, steps = helpers.make_steps(c, ds)
  with caplog.at_level(logging.WARNING):
    _, _, stats, _ = _population_stage(steps, method, whole, t=4)
  assert stats.best_epoch.tolist() == [0, 0]
  assert "stage t=4: no epoch improved the validation accuracy" in caplog.text
  assert "members 0, 1" in caplog.text


def _slow_stage_calls(monkeypatch, seconds_per_epoch, on_call=None):
  """Makes every call of the whole-stage program last at least `seconds_per_epoch` per epoch it
  runs; returns the list of (first, end) epochs of the calls."""
  from alma_jax.engine import programs  # pylint: disable=g-import-not-at-top
  calls, real = [], programs.Programs.stage_call

  def slow(self, *args, **kwargs):
    first, end = args[8], args[9]
    calls.append((first, end))
    if on_call is not None:
      on_call(first, end)
    out = real(self, *args, **kwargs)
    time.sleep(seconds_per_epoch * (end - first))
    return out

  monkeypatch.setattr(programs.Programs, "stage_call", slow)
  return calls


def _stage_saves(monkeypatch):
  """The (stage t, position epoch) of every stage save, as they are written."""
  from alma_jax.outputs import stage_checkpoint  # pylint: disable=g-import-not-at-top
  saves, real = [], stage_checkpoint.Store.save

  def save(self, arrays, position):
    saves.append((self.t, int(position["epoch"])))
    return real(self, arrays, position)

  monkeypatch.setattr(stage_checkpoint.Store, "save", save)
  return saves


@requires_mnist
def test_a_long_whole_stage_is_saved_every_every_s_and_its_records_do_not_change(tmp_path,
                                                                                monkeypatch):
  # Each epoch lasts at least 0.2 s, so a 6-epoch stage at least 1.2 s: with every_s = 0.5 the
  # calls of the program end at least every 0.5 s of measured work, and one of the boundaries
  # before the last epoch falls after 0.5 s of the stage, where a save is due.
  fields = dict(train__stage_program="whole", train__epochs=6, train__patience=6)
  reference = str(tmp_path / "reference")
  run.run(helpers.smoke(**fields), reference)
  calls = _slow_stage_calls(monkeypatch, 0.2)
  saves = _stage_saves(monkeypatch)
  wd = str(tmp_path / "wd")
  summary = run.run(helpers.smoke(checkpoint__every_s=0.5, **fields), wd)
  stages = {t for t, _ in saves}
  assert stages == {1, 2, 3, 4}, saves  # every stage saved while it trained
  assert all(epoch <= 6 for _, epoch in saves), saves  # ... with epochs still to run
  assert len(calls) > 4  # more than one call per stage
  assert helpers.outputs(wd)[0] == helpers.outputs(reference)[0]  # the same records
  assert summary["num_compilations"] == 2


@requires_mnist
def test_a_signal_during_the_last_call_of_a_whole_stage_keeps_the_stage(tmp_path, monkeypatch,
                                                                       caplog):
  # No timed saves and no stream checkpoint until the end: before, the stage trained in the
  # program was lost with the stop; now the stop saves it, and the same command resumes after it.
  import signal  # pylint: disable=g-import-not-at-top
  from alma_jax.outputs import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  fields = dict(train__stage_program="whole", train__epochs=3, train__patience=3,
                checkpoint__every=100, checkpoint__every_s=0.0)
  reference = str(tmp_path / "reference")
  run.run(helpers.smoke(**fields), reference)
  starts = []

  def term_in_stage_2(first, end):
    starts.append(first == 1)
    if sum(starts) == 2 and end == 4 and not getattr(term_in_stage_2, "sent", False):
      term_in_stage_2.sent = True  # the second stage's call that ends it
      os.kill(os.getpid(), signal.SIGTERM)

  _slow_stage_calls(monkeypatch, 0.0, term_in_stage_2)
  wd = str(tmp_path / "wd")
  with pytest.raises(run.RunInterrupted):
    run.run(helpers.smoke(**fields), wd)
  assert "stage t=2 was saved after its training: the same command continues it there" in (
      caplog.text)
  stage_dir = os.path.join(wd, "checkpoints_stage")
  (step,) = [n for n in os.listdir(stage_dir) if n.isdigit()]
  with ckpt_lib.Checkpointer(stage_dir, 1) as ckpt:
    meta = ckpt.read_meta(int(step))
  assert (meta["stage_t"], meta["position"]["epoch"]) == (2, 4)  # stage 2, nothing left to train
  assert meta["position"]["trained"] is True
  monkeypatch.undo()
  run.run(helpers.smoke(**fields), wd)
  assert helpers.outputs(wd) == helpers.outputs(reference)
  # Its three epochs are in the event file once, as in the uninterrupted run's.
  assert helpers.epoch_events(wd) == helpers.epoch_events(reference)
  assert len(helpers.epoch_events(reference)) == 12

"""The divergence and best-epoch rule of an epoch (alma_jax/engine/epoch.py), compiled as both
ways of running a stage use it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alma_jax.engine import epoch
from alma_jax.methods.base import Learner


def _select(take, new, old):  # one unit per member
  return jax.tree.map(lambda a, b: jnp.where(take[:, 0], a, b), new, old)


def _run(rule, epochs, ok=None):
  """The rule over `epochs` (per epoch: each member's score); the learner of epoch e is all e."""
  num = len(epochs[0])
  stop = epoch.StopState.start(num, 1)
  best = Learner(params=jnp.zeros((num,)), model_state=())
  end = jax.jit(lambda *a: epoch.end_epoch(rule, _select, *a))
  facts = []
  for e, scores in enumerate(epochs, start=1):
    current = Learner(params=jnp.full((num,), float(e)), model_state=())
    good = np.ones(num, bool) if ok is None else ok[e - 1]
    stop, best, f = end(stop, best, current, good, np.float32(scores).reshape(num, 1), np.int32(e),
                        np.int32(3), rule.thresholds())
    facts.append(jax.device_get(f))
  return jax.device_get(stop), np.asarray(best.params), facts


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("delta", [0.0, 0.1])
def test_an_epoch_improves_when_its_accuracy_beats_the_best_by_more_than_delta(exact, delta):
  m = 10
  accs = [0.5, 0.55, 0.7, 0.7, 0.75, 0.9]  # of 10 examples: 5, 5.5 (text only), 7, 7, 7.5, 9
  if exact:
    accs = [a for a in accs if (a * m) % 1 == 0]
  rule = epoch.Rule(patience=10, delta=delta, num_val=m, exact=exact, stop_all_on_divergence=True)
  stop, best, facts = _run(rule, [[a * m] for a in accs])
  best_acc, best_epoch = -1.0, 0
  for e, a in enumerate(accs, start=1):  # the float64 comparison of the host, as reported
    improved = a > best_acc + delta
    assert bool(facts[e - 1]["improved"][0, 0]) == improved, (e, a)
    if improved:
      best_acc, best_epoch = a, e
  assert stop.best_epoch.tolist() == [best_epoch] and best.tolist() == [float(best_epoch)]
  assert stop.best_score.tolist() == [[np.float32(best_acc * m)]]


def test_patience_ends_a_member_and_counts_its_steps_and_epochs():
  rule = epoch.Rule(patience=2, delta=0.0, num_val=4, exact=True, stop_all_on_divergence=True)
  stop, _, _ = _run(rule, [[3, 1], [2, 2], [2, 3], [4, 4]])
  # Member 0: best at 1, no gain at 2 and 3: stops after 3. Member 1 improves every epoch.
  assert stop.active.tolist() == [False, True]
  assert stop.epochs_run.tolist() == [3, 4] and stop.steps_run.tolist() == [9, 12]
  assert stop.best_epoch.tolist() == [1, 4] and stop.since_best.tolist() == [2, 0]


@pytest.mark.parametrize("stop_all", [True, False])
def test_a_diverged_member_stops_alone_or_stops_the_stage(stop_all):
  rule = epoch.Rule(patience=5, delta=0.0, num_val=4, exact=True, stop_all_on_divergence=stop_all)
  ok = [np.array([True, True]), np.array([False, True])]
  stop, best, facts = _run(rule, [[1, 1], [4, 4]], ok)
  assert facts[1]["bad"].tolist() == [True, False]
  assert stop.diverged.tolist() == [True, False]
  # The diverged member keeps its best epoch (1); the other improves at 2 unless all stop.
  assert best[0] == 1.0 and best[1] == (1.0 if stop_all else 2.0)
  assert stop.active.tolist() == [False, not stop_all]

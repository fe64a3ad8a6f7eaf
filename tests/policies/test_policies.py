"""Tests of the stage and waiting policies (alma_jax/policies/) and of their hooks in the loop."""

import jax
import numpy as np
import pytest

from alma_jax import methods
from alma_jax import policies
from alma_jax.configuration import config_lib
from alma_jax.configuration import fields
from alma_jax.configuration import plugins
from alma_jax.errors import ConfigError
from alma_jax.methods import ensemble
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir
from alma_jax.policies import base as policy_base
from alma_jax.policies import schedule
from alma_jax.stream import config_resolve
from alma_jax.stream import run
from alma_jax.stream import validation
from tests import helpers
from tests.conftest import requires_mnist

MNIST = validation.KNOWN_SHAPES["mnist"]


def _same(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def _method(name, **stream):
  """A method made from the resolved small config of `name` with `stream` fields set."""
  c = helpers.small_config("mnist", name)
  for k, v in stream.items():
    c.stream[k] = v
  c = validation.complete(c)
  return c, methods.make(c, *MNIST)


@pytest.fixture
def registered():
  """Registers policy classes for one test; removes them afterwards."""
  added = []

  def add(cls):
    added.append(cls)
    return policies.register(cls)

  yield add
  for cls in added:  # from the registry and from the declarations it added them to
    for registry in (*policy_base._REGISTRY.values(),  # pylint: disable=protected-access
                     plugins.STAGE_POLICIES, plugins.WAIT_POLICIES):
      if registry.get(cls.name) is cls:
        del registry[cls.name]


# -- the registry and the config fields ------------------------------------------------------------
def test_the_registry_holds_the_policies_by_name():
  assert policies.stage_names() == ["continual_backprop", "finetune", "l2_init", "redo",
                                    "scratch", "shrink_perturb"]
  assert policies.wait_names() == ["fixed", "geometric", "triggered"]
  c = validation.complete(config_lib.base_config("mnist"))
  assert type(policies.make_stage(c)).name == "finetune"
  assert type(policies.make_wait(c)).name == "fixed"


@pytest.mark.parametrize("path, names", [("stream.warm_start",
                                          "['continual_backprop', 'finetune', 'l2_init', "
                                          "'redo', 'scratch', 'shrink_perturb']"),
                                         ("stream.wait_policy",
                                          "['fixed', 'geometric', 'triggered']")])
def test_an_unknown_policy_is_an_error_naming_the_field_and_the_policies(path, names):
  c = config_lib.base_config("mnist")
  c.stream[path.split(".")[1]] = "shrink"
  message = rf"config\.{path}='shrink' is unknown; valid names: {names}"
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
    fields.check_all(c, config_lib.BASE_FIELDS)
  make = policies.make_stage if path.endswith("warm_start") else policies.make_wait
  with pytest.raises(ConfigError, match=r"is unknown; valid names"):
    make(c)


def test_a_policy_in_a_new_module_is_chosen_by_its_name(registered):
  @registered
  class Shrink(policies.StagePolicy):
    name = "test_shrink"

  c = config_lib.base_config("mnist")
  c.stream.warm_start = "test_shrink"
  fields.check_all(c, config_lib.BASE_FIELDS)
  assert isinstance(policies.make_stage(validation.complete(c)), Shrink)
  assert "test_shrink" in policies.stage_names()

  class Other(policies.StagePolicy):
    name = "test_shrink"

  with pytest.raises(ValueError, match="registered twice"):
    policies.register(Other)
  with pytest.raises(TypeError, match="neither a StagePolicy nor a WaitPolicy"):
    policies.register(int)


@pytest.mark.parametrize("set_fields, want", [
    ({}, ("finetune", False)),
    ({"init_from_scratch": False}, ("finetune", False)),
    ({"init_from_scratch": True}, ("scratch", True)),
    ({"warm_start": "scratch"}, ("scratch", True)),
    ({"warm_start": "scratch", "init_from_scratch": True}, ("scratch", True)),
])
def test_init_from_scratch_is_the_older_spelling_of_warm_start_scratch(set_fields, want):
  c = config_lib.base_config("mnist", "gens")
  for k, v in set_fields.items():
    c.stream[k] = v
  done = validation.complete(c)
  assert (done.stream.warm_start, done.stream.init_from_scratch) == want
  assert validation.complete(done).stream.to_dict() == done.stream.to_dict()  # settled


def test_contradicting_warm_start_fields_are_an_error(registered):
  c = config_lib.base_config("mnist")
  c.stream.warm_start, c.stream.init_from_scratch = "scratch", False
  with pytest.raises(ConfigError, match=r"config\.stream\.init_from_scratch=False contradicts "
                                        r"config\.stream\.warm_start='scratch'"):
    validation.complete(c)

  @registered
  class Perturb(policies.StagePolicy):
    name = "test_perturb"

  c.stream.warm_start, c.stream.init_from_scratch = "test_perturb", True
  with pytest.raises(ConfigError, match="contradicts config.stream.warm_start='test_perturb'"):
    validation.complete(c)
  c.stream.init_from_scratch = None
  assert validation.complete(c).stream.init_from_scratch is False


@pytest.mark.parametrize("args", [
    ["--config.stream.warm_start=finetune", "--config.stream.init_from_scratch=True"],
    ["--config.stream.init_from_scratch=True", "--config.stream.warm_start", "shrink_perturb"],
])
def test_an_explicit_warm_start_contradicting_init_from_scratch_is_an_error(args):
  with pytest.raises(ValueError, match=r"--config\.stream\.init_from_scratch=True contradicts "
                                       r"--config\.stream\.warm_start="):
    config_resolve.resolve("configs/mnist_sm.py:smoke", args)
  with pytest.raises(ValueError, match="contradicts"):
    config_resolve.check_overrides(args)  # what the entry point checks


@pytest.mark.parametrize("args", [
    ["--config.stream.init_from_scratch=True"],
    ["--config.stream.warm_start=scratch", "--config.stream.init_from_scratch=True"],
    ["--config.stream.warm_start=finetune", "--config.stream.init_from_scratch=False"],
])
def test_init_from_scratch_alone_or_agreeing_still_resolves(args):
  config_resolve.check_overrides(args)
  c = validation.complete(config_resolve.resolve("configs/mnist_sm.py:smoke", args))
  assert c.stream.warm_start == ("finetune" if "False" in args[-1] else "scratch")


def test_outputs_of_runs_before_the_policy_fields_resume_and_keep_their_hash():
  new = workdir.config_dict(validation.complete(config_lib.base_config("mnist")))
  old = workdir.config_dict(validation.complete(config_lib.base_config("mnist")))
  del old["stream"]["warm_start"], old["stream"]["wait_policy"]
  assert workdir.config_diff(old, new) == []
  assert config_resolve.config_hash(old) == config_resolve.config_hash(new)
  scratch = workdir.config_dict(validation.complete(config_lib.base_config("mnist")))
  scratch["stream"].update(warm_start="scratch", init_from_scratch=True)
  assert workdir.config_diff(old, scratch) == [
      "config.stream.init_from_scratch: False → True",
      "config.stream.warm_start: '<absent>' → 'scratch'"]
  assert config_resolve.config_hash(scratch) != config_resolve.config_hash(new)


# -- finetune and scratch on tiny learners ---------------------------------------------------------
def test_finetune_keeps_the_learner_and_scratch_starts_afresh():
  c, method = _method("sm")
  trained = jax.tree.map(lambda a: a + 0.5, method.init(jax.random.key(0)))
  key, ctx, opt_state = jax.random.key(7), helpers.context(2), {"mu": np.ones(3)}
  learner, kept = policies.make_stage(c).start_stage(method, trained, key, ctx, opt_state)
  assert _same(learner, trained) and kept is opt_state
  c, method = _method("sm", warm_start="scratch")
  learner, kept = policies.make_stage(c).start_stage(method, trained, key, ctx, opt_state)
  assert kept is None and learner.structure == trained.structure
  fresh = method.init(jax.random.fold_in(key, policy_base.REINIT_KEY))
  assert _same(learner, fresh) and not _same(learner.params, trained.params)


class _OrderRecorder:
  """A method stand-in whose growth and re-initialisation record what they were given."""

  def __init__(self):
    self.calls = []

  def before_stage(self, learner, key, ctx):
    del key, ctx
    self.calls.append(("grow", learner))
    return learner + ("grown",)

  def reinit(self, learner, key):
    del key
    self.calls.append(("reinit", learner))
    return ("fresh",) + learner[1:]


def test_scratch_grows_on_the_trained_learner_then_reinitialises_the_grown_one():
  c, _ = _method("sm", warm_start="scratch")
  method = _OrderRecorder()
  learner, opt_state = policies.make_stage(c).start_stage(
      method, ("trained",), jax.random.key(0), helpers.context(2), {"mu": 1})
  # Growth decides on what the previous stage learnt; the grown structure is then redrawn.
  assert method.calls == [("grow", ("trained",)), ("reinit", ("trained", "grown"))]
  assert learner == ("fresh", "grown") and opt_state is None


def _member(tree, i):
  return jax.tree.map(lambda a: np.asarray(a[i]), tree)


def _gens_after_a_stage(method):
  """A gEns learner whose one member has trained (its values moved)."""
  learner = method.init(jax.random.key(0))
  return learner.replace(params=jax.tree.map(lambda a: a + 0.5, learner.params))


def test_scratch_for_gens_trains_fresh_members_and_keeps_the_frozen_ones():
  key, ctx = jax.random.key(3), helpers.context(2)  # a later stage: gEns grows first
  c, method = _method("gens", warm_start="scratch")
  assert method.opts.new_member == "copy"  # scratch overrides the copy
  trained = _gens_after_a_stage(method)
  learner, opt_state = policies.make_stage(c).start_stage(method, trained, key, ctx, None)
  assert learner.structure == (2, 1) and opt_state is None
  assert _same(_member(learner.params, 0), _member(trained.params, 0))  # frozen: untouched
  grow_key = jax.random.fold_in(key, policy_base.GROWTH_KEY)
  fresh, _ = method.init_backbone(jax.random.fold_in(grow_key, 0))
  assert _same(_member(learner.params, 1), fresh)  # the trained member: a fresh network
  # With finetune the same growth copies the trained member.
  c, method = _method("gens")
  learner, _ = policies.make_stage(c).start_stage(method, trained, key, ctx, None)
  assert _same(_member(learner.params, 1), _member(trained.params, 0))


def test_scratch_for_gens_at_the_first_stage_keeps_the_untrained_members():
  c, method = _method("gens", warm_start="scratch")
  untrained = method.init(jax.random.key(0))
  learner, _ = policies.make_stage(c).start_stage(method, untrained, jax.random.key(3),
                                                  helpers.context(1), None)
  assert learner.structure == (1, 1) and _same(learner, untrained)


def test_fresh_trained_units_draws_only_what_the_stage_trains():
  key = jax.random.key(5)
  _, sm = _method("sm")
  trained = jax.tree.map(lambda a: a + 0.5, sm.init(jax.random.key(0)))
  assert _same(policy_base.fresh_trained_units(sm, trained, key), sm.init(key))
  c, gens = _method("gens")
  grown, _ = policies.make_stage(c).start_stage(gens, _gens_after_a_stage(gens),
                                                jax.random.key(3), helpers.context(2), None)
  fresh = policy_base.fresh_trained_units(gens, grown, key)
  assert fresh.structure == (2, 1)
  assert _same(_member(fresh.params, 0), _member(grown.params, 0))
  assert _same(_member(fresh.params, 1), _member(gens.init(key, (2, 1)).params, 1))
  assert ensemble.active_slots(fresh.model_state).tolist() == [True, True]


def test_the_fixed_wait_trains_at_the_schedules_times():
  c = validation.complete(config_lib.base_config("mnist"))
  c.stream.num_megabatches, c.stream.wait = 12, 3
  wait = policies.make_wait(c)
  assert [t for t in range(1, 13) if wait.trains_at(t, None)] == [3, 6, 9, 12]
  assert wait.planned_times(12) == schedule.training_times(12, 3)


# -- the hooks in the loop -------------------------------------------------------------------------
@requires_mnist
def test_every_learner_of_every_stage_starts_through_the_one_hook(registered, tmp_path):
  calls, kept = [], []

  @registered
  class Recording(policies.StagePolicy):
    name = "test_recording"

    def start_stage(self, method, learner, key, ctx, opt_state):
      calls.append((method.name, ctx.t, ctx.stage, learner.structure, len(ctx.train_idx)))
      kept.append(opt_state)
      return super().start_stage(method, learner, key, ctx, opt_state)

  c = helpers.smoke("gens", stream__warm_start="test_recording", num_seeds=2)
  run.run(c, str(tmp_path / "wd"))
  assert [x[:4] for x in calls] == [("gens", t, t, (max(t - 1, 1), 1)) for t in (1, 2, 3, 4)
                                     for _ in range(2)]
  assert all(n > 0 for *_, n in calls)
  # The run keeps no optimizer state (train.keep_optimizer_state=False): none is handed over.
  assert not c.train.keep_optimizer_state and kept == [None] * len(calls)
  arch = io_utils.read_jsonl(str(tmp_path / "wd" / workdir.ARCH_FILE))
  assert [a["members"] for a in arch] == [1, 2, 3, 4]  # growth ran inside the hook


@requires_mnist
def test_a_waiting_policy_in_a_new_module_decides_when_to_train(registered, tmp_path):
  @registered
  class FirstAndLast(policies.WaitPolicy):
    name = "test_first_and_last"

    def trains_at(self, t, state):
      return t in (1, self.config.stream.num_megabatches)

  wd = str(tmp_path / "wd")
  run.run(helpers.smoke(stream__wait_policy="test_first_and_last"), wd)
  log = io_utils.read_jsonl(f"{wd}/log.jsonl")
  assert [r["trained"] for r in log] == [False, True, False, False, True]
  # The stage at t=4 trains on the mega-batches 2, 3 and 4 (about three times the first's).
  ratio = log[4]["train_macs"] / log[1]["train_macs"]
  assert 2.8 < ratio < 3.2, ratio


# -- shrink and perturb ------------------------------------------------------------------------------
def test_shrink_perturb_at_1_0_is_finetune_and_at_0_1_is_scratch_exactly():
  trained_at = lambda m: jax.tree.map(lambda a: a + 0.5, m.init(jax.random.key(0)))
  key, ctx = jax.random.key(7), helpers.context(2)
  c, method = _method("sm")
  finetuned, _ = policies.make_stage(c).start_stage(method, trained_at(method), key, ctx, None)
  c, method = _method("sm", warm_start="scratch")
  scratch, _ = policies.make_stage(c).start_stage(method, trained_at(method), key, ctx, None)
  c, method = _method("sm", warm_start="shrink_perturb", shrink=1.0, perturb=0.0)
  same, _ = policies.make_stage(c).start_stage(method, trained_at(method), key, ctx, None)
  assert _same(same, finetuned)
  c, method = _method("sm", warm_start="shrink_perturb", shrink=0.0, perturb=1.0)
  fresh, _ = policies.make_stage(c).start_stage(method, trained_at(method), key, ctx, None)
  assert _same(fresh, scratch) and not _same(fresh.params, finetuned.params)
  c, method = _method("sm", warm_start="shrink_perturb", shrink=0.5, perturb=0.1)
  mixed, _ = policies.make_stage(c).start_stage(method, trained_at(method), key, ctx, None)
  expected = jax.tree.map(lambda a, b: 0.5 * a + 0.1 * b, finetuned.params, scratch.params)
  for got, want in zip(jax.tree.leaves(mixed.params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=0, atol=0)  # the same two float32 operations


def test_shrink_perturb_leaves_the_frozen_members_of_gens_untouched():
  c, gens = _method("gens", warm_start="shrink_perturb", shrink=0.5, perturb=0.1)
  trained = _gens_after_a_stage(gens)
  learner, _ = policies.make_stage(c).start_stage(gens, trained, jax.random.key(3),
                                                  helpers.context(2), None)
  assert _same(_member(learner.params, 0), _member(trained.params, 0))  # frozen, untouched
  assert not _same(_member(learner.params, 1), _member(trained.params, 0))


def test_shrink_perturb_mixes_fresh_draws_into_the_members_gens_trains():
  # The new member is a copy of the last one; x_fresh is a fresh draw of it, not the copy
  # again (which made shrink=0, perturb=1 leave the copy as it was).
  key, ctx = jax.random.key(3), helpers.context(2)
  c, gens = _method("gens")
  trained = _gens_after_a_stage(gens)
  copied, _ = policies.make_stage(c).start_stage(gens, trained, key, ctx, None)  # finetune
  c, gens = _method("gens", warm_start="shrink_perturb", shrink=0.0, perturb=1.0)
  fresh, _ = policies.make_stage(c).start_stage(gens, trained, key, ctx, None)
  assert fresh.structure == copied.structure == (2, 1)
  assert _same(_member(fresh.params, 0), _member(trained.params, 0))
  drawn = gens.fresh_init(copied, jax.random.key(5))
  assert _same(_member(drawn.params, 0), _member(copied.params, 0))  # only the trained one
  for got in (_member(fresh.params, 1), _member(drawn.params, 1)):
    assert not any(np.allclose(a, b) for a, b in zip(jax.tree.leaves(got),
                                                     jax.tree.leaves(_member(copied.params, 1)))
                   if np.asarray(a).size > 1)
  # A fresh member's values are those of a new network: a new draw of its shapes.
  new = gens.init_backbone(jax.random.key(11))[0]
  assert jax.tree.map(np.shape, _member(fresh.params, 1)) == jax.tree.map(np.shape, new)
  c, gens = _method("gens", warm_start="shrink_perturb", shrink=0.5, perturb=0.1)
  mixed, _ = policies.make_stage(c).start_stage(gens, trained, key, ctx, None)
  for got, a, b in zip(jax.tree.leaves(_member(mixed.params, 1)),
                       jax.tree.leaves(_member(copied.params, 1)),
                       jax.tree.leaves(_member(fresh.params, 1))):
    np.testing.assert_allclose(got, 0.5 * a + 0.1 * b, rtol=0, atol=0)


def test_shrink_and_perturb_are_refused_without_their_policy():
  c = helpers.small_config("mnist", "sm")
  c.stream.perturb = 0.1
  with pytest.raises(ConfigError, match=r"config\.stream\.shrink=1\.0 and config\.stream\."
                                        r"perturb=0\.1 are used only by config\.stream\."
                                        r"warm_start='shrink_perturb', not 'finetune'"):
    validation.complete(c)


@requires_mnist
def test_a_run_with_shrink_1_and_perturb_0_writes_the_records_of_finetune(tmp_path):
  finetune = str(tmp_path / "finetune")
  run.run(helpers.smoke(), finetune)
  same = str(tmp_path / "shrink_perturb")
  run.run(helpers.smoke(stream__warm_start="shrink_perturb"), same)
  assert helpers.outputs(same) == helpers.outputs(finetune)
  mixed = str(tmp_path / "mixed")
  run.run(helpers.smoke(stream__warm_start="shrink_perturb", stream__shrink=0.5,
                        stream__perturb=0.1), mixed)
  assert helpers.outputs(mixed)[0] != helpers.outputs(finetune)[0]

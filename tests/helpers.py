"""Small synthetic data sets, configs and compiled steps shared by the tests."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alma_jax
from alma_jax import methods
from alma_jax.configuration import config_lib
from alma_jax.engine import population
from alma_jax.engine import sharding
from alma_jax.engine.optim import make_optimizer
from alma_jax.engine.steps import Steps
from alma_jax.methods.base import StageContext
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir
from alma_jax.stream import run as run_lib
from alma_jax.stream import validation
from alma_jax.tasks import images as image_task
from alma_jax.tuning import autotune
from tests import kill_points

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# For the runs of `alma_jax.main` that tests start as processes and whose figure no test looks
# at: the child that would draw error.png imports matplotlib, about 0.7 s of CPU per run, more
# than many of those runs take. The drawing child is tested where it is started on purpose
# (`drawing_child` tests, tests/test_multiprocess.py).
NO_FIGURE = "--config.log.error_png=False"


def synthetic_dataset(n_train=512, n_test=128, shape=(28, 28, 1), num_classes=10, seed=0,
                      learnable=True):
  """uint8 noise images; if learnable, class y brightens rows 2y and 2y+1."""
  rng = np.random.default_rng(seed)

  def make(n):
    y = rng.integers(0, num_classes, n).astype(np.int32)
    x = rng.integers(0, 60, (n,) + shape)
    if learnable:
      rows = np.arange(shape[0])[None, :] // 2 == y[:, None]
      x = x + 190 * rows[:, :, None, None]
    return x.astype(np.uint8), y

  tx, ty = make(n_train)
  sx, sy = make(n_test)
  c = shape[-1]
  return types.SimpleNamespace(train_x=tx, train_y=ty, test_x=sx, test_y=sy,
                               mean=np.full((c,), 0.4, np.float32), std=np.full((c,), 0.25, np.float32),
                               num_classes=num_classes)


def gathered_dot(x, w, idx):
  """A dot of gathered rows, which XLA:CPU hands to YNNPACK by default (jax 0.10.2): its
  compiled text then says "ynn_fusion", so it shows which XLA options a program had."""
  return (x[idx] @ w).sum(-1)


def gathered_dot_args():
  return (np.ones((256, 784), np.float32), np.ones((784, 64), np.float32),
          np.arange(256, dtype=np.int32) % 7)


def small_config(dataset="mnist", method="sm", width=8, **train):
  """A small config; `train` overrides `config.train` fields. One train step per call unless
  `steps_per_call` is given (the field's default, 0, leaves it to be chosen)."""
  c = config_lib.base_config(dataset, method)
  c.model.width = width
  c.train.epochs = 2
  c.train.patience = 2
  c.train.steps_per_call = 1
  c.mesh.num_devices = 1
  for k, v in train.items():
    c.train[k] = v
  return c


@functools.lru_cache(maxsize=None)
def _cached_method(name, dataset, width, fields):
  c = small_config(dataset, method=name, width=width)
  for k, v in fields:
    c.method[k] = v
  return methods.make(c, *validation.KNOWN_SHAPES[dataset])


def cached_method(name, dataset, width=4, **fields):
  """Method `name` of a small config, one instance per arguments, shared between tests (so
  are its compiled functions)."""
  return _cached_method(name, dataset, width, tuple(sorted(fields.items())))


def make_steps(config, ds, num_devices=1, model=1):
  """(method, Steps) of `config` on data set `ds` (a `synthetic_dataset`), on a mesh of
  num_devices // model (data) x model devices; `config.mesh.rules` applies. Fields left to be
  chosen are decided by rule, except a stage driven from the host (`fit_stage(whole=True)`
  runs the whole-stage program)."""
  config = validation.complete(config)
  rules = {t.path: t.rule(config) for t in autotune.pending(config)}
  if "train.stage_program" in rules:
    rules["train.stage_program"] = "per_epoch"
  config = autotune.with_choices(config, rules)
  mesh = sharding.make_mesh(num_devices, model=model)
  method = methods.make(config, ds.train_x.shape[1:], ds.num_classes)
  steps = Steps.from_config(config, method, image_task.ImageTask.from_config(config),
                            make_optimizer(config.optimizer), image_task.device_data(ds), mesh)
  return method, steps


def compiled(fn):
  """(fn(), the names of the XLA programs built or loaded while it ran)."""
  names = []

  def listen(event, duration, **kwargs):
    del duration
    if event == "/jax/core/compile/backend_compile_duration":
      names.append(str(kwargs.get("fun_name")))

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    return fn(), names
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


_IN_A_NEW_PROCESS = """
import json
import jax
from alma_jax.runtime import caches
caches.enable_compilation_cache()  # the session's, as in the suite's own process
from tests import helpers
{setup}
_, names = helpers.compiled(lambda: exec({action!r}))
print("PROGRAMS", json.dumps(names))
"""


def compiled_in_a_new_process(setup: str, action: str) -> list[str]:
  """The names of the XLA programs built or loaded while the statements `action` run, in a
  new process after the statements `setup` (their asserts hold there too). In this process a
  program compiled earlier (by any test) would hide an eager operation: JAX compiles one
  per operation and shapes, once per process."""
  script = _IN_A_NEW_PROCESS.format(setup=textwrap.dedent(setup),
                                    action=textwrap.dedent(action))
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith("PROGRAMS ")]
  return json.loads(line.split(" ", 1)[1])


# The suite compiles with XLA:CPU's older fusion emitters (tests/conftest.py); a run compiles
# with its MLIR fusion emitters, whose elementwise code does not depend on an array's length.
RUN_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


def jit_as_runs(fn):
  """`fn` jitted and compiled with the fusion emitters of a run: for tests of bitwise equality
  between programs of different shapes (a padded array against its active part)."""
  def call(*args):
    return jax.jit(fn).lower(*args).compile(compiler_options=RUN_EMITTERS)(*args)
  return call


def init(method, seed=0):
  return method.init(jax.random.key(seed))


def random_learner(method, seed=0, scale=0.3):
  """A learner of `method`'s initial structure with N(0, scale^2) float64 numpy leaves (use
  inside `jax.enable_x64(True)`): no initialisation program to compile."""
  abstract = jax.eval_shape(method.init, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  floating = lambda s: jnp.issubdtype(s.dtype, jnp.floating)
  if all(floating(s) for s in jax.tree.leaves(abstract)):
    return jax.tree.map(lambda s: rng.normal(0.0, scale, s.shape), abstract)
  # Integer and boolean leaves (a gating tree's routing arrays, slot masks) keep their values.
  real = method.init(jax.random.key(seed))
  return jax.tree.map(lambda s, r: rng.normal(0.0, scale, s.shape) if floating(s) else r,
                      abstract, real)


def float64(tree):
  """`tree` with its floating-point leaves in float64 (use inside `jax.enable_x64(True)`).

  Tests that compare two orders of the same float32 arithmetic after several
  training steps run both in float64: rounding differences then stay below
  ~1e-12 (unit roundoff 1.1e-16 amplified by at most ~1e4 through a few
  steps), so a tolerance of 1e-9 cannot flag them, while a real difference
  (another data order, a wrong mask) is of order 1e-3 or more.
  """
  return jax.tree.map(lambda a: a.astype(np.float64) if np.issubdtype(a.dtype, np.floating)
                      else a, tree)


def evaluate(steps, learner, idx, split="train"):
  """Accuracy of one (unstacked) learner on examples `idx` of `split`."""
  acc, _ = steps.evaluate(population.stack([learner]), split, np.asarray(idx, np.int32))
  return float(acc[0])


def test_error(steps, learner):
  return 1.0 - evaluate(steps, learner, np.arange(steps.data.size("test")), "test")


def context(t, stage=None, steps=None, train_idx=None, val_idx=None):
  """A stage context of time step `t` (stage number `stage`, default t)."""
  stage = t if stage is None else stage
  empty = np.zeros((0,), np.int32)
  return StageContext(t=t, stage=stage, is_first=stage == 1,
                      train_idx=empty if train_idx is None else train_idx,
                      val_idx=empty if val_idx is None else val_idx,
                      reduce=None if steps is None else steps.reduce,
                      scan=None if steps is None else steps.scan,
                      eval_aux=None if steps is None else steps.eval_aux)


# -- whole runs --------------------------------------------------------------------------------
WALL_TIME_FIELDS = ("wall_s", "timings", "provenance")  # provenance: the process and host


def smoke(method="sm", **fields):
  """The MNIST smoke config of `method` on one device, with `fields` (paths joined by "__")
  overridden."""
  c = config_lib.apply_variant(config_lib.base_config("mnist", method), "smoke")
  return _override(c, fields)


def run_config(name: str, workdir_path, **fields) -> None:
  """What `python -m alma_jax.main --config=<name> --config.mesh.num_devices=1` runs (with
  `fields` overridden, as in `smoke`), in this process; `name` as `alma_jax.load_config`
  takes it, or a path under the checkout starting with "configs/"."""
  if name.startswith("configs/"):
    name = os.path.join(ROOT, name)
  run_lib.run(_override(alma_jax.load_config(name), fields), str(workdir_path))


def _override(c, fields):
  c.mesh.num_devices = 1
  for path, value in fields.items():
    *parents, leaf = path.split("__")
    node = c
    for p in parents:
      node = node[p]
    with node.ignore_type():
      node[leaf] = value
  return c


def strip_wall_times(d):
  return {k: v for k, v in d.items() if k not in WALL_TIME_FIELDS}


def epoch_events(folder):
  """(step, scalars) of the per-epoch events in `folder`'s TensorBoard event file."""
  from alma_jax.outputs import tensorboard  # pylint: disable=g-import-not-at-top
  return [(step, scalars) for _, step, scalars in tensorboard.read_events(folder)
          if "epoch/t" in scalars]


def outputs(wd):
  """log.jsonl, summary.json (without the wall-clock fields) and architecture.jsonl of `wd`."""
  log = [strip_wall_times(r) for r in io_utils.read_jsonl(os.path.join(wd, "log.jsonl"))]
  arch = io_utils.read_jsonl(os.path.join(wd, workdir.ARCH_FILE))
  with open(os.path.join(wd, "summary.json")) as f:
    return log, strip_wall_times(json.load(f)), arch


def tree_digest(path):
  """A digest of every file (name and content) under `path`."""
  h = hashlib.sha256()
  for root, dirs, files in sorted(os.walk(path)):
    dirs.sort()
    for name in sorted(files):
      p = os.path.join(root, name)
      h.update(os.path.relpath(p, path).encode())
      with open(p, "rb") as f:
        h.update(f.read())
  return h.hexdigest()


def interrupt(config, wd, point, monkeypatch) -> None:
  """Runs `config` in `wd` (in this process) until SIGINT stops it at kill point `point`."""
  with monkeypatch.context() as m:
    m.setenv("ALMA_JAX_TEST_KILL_AT", point)
    m.setenv("ALMA_JAX_TEST_KILL_SIGNAL", "SIGINT")
    with pytest.raises(run_lib.RunInterrupted):
      run_lib.run(config, wd)


def kill_env(kill_at=None, sig="SIGKILL") -> dict:
  """The environment of a subprocess run of this checkout that sends itself `sig` at the kill
  point `kill_at` (`tests/kill_points.py`; None: not killed)."""
  env = kill_points.env()
  env.pop("ALMA_JAX_TEST_KILL_AT", None)
  if kill_at:
    env.update(ALMA_JAX_TEST_KILL_AT=kill_at, ALMA_JAX_TEST_KILL_SIGNAL=sig)
  return env


@contextlib.contextmanager
def unraisable_reports():
  """The exceptions that Python reports as ignored (`sys.unraisablehook`) during the block.

  What earlier tests left to the garbage collector is collected, unrecorded, first;
  the block's own garbage is collected before it ends.
  """
  reports, previous = [], sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    gc.collect()
    sys.unraisablehook = reports.append
    yield reports
    gc.collect()
  finally:
    sys.unraisablehook = previous


def describe_reports(reports) -> list[str]:
  return [f"{type(r.exc_value).__name__}: {str(r.exc_value)[:200]}" for r in reports]


def wait_for_log(caplog, text: str, timeout_s: float = 30.0) -> None:
  """Returns once a log record (of any thread) holds `text`; fails after `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  while not any(text in r.getMessage() for r in caplog.records):
    assert time.monotonic() < deadline, f"no log record holds {text!r}"
    time.sleep(0.02)

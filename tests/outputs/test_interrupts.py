"""Tests of the signal handling of a run (alma_jax/outputs/interrupts.py)."""

import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from alma_jax.outputs import interrupts
from alma_jax.runtime import caches
from tests.conftest import requires_mnist
from tests import helpers
from tests import kill_points

ROOT = helpers.ROOT


def _default_signals():
  """In a child before it starts Python: the default disposition of the signals the tests send,
  whatever this process's is. Under `nohup` SIGHUP is ignored, and a job started in the
  background by a non-interactive shell (`cmd &`, as CI runners do) ignores SIGINT; Python keeps
  an ignored SIGINT ignored instead of raising KeyboardInterrupt, so the run would never see it."""
  for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_DFL)


def _main(workdir, *args, env=None, timeout=300):
  """`python -m alma_jax.main` in a subprocess (this checkout first on the path), with the
  default disposition of the signals the tests send (`_default_signals`)."""
  env = kill_points.env(dict(os.environ, **(env or {})))
  return subprocess.run([sys.executable, "-m", "alma_jax.main", f"--workdir={workdir}", *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                        check=False, preexec_fn=_default_signals)


def _term_from_a_callback(x):
  """A compiled function whose host callback sends this process SIGTERM."""
  def send():
    os.kill(os.getpid(), signal.SIGTERM)

  jax.debug.callback(send)
  return x + 1


def test_a_signal_inside_a_jax_callback_stops_at_the_next_check():
  with interrupts.Signals() as signals, signals.deferred():
    out = jax.jit(_term_from_a_callback)(jnp.float32(1.0))
    jax.effects_barrier()
    assert float(out) == 2.0  # the compiled call completed: nothing was raised inside JAX
    assert signals.pending == signal.SIGTERM
    with pytest.raises(interrupts.RunInterrupted) as info:
      signals.check()
  assert info.value.exit_code == 128 + signal.SIGTERM


def test_outside_deferred_sections_a_signal_raises_at_once_and_writes_finish_first():
  with interrupts.Signals() as signals:
    with pytest.raises(interrupts.RunInterrupted):
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(10 ** 6):  # the handler raises at the next bytecode
        pass
    signals.pending = None
    done = []
    with pytest.raises(interrupts.RunInterrupted):
      with signals.critical():
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("write finished")
    assert done == ["write finished"]


class _Votes:
  """A stand-in for the processes' vote (`multihost.Vote`): what this process gave at each
  check, and what the others gave (`others`: the signal of a lower process id, or None)."""

  def __init__(self, others=None):
    self.given, self.others = [], others

  def __call__(self, mine):
    self.given.append(mine)
    return self.others if self.others is not None else mine


def test_with_a_vote_a_signal_only_records_and_every_check_asks_the_others():
  votes = _Votes()
  with interrupts.Signals(votes) as signals:
    signals.check()
    os.kill(os.getpid(), signal.SIGTERM)  # outside a deferred section: recorded, not raised
    for _ in range(10 ** 5):
      pass
    done = []
    with signals.critical():  # nor at the end of a write
      done.append("write finished")
    assert done == ["write finished"] and signals.pending == signal.SIGTERM
    with pytest.raises(interrupts.RunInterrupted) as info:
      signals.check()
  assert votes.given == [None, signal.SIGTERM] and info.value.exit_code == 143


def test_a_signal_that_reached_another_process_stops_this_one_at_the_same_check():
  votes = _Votes(others=signal.SIGHUP)
  with interrupts.Signals(votes) as signals:
    with pytest.raises(interrupts.RunInterrupted) as info:
      signals.check()
  assert votes.given == [None] and info.value.exit_code == 129


def test_stopping_asks_the_others_too_so_that_every_process_saves_or_none():
  with interrupts.Signals(_Votes()) as signals:
    assert not signals.stopping()
  votes = _Votes(others=signal.SIGTERM)  # the signal reached another process
  with interrupts.Signals(votes) as signals:
    assert signals.stopping() and signals.pending == signal.SIGTERM
    with pytest.raises(interrupts.RunInterrupted):
      signals.check()
  assert votes.given == [None, signal.SIGTERM]


def test_a_signal_arriving_during_the_vote_waits_for_the_next_check():
  def vote(mine):  # the signal comes while the processes agree on "none"
    os.kill(os.getpid(), signal.SIGINT)
    return mine

  with interrupts.Signals(vote) as signals:
    signals.check()  # agreed: go on
    assert signals.pending == signal.SIGINT
    with pytest.raises(interrupts.RunInterrupted):
      signals.check()


def test_signals_held_before_the_run_are_acted_on_at_its_first_check():
  before = {s: signal.getsignal(s) for s in interrupts.SIGNALS}
  try:
    interrupts.hold_early()
    os.kill(os.getpid(), signal.SIGTERM)  # e.g. while jax.distributed starts
    with interrupts.Signals(_Votes()) as signals:
      assert signals.pending == signal.SIGTERM
      with pytest.raises(interrupts.RunInterrupted):
        signals.check()
  finally:
    interrupts._EARLY.clear()
    for s, h in before.items():
      signal.signal(s, h)


def test_sighup_stops_a_run_like_sigterm():
  hung_up = []
  before = signal.signal(signal.SIGHUP, lambda *_: hung_up.append(True))  # not this process's end
  try:
    with interrupts.Signals():
      with pytest.raises(interrupts.RunInterrupted) as info:
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(10 ** 6):  # the handler raises at the next bytecode
          pass
    assert info.value.exit_code == 129 and "interrupted by SIGHUP" in str(info.value)
    assert not hung_up
    os.kill(os.getpid(), signal.SIGHUP)  # the handler before the run is back
    assert hung_up
  finally:
    signal.signal(signal.SIGHUP, before)


def test_a_run_started_with_nohup_keeps_ignoring_sighup():
  before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
  try:
    with interrupts.Signals() as signals:
      assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
      os.kill(os.getpid(), signal.SIGHUP)
      signals.check()
      assert signals.pending is None
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
  finally:
    signal.signal(signal.SIGHUP, before)


@requires_mnist
def test_sighup_through_the_command_line_says_how_to_resume(tmp_path):
  proc = _main(str(tmp_path / "wd"), "--config=configs/mnist_sm.py:smoke",
               "--config.mesh.num_devices=1",
               env={"ALMA_JAX_TEST_KILL_AT": "t=2:stage", "ALMA_JAX_TEST_KILL_SIGNAL": "SIGHUP"})
  assert proc.returncode == 129, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  last = proc.stderr.rstrip("\n").splitlines()[-1]
  assert last.startswith("alma_jax: error: interrupted by SIGHUP; the last checkpoint is t=1; "
                         "to resume, run the same command again: python -m alma_jax.main "), last


# Runs the entry point with `run.run` replaced by a run that a signal interrupts while native
# work that no exception stops (as an XLA compilation in a thread of its own) goes on.
_STUCK_RUN = """
import os, runpy, signal, sys, threading, time
from alma_jax.outputs import interrupts
from alma_jax.stream import run

def stuck_run(config, workdir, **kwargs):
  threading.Thread(target=time.sleep, args=(600,)).start()
  with interrupts.Signals():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(600)

run.run = stuck_run
sys.argv = ["alma_jax.main"] + sys.argv[1:]
runpy.run_module("alma_jax.main", run_name="__main__")
"""

# Runs the entry point and presses Ctrl-C when it first imports $INTERRUPT_AT.
_CTRL_C_AT_IMPORT = """
import importlib.abc, os, runpy, signal, sys

class CtrlC(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == os.environ["INTERRUPT_AT"]:
      sys.meta_path.remove(self)
      os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt at the next bytecode
    return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["alma_jax.main"] + sys.argv[1:]
runpy.run_module("alma_jax.main", run_name="__main__")
"""


def _script(code, *args, env=None, timeout=60):
  env = kill_points.env(dict(os.environ, **(env or {})))
  try:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False,
                          preexec_fn=_default_signals)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"still running {timeout} s after the signal: {e.stderr[-2000:]!r}")


def test_an_interrupted_run_exits_at_once_though_native_work_goes_on(tmp_path):
  proc = _script(_STUCK_RUN, "--config=configs/mnist_sm.py:smoke", f"--workdir={tmp_path}/wd")
  assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  last = proc.stderr.rstrip("\n").splitlines()[-1]
  assert last.startswith("alma_jax: error: interrupted by SIGTERM; no checkpoint was written "
                         "yet; to resume, run the same command again: python -m alma_jax.main "
                         "--config=configs/mnist_sm.py:smoke"), last


# Runs the entry point with a SIGTERM while it checks the config, before the speed settings.
_SIGNAL_IN_THE_CHECK = """
import os, runpy, signal, sys, time
from alma_jax.stream import validation

validate = validation.validate

def checked(config, **kwargs):
  if kwargs.get("backend") is False:  # the command line's early check
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(600)
  return validate(config, **kwargs)

validation.validate = checked
sys.argv = ["alma_jax.main"] + sys.argv[1:]
runpy.run_module("alma_jax.main", run_name="__main__")
"""


def test_a_signal_while_the_config_is_checked_is_one_line_and_128_plus_its_number(tmp_path):
  proc = _script(_SIGNAL_IN_THE_CHECK, "--config=configs/mnist_sm.py:smoke",
                 f"--workdir={tmp_path}/wd")
  assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  lines = proc.stderr.rstrip("\n").splitlines()
  assert lines[-1].startswith(
      "alma_jax: error: interrupted by SIGTERM while checking the config and the workdir, "
      "before the run; to start it, run the same command again: python -m alma_jax.main "
      "--config=configs/mnist_sm.py:smoke"), proc.stderr[-3000:]
  assert sum(l.startswith("alma_jax: error: ") for l in lines) == 1
  assert not os.path.exists(tmp_path / "wd")


@pytest.mark.parametrize("module, message", [
    ("ml_collections", "interrupted by SIGINT while starting, before the run; run the same "
                       "command again to start it"),
    ("alma_jax.stream.run", "interrupted by SIGINT; to resume, run the same command again: python -m "
                     "alma_jax.main --config=configs/mnist_sm.py:smoke"),
], ids=["imports", "imports_of_main"])
def test_ctrl_c_while_starting_is_one_line_and_exit_code_130(tmp_path, module, message):
  proc = _script(_CTRL_C_AT_IMPORT, "--config=configs/mnist_sm.py:smoke",
                 f"--workdir={tmp_path}/wd", env={"INTERRUPT_AT": module})
  assert proc.returncode == 130, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  lines = proc.stderr.rstrip("\n").splitlines()
  assert lines[-1].startswith(f"alma_jax: error: {message}"), proc.stderr[-3000:]
  assert sum(l.startswith("alma_jax: error: ") for l in lines) == 1


def test_the_resume_hint_imports_nothing():
  # A Ctrl-C can cut a library's import short and leave it half-loaded (flax.linen without its
  # `initializers`); the hint printed then must not import the run's modules, and with them
  # that library, again.
  code = ("import sys; import alma_jax.main as m; before = set(sys.modules); "
          "sys.argv = ['alma_jax.main', '--config=mnist_sm', '--overwrite']; "
          "print(m._resume_command()); print(sorted(set(sys.modules) - before))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                        timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines() == ["python -m alma_jax.main --config=mnist_sm", "[]"]


# Runs the entry point with a Ctrl-C that Python ignores ("Exception ignored in ..."): raised in
# a finaliser, as in JAX's garbage-collector callback, while the run's modules load.
_IGNORED_CTRL_C = """
import importlib.abc, os, runpy, signal, sys

class Finalised:
  def __del__(self):
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):  # the handler runs here: its KeyboardInterrupt is ignored
      pass

class Once(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == "alma_jax.stream.run":
      sys.meta_path.remove(self)
      Finalised()
    return None

sys.meta_path.insert(0, Once())
sys.argv = ["alma_jax.main"] + sys.argv[1:]
runpy.run_module("alma_jax.main", run_name="__main__")
"""


def test_a_ctrl_c_that_python_ignores_before_the_run_still_stops_it(tmp_path):
  proc = _script(_IGNORED_CTRL_C, "--config=configs/mnist_sm.py:smoke",
                 f"--workdir={tmp_path}/wd", timeout=120)
  assert "Exception ignored" in proc.stderr  # the KeyboardInterrupt went nowhere
  assert proc.returncode == 130, proc.stderr[-3000:]
  assert proc.stderr.rstrip("\n").splitlines()[-1].startswith(
      "alma_jax: error: interrupted by SIGINT"), proc.stderr[-3000:]
  assert not os.path.exists(tmp_path / "wd" / "summary.json")


def _children(pid: int) -> set[int]:
  out = set()
  for task in os.listdir(f"/proc/{pid}/task"):
    with open(f"/proc/{pid}/task/{task}/children") as f:
      out.update(int(c) for c in f.read().split())
  return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads child processes from /proc")
def test_sigterm_while_measuring_the_speed_settings_kills_the_child_and_says_how_to_restart(
    tmp_path):
  # A fresh cache: the first convolution run measures XLA:CPU fusion settings in child processes
  # before it starts. SIGTERM once the first child runs.
  env = dict(os.environ, PYTHONPATH=ROOT, ALMA_JAX_CACHE_DIR=str(tmp_path / "cache"))
  proc = subprocess.Popen([sys.executable, "-m", "alma_jax.main", "--config=configs/cifar_sm.py:smoke",
                           f"--workdir={tmp_path}/wd", "--config.train.cpu_fusion=auto",
                           "--config.train.autotune=measure"],
                          cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_default_signals)
  seen = []
  for line in proc.stderr:  # until the measurement announces itself
    seen.append(line)
    if "measuring train.cpu_fusion once for this machine" in line:
      break
  assert any("To skip it: --config.train.cpu_fusion=none" in l for l in seen), "".join(seen)
  children = set()
  deadline = time.monotonic() + 60
  while not children and time.monotonic() < deadline and proc.poll() is None:
    children = _children(proc.pid)
    time.sleep(0.05)
  assert children, "no measuring child started"
  proc.send_signal(signal.SIGTERM)
  try:
    rest = proc.stderr.read()
    code = proc.wait(timeout=30)
  finally:
    proc.kill()
  assert code == 143, rest[-3000:]
  assert "Traceback" not in rest
  assert rest.rstrip("\n").splitlines()[-1].startswith(
      "alma_jax: error: interrupted by SIGTERM while measuring the speed settings, before the run;"
      " to start it, run the same command again: python -m alma_jax.main")
  time.sleep(0.5)
  alive = [c for c in children if os.path.exists(f"/proc/{c}")
           and open(f"/proc/{c}/stat").read().split(") ")[1][0] != "Z"]
  assert not alive, f"measuring children left running: {alive}"


@requires_mnist
def test_the_resume_hint_repeats_the_command_as_typed(tmp_path):
  # The installed command with a config's name: the hint names them, not the file they resolve to.
  import shutil  # pylint: disable=g-import-not-at-top
  exe = shutil.which("alma-jax", path=os.path.dirname(sys.executable))
  if exe is None:
    pytest.fail("the alma-jax command is not installed beside this Python (pip install -e .)")
  env = kill_points.env(dict(os.environ, ALMA_JAX_TEST_KILL_AT="t=2:stage",
                             ALMA_JAX_TEST_KILL_SIGNAL="SIGTERM"))
  proc = subprocess.run([exe, "--config=mnist_sm:smoke", f"--workdir={tmp_path}/wd"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300,
                        preexec_fn=_default_signals)
  assert proc.returncode == 143, proc.stderr[-3000:]
  last = proc.stderr.rstrip("\n").splitlines()[-1]
  assert last.endswith(f"to resume, run the same command again: alma-jax "
                       f"--config=mnist_sm:smoke --workdir={tmp_path}/wd"), last


# A process that compiles a program that takes about half a minute to compile (3,000 chained
# matrix products, XLA's optimisations off as in the suite), with a run's signal handling and a
# command line's exit for a signal during a compile.
_SLOW_COMPILE = """
import os, sys, jax, jax.numpy as jnp
from alma_jax.outputs import interrupts
def f(x):
  for i in range(3000):
    x = jnp.sin(x @ x.T) + i
  return x
lowered = jax.jit(f).lower(jnp.ones((8, 8)))
interrupts.on_stop_while_compiling(
    lambda signum, last: (print("stopped by", signum, "last checkpoint", last, flush=True),
                          os._exit(128 + signum)))
compiling = [False]
with interrupts.Signals(compiling=lambda: compiling[0]) as signals, signals.deferred():
  compiling[0] = True
  print("compiling", flush=True)
  lowered.compile()
  compiling[0] = False
print("compiled", flush=True)
"""


def test_a_signal_during_a_long_compile_ends_the_process_without_waiting_for_it():
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
  proc = subprocess.Popen([sys.executable, "-c", _SLOW_COMPILE], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_default_signals)
  try:
    assert proc.stdout.readline() == "compiling\n", proc.stderr.read()
    time.sleep(0.5)  # inside XLA's compile now
    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    code = proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  # Ended by the watcher while compiling: "compiled" never printed (without the watcher, the
  # signal waits for the compile to end, and the process then exits 0 after "compiled").
  assert code == 143 and out == "stopped by 15 last checkpoint None\n", (code, out)


@requires_mnist
def test_the_initial_parameters_compile_as_an_announced_program(tmp_path, monkeypatch):
  # A large model's initialisation compiles for seconds (11-13 s for the base Switch
  # Transformer on a GPU): a signal then must end the process as during a step's compile,
  # which needs the meter to say that a compile is going on.
  from alma_jax.engine import meter as meter_lib  # pylint: disable=g-import-not-at-top
  from alma_jax.stream import run  # pylint: disable=g-import-not-at-top
  from alma_jax.stream import run_setup  # pylint: disable=g-import-not-at-top
  meters, seen = [], []
  meter_init = meter_lib.Meter.__init__

  def remember(self, *args, **kwargs):
    meters.append(self)
    meter_init(self, *args, **kwargs)

  initial_learner = run_setup.Setup.initial_learner

  def spy(self):
    seen.append(meters[-1].is_compiling())
    return initial_learner(self)

  monkeypatch.setattr(meter_lib.Meter, "__init__", remember)
  monkeypatch.setattr(run_setup.Setup, "initial_learner", spy)
  run.run(helpers.smoke(stream__num_megabatches=2), str(tmp_path / "wd"))
  assert seen[:1] == [True] and not meters[-1].is_compiling()


@requires_mnist
def test_a_run_waiting_for_another_process_s_decoding_stops_at_once_on_ctrl_c(tmp_path):
  """While another process decodes the data set into the cache (here: this one, holding its
  lock), a run waits; Ctrl-C then ends it at once, in one line, exit code 130."""
  cache = str(tmp_path / "cache")
  env = kill_points.env(dict(os.environ, ALMA_JAX_CACHE_DIR=cache))
  with caches.exclusive(caches.lock_file(cache, "decode_mnist"), "the test") as held:
    assert held
    proc = subprocess.Popen(
        [sys.executable, "-m", "alma_jax.main", "--config=configs/mnist_sm.py:smoke",
         f"--workdir={tmp_path}/wd", "--config.train.autotune=rules"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    lines = []
    for line in proc.stderr:  # until it says that it waits
      lines.append(line)
      if "waiting for the decoding of mnist in another process" in line:
        break
    else:
      pytest.fail(f"the run did not wait: {''.join(lines)[-3000:]}")
    proc.send_signal(signal.SIGINT)
    try:
      rest = proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
      proc.kill()
      pytest.fail("the run was still waiting a minute after Ctrl-C")
  assert proc.returncode == 130, rest[-3000:]
  assert "Traceback" not in rest
  assert rest.rstrip("\n").splitlines()[-1].startswith(
      "alma_jax: error: interrupted by SIGINT; "), rest[-3000:]
  assert not os.path.exists(os.path.join(cache, "mnist"))  # nothing decoded meanwhile

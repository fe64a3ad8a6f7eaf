"""XLA:CPU fusion flags of a run's process, chosen by measurement before JAX starts.

XLA:CPU can hand its dot, elementwise and reduction fusions to the YNNPACK
library (`--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce`), and its
convolutions and matrix products to oneDNN (`--xla_cpu_use_onednn=true`). On a
2-core AMD EPYC the first made the VGG's forward and input-gradient
convolutions at width 64 about twice as fast, while other measurements of the
same flag found narrower VGGs slower; on a 2-core Intel Xeon with AVX-512
oneDNN made the VGG's train step at width 16 about 1.5x and its evaluation
about 1.7x faster. Both interact with the convolution gradient
(`model.conv_impl`). XLA reads its flags once per process, when JAX starts its
backend, so this choice is made in `alma_jax.main` before anything touches a
device, through `config.train.cpu_fusion`:

  * `none`: XLA's default;  `ynn`: the YNNPACK flag;  `onednn`: the oneDNN flag;
    `ynn_onednn`: both;
  * `auto` (default): for convolution-heavy backbones (`BackboneSpec.conv_heavy`:
    the VGG, the ResNet) on a CPU with `train.autotune=measure`, one child
    process per setting, each holding the run's train step on its real shapes
    (synthetic data) with every candidate convolution gradient, all timed in
    turns (`measure_in_children`); the fastest pair wins, and the run then
    uses both (the convolution choice without measuring it again). A setting
    whose child fails (e.g. a jaxlib that does not know its flag) is left out.
    The choice is remembered like `alma_jax.tuning.autotune`'s: in the
    workdir's `autotune.json` (a resumed run keeps it) and in
    `<cache dir>/autotune.json` under a key of this CPU's model, core count,
    the JAX version and the step's shapes. The rule, `none`, decides otherwise: MLPs and transformers, `train.autotune=rules`,
    runs of several processes, machines with an accelerator plugin installed
    (the flags only concern XLA:CPU, and on an accelerator the children's
    compilations would cost more than they could save), and a failing child
    for the `none` setting.

The other flags in `XLA_FLAGS` are kept; when `XLA_FLAGS` already sets one of
the flags above, it wins and nothing is measured.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import jax  # importing JAX starts no backend: flags set afterwards still count
from absl import logging

from alma_jax import models
from alma_jax.configuration import fields as F
from alma_jax.models import conv
from alma_jax.runtime import host
from alma_jax.runtime import xla_flags
from alma_jax.tuning import autotune

FLAG = "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce"
ONEDNN_FLAG = "--xla_cpu_use_onednn=true"
# Each setting's flags; "none" first: it is XLA's default and the fallback.
SETTING_FLAGS = {"none": (), "ynn": (FLAG,), "onednn": (ONEDNN_FLAG,),
                 "ynn_onednn": (FLAG, ONEDNN_FLAG)}
SETTINGS = tuple(SETTING_FLAGS)
CHOICES = ("auto",) + SETTINGS
FIELD = "train.cpu_fusion"
RULE = "none"
KEEP_ENV = "XLA_FLAGS"  # the user's XLA_FLAGS already set the fusion: left as they are
_FLAG_NAMES = tuple(f.split("=", 1)[0] for f in (FLAG, ONEDNN_FLAG))
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")
# Seconds one measuring child may take to start and compile its train steps (10-40 s on a
# 2-core CPU), and to answer one call; past it the setting is left out, so starting the
# children never takes more than this times the number of settings.
CHILD_TIMEOUT_S = 90.0
# The lines of the child (alma_jax.tuning.cpu_fusion_child): its steps are compiled; a call ran.
READY, DONE = "CPU_FUSION_READY ", "CPU_FUSION_DONE"

# This process's decision: {"key", "value", "how"} and what the run's in-process choices take
# from its measurement ({field: value}).
_decision: dict[str, Any] = {}
_measured_with_flags: dict[str, Any] = {}


def applies(config) -> bool:
  """Whether the fusion flags are measured for `config`: a convolution-heavy backbone."""
  return models.spec(config.model.name).conv_heavy


def accelerator_expected() -> bool:
  """Whether JAX will start an accelerator backend (decided without starting one)."""
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip() != "cpu"
  return any(importlib.util.find_spec(m) is not None for m in _ACCELERATOR_PLUGINS)


def cpu_devices_expected() -> int | None:
  """How many devices a CPU backend of this process will have, known without starting it
  (`jax_num_cpu_devices`, else XLA_FLAGS' `--xla_force_host_platform_device_count`, else 1);
  None where an accelerator backend is expected or the count cannot be read."""
  if accelerator_expected():
    return None
  count = jax.config.jax_num_cpu_devices
  if count >= 0:
    return count or None
  values = xla_flags.values("--xla_force_host_platform_device_count")
  if not values:
    return 1
  return int(values[-1]) if values[-1].isdigit() and int(values[-1]) > 0 else None


def process_key(config, input_shape) -> str:
  """What the choice depends on, known before JAX starts: this CPU, the step's shapes."""
  facts = dict(autotune.step_facts(config, input_shape, FIELD), cpu=host.cpu_name(),
               cpus=os.cpu_count(), jax=jax.__version__, candidates=list(SETTINGS))
  return json.dumps(facts, sort_keys=True)


def _sets_a_flag(flags: str) -> bool:
  """Whether `flags` (an `XLA_FLAGS` value) sets one of the settings' flags."""
  return any(xla_flags.values(name, flags) for name in _FLAG_NAMES)


def flags_with(value: str, current: str) -> str:
  """`XLA_FLAGS` for the setting `value`, keeping the other flags of `current`."""
  return xla_flags.replaced(current, _FLAG_NAMES, SETTING_FLAGS[value])


def apply(value: str) -> None:
  """Sets this process's `XLA_FLAGS` for `value`; must run before JAX starts its backend."""
  if value in SETTINGS:
    xla_flags.replace(_FLAG_NAMES, SETTING_FLAGS[value])


def measured_with_flags() -> dict[str, tuple[Any, str]]:
  """{field: (value, how)} chosen together with the fusion flags by this process's
  measurement (for `autotune.choose(given=...)`)."""
  return {k: (v, f"measured with {FIELD} in child processes")
          for k, v in _measured_with_flags.items()}


def decision(config, input_shape) -> tuple[str, str] | None:
  """(key, setting) of this process's measured or remembered choice for `config`, if it made
  one (the run records it in its workdir)."""
  if not _decision or _decision["key"] != process_key(config, input_shape):
    return None
  return _decision["key"], _decision["value"]


def choose(config, workdir: str | None, *, shapes: tuple | None, multiprocess: bool,
           cache_file: str | None = None,
           measure: Callable[..., dict] | None = None) -> tuple[str, str]:
  """(setting, how it was decided) for `config`; call `apply` with the setting next.

  `shapes`: (one example's shape, number of classes) of the data set, None when unknown.
  Reads the workdir's record (a resumed run keeps its choice) but writes nothing there:
  the run records the choice once it owns the workdir (`decision`).
  `measure(config, input_shape, num_classes, settings, impls)` -> ({(setting, conv impl):
  seconds per step}, {setting whose child failed: why}) (default: `measure_in_children`);
  for tests.
  """
  _decision.clear()
  _measured_with_flags.clear()
  value, how, key = _choose(config, workdir, shapes, multiprocess, cache_file,
                            measure or measure_in_children)
  if key is not None:
    _decision.update(key=key, value=value, how=how)
  return value, how


def _choose(config, workdir, shapes, multiprocess, cache_file, measure):
  if _sets_a_flag(xla_flags.current()):
    return KEEP_ENV, f"set in XLA_FLAGS ({xla_flags.current()})", None
  setting = F.get(config.train, "train.cpu_fusion")
  if setting != "auto":
    return setting, "set in the config", None
  if not applies(config) or shapes is None:
    return RULE, "by rule (not a convolution-heavy backbone on a known image data set)", None
  if multiprocess:
    return RULE, "by rule (a run of several processes)", None
  if accelerator_expected():
    return RULE, "by rule (an accelerator backend is expected)", None
  key = process_key(config, shapes[0])
  mine = os.path.join(workdir, autotune.FILE) if workdir else None
  cache_file = cache_file or autotune.default_cache_file()
  stored_mine, stored_machine = autotune.read(mine), autotune.read(cache_file)
  if key in stored_mine:
    return stored_mine[key], f"kept from {mine}", key
  if config.train.autotune == "rules":
    return RULE, "by rule", None
  if key in stored_machine:
    return stored_machine[key], f"measured earlier on this machine ({cache_file})", key
  # One process of the machine measures (runs that start together wait for it); a rule's
  # answer is not remembered as a measurement.
  value, how, measured = autotune.measured_once(cache_file, key, "train.cpu_fusion",
                                                lambda: _measure(config, shapes, measure))
  return value, how, key if measured else None


def _measure(config, shapes, measure) -> tuple[str, str, bool]:
  """(the fastest setting, how it was chosen, True); (the rule, why, False) when the child
  of the rule's setting fails to start or a child fails while they are timed. A setting whose
  child fails to start otherwise is left out."""
  # The backend is not started here (the flags measured are the process's): these children
  # run on XLA:CPU, where the run's own backend will be too (`accelerator_expected` is false).
  impls = (list(conv.candidates("cpu")) if config.model.conv_impl == "auto"
           else [config.model.conv_impl])
  logging.info("measuring %s once for this machine and model: %d settings (%s) x %d convolution "
               "implementations, one child process per setting (each started and compiled in "
               "at most %.0f s), timed in turns; the choice is kept for later runs. To skip it: "
               "--config.%s=none (or --config.train.autotune=rules)", FIELD, len(SETTINGS),
               ", ".join(SETTINGS), len(impls), CHILD_TIMEOUT_S, FIELD)
  try:
    times, failed = measure(config, shapes[0], shapes[1], SETTINGS, impls)
  except RuntimeError as e:  # a child failed while the settings were timed
    logging.warning("%s could not be timed (%s); the rule decides: %s", FIELD, e, RULE)
    return RULE, "by rule (a child process failed)", False
  if RULE in failed:
    logging.warning("%s=%s could not be timed (%s); the rule decides: %s", FIELD, RULE,
                    failed[RULE], RULE)
    return RULE, "by rule (a child process failed)", False
  for setting, why in failed.items():
    logging.warning("%s=%s could not be timed (%s); left out", FIELD, setting, why)
  batch = config.train.batch_size
  setting, impl = min(times, key=times.get)
  if config.model.conv_impl == "auto":
    _measured_with_flags["model.conv_impl"] = impl
  timed = ", ".join(f"{s}/{i} {batch / t:,.0f} img/s" for (s, i), t in times.items())
  timed += "".join(f", {s} failed" for s in failed)
  return setting, f"measured in child processes ({timed})", True


class _Child:
  """A child process with `setting`'s XLA flags holding the config's compiled train step for
  every convolution gradient of `impls` (`alma_jax.tuning.cpu_fusion_child`), which runs one
  call of one of them on request."""

  def __init__(self, config, input_shape, num_classes, setting: str, impls):
    env = dict(os.environ, XLA_FLAGS=flags_with(setting, xla_flags.current()))
    request = {"config": json.loads(config.to_json()), "input_shape": list(input_shape),
               "num_classes": num_classes, "impls": list(impls)}
    self._stderr = tempfile.TemporaryFile("w+")  # read on failure; a pipe could fill up
    self._proc = subprocess.Popen([sys.executable, "-m", "alma_jax.tuning.cpu_fusion_child"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._stderr, text=True, env=env)
    try:
      self._proc.stdin.write(json.dumps(request) + "\n")
      self._proc.stdin.flush()
      ready = self._line(READY)
    except BaseException:  # a signal's exception too: the child does not outlive it
      self.close(kill=True)
      raise
    info = json.loads(ready[len(READY):])
    if info["xla_flags"] != env["XLA_FLAGS"]:
      self.close()
      raise RuntimeError(f"the child ran with XLA_FLAGS={info['xla_flags']!r}, not "
                         f"{env['XLA_FLAGS']!r}")
    self.steps_per_call: dict[str, int] = info["steps_per_call"]

  def call(self, impl: str) -> Callable[[], None]:
    """One call of `impl`'s train step in the child, returning when it has run."""
    def run():
      try:
        self._proc.stdin.write(impl + "\n")
        self._proc.stdin.flush()
      except OSError:  # it exited: `_line` says how
        pass
      self._line(DONE)
    return run

  def _line(self, expected: str) -> str:
    """The child's next line, which must start with `expected`, within CHILD_TIMEOUT_S."""
    ready, _, _ = select.select([self._proc.stdout], [], [], CHILD_TIMEOUT_S)
    line = self._proc.stdout.readline() if ready else None
    if line is None:
      raise RuntimeError(f"the child process took more than {CHILD_TIMEOUT_S:.0f} s")
    if not line.startswith(expected):
      try:
        code = self._proc.wait(timeout=CHILD_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        code = None
      self._stderr.seek(0)
      tail = " ".join(self._stderr.read().strip().splitlines()[-3:])
      raise RuntimeError(f"the child process exited with {code}: {tail or line.strip()}")
    return line

  def close(self, kill: bool = False) -> None:
    """Ends the child, at the end of its input (killed if it has not ended 5 s later) or at
    once with `kill`, and removes its files."""
    if kill:
      self._proc.kill()
    with contextlib.suppress(OSError):
      self._proc.stdin.close()
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    self._stderr.close()


def measure_in_children(config, input_shape, num_classes, settings, impls
                        ) -> tuple[dict[tuple[str, str], float], dict[str, str]]:
  """({(setting, conv impl): seconds per train step}, {setting whose child failed: why}).

  One child process per setting, started one after the other (each compiles its train
  steps while the others wait); then every (setting, impl) pair is timed in turns
  (`autotune.time_in_turns`), one child running at a time. The
  children end before this returns, and are killed before it raises (a signal's exception
  too). When the child of the rule's setting fails to start, nothing more is started.
  """
  children: dict[str, _Child] = {}
  failed: dict[str, str] = {}
  ended = False
  try:
    for i, setting in enumerate(settings):
      started = time.monotonic()
      try:
        children[setting] = _Child(config, input_shape, num_classes, setting, impls)
      except RuntimeError as e:
        failed[setting] = str(e)
        if setting == RULE:
          return {}, failed
        continue
      logging.info("  %s=%s (%d of %d): started and compiled in %.0f s", FIELD, setting, i + 1,
                   len(settings), time.monotonic() - started)
    times = autotune.time_in_turns({(s, i): (child.call(i), child.steps_per_call[i])
                                    for s, child in children.items() for i in impls})
    ended = True
    return times, failed
  finally:  # killed on an exception (a signal's too), else ended by their input's end
    for child in children.values():
      child.close(kill=not ended)

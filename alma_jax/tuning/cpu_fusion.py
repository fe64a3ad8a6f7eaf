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
    process per setting, each timing the run's train step on its real shapes
    (synthetic data) with every candidate convolution gradient; the fastest
    pair wins, and the run then uses both (the convolution choice without
    measuring it again). A setting whose child fails (e.g. a jaxlib that does
    not know its flag) is left out. The choice is remembered
    like `alma_jax.tuning.autotune`'s: in the workdir's `autotune.json` (a resumed run
    keeps it) and in `<cache dir>/autotune.json` under a key of this CPU's
    model, core count, the JAX version and the step's shapes. The rule,
    `none`, decides otherwise: MLPs and transformers, `train.autotune=rules`,
    runs of several processes, machines with an accelerator plugin installed
    (the flags only concern XLA:CPU, and on an accelerator the children's
    compilations would cost more than they could save), and a failing child
    for the `none` setting.

The other flags in `XLA_FLAGS` are kept; when `XLA_FLAGS` already sets one of
the flags above, it wins and nothing is measured.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable

import jax  # importing JAX starts no backend: flags set afterwards still count
from absl import logging

from alma_jax import models
from alma_jax.configuration import fields as F
from alma_jax.models import conv
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
# Seconds one measuring child may take (start-up, compiling and timing a few train steps take
# 10-40 s on a 2-core CPU); past it the setting is left out, so the measurement never takes more
# than this times the number of settings.
CHILD_TIMEOUT_S = 90.0
RESULT = "CPU_FUSION_RESULT "  # the result line of the child (alma_jax.tuning.cpu_fusion_child)

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


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def process_key(config, input_shape) -> str:
  """What the choice depends on, known before JAX starts: this CPU, the step's shapes."""
  facts = dict(autotune.step_facts(config, input_shape, FIELD), cpu=cpu_name(),
               cpus=os.cpu_count(), jax=jax.__version__, candidates=list(SETTINGS))
  return json.dumps(facts, sort_keys=True)


def _sets_a_flag(flags: str) -> bool:
  """Whether `flags` (an `XLA_FLAGS` value) sets one of the settings' flags."""
  return any(f.split("=", 1)[0] in _FLAG_NAMES for f in flags.split())


def flags_with(value: str, current: str) -> str:
  """`XLA_FLAGS` for the setting `value`, keeping the other flags of `current`."""
  kept = [f for f in current.split() if f.split("=", 1)[0] not in _FLAG_NAMES]
  return " ".join(kept + list(SETTING_FLAGS[value]))


def apply(value: str) -> None:
  """Sets this process's `XLA_FLAGS` for `value`; must run before JAX starts its backend."""
  if value in SETTINGS:
    os.environ["XLA_FLAGS"] = flags_with(value, os.environ.get("XLA_FLAGS", ""))


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
  `measure(config, input_shape, num_classes, setting, impls)` -> {conv impl: seconds per
  step} (default: a child process); for tests.
  """
  _decision.clear()
  _measured_with_flags.clear()
  value, how, key = _choose(config, workdir, shapes, multiprocess, cache_file,
                            measure or measure_in_child)
  if key is not None:
    _decision.update(key=key, value=value, how=how)
  return value, how


def _choose(config, workdir, shapes, multiprocess, cache_file, measure):
  if _sets_a_flag(os.environ.get("XLA_FLAGS", "")):
    return KEEP_ENV, f"set in XLA_FLAGS ({os.environ['XLA_FLAGS']})", None
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
  value, how, measured = _measure(config, shapes, measure)
  if not measured:  # a rule's answer is not remembered as a measurement
    return value, how, None
  autotune.remember(cache_file, key, value)
  return value, how, key


def _measure(config, shapes, measure) -> tuple[str, str, bool]:
  """(the fastest setting, how it was chosen, True); (the rule, why, False) when the child
  of the rule's setting fails. A setting whose child fails otherwise is left out."""
  impls = ([i for i in conv.IMPLS if i != "auto"] if config.model.conv_impl == "auto"
           else [config.model.conv_impl])
  times, failed = {}, []
  logging.info("measuring %s once for this machine and model: %d settings (%s) x %d convolution "
               "implementations, each in a child process of at most %.0f s (%.0f s in all at "
               "most); the choice is kept for later runs. To skip it: --config.%s=none (or "
               "--config.train.autotune=rules)", FIELD, len(SETTINGS), ", ".join(SETTINGS),
               len(impls), CHILD_TIMEOUT_S, CHILD_TIMEOUT_S * len(SETTINGS), FIELD)
  batch = config.train.batch_size
  for i, setting in enumerate(SETTINGS):
    try:
      started = time.monotonic()
      for impl, seconds in measure(config, shapes[0], shapes[1], setting, impls).items():
        times[(setting, impl)] = seconds
      logging.info("  %s=%s (%d of %d): %s (%.0f s)", FIELD, setting, i + 1, len(SETTINGS),
                   ", ".join(f"{impl} {batch / t:,.0f} img/s" for (s, impl), t in times.items()
                             if s == setting), time.monotonic() - started)
    except Exception as e:  # pylint: disable=broad-except
      if setting == RULE:
        logging.warning("%s=%s could not be timed (%s); the rule decides: %s", FIELD, setting, e,
                        RULE)
        return RULE, "by rule (a child process failed)", False
      logging.warning("%s=%s could not be timed (%s); left out", FIELD, setting, e)
      failed.append(setting)
  setting, impl = min(times, key=times.get)
  if config.model.conv_impl == "auto":
    _measured_with_flags["model.conv_impl"] = impl
  timed = ", ".join(f"{s}/{i} {batch / t:,.0f} img/s" for (s, i), t in times.items())
  timed += "".join(f", {s} failed" for s in failed)
  return setting, f"measured in child processes ({timed})", True


def measure_in_child(config, input_shape, num_classes, setting: str, impls) -> dict[str, float]:
  """{conv impl: seconds per train step} timed in a child process with `setting`'s flags."""
  env = dict(os.environ, XLA_FLAGS=flags_with(setting, os.environ.get("XLA_FLAGS", "")))
  request = {"config": json.loads(config.to_json()), "input_shape": list(input_shape),
             "num_classes": num_classes, "impls": list(impls)}
  try:  # an exception here (a signal's, a timeout) kills the child before it propagates
    proc = subprocess.run([sys.executable, "-m", "alma_jax.tuning.cpu_fusion_child"],
                          input=json.dumps(request), capture_output=True, text=True, env=env,
                          check=False, timeout=CHILD_TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"the child process took more than {CHILD_TIMEOUT_S:.0f} s") from e
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode != 0 or not lines:
    tail = " ".join(proc.stderr.strip().splitlines()[-3:])
    raise RuntimeError(f"the child process exited with {proc.returncode}: {tail}")
  result = json.loads(lines[-1][len(RESULT):])
  if result["xla_flags"] != env["XLA_FLAGS"]:
    raise RuntimeError(f"the child ran with XLA_FLAGS={result['xla_flags']!r}, not "
                       f"{env['XLA_FLAGS']!r}")
  return result["seconds"]

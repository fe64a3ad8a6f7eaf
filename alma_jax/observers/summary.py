"""summary.json and error.png, written when the stream is over."""

from __future__ import annotations

import functools
import os
import platform
import shlex
import subprocess
import sys
from typing import Any

from absl import logging

from alma_jax import errors
from alma_jax.engine import population
from alma_jax.observers.base import Observer, RunContext
from alma_jax.observers.clock import Clock
from alma_jax.outputs import interrupts
from alma_jax.outputs import io_utils
from alma_jax.outputs import workdir as wd
from alma_jax.reports import plots
from alma_jax.runtime import host


@functools.cache
def provenance() -> dict[str, str]:
  """What made the numbers: the source's git commit (`+dirty` when tracked files differ from it;
  "unknown" outside a git checkout), the CPU's model name (as `lscpu` names it), the
  versions of Python, jax and jaxlib, and the process's command line (its arguments rerun the
  run)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  commit = "unknown"
  try:
    git = ["git", "-C", source]
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    commit = head + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    pass
  return {"commit": commit, "cpu": host.cpu_name(), "python": platform.python_version(),
          "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", "unknown"),
          "command": shlex.join(errors.program(sys.argv[0]) + sys.argv[1:])}


class Summary(Observer):
  """The run's summary: CER, Mem, Comp and the rest of `metrics.Log.summary`, the time
  breakdown and the compilations; with several seeds, each seed's summary in its folder and
  their mean and standard deviation at the top. Process 0 writes it, and error.png (drawn
  by a child process started with the stream, whose imports overlap the run) unless
  `log.error_png` is off."""

  def __init__(self, setup: RunContext, signals: interrupts.Signals, clock: Clock):
    self.setup, self.signals, self.clock = setup, signals, clock
    self.plotter = plots.PlotChild()
    self.draws = setup.primary and setup.config.log.error_png  # error.png, by process 0

  def on_start(self, state, snapshot) -> None:
    """A summary exists only once the run is over; the child that will draw error.png starts
    now (the run's checkpoints fitted it), so its imports overlap the run."""
    s = self.setup
    if s.primary and state.t < s.num_t:
      for path in {s.workdir, *s.out_dirs}:
        if os.path.exists(os.path.join(path, wd.SUMMARY_FILE)):
          os.unlink(os.path.join(path, wd.SUMMARY_FILE))
    if self.draws:
      self.plotter.start()

  def on_end(self, state) -> dict[str, Any]:
    s = self.setup
    wall_s = self.clock.elapsed()
    per_seed = [dict(log.summary(), **s.task.summary(log.records), wall_s=wall_s)
                for log in state.logs]
    extra = {"timings": self.clock.timer.report(wall_s, self.clock.startup_s),
             "num_compilations": len(self.clock.compiled()), "choices": s.choices,
             "provenance": provenance()}
    if len(s.seeds) == 1:
      top = dict(per_seed[0], **extra)
    else:
      top = dict(population.mean_summary(per_seed), seeds=s.seeds, num_seeds=len(s.seeds),
                 per_seed=per_seed, wall_s=wall_s, **extra)
      top.pop("wall_s_std")
    self.signals.check()
    with self.signals.critical():
      if s.primary:
        if len(s.seeds) > 1:
          for out, summary in zip(s.out_dirs, per_seed):
            io_utils.write_json_atomic(os.path.join(out, wd.SUMMARY_FILE),
                                       dict(summary, choices=extra["choices"],
                                            provenance=extra["provenance"]))
        io_utils.write_json_atomic(os.path.join(s.workdir, wd.SUMMARY_FILE), top)
    if self.draws:
      self._plot_errors(state)
    logging.info("done: %d seed(s), CER=%.4f mean_error=%.4f final_error=%.4f Mem=%d Comp=%.3e "
                 "wall=%.1fs", len(s.seeds), top["cer"], top["mean_error"], top["final_error"],
                 top["mem"], top["comp"], wall_s)
    task_line = s.task.summary_line(top)
    if task_line:
      logging.info(task_line)
    return top

  def _plot_errors(self, state) -> None:
    """error.png in the workdir (drawn by a child process); a failure only warns."""
    s, c = self.setup, self.setup.config
    path = os.path.join(s.workdir, wd.ERROR_PNG)
    field = plots.PERPLEXITY_FIELD
    if all(field in r.extra for log in state.logs for r in log.records):  # a language model
      value = lambda r: r.extra[field]  # pylint: disable=unnecessary-lambda-assignment
      size = f"preset={c.model.get('preset', '?')} experts={c.model.get('num_experts', '?')}"
      axis = ("test perplexity", 1.0)
    else:
      value = lambda r: r.test_error  # pylint: disable=unnecessary-lambda-assignment
      size, axis = f"width={c.model.width}", ()
    curves = [(f"seed {sd}", [r.t for r in log.records], [value(r) for r in log.records])
              for sd, log in zip(s.seeds, state.logs)]
    why = self.plotter.draw(
        path, curves, f"{c.data.name} {c.method.name} {size} wait={c.stream.wait}", *axis)
    if why is not None:
      logging.warning("could not draw %s (%s); the run's other outputs are complete", path, why)

  def close(self) -> None:
    self.plotter.close()  # a run that ended before drawing leaves no child behind

"""Runs a grid of configs: method x waiting time x width x replay x seed, ...

Each grid point is one `python -m alma_jax.main` run with its own workdir,
named after its overrides (the config file's label, then the fields sorted by
path, `seed` and `num_seeds` last, so a point reached with its fields in any
order gets one name) and a short hash of its resolved config (config file,
variant and every `--config.*` flag, extra ones after `--` included; fields
that a run may change on resume, such as data paths, aside). A folder of the
root with the same hash and the same config under another name (named in the
grid's field order by earlier versions) is that point's workdir. A point
is skipped only when its workdir holds a summary.json and a config.json equal
to the point's config; a point without a summary resumes, and a workdir
holding a different config is refused with the differing fields named. So a
rerun of a sweep skips what is done, and a sweep with another config file or
other flags gets workdirs of its own. A point whose workdir another process
holds (e.g. a second sweep on the same root; see alma_jax/outputs/workdir_lock.py) is
left to it, "running (by another process)", not failed; each point's status
is checked again just before its run starts.

Before any run starts, every point's config is checked as the run checks it
(`alma_jax.stream.validation.validate`, which loads no data; for SLURM and TPU runs
the mesh is left to their machines): invalid points are named with their
one-line errors and nothing runs (exit code 2, as for a flag or grid the
sweep refuses; `--no-validate` skips the check). `--status` (with the
sweep's own flags) prints a table of the points instead: done, running
(another live process holds the workdir), failed (the last run of this
sweep failed: its exit is kept in
<root>/logs/<workdir name>.failed.json until a run succeeds) or to run, with
their folders, and, from a grid file's `run_seconds`, the time the points not
done should take at the pace of the done ones; it starts nothing.

The grid comes from `--grid=field=v1,v2,...` flags, from a Python file
(`--grid_file=F`) that defines GRID, or both: GRID is a dict of field -> list
of values, or a list of such dicts (their union, e.g. one sub-grid per
method); each `--grid` flag is crossed with every one of them (and replaces a
field of the same name, as a later `--grid` flag replaces an earlier one's).
The field `config` (a list of config files, e.g.
["configs/mnist_gmoe.py:quick"]) gives a grid its own config files in place of
`--config`, so one grid file can cover methods whose fields differ, or several
data sets; the file's name and variant then lead the workdir name. A grid's
consecutive seeds (`--grid=seed=0,1,2`) become one run of `config.num_seeds`
seeds (seed=0, num_seeds=3: the seeds vmapped in one program, faster than
separate runs), except for methods whose growth depends on the seed (gMoE, FF:
one run per seed always), for waiting policies that time each seed's stages
from its own data (`triggered`: one run per seed always), and for
convolution-heavy backbones (VGG, ResNet) on a CPU, where separate runs are
faster (`--seeds_together=yes|no` decides instead). Runs go one after another,
`--parallel=P` at a time (each one's output then goes to <root>/logs/<workdir
name>.log), into a SLURM array script, or one after another on every worker of
a Cloud TPU VM (`--tpu`, through launch/tpu_pod.py: the code is copied and
installed on the workers once, then each point runs as one multi-host program;
`--root` must be a directory every worker sees, mounted at the same path where
the sweep runs for the report). When the runs are over, the report (`python -m
alma_jax.reports.report`) of every grid point's workdir is written to
`--report_dir` (default <root>/report), with the verdicts of the grid file's
FINDINGS (`alma_jax.reports.findings`) when it names them; `--no-report` skips
it. After each run the sweep prints its ETA: from the grid file's
`run_seconds(config)` (one run's seconds where they were measured), scaled to
this host by the runs that finished, when the file defines it, or else from
the mean finished run (a failed or refused run sets no pace). SIGINT (Ctrl-C),
SIGTERM or SIGHUP is passed on to the runs in progress (which stop at a safe
point); the sweep then names them with their exit codes, prints its own
command line to resume, and exits with 128 + the signal number.

Examples:
  # Print the commands of a 2 x 3 grid without running them.
  python launch/sweep.py --config=configs/mnist_sm.py:quick --root=/tmp/sweep \
      --grid=stream.wait=1,5,10 --grid=seed=0,1 --dry_run
  # Run them on this machine, two at a time, then write /tmp/sweep/report/.
  python launch/sweep.py --config=configs/mnist_sm.py:quick --root=/tmp/sweep \
      --grid=stream.wait=1,5,10 --grid=seed=0,1 --parallel=2
  # A grid file: GRID = [{"method.name": ["sm"], "model.width": [8, 16]},
  #                      {"method.name": ["ens"], "model.width": [8]}]
  python launch/sweep.py --config=configs/mnist_sm.py:smoke --root=/tmp/sweep \
      --grid_file=grid.py --grid=seed=0,1,2
  # The findings of REPRODUCTION.md: sub-grids with their own config files.
  python launch/sweep.py --root=/tmp/findings --grid_file=launch/grids/findings.py \
      --parallel=2
  # What is done, running, failed or left of the same sweep (starts nothing).
  python launch/sweep.py --root=/tmp/findings --grid_file=launch/grids/findings.py --status
  # Write a SLURM array script with one task per grid point (each with one GPU;
  # --slurm_gpus=0 for CPU nodes, --slurm_option for more #SBATCH lines): it
  # starts in this repository, is requeued on preemption, and 120 s before the
  # time limit each run saves and stops and its task is requeued to resume (see
  # launch/slurm.py); after the array,
  # `python -m alma_jax.reports.report --workdirs=/tmp/sweep/* --out=...`.
  python launch/sweep.py ... --slurm=sweep.sbatch --slurm_option=--time=4:00:00
  # Every point on a TPU pod slice, one after another (root on a shared mount).
  python launch/sweep.py --config=configs/cifar_sm.py --root=/mnt/shared/sweep \
      --grid=model.width=16,64 --grid=seed=0,1,2 --tpu=alma-v4-32 --tpu_zone=us-central2-b
A grid point that itself spans several GPUs or nodes is a job of
`launch/slurm.py` (one process per GPU).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import math
import os
import shlex
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for alma_jax
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for local.py, tpu_pod.py
from alma_jax import errors  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax import methods  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax import models  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax import policies  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.configuration import config_files  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.configuration import fields as F  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.engine import meter  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.outputs import io_utils  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.outputs import workdir as wd  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.reports import findings  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.reports import grid_files  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.reports import report  # pylint: disable=g-import-not-at-top,wrong-import-position
from alma_jax.stream import config_resolve  # pylint: disable=g-import-not-at-top,wrong-import-position
import local  # pylint: disable=g-import-not-at-top,wrong-import-position
import slurm  # pylint: disable=g-import-not-at-top,wrong-import-position
import sweep_state  # pylint: disable=g-import-not-at-top,wrong-import-position


# A grid field that is not a config field: the config file of the points (replaces --config).
CONFIG_FIELD = "config"
# The fields that end a workdir's name, in this order (the others come sorted by path before).
SEED_FIELDS = ("seed", "num_seeds")
# Seconds a run gets to stop (and checkpoint) after the sweep passed a signal on to it.
STOP_GRACE_S = 30.0
# The exit code of a run refused its inputs, among them a workdir that another run holds.
REFUSED = 2


class UsageError(SystemExit):
  """A flag or grid that the sweep refuses: its one-line message on stderr and exit code
  `REFUSED`, as for a flag that argparse refuses (a run that fails exits with 1)."""

  PREFIX = "sweep: error: "  # as argparse begins its own refusals

  def __init__(self, message: str):
    super().__init__(REFUSED)
    self.message = self.PREFIX + message

  def __str__(self) -> str:
    return self.message


# A point's state (sweep_state): "done", "running", "refuse" or "run".
LOGS_DIR, status, has_records = sweep_state.LOGS_DIR, sweep_state.status, sweep_state.has_records


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
  """The `--grid` flags' fields and values; a later flag of a field replaces the values of an
  earlier one (as a flag replaces a grid file's field)."""
  grid: dict[str, list[str]] = {}
  for item in items:
    if "=" not in item:
      raise UsageError(f"--grid={item!r} must look like field=v1,v2,...")
    field, values = item.split("=", 1)
    vals = [v for v in values.split(",") if v]
    if not vals:
      raise UsageError(f"--grid={item!r} has no values")
    repeated = sorted({v for v in vals if vals.count(v) > 1})
    if repeated:
      raise UsageError(f"--grid={item!r} repeats {', '.join(repeated)}: each value once")
    grid[field] = vals
  return list(grid.items())


def _value(v) -> str:
  return v if isinstance(v, str) else repr(v)


def grid_path(value: str) -> str:
  """`--grid_file`: a file's path, or the name of a grid shipped with alma_jax
  (`grid_files.path`)."""
  try:
    return grid_files.path(value)
  except grid_files.GridFileError as e:
    raise UsageError(str(e)) from e


def _grid_scope(path: str) -> dict:
  """The names a grid file defines (its code run once)."""
  try:
    return grid_files.scope(path)
  except grid_files.GridFileError as e:
    raise UsageError(str(e)) from e


def load_grid_file(path: str) -> list[list[tuple[str, list[str]]]]:
  """The grids of the GRID of a Python file (a dict of field -> values, or a list of them)."""
  grid = _grid_scope(path).get("GRID")
  grids = [grid] if isinstance(grid, dict) else grid
  if not isinstance(grids, (list, tuple)) or not grids or not all(
      isinstance(g, dict) and all(isinstance(v, (list, tuple)) and v for v in g.values())
      for g in grids):
    raise UsageError(f"--grid_file={path} must define GRID, a dict of "
                     "field -> non-empty list of values (or a list of such dicts); got "
                     f"{type(grid).__name__ if grid is not None else 'no GRID'}")
  return [[(str(f), [_value(v) for v in vals]) for f, vals in g.items()] for g in grids]


def load_run_seconds(path: str):
  """The grid file's `run_seconds(config)`, or None when it defines none."""
  fn = _grid_scope(path).get("run_seconds")
  if fn is not None and not callable(fn):
    raise UsageError(f"--grid_file={path}: run_seconds must be a function of a "
                     f"point's resolved config (a nested dict); got {type(fn).__name__}")
  return fn


def run_estimates(grid_file: str | None, todo) -> dict[str, float]:
  """{workdir: seconds} of the runs of `todo` ((index, command, workdir, resolved config)) by the
  grid file's `run_seconds(config)` (the resolved config as a nested dict, as a run's
  config.json holds it): one run's seconds on the host they were measured on, of
  which the ETA uses only the ratios. Empty when the file defines no `run_seconds`, or when it
  has no estimate (None) for a run: then the ETA counts every run as the mean of those that
  ended. A `run_seconds` that fails or returns anything else is an error before any run."""
  fn = load_run_seconds(grid_file) if grid_file else None
  if fn is None:
    return {}
  out = {}
  for i, _, workdir, resolved in todo:
    where = f"--grid_file={grid_file}: run_seconds of point [{i}] {os.path.basename(workdir)}"
    try:
      seconds = fn(resolved)
    except Exception as e:  # pylint: disable=broad-except  (its code may raise anything)
      raise UsageError(f"{where} failed: {errors.one_line(e)}") from e
    if seconds is None:
      print(f"sweep: {where} is None (no estimate); the ETA counts every run as the mean of "
            "those that ended", file=sys.stderr)
      return {}
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds) or seconds <= 0):
      raise UsageError(f"{where} returned {seconds!r}; it must return seconds "
                       "> 0, or None where it has no estimate")
    out[workdir] = float(seconds)
  return out


def sweep_eta(ended, pending, running, parallel: int) -> tuple[float | None, float | None]:
  """(seconds until the sweep ends, or None where nothing gives a pace; the factor from the
  grid's estimates to this host's times, or None where they are not used).

  ended: (seconds, estimate) of each run that finished here (a failed or refused run ends
  early, so it says nothing of the pace and is left out); pending: the estimates of the runs
  not started; running: (seconds so far, estimate) of each run in progress. With an estimate
  (`run_estimates`) for every run, the runs left take their estimates times the ratio of the
  ended runs' time to their estimates (less the time a running one has had), or the estimates
  as they are (factor 1) before any run finished; otherwise each counts as the mean of the
  ended runs. The runs left go `parallel` at a time."""
  estimates = [e for _, e in ended] + list(pending) + [e for _, e in running]
  if all(e is not None for e in estimates):
    scale = sum(t for t, _ in ended) / sum(e for _, e in ended) if ended else 1.0
    left = scale * sum(pending) + sum(max(0.0, scale * e - t) for t, e in running)
    return left / parallel, scale
  if not ended:
    return None, None
  mean = sum(t for t, _ in ended) / len(ended)
  return mean * (len(pending) + len(running)) / parallel, None


def run_wall_s(workdir: str) -> float | None:
  """The wall seconds of a finished run by its summary (all its processes, when it was
  resumed), or None where it has none."""
  try:
    wall = io_utils.read_json(os.path.join(workdir, "summary.json")).get("wall_s")
  except (OSError, ValueError, AttributeError):
    return None
  return float(wall) if isinstance(wall, (int, float)) and wall > 0 else None


def time_left(runs, states, estimates: dict[str, float]) -> str | None:
  """The line of `--status` that says how long the points not done should take, one after
  another, by the grid's `estimates` ({workdir: seconds}): scaled to the pace of the done runs
  (their summaries' `wall_s` against their estimates) where there are; None when every point
  is done or refused. `states`: the (state, detail) of each point, as the table showed them."""
  done, left = [], []
  for (_, workdir, _), (state, _) in zip(runs, states):
    if state == "done":
      wall = run_wall_s(workdir)
      if wall is not None:
        done.append((wall, estimates[workdir]))
    elif state != "refuse":
      left.append(estimates[workdir])
  if not left:
    return None
  eta, scale = sweep_eta(done, left, [], 1)  # no run done: the estimates as they are
  by = (f" x {scale:.3g} (the pace of the {len(done)} done)" if done else
        " (on the host it was measured on; no run done here to scale it by)")
  return (f"time left: {meter.duration(eta)} for {len(left)} point(s), one after another, by "
          f"the grid file's run_seconds{by}")


def combine(file_grids, flag_grid):
  """Each file grid crossed with the `--grid` fields (a flag replaces a field of the file)."""
  flagged = {f for f, _ in flag_grid}
  return [[(f, v) for f, v in g if f not in flagged] + flag_grid for g in file_grids or [[]]]


def _consecutive(values: list[str]) -> list[int] | None:
  try:
    seeds = sorted(int(v) for v in values)
  except ValueError:
    return None
  return seeds if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[0] + len(seeds))) else None


def split_configs(grids):
  """One grid per config file of a grid that names several (each decides its seeds)."""
  return [[(f, [c] if f == CONFIG_FIELD else v) for f, v in grid]
          for grid in grids for c in dict(grid).get(CONFIG_FIELD, [None])]


def fold_seeds(grids, together: str, config: str | None, extra: list[str], accelerator: bool):
  """Each grid's consecutive `seed` values as one run of `num_seeds` seeds (vmapped: faster
  than separate runs, except for convolution-heavy backbones on CPU, where vmapped
  convolutions are grouped ones)
  when `together` is "yes", or "auto" and that is faster."""
  if together == "no":
    return grids
  out = []
  for grid in grids:
    fields = dict(grid)
    seeds = _consecutive(fields.get("seed", []))
    if seeds is None or "num_seeds" in fields:
      out.append(grid)
      continue
    first = [(f, v[0]) for f, v in grid if f not in ("seed", CONFIG_FIELD)]
    resolved = command(fields.get(CONFIG_FIELD, [config])[0], "", first, extra)[2]
    names = {resolved["method"]["name"]} | {v for f, vals in grid if f == "method.name"
                                            for v in vals}
    if not all(methods.get(n).same_growth_for_every_seed for n in names):
      out.append(grid)  # its growth depends on the seed: one run per seed
      continue
    waits = {resolved["stream"]["wait_policy"]} | {v for f, vals in grid
                                                   if f == "stream.wait_policy" for v in vals}
    if not all(policies.wait_class(w).same_times_for_every_seed for w in waits):
      out.append(grid)  # each seed decides its own training times: one run per seed
      continue
    if (together == "auto" and not accelerator
        and models.spec(resolved["model"]["name"]).conv_heavy):
      out.append(grid)
      continue
    out.append([(f, [str(seeds[0])] if f == "seed" else v) for f, v in grid]
               + [("num_seeds", [str(len(seeds))])])
  return out


def _accelerator(args) -> bool:
  """Whether the runs will have an accelerator: a TPU VM, SLURM tasks with GPUs, or this
  machine's."""
  if args.tpu:
    return True
  if args.slurm:
    return args.slurm_gpus > 0
  import jax  # pylint: disable=g-import-not-at-top
  return jax.default_backend() != "cpu"


def points(grid):
  fields = [f for f, _ in grid]
  for combo in itertools.product(*[v for _, v in grid]):
    yield list(zip(fields, combo))


def _config_label(config: str) -> str:
  """`configs/mnist_gmoe.py:quick,iid` -> `mnist_gmoe-quick+iid` (a workdir name's part)."""
  path, _, variant = config.partition(":")
  stem = os.path.splitext(os.path.basename(path))[0]
  return stem + (f"-{variant.replace(',', '+')}" if variant else "")


def point_args(config: str | None, point, extra: list[str]) -> tuple[str, list[str]]:
  """(config file, `--config.*` flags and `extra`) of a grid point's run; the point's `config`
  field, if any, replaces the sweep's `--config`."""
  config = dict(point).get(CONFIG_FIELD, config)
  if not config:
    raise UsageError("--config is required unless every grid names its "
                     f"`{CONFIG_FIELD}` (a list of config files)")
  try:  # a config's name (mnist_sm:quick), or a grid's configs/<file> from another folder
    config = config_files.resolve(config)
  except config_files.UnknownConfigError as e:
    raise UsageError(f"{e}") from e
  flags = [f"--config.{f}={v}" for f, v in point if f != CONFIG_FIELD] + extra
  return config, flags


def canonical_point(point, resolved: dict):
  """`point` with each number written as its field holds it in the resolved config (`1e-1`
  -> `0.1`, `1` -> `1.0` for a float field), so one config gets one workdir name."""
  out = []
  for f, v in point:
    value = F.lookup(resolved, f, None) if f != CONFIG_FIELD else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      try:
        given = ast.literal_eval(v)
      except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        given = None
      if isinstance(given, (int, float)) and not isinstance(given, bool) and given == value:
        v = repr(value)
    out.append((f, v))
  return out


def command(config: str | None, root: str, point, extra: list[str]) -> tuple[list[str], str, dict]:
  """(command line, workdir, resolved config) of one grid point; the point's `config`
  field, if any, replaces the sweep's `--config`. Its numbers are written as the resolved
  config holds them (`canonical_point`)."""
  config_file, flags = point_args(config, point, extra)
  try:  # errors name the config as given, not the file its name stands for
    resolved = config_resolve.resolved_dict(config_file, flags,
                                            given=dict(point).get(CONFIG_FIELD, config))
  except config_resolve.ConfigResolveError as e:
    raise UsageError(f"{e}") from e
  point = canonical_point(point, resolved)
  config, flags = point_args(config, point, extra)
  workdir = find_workdir(root, workdir_name(point), config_resolve.config_hash(resolved), resolved)
  cmd = [sys.executable, "-m", "alma_jax.main", f"--config={config}", f"--workdir={workdir}"]
  return cmd + flags, workdir, resolved


def _name_order(field: str) -> tuple:
  """Sort key of a field in a workdir name: by path, the seeds last."""
  last = SEED_FIELDS.index(field) if field in SEED_FIELDS else -1
  return (last, field)


def workdir_name(point) -> str:
  """The name of a point's workdir before its hash: the config file's label, then every other
  field sorted by path (the seeds last), so a point reached in any field order gets one name."""
  fields = dict(point)
  label = [_config_label(fields.pop(CONFIG_FIELD))] if CONFIG_FIELD in fields else []
  parts = [f"{f.split('.')[-1]}-{fields[f]}" for f in sorted(fields, key=_name_order)]
  return "_".join(label + parts) or "default"


def find_workdir(root: str, name: str, digest: str, resolved: dict) -> str:
  """`<root>/<name>-<digest>`, or the folder with the same hash and the same config that an
  earlier version of the sweep named after the grid's field order (it is that point's run)."""
  canonical = os.path.join(root, f"{name}-{digest}")
  if os.path.exists(canonical):
    return canonical
  try:
    names = sorted(n for n in os.listdir(root) if n.endswith(f"-{digest}"))
  except OSError:
    return canonical
  for n in names:
    try:
      stored = io_utils.read_json(os.path.join(root, n, wd.CONFIG_FILE))
    except (OSError, ValueError):
      continue
    # The same config (a folder of another point's name is that point's run, not this one's,
    # where this one leaves a field to be chosen that the other set).
    if isinstance(stored, dict) and not wd.config_diff(stored, resolved):
      return os.path.join(root, n)
  return canonical


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", help="config file or name, e.g. configs/mnist_sm.py:quick or "
                 f"mnist_sm:quick (a grid's `{CONFIG_FIELD}` field replaces it)")
  p.add_argument("--root", required=True, help="directory holding one workdir per grid point")
  p.add_argument("--grid", action="append", default=[], help="field=v1,v2,... (repeatable)")
  p.add_argument("--grid_file", help="a Python file defining GRID (see above), or the name of "
                 f"a grid shipped with alma_jax ({', '.join(grid_files.names())})")
  p.add_argument("--parallel", type=int, default=1, help="runs at a time on this machine")
  p.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                 help="write the report of the sweep's workdirs when its runs are over")
  p.add_argument("--report_dir", help="where the report goes (default: <root>/report)")
  p.add_argument("--dry_run", action="store_true", help="print the commands only")
  p.add_argument("--status", action="store_true", help="print a table of the points (done, "
                 "running, failed, to run) and their folders; start nothing")
  p.add_argument("--validate", action=argparse.BooleanOptionalAction, default=True,
                 help="check every point's config (as the run does, without loading data) "
                 "before starting any; invalid points are named and nothing runs (exit code 2)")
  p.add_argument("--seeds_together", choices=("auto", "yes", "no"), default="auto",
                 help="run a grid's consecutive seeds as one run of config.num_seeds seeds "
                 "(auto: except convolution-heavy backbones (VGG, ResNet) on CPU, where "
                 "separate runs are faster)")
  p.add_argument("--slurm", help="write a SLURM array script to this path instead of running")
  p.add_argument("--slurm_gpus", type=int, default=1, help="GPUs of each array task (0: none)")
  p.add_argument("--slurm_option", action="append", default=[],
                 help="another #SBATCH line of the array script (repeatable), e.g. "
                 "--slurm_option=--time=4:00:00")
  p.add_argument("--tpu", help="run the points one after another on every worker of this "
                 "Cloud TPU VM (launch/tpu_pod.py)")
  p.add_argument("--tpu_zone", help="the TPU VM's zone (required with --tpu)")
  p.add_argument("--tpu_project", default="", help="the TPU VM's project (default: gcloud's)")
  p.add_argument("--tpu_setup", action=argparse.BooleanOptionalAction, default=True,
                 help="copy the repository to the TPU workers and install it before the runs")
  p.add_argument("extra", nargs="*", help="extra flags passed to every run (after --)")
  args = p.parse_args(argv)
  if args.grid_file:
    args.grid_file = grid_path(args.grid_file)
  if not args.root:
    raise UsageError("--root is empty; give a directory (existing or new) to hold the "
                     "points' workdirs")
  if args.report_dir == "":
    raise UsageError("--report_dir is empty; give the directory for the report, or leave "
                     "the flag out for <root>/report")
  if os.path.exists(args.root) and not os.path.isdir(args.root):
    raise UsageError(f"--root={args.root} exists and is not a directory; give a "
                     "directory (existing or new) to hold the points' workdirs")
  if args.parallel < 1:
    raise UsageError(f"--parallel={args.parallel} must be >= 1")
  if args.slurm:
    if args.slurm_gpus < 0:
      raise UsageError(f"--slurm_gpus={args.slurm_gpus} must be >= 0 (0: no GPU)")
    found = (slurm.options_problem("--slurm_option", args.slurm_option)
             or slurm.script_problem("--slurm", args.slurm))
    if found:
      raise UsageError(found)
  if args.tpu:
    if not args.tpu_zone:
      raise UsageError("--tpu needs --tpu_zone")
    if not os.path.isabs(args.root):
      raise UsageError(f"--root={args.root}: with --tpu it must be an absolute "
                       "path that every TPU worker sees (a shared mount)")
    if args.slurm or args.parallel != 1:
      raise UsageError("--tpu runs the points one after another on the pod "
                       "slice; it takes neither --slurm nor --parallel")
  elif args.tpu_zone or args.tpu_project:
    raise UsageError("--tpu_zone and --tpu_project go with --tpu")
  return args


def _tpu_pod():
  import tpu_pod  # pylint: disable=g-import-not-at-top
  return tpu_pod


def tpu_command(args, cmd: list[str]) -> list[str]:
  """The gcloud command that runs `cmd` (a grid point's `python -m alma_jax.main ...`, as
  `command` builds it) on every TPU worker."""
  (run,) = _tpu_pod().commands(cmd[3:], tpu=args.tpu, zone=args.tpu_zone,
                               project=args.tpu_project, archive="", steps=["run"])
  return run


def slurm_script(args, runs) -> str:
  """The SLURM array script of `runs`: one task per point, started in the repository, named
  after the root, requeued on preemption; before the time limit the task's run saves and
  stops and the task is requeued, to resume (launch/slurm.py `run_lines`)."""
  name = f"alma_jax-{os.path.basename(os.path.normpath(args.root)) or 'sweep'}"
  lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --array=0-{len(runs) - 1}"]
  lines += [f"#SBATCH --gres=gpu:{args.slurm_gpus}"] * (args.slurm_gpus > 0)
  lines += slurm.requeue_options() + [f"#SBATCH {o}" for o in args.slurm_option]
  lines += ["set -euo pipefail"] + slurm.setup_lines() + ["CMDS=("]
  lines += [f"  {shlex.quote(shlex.join(c))}" for c, _, _ in runs] + [")"]
  return "\n".join(lines + slurm.run_lines('eval "exec ${CMDS[$SLURM_ARRAY_TASK_ID]}"')) + "\n"


def _write_slurm(args, runs) -> int:
  with open(args.slurm, "w") as f:
    f.write(slurm_script(args, runs))
  print(f"wrote {args.slurm} with {len(runs)} tasks")
  return 0


def _start(cmd: list[str], log: str | None, resume_command: str):
  """Starts a point's run, its output appended to `log` if given, in a session of its own
  (Ctrl-C reaches the sweep alone, which passes it on)."""
  env = dict(os.environ, **{local.RESUME_ENV: resume_command})
  if log is None:
    return subprocess.Popen(cmd, env=env, start_new_session=True)
  os.makedirs(os.path.dirname(log), exist_ok=True)
  with open(log, "a") as f:
    return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _launch(todo, args, total: int, signals, resume_command: str,
            estimates: dict[str, float]) -> tuple[int, int]:
  """Runs the (index, command, workdir, resolved config) of `todo`, `args.parallel` at a time
  (with P > 1 each one's output goes to <root>/logs/<workdir name>.log), until they are over or
  `signals` receives one, which is passed on to the runs in progress. After each run it prints
  the sweep's ETA (`sweep_eta`, with the runs' `estimates` by workdir where there are).

  Each point's status is checked again just before it starts, and after its run was refused:
  a point that another process (another sweep on the same root) ran meanwhile, or runs, is
  not run here, and the run it refused is not a failure.

  Returns:
    (runs that failed, points left to another process that runs them).
  """
  pending, running, failed, elsewhere = list(todo), {}, 0, 0
  # When each run began; (seconds, estimate) of each run that finished (the ETA's pace); how
  # many ended in all, failed and refused ones included.
  started, finished, ended = {}, [], 0
  while (pending or running) and not signals.received:
    for p, (i, _, workdir, resolved, log) in list(running.items()):
      if p.poll() is None:
        continue
      del running[p]
      now = time.monotonic()
      took = now - started.pop(p)
      ended += 1
      if p.returncode == 0:
        # A resumed run's own time counts its earlier processes too (its summary's wall_s).
        finished.append((max(took, run_wall_s(workdir) or 0.0), estimates.get(workdir)))
      eta, scale = sweep_eta(finished, [estimates.get(w) for _, _, w, _ in pending],
                             [(now - started[q], estimates.get(r[2])) for q, r in running.items()],
                             args.parallel)
      if eta is None:
        eta_text = "sweep_eta=? (no run finished yet)"
      elif scale is not None and not finished:
        eta_text = (f"sweep_eta={meter.duration(eta)} (the grid file's run_seconds; no run "
                    "finished yet to scale it)")
      else:
        by = f" (the grid file's run_seconds x {scale:.3g})" if scale is not None else ""
        eta_text = f"sweep_eta={meter.duration(eta)}{by}"
      print(f"sweep: [{i}/{total}] ended after {meter.duration(took)}; {ended} ended here, "
            f"{len(pending) + len(running)} to go, {eta_text}", file=sys.stderr, flush=True)
      where = f"; its output: {log}" if log else ""
      # Refused: the workdir may be another process's (there, of another host too).
      state, why = (status(workdir, resolved, any_host=True) if p.returncode == REFUSED
                    else ("", ""))
      if state == "done":
        print(f"[{i}/{total}] done by another process meanwhile{where}", flush=True)
      elif state == "running":
        print(f"[{i}/{total}] running ({why}), skipped{where}", flush=True)
        elsewhere += 1
      elif p.returncode != 0:
        print(f"[{i}/{total}] failed: {local.describe_exit(p.returncode)}{where}", flush=True)
        failed += 1
        sweep_state.record_exit(workdir, p.returncode, log)
      else:
        sweep_state.record_exit(workdir, 0, log)
        if log:
          print(f"[{i}/{total}] finished{where}", flush=True)
    while pending and len(running) < args.parallel and not signals.received:
      i, cmd, workdir, resolved = pending.pop(0)
      state, why = status(workdir, resolved)
      if state != "run":  # changed since the sweep started: another process ran or runs it
        label = {"done": "done by another process meanwhile", "running": f"running ({why})",
                 "refuse": f"refused ({why})"}[state]
        print(f"[{i}/{total}] {label}, skipped", flush=True)
        failed += state == "refuse"
        elsewhere += state == "running"
        continue
      log = (os.path.join(args.root, LOGS_DIR, os.path.basename(workdir) + ".log")
             if args.parallel > 1 else None)
      proc = _start(cmd, log, resume_command)
      started[proc] = time.monotonic()
      running[proc] = (i, cmd, workdir, resolved, log)
    if running:
      time.sleep(0.1)
  if signals.received:
    _stop(running, total, len(pending), signals)
  return failed, elsewhere


def _stop(running: dict, total: int, left: int, signals) -> None:
  """Passes the signal on to the runs in progress, waits for them, and names each one's exit."""
  print(f"sweep: {signal.Signals(signals.received[0]).name}: stopping {len(running)} run(s) in "
        f"progress; {left} point(s) not started", file=sys.stderr, flush=True)
  killed = local.stop_processes(list(running), signals.forwarded(), STOP_GRACE_S, signals)
  for p, (i, _, _, _, log) in running.items():
    late = " (it did not stop in time)" if p in killed else ""
    where = f"; its output: {log}" if log else ""
    print(f"sweep: [{i}/{total}] (pid {p.pid}): {local.describe_exit(p.returncode)}{late}{where}",
          file=sys.stderr, flush=True)


def _report(args, runs) -> int:
  out = args.report_dir or os.path.join(args.root, "report")
  workdirs = [w for _, w, r in runs if status(w, r)[0] != "refuse" and has_records(w)]
  if args.dry_run or not workdirs:
    print(f"report of the grid's workdirs -> {out}" if args.dry_run else
          "report: no grid point has outputs yet; nothing to report", file=sys.stderr)
    return 0
  try:
    found = findings.load_findings(args.grid_file) if args.grid_file else ()
    figures = report.write_report(workdirs, out, findings=found)
  except (report.ReportError, findings.FindingsError, OSError) as e:
    print(f"report: error: {e}", file=sys.stderr)
    return 1
  print(f"report of {len(workdirs)} workdirs: {os.path.join(out, 'report.md')} and "
        f"{len(figures)} figures")
  return 0


def plan(args) -> dict:
  """{workdir: (command, workdir, resolved config, (config file, flags))} of the grid's points."""
  grids = combine(load_grid_file(args.grid_file) if args.grid_file else [],
                  parse_grid(args.grid))
  if args.seeds_together != "no":
    grids = fold_seeds(split_configs(grids), args.seeds_together, args.config, args.extra,
                       args.seeds_together == "auto" and _accelerator(args))
  made = {}  # workdir -> (command, workdir, resolved config, (config file, flags))
  hashes = {}  # config hash -> workdirs of that hash
  given = {}  # workdir -> its point as the grid spelled it
  for pt in (pt for g in grids for pt in points(g)):
    cmd, workdir, resolved = command(args.config, args.root, pt, args.extra)
    digest = config_resolve.config_hash(resolved)
    # Two points of one sweep are one run where their configs are equal (a field left to be
    # chosen is not the value another point sets: `same_run` takes it so for a resume alone).
    same = next((w for w in hashes.get(digest, [])
                 if not wd.config_diff(made[w][2], resolved)), None)
    if same is not None:
      if sorted(given[same]) != sorted(pt):  # not merely the same point again
        flags = " ".join(f"{f}={v}" for f, v in pt)
        print(f"sweep: the point {flags} resolves to the config of {os.path.basename(same)}; "
              "it runs once", file=sys.stderr)
      continue
    hashes.setdefault(digest, []).append(workdir)
    given[workdir] = pt
    made[workdir] = (cmd, workdir, resolved, point_args(args.config, canonical_point(pt, resolved),
                                                        args.extra))
  return made


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  args = _args(argv)
  made = plan(args)
  runs = [m[:3] for m in made.values()]
  if args.status:
    states = sweep_state.print_status(args.root, runs)
    estimates = run_estimates(args.grid_file, [(i + 1, c, w, r) for i, (c, w, r) in
                                               enumerate(runs)])
    line = time_left(runs, states, estimates) if estimates else None
    if line:
      print(line)
    return 0
  invalid = (sweep_state.invalid_points(runs, [m[3] for m in made.values()],
                                         bool(args.slurm or args.tpu)) if args.validate else [])
  if invalid:
    print(f"sweep: {len(invalid)} of {len(runs)} points are invalid; no run was started:",
          file=sys.stderr)
    for i, workdir, why in invalid:
      print(f"  [{i + 1}/{len(runs)}] {os.path.basename(workdir)}: {why}", file=sys.stderr)
    return REFUSED
  if args.slurm:
    return _write_slurm(args, runs)
  if args.tpu:  # the same points and workdirs, each run through gcloud on every worker
    runs = [(tpu_command(args, c), w, r) for c, w, r in runs]
  failed, elsewhere, todo, to_run = 0, 0, [], 0
  for i, (cmd, workdir, resolved) in enumerate(runs):
    state, why = status(workdir, resolved)
    label = {"run": "", "done": "done, skipped: ", "running": f"running ({why}), skipped: ",
             "refuse": f"refused ({why}): "}[state]
    print(f"[{i + 1}/{len(runs)}] {label}{shlex.join(cmd)}", flush=True)
    failed += state == "refuse"
    elsewhere += state == "running"
    to_run += state == "run"
    if state == "run" and not args.dry_run:
      todo.append((i + 1, cmd, workdir, resolved))
  if todo and not args.tpu:  # the points' workdirs and logs go under the root, here
    try:
      wd.check_writable(args.root, "--root", "the points' workdirs")
    except errors.ConfigError as e:
      raise UsageError(f"{e}; no run was started") from None
  if args.tpu and args.tpu_setup and to_run:
    if _tpu_pod().execute([], tpu=args.tpu, zone=args.tpu_zone, project=args.tpu_project,
                          steps=["copy", "install"], dry_run=args.dry_run):
      print("sweep: the TPU setup failed; no point was run", file=sys.stderr)
      return 1
  estimates = run_estimates(args.grid_file, todo) if todo else {}
  if estimates:
    print(f"sweep: {len(todo)} run(s) to go, {meter.duration(sum(estimates.values()))} one after "
          "another by the grid file's run_seconds (on the host it was measured on; after each "
          "run the ETA scales it to this one)", file=sys.stderr, flush=True)
  resume_command = local.own_command(argv, __file__)
  with local.StopSignals() as signals:
    failed_here, elsewhere_here = _launch(todo, args, len(runs), signals, resume_command,
                                          estimates)
  if signals.received:
    print(f"sweep: to resume, run the same command again: {resume_command}", file=sys.stderr)
    return 128 + signals.received[0]
  failed += failed_here
  elsewhere += elsewhere_here
  if failed:
    print(f"{failed} of {len(runs)} runs failed", file=sys.stderr)
  if elsewhere:
    print(f"{elsewhere} of {len(runs)} points are running in another process; run the sweep "
          "again once they are over for their report", file=sys.stderr)
  report_failed = _report(args, runs) if args.report else 0
  return 1 if failed or report_failed else 0


if __name__ == "__main__":
  try:
    sys.exit(main())
  except UsageError as e:
    print(e, file=sys.stderr)
    sys.exit(e.code)

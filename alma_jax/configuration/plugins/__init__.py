"""The plug-ins by name, and what a config needs of them, without importing them.

A config is built (`config_lib.base_config`) and its variants applied before any
model, method or task code is loaded, so that `get_config()` of a config file
imports no JAX. What that takes of each plug-in is declared in this package,
which imports nothing heavy:

- `tasks`: each task's declaration (name, data sets, method aliases, config
  fields, the base fields it sets, its variants), the base class of the task's
  class in `alma_jax.tasks`;
- `methods`: each method's declaration (name, config fields), the base class of
  the method's class in `alma_jax.methods`;
- `policies`: each stage and waiting policy's declaration (name, config
  fields), the base class of the policy's class in `alma_jax.policies`;
- `backbones`: the tasks each backbone serves, and whether it has experts.

A plug-in registered at run time (`alma_jax.tasks.register`,
`alma_jax.methods.register`, `alma_jax.policies.register`,
`alma_jax.models.register`) is added here by its registry: a task, method or
policy class is its own declaration.
"""

from __future__ import annotations

from alma_jax.configuration import fields as F
from alma_jax.configuration.plugins import backbones
from alma_jax.configuration.plugins import methods
from alma_jax.configuration.plugins import policies
from alma_jax.configuration.plugins import tasks
from alma_jax.errors import ConfigError

DEFAULT_TASK = "images"
TASKS: dict[str, type] = {}
METHODS: dict[str, type] = {c.name: c for c in methods.DECLARED}
# Stage policies (`config.stream.warm_start`) and waiting policies (`config.stream.wait_policy`).
STAGE_POLICIES: dict[str, type] = {}
WAIT_POLICIES: dict[str, type] = {}


def _declare(table: dict[str, type], cls: type, what: str) -> None:
  """Adds declaration `cls` to `table`; a class may replace its own declaration (its base),
  never another's. The fields of tasks and policies are known by path (`fields.declared`);
  methods' are not, since two methods may give one path different defaults."""
  known = table.get(cls.name)
  if known is not None and not issubclass(cls, known):
    raise ValueError(f"{what} name {cls.name!r} declared twice")
  table[cls.name] = cls
  if table is not METHODS:
    F.declare(cls.FIELDS)


def declare_task(cls: type) -> None:
  """Adds task declaration `cls` (a class with the attributes of `tasks.Declaration`)."""
  _declare(TASKS, cls, "task")


def summary_stats() -> tuple[tuple[str, str, str], ...]:
  """The summary fields of every declared task that a report's table shows
  (`tasks.Declaration.SUMMARY_STATS`)."""
  return tuple(s for cls in TASKS.values() for s in cls.SUMMARY_STATS)


def declare_method(cls: type) -> None:
  """Adds method declaration `cls` (a class with the attributes of `methods.Declaration`)."""
  _declare(METHODS, cls, "method")


def declare_policy(cls: type, stage: bool) -> None:
  """Adds the declaration `cls` of a stage policy (`stage`) or a waiting policy."""
  _declare(STAGE_POLICIES if stage else WAIT_POLICIES, cls, "policy")


for _cls in tasks.DECLARED:
  declare_task(_cls)
for _cls in policies.STAGE:
  declare_policy(_cls, stage=True)
for _cls in policies.WAIT:
  declare_policy(_cls, stage=False)


def policy_fields() -> tuple[F.Field, ...]:
  """The config fields of every declared policy (every config has them all)."""
  return tuple(f for table in (STAGE_POLICIES, WAIT_POLICIES) for cls in table.values()
               for f in cls.FIELDS)


def method_aliases() -> dict[str, tuple[str, str]]:
  """{method alias: (the method's name, the task's name)} over the declared tasks."""
  return {alias: (method, cls.name) for cls in TASKS.values()
          for alias, method in cls.METHOD_ALIASES.items()}


def method_names() -> list[str]:
  """The valid `config.method.name` values: the methods and the tasks' aliases of them."""
  return sorted(set(METHODS) | set(method_aliases()))


def method(name: str) -> type:
  """The declaration of method `name` (or of the method an alias stands for)."""
  alias = method_aliases().get(name)
  name = alias[0] if alias is not None else name
  if name not in METHODS:
    raise ConfigError(f"config.method.name={name!r} is unknown; valid names: {method_names()}")
  return METHODS[name]


def method_fields(config) -> tuple[F.Field, ...]:
  """The config fields of `config`'s method."""
  return method(config.method.name).fields(config)


def backbones_of(task: type) -> list[str]:
  """The backbones that serve task `task`: those whose declaration names it, and those the
  task lists itself (`BACKBONES`)."""
  named = {n for n, b in backbones.BACKBONES.items() if task.name in b.tasks}
  return sorted(named | set(task.BACKBONES))


def task(config) -> type:
  """The task declaration of `config`: the first declared task that claims its data; else
  the task that its method alias stands for (e.g. `lm_sm`); else the one task its backbone
  serves; else images."""
  for cls in TASKS.values():
    if cls.claims(config):
      return cls
  alias = method_aliases().get(F.lookup(config, "method.name", ""))
  if alias is not None:
    return TASKS[alias[1]]
  model = F.lookup(config, "model.name", "")
  serving = [cls for cls in TASKS.values() if model in backbones_of(cls)]
  return serving[0] if len(serving) == 1 else TASKS[DEFAULT_TASK]


# -- the older field stream.init_from_scratch ------------------------------------------------------
def resolve_warm_start(config) -> None:
  """Makes `stream.init_from_scratch` (the older name of `warm_start="scratch"`) and
  `stream.warm_start` agree, in place; raises `ConfigError` when they contradict each other.

  init_from_scratch unset (None) follows warm_start; True selects "scratch" (a
  warm_start left at "finetune" cannot be told from its default, so it is read
  as the older spelling); False (or True) with another warm_start is a
  contradiction unless warm_start agrees.
  """
  s = config.stream
  legacy, policy = F.get(s, "stream.init_from_scratch"), F.get(s, "stream.warm_start")
  if legacy is None:
    s.init_from_scratch = policy == "scratch"
  elif legacy and policy == "finetune":
    s.warm_start = "scratch"
  elif bool(legacy) != (policy == "scratch"):
    raise ConfigError(
        f"config.stream.init_from_scratch={legacy} contradicts config.stream.warm_start="
        f"{policy!r} (init_from_scratch=True is the older spelling of warm_start='scratch'); "
        f"set config.stream.warm_start alone; allowed values: {sorted(STAGE_POLICIES)}")
  chosen = STAGE_POLICIES.get(s.warm_start)
  for other in STAGE_POLICIES.values():
    unused = [f for f in other.FIELDS if chosen is None or f.path not in chosen.paths()]
    changed = [f for f in unused if F.get(config.get(f.path.split(".")[0]), f.path) != f.default]
    if changed:
      values = " and ".join(f"config.{f.path}={F.get(config.get(f.path.split('.')[0]), f.path)}"
                            for f in unused)
      raise ConfigError(
          f"{values} {'is' if len(unused) == 1 else 'are'} used only by "
          f"config.stream.warm_start={other.name!r}, not {s.warm_start!r}; set it, or leave "
          f"{'it' if len(unused) == 1 else 'them'} at "
          f"{' and '.join(repr(f.default) for f in unused)}")

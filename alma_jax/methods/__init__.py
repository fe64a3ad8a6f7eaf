"""Methods of the paper, registered by name (`config.method.name`).

Every module of this package is imported here, so a method defined (and
`@register`ed) in a new file `alma_jax/methods/<name>.py` is available
without further edits.
"""

from __future__ import annotations

import importlib
import pkgutil

from alma_jax.methods.base import Learner, Method, SingleBackbone, StageContext
from alma_jax.methods.registry import fields_for, get, make, names, register

for _info in pkgutil.iter_modules(__path__):
  importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["Learner", "Method", "SingleBackbone", "StageContext", "register", "get", "make",
           "fields_for", "names"]

"""Deprecated: the planner is the `moestack-plan` package, imported as `moe_plan`.

moe_train.plan (and its submodules, such as `moe_train.plan.serve`) re-exports it for one
release, with a DeprecationWarning on import.
"""

import importlib
import pkgutil
import sys
import warnings

import moe_plan
from moe_plan import *  # noqa: F403

__all__ = moe_plan.__all__

warnings.warn(
    "moe_train.plan is deprecated: import moe_plan (the moestack-plan package) instead",
    DeprecationWarning,
    stacklevel=2,
)

for _module in pkgutil.iter_modules(moe_plan.__path__):
    if _module.name.startswith("_"):  # private modules, such as __main__
        continue
    sys.modules[f"{__name__}.{_module.name}"] = importlib.import_module(f"moe_plan.{_module.name}")

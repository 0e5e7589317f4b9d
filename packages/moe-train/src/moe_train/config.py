"""Deprecated: the typed config is the `moestack-plan` package's `moe_plan.config`.

moe_train.config (and its submodules, such as `moe_train.config.model`) re-exports it for one
release, with a DeprecationWarning on import.
"""

import importlib
import pkgutil
import sys
import warnings

import moe_plan.config
from moe_plan.config import *  # noqa: F403

__all__ = moe_plan.config.__all__

warnings.warn(
    "moe_train.config is deprecated: import moe_plan.config (the moestack-plan package) instead",
    DeprecationWarning,
    stacklevel=2,
)

for _module in pkgutil.iter_modules(moe_plan.config.__path__):
    if _module.name.startswith("_"):  # private modules, such as __main__
        continue
    sys.modules[f"{__name__}.{_module.name}"] = importlib.import_module(
        f"moe_plan.config.{_module.name}"
    )

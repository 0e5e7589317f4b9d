"""Deprecated: the data pipeline is the `moestack-data` package, imported as `moe_data`.

`moe_train.data` (and its submodules, such as `moe_train.data.labels`) re-exports it for one
release, with a DeprecationWarning on import.
"""

import importlib
import pkgutil
import sys
import warnings

import moe_data
from moe_data import *  # noqa: F403

__all__ = moe_data.__all__

warnings.warn(
    "moe_train.data is deprecated: import moe_data (the moestack-data package) instead",
    DeprecationWarning,
    stacklevel=2,
)

for _module in pkgutil.iter_modules(moe_data.__path__):
    sys.modules[f"{__name__}.{_module.name}"] = importlib.import_module(f"moe_data.{_module.name}")

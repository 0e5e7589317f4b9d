"""The old import paths of modules that moved to their own packages: each re-exports its new
home for one release, with a DeprecationWarning on import."""

import importlib
import pkgutil
import sys
import warnings
from types import ModuleType


def forward(old: str, new: ModuleType, package: str) -> None:
    """Warn that module `old` is deprecated for `new` (of distribution `package`), and make
    each public submodule of `new` importable under `old` too."""
    warnings.warn(
        f"{old} is deprecated: import {new.__name__} (the {package} package) instead",
        DeprecationWarning,
        stacklevel=3,
    )
    for module in pkgutil.iter_modules(new.__path__):
        if not module.name.startswith("_"):  # private modules, such as __main__
            sys.modules[f"{old}.{module.name}"] = importlib.import_module(
                f"{new.__name__}.{module.name}"
            )

"""torchao, imported without the notices torch and Python print about torchao's own code.

On import torchao registers its enums (KernelPreference, ScaleCalculationMode) as pytree
constants; torch versions that treat enums as opaque values natively log a deprecation
warning for each ("... is an Enum subclass ... Calling register_constant() on Enum subclasses
is deprecated"). Compiling torchao's sources also warns about an invalid escape sequence in one
of its docstrings. Both are torchao's, harmless, and nothing a user of this stack can act on,
so every import of torchao here runs inside `quiet_torchao_import()`, which drops those two
notices, and only them, while it runs (torchao registers once, at its first import).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

_PYTREE_LOGGER = "torch.utils._pytree"
_ENUM_NOTICE = "is an Enum subclass and is now natively supported"


class _DropEnumNotice(logging.Filter):
    """Drops torch's notice about enums registered as pytree constants."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _ENUM_NOTICE not in record.getMessage()


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Import torchao modules inside this block: torch's enum-registration notice and
    Python's invalid-escape warnings are dropped while it runs; everything else passes."""
    logger = logging.getLogger(_PYTREE_LOGGER)
    notice = _DropEnumNotice()
    logger.addFilter(notice)
    try:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, SyntaxWarning):
                warnings.filterwarnings("ignore", "invalid escape sequence", category)
            yield
    finally:
        logger.removeFilter(notice)

"""Deprecated: the data pipeline is the `moestack-data` package, imported as `moe_data`.

`moe_train.data` (and its submodules, such as `moe_train.data.labels`)
re-exports it for one release, with a DeprecationWarning on import.
"""

import moe_data
from moe_data import *  # noqa: F403
from moe_train.moved import forward

__all__ = moe_data.__all__

forward(__name__, moe_data, "moestack-data")

"""Deprecated: the typed config is the `moestack-plan` package's `moe_plan.config`.

`moe_train.config` (and its submodules, such as `moe_train.config.model`)
re-exports it for one release, with a DeprecationWarning on import.
"""

import moe_plan.config
from moe_plan.config import *  # noqa: F403
from moe_train.moved import forward

__all__ = moe_plan.config.__all__

forward(__name__, moe_plan.config, "moestack-plan")

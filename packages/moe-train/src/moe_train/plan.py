"""Deprecated: the planner is the `moestack-plan` package, imported as `moe_plan`.

`moe_train.plan` (and its submodules, such as `moe_train.plan.serve`)
re-exports it for one release, with a DeprecationWarning on import.
"""

import moe_plan
from moe_plan import *  # noqa: F403
from moe_train.moved import forward

__all__ = moe_plan.__all__

forward(__name__, moe_plan, "moestack-plan")

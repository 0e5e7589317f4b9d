"""`moe-train plan ...`: the planner's command (`moe-plan`, of the moestack-plan package)."""

from moe_plan.cli import DESCRIPTION, HELP, add_arguments, handle
from moe_train.cli.command import Command

PLAN = Command(
    name="plan",
    help=HELP,
    description=DESCRIPTION,
    add_arguments=add_arguments,
    handle=handle,
    takes_overrides=True,
)

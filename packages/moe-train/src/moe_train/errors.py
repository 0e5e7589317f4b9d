"""User-facing errors: the CLI prints them as one line and exits with their `exit_code`."""

from typing import TypeVar

from moe_data import DataError, UserError
from moe_plan import ConfigError

MoeTrainError = UserError
"""An error caused by the user's input (config, data, paths), not by a bug: the base of every
user-facing error, moe-data's DataError and moe-plan's ConfigError included (`exit_code` 2
unless a subclass says)."""


class TrainingDiverged(MoeTrainError):
    """The loss or gradient norm stayed non-finite, or the state became non-finite."""

    exit_code = 3


class RankLost(MoeTrainError):
    """Another rank died, failed, or did not answer within parallel.timeout_s."""

    exit_code = 4


__all__ = [
    "ConfigError",
    "DataError",
    "MoeTrainError",
    "RankLost",
    "TrainingDiverged",
    "on_every_rank",
]

E = TypeVar("E", bound=MoeTrainError)


def on_every_rank(error: E) -> E:
    """`error`, marked as raised alike on every rank of a launch."""
    error.same_on_every_rank = True
    return error

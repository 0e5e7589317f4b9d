"""User-facing errors: the CLI prints them as one line and exits with their `exit_code`."""

from typing import TypeVar


class MoeTrainError(Exception):
    """An error caused by the user's input (config, data, paths), not by a bug."""

    exit_code = 2
    same_on_every_rank = False
    """Every rank of a launch raises this error alike (a check each rank makes of the same
    config, or an error shared through a collective): rank 0 alone prints it."""


class ConfigError(MoeTrainError):
    """A config key is unknown, has the wrong type, or an impossible value."""


class DataError(MoeTrainError):
    """A data file is missing, unreadable, or does not match the model."""


class TrainingDiverged(MoeTrainError):
    """The loss or gradient norm stayed non-finite, or the state became non-finite."""

    exit_code = 3


class RankLost(MoeTrainError):
    """Another rank died, failed, or did not answer within parallel.timeout_s."""

    exit_code = 4


E = TypeVar("E", bound=MoeTrainError)


def on_every_rank(error: E) -> E:
    """`error`, marked as raised alike on every rank of a launch."""
    error.same_on_every_rank = True
    return error

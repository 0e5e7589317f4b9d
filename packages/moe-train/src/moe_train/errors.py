"""User-facing errors: the CLI prints them as one line and exits with their `exit_code`."""


class MoeTrainError(Exception):
    """An error caused by the user's input (config, data, paths), not by a bug."""

    exit_code = 2


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

"""User-facing errors: the CLI prints them as one line and exits non-zero."""


class MoeTrainError(Exception):
    """An error caused by the user's input (config, data, paths), not by a bug."""


class ConfigError(MoeTrainError):
    """A config key is unknown, has the wrong type, or an impossible value."""


class DataError(MoeTrainError):
    """A data file is missing, unreadable, or does not match the model."""

"""The planner's and the config's user-facing error: a command prints it as one line and exits
with its `exit_code` (2)."""

from moe_data import DataError, UserError


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or an impossible value."""


__all__ = ["ConfigError", "DataError", "UserError"]

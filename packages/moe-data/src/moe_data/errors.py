"""User-facing errors: a command prints them as one line and exits with their `exit_code`."""


class UserError(Exception):
    """An error caused by the user's input (config, data, paths), not by a bug.

    The base of every user-facing error of moe-stack (moe-train names it MoeTrainError)."""

    exit_code = 2
    same_on_every_rank = False
    """Every rank of a launch raises this error alike (a check each rank makes of the same
    config, or an error shared through a collective): rank 0 alone prints it."""


class DataError(UserError):
    """A data file is missing, unreadable, or does not match the model."""


PREEMPTED_EXIT = 75
"""Exit code of a command stopped by a signal (a training run after its checkpoint, when
checkpointing is on): EX_TEMPFAIL, "try again later"; rerunning the same command continues."""

"""The one error type of moe-checkpoint."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint cannot be saved, trusted or read; the message is one line naming the file
    or tensor and what is wrong."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split("\n")))

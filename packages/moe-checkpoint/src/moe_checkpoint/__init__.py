"""moe-checkpoint: checkpoints of global FP32 tensors that any topology writes in parallel and
reads back, as plain safetensors files (readable by ``safetensors.safe_open`` alone).

Every rank passes the pieces it owns (`OwnedSlice`: a flat range of a global tensor); the
bytes go straight into consolidated files; a checkpoint counts only once its ``COMMITTED``
marker exists. See the package README for the format and the commit protocol.
"""

from moe_checkpoint.errors import CheckpointError
from moe_checkpoint.load import SliceRequest, load_into, load_slices
from moe_checkpoint.manage import (
    checkpoint_summary,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_trainer_state,
    resolve_checkpoint,
    verify_checkpoint,
)
from moe_checkpoint.plan import OwnedSlice
from moe_checkpoint.save import SaveHandle, release_staging_memory, save_checkpoint

__all__ = [
    "CheckpointError",
    "OwnedSlice",
    "SaveHandle",
    "SliceRequest",
    "checkpoint_summary",
    "latest_checkpoint",
    "list_checkpoints",
    "load_into",
    "load_slices",
    "prune_checkpoints",
    "read_trainer_state",
    "release_staging_memory",
    "resolve_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

__version__ = "0.1.0"

"""Full-state checkpoints (atomic, retained) and, from issue #5, exports."""

from impasto.checkpoint.state import (
    CheckpointData,
    DamagedCheckpoint,
    DiskFullError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_leftovers,
    save_checkpoint,
)

__all__ = [
    "CheckpointData",
    "DamagedCheckpoint",
    "DiskFullError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "remove_leftovers",
    "save_checkpoint",
]

"""Full-state checkpoints (atomic, retained) and, from issue #5, exports."""

from impasto.checkpoint.state import (
    CheckpointData,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
)

__all__ = [
    "CheckpointData",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "remove_partial_checkpoints",
    "save_checkpoint",
]

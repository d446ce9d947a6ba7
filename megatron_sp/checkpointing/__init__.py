"""Checkpoints that load at any TP/CP/DP layout (torch.distributed.checkpoint), given the state to
save and load (checkpointer.py), with their paths and start-up checks (paths.py), the canonical
tensor layout (canonical.py), safe reading (safe_dcp.py) and whole-model conversion (full_state.py)."""

from megatron_sp.checkpointing.checkpointer import (
    CheckpointSaveError,
    TrainState,
    check_inputs,
    load,
    save,
)
from megatron_sp.checkpointing.paths import LATEST, CheckpointError, checkpoint_dir, read_latest

__all__ = [
    "LATEST",
    "CheckpointError",
    "CheckpointSaveError",
    "TrainState",
    "check_inputs",
    "checkpoint_dir",
    "load",
    "read_latest",
    "save",
]

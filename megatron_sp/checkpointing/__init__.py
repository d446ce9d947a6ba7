"""Checkpoints that load at any TP/CP/DP layout (torch.distributed.checkpoint), of the states a run
gives: checkpointer.py (save / load), states.py (the stateful objects), metadata.py (metadata.json
and its integrity record), paths.py (where checkpoints live; start-up checks), canonical.py (the
layout-independent tensor layout), safe_dcp.py (reading without running code), files.py (opening files
of an untrusted directory: nothing outside it read or written), full_state.py (whole models for the
conversion tools, read with the trainer's checks); Megatron-LM's formats in and out: megatron.py
(read_model), megatron_files.py (its files, read safely), megatron_model.py (args -> config, the tensor
mapping), megatron_export.py (writing them), megatron_resume.py (pretrain_gpt_sp.py --load of a
Megatron-LM run), megatron_optim.py (its AdamW state, where the layout allows)."""

from megatron_sp.checkpointing.checkpointer import (
    CheckpointSaveError,
    check_inputs,
    finalize_async_save,
    load,
    save,
    wait_for_saves,
)
from megatron_sp.checkpointing.paths import LATEST, CheckpointError, checkpoint_dir, read_latest, same_path
from megatron_sp.checkpointing.states import Fp8ScalingState, ModelState, OptimizerState, RNGState, TrainState

__all__ = [
    "finalize_async_save",
    "wait_for_saves",
    "LATEST",
    "CheckpointError",
    "CheckpointSaveError",
    "Fp8ScalingState",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "TrainState",
    "check_inputs",
    "checkpoint_dir",
    "load",
    "read_latest",
    "same_path",
    "save",
]

"""Whole (unsharded) model state <-> checkpoint directories, in one process (the conversion tools).

read_full_state(path)                          -> (ReferenceGPT state dict, metadata.json dict)
write_full_checkpoint(state, cfg, save, source)   iteration 0 of `save`, the model only (no optimizer
                                               state), written by checkpointer.save as a training run
                                               writes one: pretrain_gpt_sp.py --load (--finetune)
                                               reads it at any TP
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch

from megatron_sp.checkpointing import checkpointer, safe_dcp
from megatron_sp.checkpointing.canonical import canonical_to_full, full_to_canonical
from megatron_sp.checkpointing.paths import LATEST, CheckpointError, checkpoint_dir, read_latest, read_metadata_json
from megatron_sp.checkpointing.states import TrainState
from megatron_sp.config import GPTConfig, config_from_dict


def model_specs(cfg: GPTConfig) -> dict:
    """Each parameter's ShardSpec for a config (a shape-only serial model on the meta device)."""
    from megatron_sp.models.reference import ReferenceGPT

    with torch.device("meta"):
        model = ReferenceGPT(config_from_dict(dataclasses.asdict(cfg)), initialise=False)
    return {name: p.shard_spec for name, p in model.named_parameters()}


def checkpoint_path(root: str, iteration=None) -> str:
    """iter_N of a --save directory: the given iteration or the latest."""
    it = iteration if iteration is not None else read_latest(root)
    if it is None:
        raise CheckpointError(f"{root} holds no checkpoint ({LATEST} missing).")
    return checkpoint_dir(root, it)


def read_full_state(path: str) -> tuple[dict, dict]:
    """All model tensors of one checkpoint directory in ReferenceGPT layout, and its metadata."""
    dcp = safe_dcp.safe_module()
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"model": {}}
    for key, md in stored.items():
        if key.startswith("model."):
            state["model"][key[len("model.") :]] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    metadata = read_metadata_json(path)
    return canonical_to_full(state["model"], model_specs(config_from_dict(metadata["config"]))), metadata


class _CanonicalEntries:
    """A tensor state (states.py) that already is canonical entries: a whole model at TP=1."""

    label = "model"

    def __init__(self, entries: dict):
        self.entries = entries

    def state_dict(self) -> dict:
        return self.entries

    def load_target(self) -> dict:
        return self.entries

    def load_state_dict(self, loaded: dict) -> None:
        self.entries = loaded


def write_full_checkpoint(state: dict, cfg: GPTConfig, save: str, source: str) -> str:
    """Writes `state` (ReferenceGPT keys) of model `cfg` as iteration 0 of `save`; returns the
    checkpoint directory. The metadata holds every GPTConfig field resolved (family defaults filled
    in), as a training run's checkpoint does, so that a resume compares like with like."""
    from megatron_sp.parallel_state import ParallelState

    cfg = config_from_dict(dataclasses.asdict(cfg))  # serial: TP = CP = 1
    entries = full_to_canonical({k: v.float() for k, v in state.items()}, model_specs(cfg))
    states = {"model": _CanonicalEntries(entries), "train_state": TrainState(), "loss_scale": None}
    extra = {"converted_from": os.path.abspath(source)}
    return checkpointer.save(save, states, cfg, ParallelState(), log=lambda message: None, extra=extra)

"""Whole (unsharded) model state <-> checkpoint directories, in one process (the conversion tools).

read_full_state(path)                   -> (ReferenceGPT state dict, metadata.json dict)
write_full_checkpoint(state, config, save, source)   a checkpoint at iteration 0 (no optimizer
                                        state) that pretrain_gpt_sp.py --load (--finetune) reads at any TP
"""

from __future__ import annotations

import json
import os
import warnings

import torch

from megatron_sp.checkpointing import checkpointer as checkpointing
from megatron_sp.checkpointing.canonical import canonical_to_full, full_to_canonical
from megatron_sp.config import config_from_dict


def model_specs(config: dict) -> dict:
    """Each parameter's ShardSpec for a saved config (a shape-only serial model on the meta device)."""
    from megatron_sp.models.reference import ReferenceGPT

    with torch.device("meta"):
        model = ReferenceGPT(config_from_dict(config), initialise=False)
    return {name: p.shard_spec for name, p in model.named_parameters()}


def checkpoint_path(root: str, iteration=None) -> str:
    """iter_N of a --save directory: the given iteration or the latest."""
    it = iteration if iteration is not None else checkpointing.read_latest(root)
    if it is None:
        raise checkpointing.CheckpointError(f"{root} holds no checkpoint ({checkpointing.LATEST} missing).")
    return checkpointing.checkpoint_dir(root, it)


def read_full_state(path: str) -> tuple[dict, dict]:
    """All model tensors of one checkpoint directory in ReferenceGPT layout, and its metadata."""
    dcp = checkpointing._dcp()
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"model": {}}
    for key, md in meta.items():
        if key.startswith("model."):
            state["model"][key[len("model.") :]] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, "metadata.json")) as f:
        metadata = json.load(f)
    return canonical_to_full(state["model"], model_specs(metadata["config"])), metadata


def write_full_checkpoint(state: dict, config: dict, save: str, source: str) -> str:
    """Writes `state` (ReferenceGPT keys) as iteration 0 of `save`; returns the checkpoint directory.
    The metadata holds every GPTConfig field resolved (family defaults filled in), as a training
    run's checkpoint does, so that a resume compares like with like."""
    from dataclasses import asdict

    config = asdict(config_from_dict(config))
    path = checkpointing.checkpoint_dir(save, 0)
    os.makedirs(path, exist_ok=True)
    entries = full_to_canonical({k: v.float() for k, v in state.items()}, model_specs(config))
    dcp = checkpointing._dcp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": entries}, checkpoint_id=path, no_dist=True)
    meta = {
        "iteration": 0,
        "train_state": {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0},
        "tokens_seen": 0,
        "tensor_model_parallel_size": 1,
        "data_parallel_size": 1,
        "sequence_parallel": False,
        "config": config,
        "loss_scale": None,
        "format": "megatron_sp-dcp-1",
        "converted_from": os.path.abspath(source),
    }
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    checkpointing._write_text_atomic(os.path.join(save, checkpointing.LATEST), "0")
    return path

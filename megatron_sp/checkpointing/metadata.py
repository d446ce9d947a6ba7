"""metadata.json: what one checkpoint holds, and the integrity record of its files.

The one writer, used by training runs and by the conversion tools (both save through
checkpointer.save). paths.read_metadata_json reads it back and checks its schema.

    format                      "megatron_sp-dcp-1"
    iteration, train_state      where training stands (TrainState); tokens_seen
    config                      every GPTConfig field, resolved (family defaults filled in)
    tensor_model_parallel_size, data_parallel_size, pipeline_model_parallel_size, sequence_parallel
                                                                        the layout it was saved at
    <key>                       each JSON state given to save (loss_scale, ...), null when absent
    files                       {file: {size, sha256}} of every other file of the checkpoint
    converted_from, ...         what a tool adds
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch.distributed as dist

from megatron_sp.checkpointing import files, safe_dcp
from megatron_sp.checkpointing.paths import METADATA_JSON

FORMAT = "megatron_sp-dcp-1"


def describe(cfg, ps, train_state: dict, entries: dict) -> dict:
    """The metadata of a checkpoint of model `cfg` saved at layout `ps`, less the integrity record."""
    return {
        "iteration": train_state["iteration"],
        "train_state": train_state,
        "tokens_seen": train_state["consumed_train_samples"] * cfg.seq_length,
        "tensor_model_parallel_size": ps.tp_size,
        "data_parallel_size": ps.dp_size,
        "pipeline_model_parallel_size": ps.pp_size,
        "sequence_parallel": cfg.sequence_parallel,
        "config": dataclasses.asdict(cfg),
        "format": FORMAT,
        **entries,
    }


def write(path: str, meta: dict) -> None:
    """Collective: the integrity record of every file now in `path` (each rank hashes the files it
    wrote), then rank 0 writes metadata.json with it."""
    record = safe_dcp.integrity_record(path)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with files.create_new(os.path.join(path, METADATA_JSON)) as f:
            json.dump({**meta, "files": record}, f, indent=2, sort_keys=True)

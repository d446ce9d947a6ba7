"""Megatron-LM checkpoints in and out (docs/checkpoints.md): a whole model of ours from either of
Megatron-LM's formats at any TP/PP it was saved at.

    read_model(root, iteration=None, vocab_size=None) -> (ReferenceGPT state, GPTConfig, MegatronCheckpoint)

Reading: megatron_files.py (the files, safely); mapping: megatron_model.py (args -> config, tensors).
"""

from __future__ import annotations

from megatron_sp.checkpointing.megatron_files import MegatronCheckpoint, read_megatron
from megatron_sp.checkpointing.megatron_model import check_objects, config_fields, merge_tp, to_ours
from megatron_sp.checkpointing.paths import CheckpointError
from megatron_sp.config import config_from_dict

_QKV_VERSION = 2.0  # checkpoint_version from which QKV is laid out per query group (Megatron-LM's)


def read_model(root: str, iteration=None, vocab_size=None) -> tuple[dict, object, MegatronCheckpoint]:
    """A Megatron-LM checkpoint's model as ReferenceGPT tensors, its config and what was read.
    vocab_size: the tokenizer's (the padded rows beyond it are dropped); default args.vocab_size
    when the args carry one, else every padded row is kept."""
    ckpt = read_megatron(root, iteration)
    _check_version(ckpt)
    args = ckpt.args
    vocab = vocab_size or getattr(args, "vocab_size", None)
    try:
        cfg = config_from_dict(config_fields(args, ckpt.path, vocab))
    except (TypeError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{ckpt.path}'s args describe a model megatron_sp cannot build ({err}).") from None
    check_objects(ckpt.objects, ckpt.path)
    tensors = dict(ckpt.tensors)
    for name, shards in ckpt.shards.items():
        tensors[name] = merge_tp(name, shards, cfg, ckpt.path)
    return to_ours(tensors, cfg, args.padded_vocab_size, ckpt.path), cfg, ckpt


def _check_version(ckpt: MegatronCheckpoint) -> None:
    version = ckpt.common.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < _QKV_VERSION:
        raise CheckpointError(
            f"{ckpt.path} has checkpoint_version {version}: its QKV rows are in the order of Megatron-LM "
            f"before 2.0, which megatron_sp does not read (load and save it once with Megatron-LM)."
        )

#!/usr/bin/env python
"""Convert between a megatron_sp checkpoint (DCP, any TP size) and one full state dict (safetensors).

    # checkpoint -> one file with ReferenceGPT's keys and shapes (unsharded, unpadded)
    python tools/convert_checkpoint.py to-safetensors --load runs/ckpt [--iteration N] --output model.safetensors
    # a full state dict -> a checkpoint that pretrain_gpt_sp.py --load (--finetune) reads at any TP size
    python tools/convert_checkpoint.py from-safetensors --input model.safetensors --save runs/ckpt0 \
        --num-attention-heads 16

Runs in one process, no torch.distributed needed. Optimizer state is not converted. The checkpoint
is read with the trainer's checks (schema, sizes, sha256, shapes against its config); an existing
--output is replaced only with --overwrite; each error is one sentence (exit 2 for bad input, 1 when
writing fails).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_sp import failures
from megatron_sp.checkpointing import CheckpointSaveError, files
from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state, write_full_checkpoint
from megatron_sp.config import config_from_dict


def to_safetensors(load: str, iteration, output: str, overwrite: bool = False) -> None:
    from safetensors.torch import save_file

    path = checkpoint_path(load, iteration)
    state, meta = read_full_state(path)
    if os.path.isdir(output):
        raise ValueError(f"--output {output} is a directory; pass the name of the file to write.")
    if os.path.lexists(output) and not overwrite:
        raise ValueError(f"--output {output} exists; pass --overwrite to replace it.")
    tensors = {k: v.contiguous() for k, v in state.items()}
    metadata = {"megatron_sp_config": json.dumps(meta["config"]), "iteration": str(meta["iteration"])}
    files.write_via_temp(output, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    print(f"wrote {len(tensors)} tensors of iteration {meta['iteration']} to {output}")


def _infer_config(tensors: dict, heads: int) -> dict:
    try:
        word = tensors["embedding.word_embeddings.weight"]
        layers = {int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.split(".")[1].isdigit()}
        return {
            "num_layers": len(layers),
            "hidden_size": word.shape[1],
            "num_attention_heads": heads,
            "vocab_size": word.shape[0],
            "ffn_hidden_size": tensors["layers.0.mlp.fc1.weight"].shape[0],
            "max_position_embeddings": tensors["embedding.position_embeddings.weight"].shape[0],
            "seq_length": tensors["embedding.position_embeddings.weight"].shape[0],
        }
    except (KeyError, IndexError) as err:
        raise ValueError(f"the file lacks {err} (or it is not 2-D), so its model cannot be inferred.") from None


def _read_input(input_path: str) -> tuple[dict, dict]:
    """(tensors, the megatron_sp config the file records or None) of a regular safetensors file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    problem = files.regular_file_problem(input_path, os.path.dirname(os.path.abspath(input_path)))
    if problem:
        raise ValueError(f"{problem}; --input must be a safetensors file.")
    try:
        tensors = load_file(input_path)
        with safe_open(input_path, "pt") as f:
            stored = (f.metadata() or {}).get("megatron_sp_config")
        config = json.loads(stored) if stored else None
    except (json.JSONDecodeError, RecursionError):
        raise ValueError(f"{input_path} records a megatron_sp_config that is not valid JSON.") from None
    except Exception as err:  # noqa: BLE001 - SafetensorError and its kin
        raise ValueError(f"{input_path} is not a readable safetensors file ({failures.one_sentence(err)}).") from None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"{input_path} records a megatron_sp_config that is not a JSON object.")
    return tensors, config


def from_safetensors(input_path: str, save: str, heads) -> None:
    tensors, config = _read_input(input_path)
    config = config or _infer_config(tensors, heads)
    if heads is not None:
        config["num_attention_heads"] = heads
    if not config.get("num_attention_heads"):
        raise ValueError("the file does not record the number of heads; pass --num-attention-heads.")
    try:
        cfg = config_from_dict(config)
    except (TypeError, OverflowError) as err:
        raise ValueError(f"the file's config cannot build a model ({err}).") from None
    path = write_full_checkpoint(tensors, cfg, save, input_path)
    print(f"wrote checkpoint {path} ({len(tensors)} tensors, no optimizer state)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-safetensors")
    a.add_argument("--load", required=True)
    a.add_argument("--iteration", type=int, default=None, help="default: the latest")
    a.add_argument("--output", required=True)
    a.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    b = sub.add_parser("from-safetensors")
    b.add_argument("--input", required=True)
    b.add_argument("--save", required=True)
    b.add_argument("--num-attention-heads", type=int, default=None)
    args = p.parse_args(argv)
    try:
        if args.command == "to-safetensors":
            to_safetensors(args.load, args.iteration, args.output, args.overwrite)
        else:
            from_safetensors(args.input, args.save, args.num_attention_heads)
    except ValueError as err:  # CheckpointError, GPTConfig's ValueError: the input
        return _error(err, 2)
    except (OSError, CheckpointSaveError) as err:  # a failed write
        return _error(err, 1)
    return 0


def _error(err: BaseException, code: int) -> int:
    print(f"convert_checkpoint.py: error: {failures.one_sentence(err)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

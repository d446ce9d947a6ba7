#!/usr/bin/env python
"""Convert between a megatron_sp checkpoint (DCP, any TP size) and one full state dict (safetensors).

    # checkpoint -> one file with ReferenceGPT's keys and shapes (unsharded, unpadded)
    python tools/convert_checkpoint.py to-safetensors --load runs/ckpt [--iteration N] --output model.safetensors
    # a full state dict -> a checkpoint that pretrain_gpt_sp.py --load (--finetune) reads at any TP size
    python tools/convert_checkpoint.py from-safetensors --input model.safetensors --save runs/ckpt0 \
        --num-attention-heads 16

Runs in one process, no torch.distributed needed. Optimizer state is not converted.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_sp.checkpointing import CheckpointSaveError
from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state, write_full_checkpoint
from megatron_sp.config import config_from_dict


def to_safetensors(load: str, iteration, output: str) -> None:
    from safetensors.torch import save_file

    path = checkpoint_path(load, iteration)
    state, meta = read_full_state(path)
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(
        tensors,
        output,
        metadata={"megatron_sp_config": json.dumps(meta["config"]), "iteration": str(meta["iteration"])},
    )
    print(f"wrote {len(tensors)} tensors of iteration {meta['iteration']} to {output}")


def _infer_config(tensors: dict, heads: int) -> dict:
    word = tensors["embedding.word_embeddings.weight"]
    layers = {int(k.split(".")[1]) for k in tensors if k.startswith("layers.")}
    return {
        "num_layers": len(layers),
        "hidden_size": word.shape[1],
        "num_attention_heads": heads,
        "vocab_size": word.shape[0],
        "ffn_hidden_size": tensors["layers.0.mlp.fc1.weight"].shape[0],
        "max_position_embeddings": tensors["embedding.position_embeddings.weight"].shape[0],
        "seq_length": tensors["embedding.position_embeddings.weight"].shape[0],
    }


def from_safetensors(input_path: str, save: str, heads) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(input_path)
    with safe_open(input_path, "pt") as f:
        stored = (f.metadata() or {}).get("megatron_sp_config")
    config = json.loads(stored) if stored else _infer_config(tensors, heads)
    if heads is not None:
        config["num_attention_heads"] = heads
    if not config.get("num_attention_heads"):
        raise SystemExit("error: the file does not record the number of heads; pass --num-attention-heads.")
    path = write_full_checkpoint(tensors, config_from_dict(config), save, input_path)
    print(f"wrote checkpoint {path} ({len(tensors)} tensors, no optimizer state)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-safetensors")
    a.add_argument("--load", required=True)
    a.add_argument("--iteration", type=int, default=None, help="default: the latest")
    a.add_argument("--output", required=True)
    b = sub.add_parser("from-safetensors")
    b.add_argument("--input", required=True)
    b.add_argument("--save", required=True)
    b.add_argument("--num-attention-heads", type=int, default=None)
    args = p.parse_args(argv)
    try:
        if args.command == "to-safetensors":
            to_safetensors(args.load, args.iteration, args.output)
        else:
            from_safetensors(args.input, args.save, args.num_attention_heads)
    except (ValueError, CheckpointSaveError) as err:  # CheckpointError, GPTConfig's ValueError, a failed write
        print(f"convert_checkpoint.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

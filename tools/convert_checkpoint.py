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
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_sp.training import checkpointing  # noqa: E402
from megatron_sp.training.canonical import canonical_to_full, full_to_canonical  # noqa: E402

def model_specs(config: dict) -> dict:
    """Each parameter's ShardSpec for a saved config (a shape-only serial model on the meta device)."""
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.reference import ReferenceGPT
    fields = {k: v for k, v in config.items() if k in GPTConfig.__dataclass_fields__}
    fields["tensor_model_parallel_size"], fields["sequence_parallel"] = 1, False
    with torch.device("meta"):
        model = ReferenceGPT(GPTConfig(**fields), initialise=False)
    return {name: p.shard_spec for name, p in model.named_parameters()}


def read_full_state(path: str) -> dict:
    """All model tensors of one checkpoint directory, in ReferenceGPT layout."""
    dcp = checkpointing._dcp()
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"model": {}}
    for key, md in meta.items():
        if key.startswith("model."):
            state["model"][key[len("model."):]] = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    config = json.load(open(os.path.join(path, "metadata.json")))["config"]
    return canonical_to_full(state["model"], model_specs(config))


def to_safetensors(load: str, iteration, output: str) -> None:
    from safetensors.torch import save_file
    it = iteration if iteration is not None else checkpointing.read_latest(load)
    if it is None:
        raise SystemExit(f"error: {load} holds no checkpoint ({checkpointing.LATEST} missing).")
    path = checkpointing.checkpoint_dir(load, it)
    tensors = {k: v.contiguous() for k, v in read_full_state(path).items()}
    meta = json.load(open(os.path.join(path, "metadata.json")))
    save_file(tensors, output, metadata={"megatron_sp_config": json.dumps(meta["config"]),
                                         "iteration": str(meta["iteration"])})
    print(f"wrote {len(tensors)} tensors of iteration {it} to {output}")


def _infer_config(tensors: dict, heads: int) -> dict:
    word = tensors["embedding.word_embeddings.weight"]
    layers = {int(k.split(".")[1]) for k in tensors if k.startswith("layers.")}
    return {"num_layers": len(layers), "hidden_size": word.shape[1], "num_attention_heads": heads,
            "vocab_size": word.shape[0], "ffn_hidden_size": tensors["layers.0.mlp.fc1.weight"].shape[0],
            "max_position_embeddings": tensors["embedding.position_embeddings.weight"].shape[0],
            "seq_length": tensors["embedding.position_embeddings.weight"].shape[0]}


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
    path = checkpointing.checkpoint_dir(save, 0)
    os.makedirs(path, exist_ok=True)
    state = {"model": full_to_canonical({k: v.float() for k, v in tensors.items()}, model_specs(config))}
    dcp = checkpointing._dcp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    meta = {"iteration": 0, "train_state": {"iteration": 0, "consumed_train_samples": 0,
                                           "consumed_valid_samples": 0},
            "tokens_seen": 0, "tensor_model_parallel_size": 1, "data_parallel_size": 1,
            "sequence_parallel": False, "config": config, "loss_scale": None, "format": "megatron_sp-dcp-1",
            "converted_from": os.path.abspath(input_path)}
    json.dump(meta, open(os.path.join(path, "metadata.json"), "w"), indent=2, sort_keys=True)
    checkpointing._write_text_atomic(os.path.join(save, checkpointing.LATEST), "0")
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
    if args.command == "to-safetensors":
        to_safetensors(args.load, args.iteration, args.output)
    else:
        from_safetensors(args.input, args.save, args.num_attention_heads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

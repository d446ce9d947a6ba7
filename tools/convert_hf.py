#!/usr/bin/env python
"""Convert between a megatron_sp checkpoint and a Hugging Face model directory (GPT2LMHeadModel,
LlamaForCausalLM: model.safetensors + config.json, loadable offline by transformers).

    # checkpoint (any TP size) -> HF directory
    python tools/convert_hf.py export --load runs/ckpt [--iteration N] --output hf/ [--dtype bf16] [--eos-token-id 256]
    # HF directory -> checkpoint at iteration 0; prints the pretrain_gpt_sp.py model flags to use
    python tools/convert_hf.py import --input hf/ --save runs/ckpt0
    python pretrain_gpt_sp.py <printed flags> --load runs/ckpt0 --finetune ...

Runs in one process, no torch.distributed needed; transformers is not needed either. Optimizer state
is not converted. Sharded HF checkpoints (model-0000x-of-0000y.safetensors + index) are read too.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import sys

from megatron_sp.checkpointing import CheckpointSaveError
from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state, write_full_checkpoint
from megatron_sp.config import config_from_dict
from megatron_sp.models.hf import from_hf, to_hf
from megatron_sp.training.config_flags import model_flags

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export(load: str, iteration, output: str, dtype: str, eos_token_id=None) -> None:
    import torch
    from safetensors.torch import save_file

    state, meta = read_full_state(checkpoint_path(load, iteration))
    cfg = config_from_dict(meta["config"])
    tensors, config = to_hf(state, cfg)
    tensors = {k: v.to(getattr(torch, DTYPES[dtype])) for k, v in tensors.items()}
    config.update(
        torch_dtype=DTYPES[dtype], dtype=DTYPES[dtype], bos_token_id=eos_token_id, eos_token_id=eos_token_id
    )  # the tokenizer's EOD; not known to the checkpoint
    os.makedirs(output, exist_ok=True)
    save_file(tensors, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    print(f"wrote {config['architectures'][0]} ({len(tensors)} tensors, iteration {meta['iteration']}) to {output}")


def read_hf(directory: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    config_path = os.path.join(directory, "config.json")
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not os.path.isfile(config_path) or not files:
        raise ValueError(
            f"{directory} is not a Hugging Face model directory (config.json and *.safetensors "
            f"expected; .bin weights are not read: they are pickles)."
        )
    with open(config_path) as f:
        config = json.load(f)
    tensors = {}
    for path in files:
        tensors.update(load_file(path))
    return tensors, config


def import_(input_dir: str, save: str) -> None:
    tensors, hf_config = read_hf(input_dir)
    state, fields = from_hf(tensors, hf_config)
    cfg = config_from_dict(dict(fields, seq_length=fields["max_position_embeddings"]))
    path = write_full_checkpoint(state, cfg, save, input_dir)
    print(
        f"wrote checkpoint {path} ({len(state)} tensors, no optimizer state); train it with\n"
        f"  {shlex.join(model_flags(cfg))} --load {save} --finetune\n"
        f"and a tokenizer of {cfg.vocab_size} ids (e.g. --tokenizer-type HuggingFaceTokenizer "
        f"--tokenizer-model {os.path.join(input_dir, 'tokenizer.json')})."
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("export")
    a.add_argument("--load", required=True)
    a.add_argument("--iteration", type=int, default=None, help="default: the latest")
    a.add_argument("--output", required=True)
    a.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    a.add_argument(
        "--eos-token-id",
        type=int,
        default=None,
        help="the tokenizer's end-of-document id, written as bos/eos_token_id (default: none)",
    )
    b = sub.add_parser("import")
    b.add_argument("--input", required=True)
    b.add_argument("--save", required=True)
    args = p.parse_args(argv)
    try:
        if args.command == "export":
            export(args.load, args.iteration, args.output, args.dtype, args.eos_token_id)
        else:
            import_(args.input, args.save)
    except (ValueError, CheckpointSaveError) as err:  # ConversionError, CheckpointError, GPTConfig's, a failed write
        print(f"convert_hf.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

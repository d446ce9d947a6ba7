#!/usr/bin/env python
"""Convert between a megatron_sp checkpoint and a Hugging Face model directory (model.safetensors +
config.json, loadable offline by transformers) of any family with an adapter (megatron_sp/families.py,
megatron_sp/models/hf/: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM, and with experts MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM: their
per-expert files and transformers 5's fused expert tensors are read, the per-expert layout written; and
GptOssForCausalLM, whose fused experts are its file layout, read and written).

    # checkpoint (any TP size) -> HF directory
    python tools/convert_hf.py export --load runs/ckpt [--iteration N] --output hf/ [--dtype bf16] [--eos-token-id 256]
    # HF directory -> checkpoint at iteration 0; prints the pretrain_gpt_sp.py model flags to use
    python tools/convert_hf.py import --input hf/ --save runs/ckpt0
    python pretrain_gpt_sp.py <printed flags> --load runs/ckpt0 --finetune ...

Runs in one process, no torch.distributed needed; transformers is not needed either. Optimizer state
is not converted. Sharded HF checkpoints (model-0000x-of-0000y.safetensors + index) are read too.

A model directory is data from elsewhere: every tensor's name, shape and dtype is checked against
its config.json (models/hf/), only regular files inside it are read, and each error is one
sentence (exit 2 for bad input, 1 when writing fails). Export refuses a directory that already
holds a model unless --overwrite, which first removes that model's files (never two models in one
directory); import refuses a --save that already holds a run (its marker would be reset).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import sys

from megatron_sp import failures
from megatron_sp.checkpointing import CheckpointSaveError, files
from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state, write_full_checkpoint
from megatron_sp.config import config_from_dict
from megatron_sp.models.hf import from_hf, to_hf
from megatron_sp.training.config_flags import model_flags

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CONFIG_LIMIT = 16 << 20  # bytes of config.json read at most (a few KB in practice)
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
)


def export(load: str, iteration, output: str, dtype: str, eos_token_id=None, overwrite: bool = False) -> None:
    import torch

    state, meta = read_full_state(checkpoint_path(load, iteration))
    cfg = config_from_dict(meta["config"])
    tensors, config = to_hf(state, cfg)
    tensors = {k: v.to(getattr(torch, DTYPES[dtype])) for k, v in tensors.items()}
    config.update(
        torch_dtype=DTYPES[dtype], dtype=DTYPES[dtype], bos_token_id=eos_token_id, eos_token_id=eos_token_id
    )  # the tokenizer's EOD; not known to the checkpoint
    _prepare_output(output, overwrite)
    files.write_via_temp(os.path.join(output, "model.safetensors"), lambda path: _save_safetensors(tensors, path))
    files.write_atomic(os.path.join(output, "config.json"), json.dumps(config, indent=2, sort_keys=True).encode())
    print(f"wrote {config['architectures'][0]} ({len(tensors)} tensors, iteration {meta['iteration']}) to {output}")


def _prepare_output(output: str, overwrite: bool) -> None:
    """--output is a directory (made if missing) holding no other model: one there is refused, or
    removed first with --overwrite (other files, e.g. a tokenizer, stay)."""
    if os.path.lexists(output) and not os.path.isdir(output):
        raise ValueError(f"--output {output} is a file; pass a directory for the model.")
    os.makedirs(output, exist_ok=True)
    found = (glob.glob(os.path.join(glob.escape(output), pattern)) for pattern in MODEL_FILES)
    present = sorted({os.path.basename(p) for paths in found for p in paths})
    if present and not overwrite:
        raise ValueError(
            f"--output {output} already holds a model ({', '.join(present[:3])}); pass --overwrite to "
            f"replace it or choose an empty directory."
        )
    for name in present:
        path = os.path.join(output, name)
        if os.path.isdir(path) and not os.path.islink(path):
            raise ValueError(f"--output {output} holds a directory {name}; remove it or choose another --output.")
        os.unlink(path)


def _save_safetensors(tensors: dict, path: str) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})


def read_hf(directory: str) -> tuple[dict, dict]:
    """(tensors, config.json) of a Hugging Face model directory: regular files inside it only."""
    config_path = os.path.join(directory, "config.json")
    paths = sorted(glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))
    if not os.path.isdir(directory) or not os.path.lexists(config_path) or not paths:
        raise ValueError(
            f"{directory} is not a Hugging Face model directory (config.json and *.safetensors "
            f"expected; .bin weights are not read: they are pickles)."
        )
    config = _read_config(config_path, directory)
    tensors, where = {}, {}
    for path in paths:
        for name, t in _read_safetensors(path, directory).items():
            if name in tensors:
                raise ValueError(
                    f"{directory} holds {name} in both {where[name]} and {os.path.basename(path)}: two models "
                    f"in one directory? Keep one."
                )
            tensors[name], where[name] = t, os.path.basename(path)
    return tensors, config


def _read_config(path: str, directory: str) -> dict:
    try:
        config = json.loads(files.read_bytes(path, directory, CONFIG_LIMIT).decode("utf-8"))
    except files.UnreadableFile as err:
        raise ValueError(f"{err}; config.json must be a JSON file.") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{path} is not a readable config.json ({type(err).__name__}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object: not a config.json.")
    return config


def _read_safetensors(path: str, directory: str) -> dict:
    from safetensors.torch import load_file

    problem = files.regular_file_problem(path, directory)
    if problem:
        raise ValueError(f"{problem}; the weights must be regular safetensors files of {directory}.")
    try:
        return load_file(path)
    except Exception as err:  # noqa: BLE001 - SafetensorError, or torch's on a forged dtype
        reason = failures.one_sentence(err)
        raise ValueError(f"{path} is not a readable safetensors file ({reason}); it is truncated or damaged.") from None


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
        "--overwrite", action="store_true", help="replace the model already in --output (its files are removed first)"
    )
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
            export(args.load, args.iteration, args.output, args.dtype, args.eos_token_id, args.overwrite)
        else:
            import_(args.input, args.save)
    except ValueError as err:  # ConversionError, CheckpointError, GPTConfig's: the input
        return _error(err, 2)
    except (OSError, CheckpointSaveError) as err:  # a failed write
        return _error(err, 1)
    return 0


def _error(err: BaseException, code: int) -> int:
    print(f"convert_hf.py: error: {failures.one_sentence(err)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

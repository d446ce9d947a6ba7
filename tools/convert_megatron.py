#!/usr/bin/env python
"""Convert between a Megatron-LM checkpoint (what its save_checkpoint writes: --ckpt-format torch or
torch_dist, any TP/PP/EP, virtual pipeline stages) and a megatron_sp checkpoint.

    # Megatron-LM -> ours, at iteration 0; prints the pretrain_gpt_sp.py model flags to use
    python tools/convert_megatron.py [import] --load megatron/ckpts --save runs/ckpt0 [--iteration N] [--vocab-size V]
    python pretrain_gpt_sp.py <printed flags> --load runs/ckpt0 --finetune ...
    # ours -> Megatron-LM, model only (Megatron-LM loads it with --no-load-optim --no-load-rng)
    python tools/convert_megatron.py export --load runs/ckpt --save megatron/ckpts --format torch_dist \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 [--expert-model-parallel-size 2] [--iteration N]

Runs in one process; neither torch.distributed nor megatron-core is needed (the enums Megatron-LM
pickles into its args are read as inert stand-ins). Every tensor is accounted for (a key the mapping
does not use, a missing key, a shape that does not match the args, or an option megatron_sp does not support
is an error in one sentence: exit 2 for bad input, 1 when writing fails). The embedding and output
rows padded beyond --vocab-size (default: the args' vocab_size, else every padded row is kept) are
dropped on import and written back as zeros on export. Optimizer state is not converted; to continue
a Megatron-LM run (weights, iteration, data position, with a fresh AdamW), pass its directory to
pretrain_gpt_sp.py --load with --no-load-optim.
See docs/checkpoints.md for the mapping.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from megatron_sp import failures
from megatron_sp.checkpointing import CheckpointSaveError
from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state, write_full_checkpoint
from megatron_sp.config import config_from_dict
from megatron_sp.training.config_flags import model_flags


def import_(load: str, save: str, iteration=None, vocab_size=None) -> None:
    from megatron_sp.checkpointing.megatron import read_model

    state, cfg, ckpt = read_model(load, iteration, vocab_size)
    path = write_full_checkpoint(state, cfg, save, ckpt.path)
    print(
        f"wrote checkpoint {path} ({len(state)} tensors from Megatron-LM's {ckpt.format} format, iteration "
        f"{ckpt.common.get('iteration')}; no optimizer state); train it with\n"
        f"  {shlex.join(model_flags(cfg))} --load {save} --finetune\n"
        f"and a tokenizer of {cfg.vocab_size} ids."
    )


def export(load: str, save: str, fmt: str, tp: int, pp: int, iteration=None, ep: int = 1) -> None:
    from megatron_sp.checkpointing.megatron_export import write_megatron

    state, meta = read_full_state(checkpoint_path(load, iteration))
    cfg = config_from_dict(meta["config"])
    consumed = int(meta.get("train_state", {}).get("consumed_train_samples", 0) or 0)
    path = write_megatron(state, cfg, save, fmt, tp, pp, int(meta["iteration"]), consumed, ep)
    print(f"wrote Megatron-LM {fmt} checkpoint {path} (TP {tp}, PP {pp}, EP {ep}, {len(state)} tensors, model only)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("import", help="Megatron-LM -> megatron_sp")
    a.add_argument("--load", required=True, help="the Megatron-LM --save directory")
    a.add_argument("--save", required=True, help="a new megatron_sp checkpoint directory")
    a.add_argument("--iteration", type=int, default=None, help="default: the tracked one")
    a.add_argument("--vocab-size", type=int, default=None, help="the tokenizer's; default: the args'")
    b = sub.add_parser("export", help="megatron_sp -> Megatron-LM")
    b.add_argument("--load", required=True)
    b.add_argument("--save", required=True, help="a new Megatron-LM checkpoint directory")
    b.add_argument("--iteration", type=int, default=None, help="default: the latest")
    b.add_argument("--format", choices=("torch", "torch_dist"), required=True)
    b.add_argument("--tensor-model-parallel-size", type=int, default=1)
    b.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    b.add_argument("--expert-model-parallel-size", type=int, default=1, help="MoE models: experts split over EP ranks")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("import", "export", "-h", "--help"):
        argv.insert(0, "import")  # the bare form: convert_megatron.py --load <Megatron-LM> --save <ours>
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            tp, pp, ep = (
                args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size,
                args.expert_model_parallel_size,
            )
            if min(tp, pp, ep) < 1:
                raise ValueError("--tensor-, --pipeline- and --expert-model-parallel-size must be >= 1.")
            export(args.load, args.save, args.format, tp, pp, args.iteration, ep)
        else:
            import_(args.load, args.save, args.iteration, args.vocab_size)
    except ValueError as err:  # CheckpointError, GPTConfig's: the input
        return _error(err, 2)
    except (OSError, CheckpointSaveError) as err:  # a failed write
        return _error(err, 1)
    return 0


def _error(err: BaseException, code: int) -> int:
    print(f"convert_megatron.py: error: {failures.one_sentence(err)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Command line of pretrain_gpt_sp.py: Megatron-LM's flag names and meanings.

`parse_args(argv)` returns an argparse.Namespace, validated; any error a user can cause raises
`ArgumentError` with one sentence (the entry point prints it and exits 2, no traceback).
"""

from __future__ import annotations

import argparse
import importlib.util
import math

from megatron_sp.training.config_flags import add_config_flags


class ArgumentError(ValueError):
    """A bad command line: one clear sentence."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence instead of usage + traceback
        raise ArgumentError(f"{message} (see --help)")


def _model_args(p):
    add_config_flags(p.add_argument_group("model"), "model")


def _parallel_args(p):
    g = p.add_argument_group("parallelism")
    add_config_flags(g, "parallelism")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="only 1 (no pipeline parallelism)")
    g.add_argument(
        "--distributed-backend", choices=["nccl", "gloo"], default=None, help="default: nccl on cuda, gloo on cpu"
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard the AdamW moments over the data- (and context-) parallel replicas (ZeRO-1)",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the data-parallel gradient all-reduces during the last backward",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="collective timeout: a dead or hung rank fails the job after this long",
    )
    g.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")


def _training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro batch × DP")
    g.add_argument("--train-iters", type=int, default=None, help="default 300 (or from --train-samples)")
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="train on this many samples (iterations = samples / global batch); LR flags in samples",
    )
    g.add_argument("--exit-interval", type=int, default=None, help="exit after an iteration divisible by this")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default train iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="with --train-samples; default train samples")
    g.add_argument("--lr-warmup-iters", type=int, default=None, help="default 20")
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="with --train-samples")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warmup as a fraction of the decay span")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true")
    prec.add_argument("--fp16", action="store_true")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**16, help="fp16 dynamic loss scale start")
    g.add_argument(
        "--torch-compile",
        action="store_true",
        help="compile each transformer layer with torch.compile (ours: Megatron-LM has no such flag)",
    )


def _data_args(p):
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="PREFIX or WEIGHT PREFIX WEIGHT PREFIX ...; default: the embedded corpus",
    )
    g.add_argument(
        "--mock-data",
        action="store_true",
        help="random tokens instead of a dataset (speed runs; needs no data and no megatron-core)",
    )
    g.add_argument("--split", default="969,30,1")
    g.add_argument(
        "--tokenizer-type",
        default="ByteLevelTokenizer",
        choices=["ByteLevelTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"],
    )
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--data-cache-path", default=None, help="default: <repo>/data_cache")


def _logging_args(p):
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-jsonl", default=None, help="one JSON object per logged iteration")
    g.add_argument("--loss-curve", default=None, help="PNG written at the end (default: next to the JSONL/TB logs)")
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="per-device peak for MFU; default: from the GPU model, or measured on CPU",
    )
    g.add_argument("--no-progress-bar", action="store_true")


def _checkpoint_args(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--finetune", action="store_true", help="load weights only and start at iteration 0")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt_sp.py", description="GPT pretraining with tensor + sequence parallelism.")
    for add in (_model_args, _parallel_args, _training_args, _data_args, _logging_args, _checkpoint_args):
        add(p)
    return p


def parse_args(argv=None, world_size: int = 1) -> argparse.Namespace:
    """world_size: the number of processes the launcher started (dist_env.detect_env)."""
    args = build_parser().parse_args(argv)
    args.world_size = world_size
    validate(args)
    return args


def validate(args) -> None:
    """Checks that need no data and no devices; fills derived defaults (dp size, batch sizes...)."""
    if args.pipeline_model_parallel_size != 1:
        raise ArgumentError(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} is not supported: "
            f"megatron_sp has no pipeline parallelism; use tensor, sequence, context and data "
            f"parallelism (--pipeline-model-parallel-size 1)."
        )
    _train_length(args)
    for name in (
        "micro_batch_size",
        "train_iters",
        "log_interval",
        "eval_interval",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "tensor_model_parallel_size",
    ):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}.")
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if cp <= 0:
        raise ArgumentError(f"--context-parallel-size must be positive, got {cp}.")
    if args.world_size % (tp * cp) != 0:
        raise ArgumentError(
            f"world size {args.world_size} is not divisible by --tensor-model-parallel-size {tp}"
            + (f" × --context-parallel-size {cp}" if cp > 1 else "")
            + "."
        )
    args.data_parallel_size = args.world_size // (tp * cp)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step != 0:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by micro batch size × "
            f"data-parallel size ({args.micro_batch_size} × {args.data_parallel_size})."
        )
    args.num_micro_batches = args.global_batch_size // per_step
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save DIR.")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ArgumentError("--tokenizer-type NullTokenizer needs --vocab-size.")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise ArgumentError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH/tokenizer.json.")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise ArgumentError(
            "--tokenizer-type GPT2BPETokenizer needs --vocab-file vocab.json and --merge-file merges.txt."
        )
    for flag, value, module, package in (
        ("--loss-curve", args.loss_curve, "matplotlib", "matplotlib"),
        ("--tensorboard-dir", args.tensorboard_dir, "tensorboard", "tensorboard"),
    ):
        if value and importlib.util.find_spec(module) is None:
            raise ArgumentError(f"{flag} needs the {package} package, which is not installed (pip install {package}).")
    _schedule_units(args)
    if args.min_lr > args.lr:
        raise ArgumentError("--min-lr must not exceed --lr.")
    _check_numbers(args)
    _check_intervals(args)
    _check_data_flags(args)


def _train_length(args) -> None:
    """--train-iters or --train-samples (Megatron: one of them; samples make the LR flags sample-based)."""
    if args.train_samples is not None and args.train_iters is not None:
        raise ArgumentError("give --train-iters or --train-samples, not both.")
    if args.train_samples is None:
        for flag in ("lr_decay_samples", "lr_warmup_samples"):
            if getattr(args, flag) is not None:
                raise ArgumentError(
                    f"--{flag.replace('_', '-')} needs --train-samples (with --train-iters use "
                    f"--{flag.replace('_samples', '_iters').replace('_', '-')})."
                )
        if args.train_iters is None:
            args.train_iters = 300
        return
    for flag in ("lr_decay_iters", "lr_warmup_iters"):
        if getattr(args, flag) is not None:
            raise ArgumentError(
                f"--{flag.replace('_', '-')} does not go with --train-samples; use "
                f"--{flag.replace('_iters', '_samples').replace('_', '-')}."
            )
    if args.train_samples <= 0:
        raise ArgumentError(f"--train-samples must be positive, got {args.train_samples}.")
    args.train_iters = None  # set once the global batch size is known (_schedule_units)


def _schedule_units(args) -> None:
    """LR schedule span in iterations or samples: args.lr_unit, args.lr_warmup, args.lr_decay."""
    samples = args.train_samples is not None
    if samples:
        args.train_iters = max(1, args.train_samples // args.global_batch_size)
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup = args.lr_warmup_samples
    else:
        decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
        warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        if warmup is not None:
            raise ArgumentError("give --lr-warmup-fraction or --lr-warmup-iters/--lr-warmup-samples, not both.")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ArgumentError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}.")
        warmup = int(args.lr_warmup_fraction * decay)
    if warmup is None:
        warmup = 0 if samples else 20
    if warmup < 0 or decay <= 0:
        raise ArgumentError("the LR warmup must be >= 0 and the decay span positive.")
    args.lr_unit, args.lr_warmup, args.lr_decay = ("samples" if samples else "iterations"), warmup, decay
    args.lr_decay_iters = decay if not samples else args.lr_decay_iters
    args.lr_warmup_iters = warmup if not samples else args.lr_warmup_iters


# (flag, attribute, predicate on a finite value, what it must be); None values (unset) are skipped.
_NUMBER_RULES = (
    ("--lr", "lr", lambda v: v >= 0, "a finite number >= 0"),
    ("--min-lr", "min_lr", lambda v: v >= 0, "a finite number >= 0"),
    ("--weight-decay", "weight_decay", lambda v: v >= 0, "a finite number >= 0"),
    ("--adam-beta1", "adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("--adam-beta2", "adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("--adam-eps", "adam_eps", lambda v: v > 0, "a finite number > 0"),
    ("--clip-grad", "clip_grad", lambda v: v >= 0, "a finite number >= 0 (0 disables clipping)"),
    ("--initial-loss-scale", "initial_loss_scale", lambda v: v > 0, "a finite number > 0, e.g. 65536"),
    ("--init-method-std", "init_method_std", lambda v: v > 0, "a finite number > 0"),
    ("--distributed-timeout-minutes", "distributed_timeout_minutes", lambda v: v > 0, "a finite number > 0"),
    ("--peak-tflops", "peak_tflops", lambda v: v > 0, "a finite number > 0"),
)


def _check_numbers(args) -> None:
    """Values argparse accepts but training cannot use: nan/inf, betas >= 1, negative decay..."""
    for flag, name, ok, must_be in _NUMBER_RULES:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise ArgumentError(f"{flag} must be {must_be}, got {value}.")


def _check_intervals(args) -> None:
    if args.eval_iters <= 0:
        raise ArgumentError(
            f"--eval-iters must be positive, got {args.eval_iters} (to evaluate less often, raise --eval-interval)."
        )
    for flag, value in (("--save-interval", args.save_interval), ("--exit-interval", args.exit_interval)):
        if value is not None and value <= 0:
            raise ArgumentError(f"{flag} must be positive, got {value}.")


def _check_data_flags(args) -> None:
    """--data-path and --split syntax (plain Python: --mock-data runs import no numpy)."""
    from megatron_sp.data.blend import check_train_share, parse_data_path
    from megatron_sp.data.errors import DataError

    try:
        if args.data_path:
            parse_data_path(args.data_path)
        if not args.mock_data:
            check_train_share(args.split)
    except DataError as err:
        raise ArgumentError(str(err)) from None

"""Command line of pretrain_gpt_sp.py: Megatron-LM's flag names and meanings.

`parse_args(argv)` returns an argparse.Namespace, validated; any error a user can cause raises
`ArgumentError` with one sentence (the entry point prints it and exits 2, no traceback). Defaults are
Megatron-LM's (main, 2026) wherever a script may rely on them by leaving a flag out; no abbreviated
flags. Flags accepted without effect and flags refused for a missing feature: training/megatron_flags.py.
"""

from __future__ import annotations

import argparse

from megatron_sp.training import megatron_flags
from megatron_sp.training.argument_checks import ArgumentError, validate
from megatron_sp.training.config_flags import add_config_flags
from megatron_sp.training.schedules import LR_STYLES, WD_STYLES, WSD_STYLES

__all__ = ["ArgumentError", "build_parser", "parse_args"]

TOKENIZERS = ("ByteLevelTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")
STRICTNESS = (
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence instead of usage + traceback
        raise ArgumentError(f"{message} (see --help)")


class _JoinWords(argparse.Action):
    """A value given as several words (a script's unquoted "0:16 2.4B:320 ...") joined by spaces."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, " ".join(values))


def _model_args(p):
    g = p.add_argument_group("model")
    add_config_flags(g, "model")
    g.add_argument(  # read after parsing, whatever the order (Megatron-LM's legacy RoPE rule)
        "--use-rotary-position-embeddings", action="store_true", help="same as --position-embedding-type rope"
    )
    g.add_argument(
        "--no-position-embedding",
        action="store_true",
        help="no learned positions: --position-embedding-type none, unless it is rope (kept)",
    )


def _pipeline_args(g):
    """Pipeline parallelism's layout and schedule (megatron_sp/pipeline_parallel/layout.py)."""
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None, help="model chunks per rank")
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers per model chunk (sets the above)",
    )
    g.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="model chunks per rank (Megatron-LM's newer name of --virtual-pipeline-model-parallel-size)",
    )
    g.add_argument(
        "--pipeline-model-parallel-layout",
        default=None,
        metavar="LAYOUT",
        help="the stages spelled out, e.g. 'Et|(tt|)*2,tL': E embedding, t transformer layer, L loss, "
        "stages in stage order (p·v of them, stage s on rank s mod p) between |, (…)*N and x*N repeat, "
        "commas ignored (docs/parallelism.md)",
    )
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None, help="layers of the first stage")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None, help="layers of the last stage")
    for what in ("embedding", "loss"):
        g.add_argument(
            f"--account-for-{what}-in-pipeline-split",
            action="store_true",
            help=f"the {what} counts as one layer when the layers are divided over the stages",
        )
    g.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved schedules: contiguous micro-batches per model chunk; only the pipeline size (the default)",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=["1f1b", "gpipe", "interleaved-zb", "zbv"],
        default="1f1b",
        help="torch.distributed.pipelining schedule (1f1b: interleaved with virtual stages; ours, not Megatron's)",
    )


def _moe_args(p):
    g = p.add_argument_group("mixture of experts")
    add_config_flags(g, "mixture of experts")
    g.add_argument(
        "--moe-per-layer-logging",
        action="store_true",
        help="log (and write to TensorBoard) each MoE layer's auxiliary losses besides their mean",
    )


def _parallel_args(p):
    g = p.add_argument_group("parallelism")
    add_config_flags(g, "parallelism")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages (docs/parallelism.md)")
    _pipeline_args(g)
    g.add_argument(
        "--distributed-backend", choices=["nccl", "gloo"], default=None, help="default: nccl on cuda, gloo on cpu"
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard the AdamW moments over the data- (and context-) parallel replicas (ZeRO-1)",
    )
    g.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="ZeRO-3 with torch FSDP2 (fully_shard per layer): shard weights, gradients and AdamW state over "
        "the data- (and context-) parallel replicas, composed with TP+SP, CP and PP (distributed/fsdp.py)",
    )
    g.add_argument(
        "--torch-fsdp2-no-reshard-after-forward",
        dest="torch_fsdp2_reshard_after_forward",
        action="store_false",
        help="with --use-torch-fsdp2: each layer keeps its gathered weights from forward to backward (ZeRO-2)",
    )
    _megatron_fsdp_args(g)
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


def _megatron_fsdp_args(g):
    """Megatron-FSDP's switch and sharding strategy, run on FSDP2 or the distributed optimizer."""
    g.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="Megatron-FSDP's sharding by --data-parallel-sharding-strategy, run on torch FSDP2 (optim_grads_params, "
        "optim_grads) or the distributed optimizer (optim); its own buffers' knobs have no effect",
    )
    g.add_argument(
        "--data-parallel-sharding-strategy",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
        default="optim_grads_params",
        help="with --use-megatron-fsdp: ZeRO-3 = --use-torch-fsdp2, ZeRO-2 = the same without resharding after "
        "forward, ZeRO-1 = --use-distributed-optimizer, or plain data parallelism",
    )


def _training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch and data-parallel rank")
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro batch × DP")
    g.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="global batch from START up by INCREMENT in equal steps over SAMPLES samples (Megatron's)",
    )
    g.add_argument(
        "--step-batch-size-schedule",
        nargs="+",
        action=_JoinWords,
        default=None,
        help='"SAMPLES:BATCH ..." global batch by samples consumed (suffixes K M B T), e.g. "0:16 2.4B:320"',
    )
    g.add_argument("--train-iters", type=int, default=None, help="default 300 (or from --train-samples)")
    g.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="train on this many samples (iterations = samples / global batch); LR flags in samples",
    )
    g.add_argument("--exit-interval", type=int, default=None, help="exit after an iteration divisible by this")
    g.add_argument(
        "--exit-duration-in-mins", type=float, default=None, help="save and exit before this many minutes of training"
    )
    _schedule_args(g)
    _adamw_args(g)
    g.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="the loss is the sum over the global batch's tokens divided by their number (not a mean of means)",
    )
    g.add_argument(
        "--disable-bf16-reduced-precision-matmul",
        action="store_true",
        help="CUDA: no reduced-precision reductions in bf16 GEMMs",
    )
    _runtime_args(g)


def _adamw_args(g):
    """AdamW's hyper-parameters and gradient clipping."""
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW's beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW's beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW's epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")


def _schedule_args(g):
    """The learning-rate and weight-decay schedules (training/schedules.py: Megatron's
    OptimizerParamScheduler, counted in samples)."""
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="the LR decays to this")
    g.add_argument("--decoupled-lr", type=float, default=None, help="LR of the embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None, help="their --min-lr (default --min-lr)")
    g.add_argument(
        "--lr-decay-style",
        choices=list(LR_STYLES),
        default="linear",
        help="after warmup, to --min-lr over the decay span (WSD: stable, then the last --lr-wsd-decay-*)",
    )
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default train iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="with --train-samples; default train samples")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warmup over this many iterations")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="with --train-samples: warmup samples")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warmup as a fraction of the decay span")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="the LR warmup starts at this value")
    g.add_argument(
        "--lr-wsd-decay-style", choices=list(WSD_STYLES), default="exponential", help="WSD's annealing shape"
    )
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD: iterations of annealing at the end")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="WSD with --train-samples: samples of it")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (none on biases and norm weights)")
    g.add_argument(
        "--weight-decay-incr-style",
        choices=list(WD_STYLES),
        default="constant",
        help="weight decay from --start- to --end-weight-decay over the run",
    )
    g.add_argument("--start-weight-decay", type=float, default=None, help="with a linear/cosine incr style")
    g.add_argument("--end-weight-decay", type=float, default=None, help="with a linear/cosine incr style")
    for name, what in (
        ("use-checkpoint", "on resume, the checkpoint's LR / weight-decay schedule instead of the command line's"),
        ("override", "on resume, the command line's LR / weight-decay schedule instead of the checkpoint's"),
    ):
        g.add_argument(f"--{name}-opt_param-scheduler", f"--{name}-opt-param-scheduler", action="store_true", help=what)


def _runtime_args(g):
    g.add_argument("--deterministic-mode", action="store_true", help="torch.use_deterministic_algorithms(True)")
    g.add_argument("--manual-gc", action="store_true", help="no automatic garbage collection; collect every interval")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: steps between collections")
    g.add_argument(
        "--empty-unused-memory-level",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="CUDA: empty the cache after each step (1) and also after the forward-backward (2)",
    )
    g.add_argument(
        "--activations-checkpoint-method",
        choices=["uniform", "block"],
        default=None,
        help="older Megatron-LM spelling of --recompute-granularity full --recompute-method",
    )


def _precision_args(p):
    """Megatron's mixed precision: --bf16/--fp16 put parameters and activations in that dtype, the
    optimizer keeping fp32 main weights and moments (distributed/optimizer.py)."""
    g = p.add_argument_group("mixed precision")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", help="parameters and activations in bf16, fp32 main weights")
    prec.add_argument("--fp16", action="store_true", help="parameters and activations in fp16, with loss scaling")
    add_config_flags(g, "mixed precision")
    g.add_argument("--loss-scale", type=float, default=None, help="a static loss scale; default: dynamic (fp16)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="dynamic loss scale at the start")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="the dynamic scale never halves below this")
    g.add_argument("--loss-scale-window", type=float, default=1000, help="clean steps before the scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflowing steps before the scale halves")
    g.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="the default: gradients are accumulated and reduced in fp32 unless --grad-reduce-in-bf16",
    )
    g.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="with --fp8-format and --use-distributed-optimizer or FSDP2: the FP8 linears' weights are cast to "
        "FP8 once per step from the fp32 main weights and broadcast, or all-gathered, in FP8 (docs/precision.md)",
    )
    g.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="with --bf16: gradient buffers (accumulation and data-parallel reduction) in bf16",
    )
    g.add_argument(
        "--init-model-with-meta-device",
        action="store_true",
        help="the default: the model is built on the meta device, each rank drawing only its shard",
    )
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
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights (quotes around them are ignored)")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer", help=f"one of {', '.join(TOKENIZERS)}")
    g.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer's tokenizer.json or its directory")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary (EOD = N - 1)")
    g.add_argument(
        "--null-tokenizer-eod-id", type=int, default=None, help="NullTokenizer's EOD id (default vocab size - 1)"
    )
    g.add_argument("--reset-position-ids", action="store_true", help="positions restart after each EOD")
    g.add_argument("--reset-attention-mask", action="store_true", help="no attention across an EOD (documents)")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on predicting EOD tokens")
    g.add_argument("--data-cache-path", default=None, help="default: <repo>/data_cache")


def _logging_args(p):
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="iterations between log lines")
    g.add_argument("--eval-interval", type=int, default=None, help="default: no evaluation during training")
    g.add_argument("--eval-iters", type=int, default=100, help="0: no evaluation")
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard events (our and Megatron-LM's scalar names)")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="iterations between TensorBoard scalars")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000, help="events buffered before a write")
    for flag, what in (
        ("--log-params-norm", "the parameters' global L2 norm (log line and TensorBoard)"),
        ("--log-num-zeros-in-grad", "the number of zero gradient elements (log line and TensorBoard)"),
        ("--log-throughput", "TFLOP/s per device in the log line"),
        ("--log-timers-to-tensorboard", "the step's timers (forward-backward, optimizer, ...)"),
        ("--log-validation-ppl-to-tensorboard", "validation perplexity"),
        ("--log-memory-to-tensorboard", "allocated / reserved / peak device memory (CUDA) or RSS (CPU)"),
        ("--log-world-size-to-tensorboard", "the world size"),
    ):
        g.add_argument(flag, action="store_true", help=what)
    g.add_argument(
        "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard",
        dest="log_loss_scale_to_tensorboard",
        action="store_false",
        default=True,
        help="no loss-scale scalar (fp16)",
    )
    g.add_argument(
        "--timing-log-level", type=int, choices=[0, 1, 2], default=0, help="0: iteration time; 1, 2: the step's timers"
    )
    g.add_argument("--logging-level", type=int, default=None, help="Python logging level (e.g. 20 = INFO)")
    g.add_argument("--log-jsonl", default=None, help="one JSON object per logged iteration")
    g.add_argument("--loss-curve", default=None, help="PNG written at the end (default: next to the JSONL/TB logs)")
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="per-device peak for MFU; default: from the GPU model, or measured on CPU",
    )
    g.add_argument("--no-progress-bar", action="store_true", help="no tqdm bar on a terminal")
    _wandb_and_profile_args(g)


def _wandb_and_profile_args(g):
    """Weights & Biases and the torch profiler."""
    g.add_argument("--wandb-project", default=None, help="log to Weights & Biases (wandb package; offline works)")
    g.add_argument("--wandb-exp-name", default=None, help="the wandb run's name")
    g.add_argument("--wandb-save-dir", default=None, help="default: <--save>/wandb")
    g.add_argument("--wandb-entity", default=None, help="the wandb user or team")
    g.add_argument("--profile", action="store_true", help="torch profiler trace of steps [start, end)")
    g.add_argument("--profile-step-start", type=int, default=10, help="first profiled step")
    g.add_argument("--profile-step-end", type=int, default=12, help="first step after the profiled ones")
    g.add_argument("--profile-ranks", type=int, nargs="*", default=[], help="the ranks traced (none given: all)")
    g.add_argument("--profile-dir", default=None, help="default: <--tensorboard-dir or --save or .>/profile")


def _checkpoint_args(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint directory (DCP, one per iteration)")
    g.add_argument(
        "--save-interval",
        "--persistent-save-interval",
        type=int,
        default=None,
        help="iterations between checkpoints (without --save none are written, as in Megatron-LM)",
    )
    g.add_argument("--no-save-optim", action="store_true", help="checkpoints without the optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="checkpoints without the RNG states")
    g.add_argument("--load", default=None, help="resume from this directory's latest checkpoint")
    g.add_argument("--finetune", action="store_true", help="load weights only and start at iteration 0")
    g.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="a --load without a checkpoint is an error even when it is also --save (else: start from scratch)",
    )
    g.add_argument("--no-load-optim", action="store_true", help="with --load: a fresh optimizer")
    g.add_argument("--no-load-rng", action="store_true", help="with --load: the RNG states not restored")
    g.add_argument(
        "--ckpt-format",
        default="torch_dist",
        help="torch_dist: torch.distributed.checkpoint; fsdp_dtensor (with --use-megatron-fsdp, Megatron's rule) "
        "is written as the same torch_dist checkpoint",
    )
    g.add_argument("--async-save", action="store_true", help="write checkpoints in the background (still atomic)")
    g.add_argument(
        "--save-retain-interval",
        type=int,
        default=None,
        help="keep only the checkpoints at multiples of this (and the latest)",
    )
    g.add_argument(
        "--dist-ckpt-strictness",
        choices=STRICTNESS,
        default="assume_ok_unexpected",
        help="checkpoint entries the model does not have: ignored, logged or an error (missing ones always are)",
    )


def _compat_args(p):
    group = p.add_argument_group("accepted without effect (see docs/megatron_flags.md)")
    megatron_flags.add_no_effect_flags(group)
    megatron_flags.add_rule_flags(p, group)  # the rest of Megatron-LM's options (megatron_rules.py)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_gpt_sp.py",
        description="GPT pretraining with tensor + sequence parallelism.",
        allow_abbrev=False,  # Megatron-LM's: --lr never means --lr-decay-style
    )
    for add in (
        _model_args,
        _moe_args,
        _parallel_args,
        _training_args,
        _precision_args,
        _data_args,
        _logging_args,
        _checkpoint_args,
        _compat_args,
    ):
        add(p)
    return p


def parse_args(argv=None, world_size: int = 1) -> argparse.Namespace:
    """world_size: the number of processes the launcher started (dist_env.detect_env)."""
    args, unknown = build_parser().parse_known_args(argv)
    refused = megatron_flags.refusal(unknown)
    if refused:
        raise ArgumentError(refused)
    if unknown:
        raise ArgumentError(f"unrecognized arguments: {' '.join(unknown)} (see --help)")
    refused = megatron_flags.refused_value(args)
    if refused:
        raise ArgumentError(refused)
    args.world_size = world_size
    validate(args)
    return args

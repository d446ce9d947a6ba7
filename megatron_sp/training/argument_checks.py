"""Validation of pretrain_gpt_sp.py's command line (training/arguments.py parses it): every check that
needs no data and no device, each failure one sentence (`ArgumentError`); and the derived values the
run uses (data-parallel size, the batch schedule, micro-batches, the LR schedule's unit and spans).
"""

from __future__ import annotations

import importlib.util
import math

from megatron_sp.training.batch_schedule import BatchSchedule

OUR_TOKENIZERS = ("ByteLevelTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")


class ArgumentError(ValueError):
    """A bad command line: one clear sentence."""


def validate(args) -> None:
    """Checks that need no data and no devices; fills derived defaults (dp size, batch sizes...)."""
    _check_features(args)
    _train_length(args)
    _check_sizes(args)
    _check_fsdp2(args)
    _batch_schedule(args)
    _check_pipeline(args)
    _check_tokenizer(args)
    _check_tokenizer_needs(args)
    _schedule_units(args)
    _check_lr(args)
    _check_numbers(args)
    _check_precision(args)
    _check_fp8(args)
    _check_intervals(args)
    _check_data_flags(args)


def _check_sizes(args) -> None:
    """Positive sizes, a world the model-parallel sizes divide; sets args.data_parallel_size."""
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
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    if cp <= 0 or pp <= 0:
        raise ArgumentError(
            f"--context-parallel-size and --pipeline-model-parallel-size must be positive, got {cp}, {pp}."
        )
    if args.world_size % (tp * cp * pp) != 0:
        raise ArgumentError(
            f"world size {args.world_size} is not divisible by --tensor-model-parallel-size {tp}"
            + (f" × --context-parallel-size {cp}" if cp > 1 else "")
            + (f" × --pipeline-model-parallel-size {pp}" if pp > 1 else "")
            + "."
        )
    args.data_parallel_size = args.world_size // (tp * cp * pp)


def _check_tokenizer_needs(args) -> None:
    """The files each tokenizer needs, and the packages of the optional outputs."""
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


def _check_lr(args) -> None:
    """The learning rates' order (min <= peak, warmup start <= peak, the decoupled pair)."""
    if args.min_lr > args.lr:
        raise ArgumentError("--min-lr must not exceed --lr.")
    if args.lr_warmup_init > args.lr:
        raise ArgumentError("--lr-warmup-init must not exceed --lr (the warmup climbs from it to --lr).")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ArgumentError("--decoupled-min-lr needs --decoupled-lr.")
    if args.decoupled_lr is not None and (args.decoupled_min_lr or args.min_lr) > args.decoupled_lr:
        raise ArgumentError("--decoupled-min-lr (default --min-lr) must not exceed --decoupled-lr.")


def _train_length(args) -> None:
    """--train-iters or --train-samples (Megatron: one of them; samples make the LR flags sample-based).
    Megatron's defaults: --lr-warmup-iters 0 and --lr-warmup-samples 0, so an explicit 0 of the other
    unit is fine."""
    if args.train_samples is not None and args.train_iters is not None:
        raise ArgumentError("give --train-iters or --train-samples, not both.")
    by_samples = args.train_samples is not None
    unit, other = ("iters", "samples") if by_samples else ("samples", "iters")
    for name, default in ((f"lr_decay_{unit}", None), (f"lr_warmup_{unit}", 0), (f"lr_wsd_decay_{unit}", None)):
        value = getattr(args, name)
        if value not in (None, default):
            flag = f"--{name.replace('_', '-')}"
            raise ArgumentError(
                f"{flag} needs --train-{unit} (with --train-{other} use {flag.replace(unit, other)}; got {value})."
            )
    if args.train_samples is None:
        if args.train_iters is None:
            args.train_iters = 300
        return
    if args.train_samples <= 0:
        raise ArgumentError(f"--train-samples must be positive, got {args.train_samples}.")
    args.train_iters = None  # set once the global batch size is known (_schedule_units)


def _schedule_units(args) -> None:
    """The schedules' spans in samples, as Megatron's get_optimizer_param_scheduler computes them
    (--train-iters: iterations × the final --global-batch-size): args.lr_warmup_steps (a float with
    --lr-warmup-fraction), lr_decay_steps, wsd_decay_steps, wd_incr_steps; and the weight-decay range."""
    gbs = args.global_batch_size
    if args.train_samples is not None:
        args.train_iters = max(1, args.batch_schedule.iterations(args.train_samples))
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup, wsd, wd_incr = args.lr_warmup_samples, args.lr_wsd_decay_samples, args.train_samples
    else:
        decay = (args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters) * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        warmup, wd_incr = args.lr_warmup_iters * gbs, args.train_iters * gbs
    if args.lr_warmup_fraction is not None:
        if warmup != 0:
            raise ArgumentError("give --lr-warmup-fraction or --lr-warmup-iters/--lr-warmup-samples, not both.")
        if not 0.0 <= args.lr_warmup_fraction <= 1.0:
            raise ArgumentError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}.")
        warmup = args.lr_warmup_fraction * decay  # fractional, as Megatron keeps it
    if warmup < 0 or decay <= 0:
        raise ArgumentError("the LR warmup must be >= 0 and the decay span (--lr-decay-iters/-samples) positive.")
    if args.lr_decay_style == "WSD" and wsd is None:
        raise ArgumentError(
            "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)."
        )
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        raise ArgumentError(
            "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler contradict each other; give one."
        )
    args.lr_warmup_steps, args.lr_decay_steps, args.wsd_decay_steps, args.wd_incr_steps = warmup, decay, wsd, wd_incr
    _weight_decay_range(args)


def _weight_decay_range(args) -> None:
    """--start/--end-weight-decay: Megatron's rule (constant: both from --weight-decay)."""
    start, end = args.start_weight_decay, args.end_weight_decay
    if args.weight_decay_incr_style == "constant":
        if start is not None or end is not None:
            raise ArgumentError(
                "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine "
                "(constant decay is --weight-decay)."
            )
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
        return
    if start is None or end is None:
        raise ArgumentError(
            f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
            f"--end-weight-decay."
        )
    if not 0.0 <= start <= end:
        raise ArgumentError(f"need 0 <= --start-weight-decay ({start}) <= --end-weight-decay ({end}).")


# (flag, attribute, predicate on a finite value, what it must be); None values (unset) are skipped.
_NUMBER_RULES = (
    ("--lr", "lr", lambda v: v >= 0, "a finite number >= 0"),
    ("--min-lr", "min_lr", lambda v: v >= 0, "a finite number >= 0"),
    ("--weight-decay", "weight_decay", lambda v: v >= 0, "a finite number >= 0"),
    ("--adam-beta1", "adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("--adam-beta2", "adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("--adam-eps", "adam_eps", lambda v: v > 0, "a finite number > 0"),
    ("--clip-grad", "clip_grad", lambda v: v >= 0, "a finite number >= 0 (0 disables clipping)"),
    ("--decoupled-lr", "decoupled_lr", lambda v: v >= 0, "a finite number >= 0"),
    ("--decoupled-min-lr", "decoupled_min_lr", lambda v: v >= 0, "a finite number >= 0"),
    ("--lr-warmup-init", "lr_warmup_init", lambda v: v >= 0, "a finite number >= 0"),
    ("--start-weight-decay", "start_weight_decay", lambda v: v >= 0, "a finite number >= 0"),
    ("--end-weight-decay", "end_weight_decay", lambda v: v >= 0, "a finite number >= 0"),
    ("--exit-duration-in-mins", "exit_duration_in_mins", lambda v: v > 0, "a finite number > 0"),
    ("--initial-loss-scale", "initial_loss_scale", lambda v: v > 0, "a finite number > 0, e.g. 65536"),
    ("--loss-scale", "loss_scale", lambda v: v > 0, "a finite number > 0, e.g. 4096 (omit it for dynamic scaling)"),
    ("--min-loss-scale", "min_loss_scale", lambda v: v > 0, "a finite number > 0"),
    ("--loss-scale-window", "loss_scale_window", lambda v: v >= 1 and v == int(v), "a whole number >= 1"),
    ("--hysteresis", "hysteresis", lambda v: v >= 1, "an integer >= 1"),
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


def _check_precision(args) -> None:
    """Combinations of the precision flags that cannot work; args.params_dtype (Megatron's name)."""
    args.params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    low = args.bf16 or args.fp16
    if args.fp32_residual_connection and not low:
        raise ArgumentError("--fp32-residual-connection needs --bf16 or --fp16 (in fp32 the residual already is fp32).")
    if args.loss_scale is not None and not low:
        raise ArgumentError("--loss-scale needs --fp16 or --bf16 (fp32 training is not loss-scaled).")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ArgumentError("--grad-reduce-in-bf16 needs --bf16 (the gradient buffers hold bf16 only for bf16 models).")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        raise ArgumentError(
            "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other; give one of them."
        )


def _check_fp8(args) -> None:
    """--fp8-format's needs beyond the model's (config_checks.check_fp8 refuses the recipes that cannot run)."""
    if args.fp8 is None:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ArgumentError(
            "--fp8-format needs the torchao package, which is not installed (pip install --no-deps torchao==0.18.0)."
        )
    if args.torch_compile:
        raise ArgumentError("--fp8-format does not run with --torch-compile (its amax all-reduces are not traced).")
    _check_fp8_param_gather(args)


def _check_fp8_param_gather(args) -> None:
    """--fp8-param-gather (distributed/fp8_param_gather.py): Megatron-LM's rule (the distributed optimizer
    or FSDP), and what holding FP8 values in the model's weights needs."""
    if not args.fp8_param_gather:
        return
    if not (args.use_distributed_optimizer or args.use_torch_fsdp2):
        raise ArgumentError(
            "--fp8-param-gather needs --use-distributed-optimizer, --use-torch-fsdp2 or --use-megatron-fsdp "
            "(as in Megatron-LM)."
        )
    if not args.bf16:
        raise ArgumentError(
            "--fp8-param-gather needs --bf16: the model's weights then hold their FP8 values exactly (fp16 "
            "underflows some, and in fp32 the weights are the optimizer's main weights)."
        )
    if args.fp8_recipe not in ("tensorwise", "delayed"):
        raise ArgumentError(
            f"--fp8-param-gather with --fp8-recipe {args.fp8_recipe}: one FP8 copy of a weight serves both of "
            "its GEMMs only under one scale per tensor; use --fp8-recipe tensorwise or delayed."
        )


def _check_intervals(args) -> None:
    if args.eval_iters < 0:
        raise ArgumentError(f"--eval-iters must be >= 0 (0: no evaluation), got {args.eval_iters}.")
    for flag, value in (
        ("--save-interval", args.save_interval),
        ("--exit-interval", args.exit_interval),
        ("--save-retain-interval", args.save_retain_interval),
        ("--tensorboard-log-interval", args.tensorboard_log_interval),
    ):
        if value is not None and value <= 0:
            raise ArgumentError(f"{flag} must be positive, got {value}.")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        raise ArgumentError("--profile needs 0 <= --profile-step-start < --profile-step-end.")


def _check_data_flags(args) -> None:
    """--data-path and --split syntax (plain Python: --mock-data runs import no numpy)."""
    from megatron_sp.data.blend import check_train_share, parse_data_path
    from megatron_sp.data.errors import DataError

    args.split = args.split.strip().strip("'\"")  # a script's --split "'99,1,0'": megatron-core reads the numbers
    try:
        if args.data_path:
            parse_data_path(args.data_path)
        if not args.mock_data:
            check_train_share(args.split)
    except DataError as err:
        raise ArgumentError(str(err)) from None


def _check_experts(args) -> None:
    """Mixture-of-experts flags the layout cannot take (the model's own checks are GPTConfig's)."""
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if args.num_experts is None:
        return
    stage = args.world_size // max(1, args.pipeline_model_parallel_size)
    if stage % (ep * etp):
        raise ArgumentError(
            f"--expert-model-parallel-size {ep} × --expert-tensor-parallel-size {etp} must divide the {stage} ranks "
            f"of a pipeline stage (world {args.world_size} / --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size})."
        )


def _check_features(args) -> None:
    """Flags whose value asks for a feature megatron_sp lacks (pipeline, experts, other checkpoint
    formats) or for another flag (Megatron-LM's own rules), and the older recompute spelling."""
    _check_experts(args)
    _megatron_fsdp(args)
    if args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):
        raise ArgumentError(
            f"--ckpt-format {args.ckpt_format} is not supported: checkpoints are torch.distributed.checkpoint "
            f"directories (--ckpt-format torch_dist)."
        )
    if args.overlap_param_gather and not (args.use_distributed_optimizer or args.use_torch_fsdp2):
        raise ArgumentError(
            "--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp (as in Megatron-LM)."
        )
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--wandb-project needs the wandb package, which is not installed (pip install wandb).")
    _position_flags(args)
    if args.activations_checkpoint_method is not None:  # Megatron-LM before 2022: full recomputation
        if args.recompute_granularity not in (None, "full"):
            raise ArgumentError("--activations-checkpoint-method means full recomputation; drop one of the two.")
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or args.activations_checkpoint_method


def _megatron_fsdp(args) -> None:
    """--use-megatron-fsdp on our implementations, with its --data-parallel-sharding-strategy's meaning:
    optim_grads_params (ZeRO-3) is --use-torch-fsdp2, optim_grads (ZeRO-2) the same with the weights kept
    gathered from forward to backward, optim (ZeRO-1) --use-distributed-optimizer, no_shard plain data
    parallelism. Megatron-LM's rules: --ckpt-format fsdp_dtensor only with it (written here as torch_dist)."""
    if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
        raise ArgumentError("--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (as in Megatron-LM).")
    if not args.use_megatron_fsdp:
        return
    if args.use_torch_fsdp2:
        raise ArgumentError("--use-megatron-fsdp and --use-torch-fsdp2 are two FSDP implementations; give one.")
    strategy = args.data_parallel_sharding_strategy
    if strategy == "optim":
        args.use_distributed_optimizer = True
    elif strategy in ("optim_grads", "optim_grads_params"):  # FSDP2 shards the optimizer state itself
        args.use_torch_fsdp2, args.use_distributed_optimizer = True, False
        args.torch_fsdp2_reshard_after_forward &= strategy == "optim_grads_params"


def _check_fsdp2(args) -> None:
    """--use-torch-fsdp2's impossible combinations (distributed/fsdp.py says why each)."""
    if not args.use_torch_fsdp2:
        return
    from megatron_sp.distributed.fsdp import problem

    if problem(args):
        raise ArgumentError(problem(args))


def _check_tokenizer(args) -> None:
    if args.tokenizer_type not in OUR_TOKENIZERS:
        raise ArgumentError(
            f"--tokenizer-type {args.tokenizer_type} is not supported (only {', '.join(OUR_TOKENIZERS)}); "
            f"save the tokenizer as a tokenizer.json and use HuggingFaceTokenizer."
        )
    if args.null_tokenizer_eod_id is not None and args.tokenizer_type != "NullTokenizer":
        raise ArgumentError(
            "--null-tokenizer-eod-id is NullTokenizer's; drop it or use --tokenizer-type NullTokenizer."
        )


def _batch_schedule(args) -> None:
    """args.batch_schedule and args.global_batch_size (its final batch); every batch a multiple of
    micro batch × DP. A schedule and --global-batch-size must agree on the final batch."""
    per_step = args.micro_batch_size * args.data_parallel_size
    ramp, steps = args.rampup_batch_size, args.step_batch_size_schedule
    if ramp is not None and steps is not None:
        raise ArgumentError("give --rampup-batch-size or --step-batch-size-schedule, not both.")
    try:
        schedule = _schedule(args, ramp, steps, per_step)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    for _, batch in schedule.steps:
        if batch % per_step != 0:
            what = "--global-batch-size" if len(schedule.steps) == 1 else "the batch schedule's global batch"
            raise ArgumentError(
                f"{what} {batch} is not divisible by micro batch size × data-parallel size "
                f"({args.micro_batch_size} × {args.data_parallel_size})."
            )
    args.batch_schedule, args.global_batch_size = schedule, schedule.final
    args.num_micro_batches = schedule.final // per_step


def _schedule(args, ramp, steps, per_step) -> BatchSchedule:
    if steps is not None:
        schedule = BatchSchedule.parse(steps, args.seq_length)
        if args.global_batch_size not in (None, schedule.final):
            raise ValueError(
                f"--step-batch-size-schedule ends at batch {schedule.final} but --global-batch-size is "
                f"{args.global_batch_size}; drop --global-batch-size or make them agree."
            )
        return schedule
    final = args.global_batch_size or per_step
    if ramp is None:
        return BatchSchedule.constant(final)
    start, increment, samples = ramp
    if start <= 0 or increment <= 0 or samples < 0 or start > final or (final - start) % increment != 0:
        raise ValueError(
            f"--rampup-batch-size {start} {increment} {samples}: need 0 < START <= --global-batch-size ({final}), "
            f"INCREMENT > 0 dividing the difference, SAMPLES >= 0."
        )
    return BatchSchedule.rampup(start, increment, samples, final) if final > start else BatchSchedule.constant(final)


def _position_flags(args) -> None:
    """Megatron-LM's deprecated position switches: --use-rotary-position-embeddings means rope in any
    order; --no-position-embedding beside rope keeps rope (Mixtral's script passes both)."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.no_position_embedding and args.position_embedding_type != "rope":
        if args.position_embedding_type not in (None, "none"):
            raise ArgumentError(
                f"--no-position-embedding contradicts --position-embedding-type {args.position_embedding_type}; "
                f"give one of them."
            )
        args.position_embedding_type = "none"


def _check_pipeline(args) -> None:
    """args.pipeline_layout (None at pp 1) from the pipeline flags; the layout, the micro-batch count
    and the options pipeline parallelism cannot serve yet, each refused in one sentence."""
    from megatron_sp.pipeline_parallel.layout import ZERO_BUBBLE

    pp = args.pipeline_model_parallel_size
    args.pipeline_layout = None
    layout_flags = (
        args.microbatch_group_size_per_virtual_pipeline_stage,
        args.account_for_embedding_in_pipeline_split or None,
        args.account_for_loss_in_pipeline_split or None,
        args.virtual_pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
        args.num_virtual_stages_per_pipeline_rank,
        args.pipeline_model_parallel_layout,
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
    )
    if pp == 1:
        if any(flag is not None for flag in layout_flags) or args.pipeline_schedule != "1f1b":
            raise ArgumentError(
                "the virtual-stage, layout, first/last-stage, split-accounting and --pipeline-schedule flags need "
                "--pipeline-model-parallel-size > 1."
            )
        return
    from megatron_sp.pipeline_parallel.model import schedule_problem

    problem = schedule_problem(args.pipeline_schedule)
    if problem:
        raise ArgumentError(problem)
    if args.torch_compile and args.pipeline_schedule in ZERO_BUBBLE:
        raise ArgumentError(
            f"--torch-compile cannot run --pipeline-schedule {args.pipeline_schedule}: a zero-bubble schedule "
            f"splits each backward into input and weight passes through autograd's graph, which compiled layers "
            f"hide; use 1f1b (interleaved with virtual stages) or gpipe."
        )
    try:
        _accounted_split(args)
        layout = _pipeline_layout(args)
        for _, batch in args.batch_schedule.steps:
            layout.check_microbatches(batch // (args.micro_batch_size * args.data_parallel_size))
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    group = args.microbatch_group_size_per_virtual_pipeline_stage
    if group is not None and group != pp:
        raise ArgumentError(
            f"--microbatch-group-size-per-virtual-pipeline-stage {group}: our interleaved schedules run rounds of "
            f"--pipeline-model-parallel-size ({pp}) micro-batches, Megatron-LM's default; other sizes are not "
            f"implemented."
        )
    args.pipeline_layout = layout


def _accounted_split(args) -> None:
    """--account-for-embedding/loss-in-pipeline-split: the layout string they mean (layout.py)."""
    from megatron_sp.pipeline_parallel.layout import accounted_layout

    embedding, loss = args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split
    if not (embedding or loss):
        return
    others = (
        args.pipeline_model_parallel_layout,
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
        args.num_layers_per_virtual_pipeline_stage,
    )
    if any(v is not None for v in others):
        raise ValueError(
            "--account-for-embedding/loss-in-pipeline-split divide the layers evenly; they do not go with a "
            "layout string, --decoder-first/last-pipeline-num-layers or --num-layers-per-virtual-pipeline-stage."
        )
    vp = args.num_virtual_stages_per_pipeline_rank or args.virtual_pipeline_model_parallel_size or 1
    if args.pipeline_schedule == "zbv":
        vp = 2
    args.pipeline_model_parallel_layout = accounted_layout(
        args.num_layers, args.pipeline_model_parallel_size, vp, embedding, loss
    )


def _pipeline_layout(args):
    """The checked PipelineLayout the pipeline flags describe (ValueError: one sentence)."""
    from megatron_sp.pipeline_parallel.layout import layout_from_args

    layout = layout_from_args(
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
        args.num_layers,
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
        args.pipeline_schedule,
        virtual_stages=args.num_virtual_stages_per_pipeline_rank,
        text=args.pipeline_model_parallel_layout,
    )
    layout.check(args.num_layers)
    return layout

"""pretrain_gpt_sp.py --load <a Megatron-LM --save directory>: continue a Megatron-LM run.

    is_megatron_dir(root)                     its tracker names an iteration Megatron-LM wrote
    check_resume(root, cfg, args)             start-up: model flags against its args, the optimizer
                                              rule, the learning-rate schedule (no tensors read)
    load_resume(root, cfg, model, optimizer, train_state, finetune, scheduler, load_optim) -> its iteration

Carried over: the weights (any TP/PP and format), the iteration, the samples consumed (the data
position) and the learning-rate schedule's position (the checkpoint's opt_param_scheduler, loaded into
training/schedules.py's ParamScheduler, which is Megatron's; its values must agree with this run's
--lr / --min-lr / --lr-decay-style / warmup / decay unless --override-opt_param-scheduler or
--use-checkpoint-opt_param-scheduler chooses, as in Megatron-LM, and it must have stepped once per
sample consumed), and AdamW's state where the checkpoint's layout allows (megatron_optim.py: torch_dist's
`optimizer.state.*` of megatron-core's FP32Optimizer, Float16OptimizerWithFloat16Params and the
distributed optimizer's --dist-ckpt-optim-fully-reshardable: moments, step, fp32 main weights; betas
and epsilon checked against --adam-beta1/2 and --adam-eps). Any other layout (dp_reshardable,
distrib_optim.pt, the legacy format's index-keyed `optimizer`, none saved) is refused without
--no-load-optim (AdamW starts fresh) or --finetune, the sentence naming it. Not carried over: the RNG
state (our dropout masks are a function of --seed, the sample and the position, not of a generator's
state) and --fp16's loss scale.
"""

from __future__ import annotations

import dataclasses
import os

from megatron_sp.checkpointing import files
from megatron_sp.checkpointing.megatron_files import RANK_FILE, TRACKER, iteration_dir, read_common
from megatron_sp.checkpointing.megatron_model import config_fields
from megatron_sp.checkpointing.megatron_optim import check_optimizer, optimizer_layout
from megatron_sp.checkpointing.paths import CheckpointError
from megatron_sp.config import config_from_dict
from megatron_sp.fields import mismatch


def is_megatron_dir(root) -> bool:
    """A directory whose tracked iteration holds mp_rank_*/model_optim_rng.pt or a torch_dist
    checkpoint of megatron-core's (metadata.json naming its sharded backend)."""
    if not root or not os.path.isfile(os.path.join(root, TRACKER)):
        return False
    try:
        path = iteration_dir(root)
    except CheckpointError:
        return False
    if any(os.path.isfile(os.path.join(path, n, RANK_FILE)) for n in os.listdir(path) if n.startswith("mp_rank_")):
        return True
    try:
        head = files.read_bytes(os.path.join(path, "metadata.json"), path, 4096)
    except (files.UnreadableFile, OSError):
        return False
    return b'"sharded_backend"' in head


def _saved_config(common: dict, cfg, path: str):
    args = common.get("args")
    try:
        return config_from_dict(config_fields(args, path, getattr(args, "vocab_size", None) or cfg.vocab_size))
    except CheckpointError:
        raise
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}'s args describe a model megatron_sp cannot build ({err}).") from None


def check_resume(root: str, cfg, args) -> None:
    """Everything --load of a Megatron-LM directory needs, before the model is built."""
    common, path = read_common(root)
    saved = _saved_config(common, cfg, path)
    name = mismatch(dataclasses.fields(cfg), cfg, saved)
    if name is not None:
        raise CheckpointError(
            f"Megatron-LM checkpoint {path} has {name}={getattr(saved, name)} but this run's model has "
            f"{getattr(cfg, name)}; use the model flags tools/convert_megatron.py prints for it."
        )
    if args.finetune:
        return
    if not args.no_load_optim:
        layout = optimizer_layout(common, path)
        if not layout.readable:
            raise CheckpointError(
                f"--load {root} is a Megatron-LM checkpoint holding {layout.what}, which megatron_sp does not "
                f"read; pass --no-load-optim to continue with a fresh AdamW, or --finetune."
            )
        check_optimizer(common, path, args)
    if getattr(args, "use_torch_fsdp2", False):
        raise CheckpointError(
            f"--load of a Megatron-LM checkpoint ({root}) with --use-torch-fsdp2 is not supported yet."
        )
    _check_schedule(common, args, path)


def _check_schedule(common: dict, args, path: str) -> None:
    """Megatron-LM's rule for its own resume: the checkpoint's schedule must be the command line's
    unless --override-opt_param-scheduler (the command line's) or --use-checkpoint-opt_param-scheduler
    (the checkpoint's) says which wins; both count in samples (argument_checks.py)."""
    sched = common.get("opt_param_scheduler") or {}
    ours = {
        "max_lr": (args.lr, "--lr"),
        "min_lr": (args.min_lr, "--min-lr"),
        "lr_decay_style": (args.lr_decay_style, "--lr-decay-style"),
        "lr_warmup_steps": (args.lr_warmup_steps, "--lr-warmup-* (in samples)"),
        "lr_decay_steps": (args.lr_decay_steps, "--lr-decay-* (in samples)"),
    }
    chosen = getattr(args, "override_opt_param_scheduler", False) or getattr(
        args, "use_checkpoint_opt_param_scheduler", False
    )
    for key, (value, flag) in ours.items():
        if not chosen and key in sched and sched[key] != value:
            raise CheckpointError(
                f"Megatron-LM checkpoint {path} was trained with {key} {sched[key]} but this run has {flag} "
                f"{value}; pass the same learning-rate schedule, or --override-opt_param-scheduler / "
                f"--use-checkpoint-opt_param-scheduler to choose."
            )
    consumed = getattr(common.get("args"), "consumed_train_samples", None)
    if "num_steps" in sched and consumed is not None and sched["num_steps"] != consumed:
        raise CheckpointError(
            f"Megatron-LM checkpoint {path}'s schedule stepped {sched['num_steps']} samples but the run "
            f"consumed {consumed} (a batch-size ramp-up?): its position cannot be carried over."
        )


def load_resume(
    root: str, cfg, model, optimizer, train_state, finetune: bool, scheduler=None, load_optim: bool = False
) -> int:
    """Loads the weights into `model` (a TrainableModel) and the optimizer's fp32 main weights and,
    unless finetune, the iteration and data position into `train_state` and the schedule's position
    into `scheduler` (training/schedules.py's ParamScheduler: Megatron's opt_param_scheduler state, whose
    values it checks against the command line's as for our own checkpoints; without one, the consumed
    samples), and with load_optim AdamW's moments, step and fp32 main weights (megatron_optim.py; the
    layout was checked by check_resume); returns the iteration."""
    import torch

    from megatron_sp.checkpointing.megatron import read_model
    from megatron_sp.checkpointing.states import kept_buffers

    state, _, ckpt = read_model(root, None, cfg.vocab_size)
    model.load_full_state_dict({k: v for k, v in state.items() if not k.endswith(".expert_bias")})
    with torch.no_grad():
        for name, buffer in kept_buffers(model):  # the routers' expert biases (this rank's stages)
            buffer.copy_(state[name])
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, main in optimizer.main_params().items():
            if main is not params[name]:
                main.copy_(params[name])
    iteration = int(ckpt.common.get("iteration", 0))
    if load_optim and not finetune:
        from megatron_sp.checkpointing.megatron_optim import load_optimizer, read_optimizer

        load_optimizer(read_optimizer(ckpt.path, cfg, ckpt.args.padded_vocab_size, ckpt.common), optimizer, model)
    if not finetune:
        args = ckpt.args
        train_state.iteration = iteration
        train_state.consumed_train_samples = int(getattr(args, "consumed_train_samples", 0) or 0)
        train_state.consumed_valid_samples = int(getattr(args, "consumed_valid_samples", 0) or 0)
        if scheduler is not None:
            saved = ckpt.common.get("opt_param_scheduler")
            if isinstance(saved, dict) and "num_steps" in saved:
                scheduler.load_state_dict(saved)
            else:  # (a run without a scheduler entry: every sample so far was a successful update's)
                scheduler.num_steps = train_state.consumed_train_samples
    return iteration

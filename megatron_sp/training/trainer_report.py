"""What a Trainer (training/pretrain.py) reports: each step's record (the log line, JSON lines,
TensorBoard and wandb read it) and the start-up description."""

from __future__ import annotations

import torch

from megatron_sp.training.throughput import throughput


def record(trainer, result, batch, elapsed) -> dict:
    """The figures of one step: what the log line, the JSONL file, TensorBoard and wandb show. The
    learning rates are Megatron's logged ones: the schedule's after this step, i.e. the next update's."""
    args, state = trainer.args, trainer.state
    lr, decoupled_lr = trainer.scheduler.current()
    optimizer, model, ps = trainer.optimizer, trainer.model, trainer.ps
    return {
        "iteration": state.iteration,
        "lm_loss": result.loss,
        "lr": lr,
        "decoupled_lr": decoupled_lr,
        "grad_norm": result.grad_norm,
        "consumed_samples": state.consumed_train_samples,
        "global_batch_size": batch,
        "elapsed_ms": 1000 * elapsed,
        "elapsed_s": elapsed,
        "skipped": result.skipped,
        "peak_tflops": trainer.peak,
        "loss_scale": trainer.scaler.scale if trainer.scaler else None,
        "params_norm": optimizer.params_norm(model, ps) if args.log_params_norm else None,
        "num_zeros": optimizer.zero_grads_count(model, ps) if args.log_num_zeros_in_grad else None,
        "timers": result.timers,
        **result.moe,
        "memory": trainer.runtime.memory() if args.log_memory_to_tensorboard else None,
        # this step's peak of allocated GPU memory (bench/gpu_check.sh reports it per run)
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        **throughput(trainer.cfg.flops_per_token(), batch * args.seq_length, elapsed, args.world_size, trainer.peak),
    }


def _optimizer_words(trainer) -> str:
    return _sharding_words(trainer) + _fp8_gather_words(trainer)


def _sharding_words(trainer) -> str:
    replicas = trainer.ps.replicas
    if trainer.optimizer.partition is None:
        return "AdamW"
    if trainer.args.use_torch_fsdp2:
        return f"FSDP2: weights, gradients and AdamW state sharded over {replicas} replicas"
    mine = sum(p.numel() for g in trainer.optimizer.optim.param_groups for p in g["params"])
    total = sum(p.numel() for p in trainer.model.parameters())
    return f"AdamW state sharded over {replicas} replicas (this rank: {mine / total:.0%} of its parameters)"


def _fp8_gather_words(trainer) -> str:
    """--fp8-param-gather: what it does here (distributed/fp8_param_gather.py)."""
    if not getattr(trainer.args, "fp8_param_gather", False):
        return ""
    moved = " all-gathered in FP8" if trainer.args.use_torch_fsdp2 else " broadcast in FP8"
    return "; FP8 weights cast once per step from the fp32 main weights" + (
        moved if trainer.optimizer.partition is not None else ""
    )


def _pipeline_words(args) -> str:
    layout = getattr(args, "pipeline_layout", None)
    if layout is None:
        return ""
    chunks = f", {layout.vp_size} chunks per rank" if layout.vp_size > 1 else ""
    return f" × PP {layout.pp_size} ({layout.schedule}{chunks})"


def _cp_words(cfg) -> str:
    """The CP type (or the layers' types in turn), with the hierarchical sizes of a2a+p2p."""
    types = cfg.cp_comm_type if isinstance(cfg.cp_comm_type, str) else " ".join(cfg.cp_comm_type)
    sizes = cfg.hierarchical_context_parallel_sizes
    return types + (f"; levels {' × '.join(map(str, sizes))}" if sizes else "")


def _precision_words(cfg) -> str:
    """The parameters' dtype, and FP8's format and recipe (with the layers kept out) when on; the MoE
    experts' grouped GEMMs stay in the parameters' dtype (torchao's FP8 grouped GEMM needs triton, and
    torch._scaled_grouped_mm has no CPU kernel), which the line says."""
    if cfg.fp8 is None:
        return cfg.params_dtype
    kept = ""
    if cfg.first_last_layers_bf16:
        kept = f", first {cfg.num_layers_at_start_in_bf16} / last {cfg.num_layers_at_end_in_bf16} layers not"
    experts = f"; MoE experts' grouped GEMMs in {cfg.params_dtype}, not FP8" if cfg.num_experts else ""
    return f"{cfg.params_dtype} + FP8 GEMMs ({cfg.fp8} {cfg.fp8_recipe}, torchao{kept}){experts}"


def describe(trainer) -> None:
    """The start-up line: layout, model, batch, optimizer, MFU peak (and where a resume starts)."""
    a, c = trainer.args, trainer.cfg
    trainer.log.info(
        f" megatron_sp: world {a.world_size} = TP {a.tensor_model_parallel_size}"
        f"{f' × CP {c.context_parallel_size} ({_cp_words(c)})' if c.context_parallel_size > 1 else ''}"
        f" × DP {a.data_parallel_size}{_pipeline_words(a)}"
        f"{' + SP' if c.sequence_parallel else ''} | device {a.device} ({a.distributed_backend}) | "
        f"model {c.model}: {c.normalization}, {c.activation}, {c.position_embedding_type} positions, "
        f"{c.num_attention_heads} heads / {c.num_query_groups} kv | {_precision_words(c)} | "
        f"{c.num_parameters() / 1e6:.2f}M parameters | vocab {c.vocab_size} (padded {c.padded_vocab_size}) | "
        f"{a.num_micro_batches} micro-batches of {a.micro_batch_size} per DP rank | "
        f"{_optimizer_words(trainer)} | "
        f"MFU peak {f'{trainer.peak:.3g} TFLOP/s' if trainer.peak else 'n/a'} ({trainer.peak_source})"
    )
    if trainer.state.iteration:
        trainer.log.info(
            f" resuming at iteration {trainer.state.iteration}, {trainer.state.consumed_train_samples} samples consumed"
        )

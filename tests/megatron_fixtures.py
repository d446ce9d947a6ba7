"""Megatron-LM checkpoints written by megatron-core itself, for tests/test_megatron_checkpoints.py.

    python tests/megatron_fixtures.py OUT      # two gloo ranks on CPU; writes OUT/<family>/...

For each family (GPT-2-style: LayerNorm, biases, learned positions, gelu, tied output; Llama-style:
RMSNorm, SwiGLU, RoPE, GQA, qk-layernorm, untied) megatron-core's own GPTModel (the local spec) is
built at TP1, every parameter perturbed (norm weights off 1, biases off 0), its logits on a fixed
batch kept, and it is saved as Megatron-LM's `save_checkpoint` saves it (the state dict of
megatron/training/checkpointing.py's `generate_state_dict`):

    <family>/tp1_dist, tp2_dist, pp2_dist    --ckpt-format torch_dist (dist_checkpointing.save)
    <family>/tp1_torch, tp2_torch, pp2_torch --ckpt-format torch (mp_rank_TT[_PPP]/model_optim_rng.pt)
    llama/tp2_dist_head                      torch_dist without common.pt (Megatron-LM's main branch)
    <family>/logits.pt                       {"tokens": [b, s], "logits": [b, s, padded vocab]}

and a mixture-of-experts family ("moe": 4 layers, dense and MoE ones by --moe-layer-freq [0,1,1,0],
megatron-core's MoELayer with SequentialMLP experts, the router's expert bias, sigmoid scores, a gated
shared expert; learnt attention sinks, --softmax-type learnable, and a sliding window), built by
get_gpt_decoder_block_spec (local spec) at EP1 and saved at MOE_LAYOUTS: ep1_*, ep2_* (mp_rank_TT_EEE),
vpp_* (PP2 x 2 virtual stages: model0, model1) and pp2_uneven_torch (--decoder-first-pipeline-num-layers 1).

For llama and moe, make_optimizer_run trains with megatron-core's own optimizer (get_megatron_optimizer:
FP32Optimizer over torch's AdamW, its OptimizerParamScheduler, its gradient clipping) for ITERATION steps
on pretrain_gpt_sp.py's --mock-data samples and saves as Megatron-LM does with its optimizer state:

    <family>/optim_dist        iteration 10, torch_dist, optimizer.state.{exp_avg,exp_avg_sq}.<model key>
    <family>/optim_next_dist   the same after step 11 (on the samples our resumed run reads next)
    <family>/optim_state.pt    megatron-core's in-memory AdamW state at iteration 10, by parameter name
    llama/optim_bf16_*         the same with --bf16 (Float16OptimizerWithFloat16Params: bf16 weights, and
                               its fp32 main weights as optimizer.state.fp32_param.<model key>)
    llama/distopt_*            the same at TP2 with --use-distributed-optimizer (its DistributedDataParallel
                               and DistributedOptimizer) saved --dist-ckpt-optim-fully-reshardable
                               (optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>, the step in its
                               param groups), and distopt_dp_reshardable_dist: its default flat buckets

TP2 and PP2 models load the TP1 torch_dist checkpoint with megatron-core's own dist_checkpointing.load
(its resharding) before they are saved, so every layout holds the same weights.

megatron-core's save path assumes CUDA; the shims below (`cpu_shims`) make it run on CPU: a no-op
torch.cuda.synchronize, "cpu" as the current device, tensors staying on CPU, no psutil memory probe, no CUDA RNG
tracker in the forward (dropout is off), and the MoE router's gating GEMM without Transformer Engine
(moe_utils names te_general_gemm only when TE imports); for its optimizer (`optimizer_shims`, last), the
scalars it makes with device='cuda' made on the CPU and Tensor.type() naming CPU tensors as CUDA ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

ITERATION = 10
CONSUMED = 320  # samples: 32 per iteration
VOCAB, PADDED = 100, 128  # --vocab-size 100, --make-vocab-size-divisible-by 64: 128 at TP1 and TP2
SEQ = 16
FAMILIES = {
    "gpt2": dict(
        normalization="LayerNorm",
        add_bias_linear=True,
        add_qkv_bias=True,
        swiglu=False,
        position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False,
        num_query_groups=4,
        group_query_attention=False,
        ffn_hidden_size=256,
        qk_layernorm=False,
        rotary_base=10000,
    ),
    "llama": dict(
        normalization="RMSNorm",
        add_bias_linear=False,
        add_qkv_bias=False,
        swiglu=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
        group_query_attention=True,
        ffn_hidden_size=128,
        qk_layernorm=True,
        rotary_base=20000,
    ),
}
FAMILIES["moe"] = dict(FAMILIES["llama"], num_layers=4, qk_layernorm=False)
# the MoE family's TransformerConfig fields beyond the dense ones (Megatron-LM's args: the same names,
# num_moe_experts as num_experts)
MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_layer_freq=[0, 1, 1, 0],
    moe_shared_expert_intermediate_size=64,
    moe_shared_expert_gate=True,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.0,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-3,
    moe_token_dispatcher_type="allgather",
    softmax_type="learnable",
    window_size=(5, 0),
)
# (name, tp, pp, ep, vp, first-stage layers, formats): the layouts the MoE family is saved at
MOE_LAYOUTS = (
    ("ep2", 1, 1, 2, None, None, ("dist", "torch")),
    ("vpp", 1, 2, 1, 2, None, ("dist", "torch")),
    ("pp2_uneven", 1, 2, 1, None, 1, ("torch",)),
)


def cpu_shims() -> None:
    """What megatron-core 0.16.1's dist_checkpointing needs to save and load on a CPU-only torch."""
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the tied embedding's PP all-reduce
    filesystem_async._process_memory = lambda: 0
    tensor_parallel.get_cuda_rng_tracker = _NoRNGTracker  # the forward, no dropout: nothing to fork
    moe_utils.te_general_gemm = None  # the router's gating GEMM in torch (moe_utils leaves the name unset)
    fused_softmax.get_sliding_window_causal_mask = _window_mask  # its own builds the mask on "cuda"


def _window_mask(sq: int, skv: int, window) -> torch.Tensor:
    """[sq, skv] True = masked: query i (aligned to the last keys) sees keys i - left .. i + right."""
    i = torch.arange(sq).unsqueeze(1) + (skv - sq)
    j = torch.arange(skv).unsqueeze(0)
    return ~((j >= i - window[0]) & (j <= i + window[1]))


class _NoRNGTracker:
    def fork(self, *args, **kwargs):
        import contextlib

        return contextlib.nullcontext()


def megatron_args(family: str, tp: int, pp: int, ep: int = 1, vp=None, first=None) -> argparse.Namespace:
    """The training arguments Megatron-LM pickles into a checkpoint (the ones a reader needs, under
    megatron/training/arguments.py's names, and a few it does not)."""
    from megatron.core.transformer.enums import AttnBackend

    f = FAMILIES[family]
    moe = {}
    if family == "moe":
        moe = {k: v for k, v in MOE.items() if k != "num_moe_experts"}
        moe.update(num_experts=MOE["num_moe_experts"], expert_tensor_parallel_size=tp)
        moe.update(decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=None)
    return argparse.Namespace(
        hidden_size=64,
        num_attention_heads=4,
        kv_channels=16,
        max_position_embeddings=SEQ,
        seq_length=SEQ,
        vocab_size=VOCAB,
        padded_vocab_size=PADDED,
        make_vocab_size_divisible_by=64,
        layernorm_epsilon=1e-5,
        layernorm_zero_centered_gamma=False,
        rotary_percent=1.0,
        rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=False,
        openai_gelu=False,
        squared_relu=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
        sequence_parallel=False,  # torch's norms in the local spec refuse it; it changes no tensor
        params_dtype=torch.float32,
        attention_backend=AttnBackend.local,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        seed=1234,
        micro_batch_size=4,
        global_batch_size=32,
        lr=3e-4,
        min_lr=3e-5,
        lr_decay_style="cosine",
        lr_warmup_iters=2,
        train_iters=100,
        use_distributed_optimizer=True,
        ckpt_format="torch",
        iteration=ITERATION,
        consumed_train_samples=CONSUMED,
        **{"num_experts": None, "num_layers": 2, **f, **moe},
    )


_LAYOUT = {}  # this process's current layout's vp and first-stage layers (layout())


def build_chunks(family: str) -> list:
    """This rank's model chunks at the current layout (one, or one per virtual pipeline stage)."""
    from megatron.core import parallel_state as ps

    vp = _LAYOUT.get("vp")
    if vp is None:
        return [build_model(family, ps.is_pipeline_first_stage(True), ps.is_pipeline_last_stage(True))]
    stage = lambda c: dict(ignore_virtual=False, vp_stage=c)  # noqa: E731
    return [
        build_model(family, ps.is_pipeline_first_stage(**stage(c)), ps.is_pipeline_last_stage(**stage(c)), c)
        for c in range(vp)
    ]


def build_model(family: str, pre_process: bool = True, post_process: bool = True, vp_stage=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = FAMILIES[family]
    swiglu = f["swiglu"]
    moe = dict(MOE) if family == "moe" else {}
    if _LAYOUT.get("vp"):
        moe["virtual_pipeline_model_parallel_size"] = _LAYOUT["vp"]
    if _LAYOUT.get("first"):
        moe["num_layers_in_first_pipeline_stage"] = _LAYOUT["first"]
    cfg = TransformerConfig(
        num_layers=f.get("num_layers", 2),
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=f["num_query_groups"],
        kv_channels=16,
        ffn_hidden_size=f["ffn_hidden_size"],
        normalization=f["normalization"],
        layernorm_epsilon=1e-5,
        add_bias_linear=f["add_bias_linear"],
        add_qkv_bias=f["add_qkv_bias"],
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        bias_activation_fusion=False,
        qk_layernorm=f["qk_layernorm"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=_tp_size(),
        pipeline_model_parallel_size=_pp_size(),
        expert_model_parallel_size=_ep_size(),
        pipeline_dtype=torch.float32,
        **moe,
    )
    if family == "moe":
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=f["normalization"], qk_layernorm=f["qk_layernorm"])
    return GPTModel(
        cfg,
        spec,
        vocab_size=PADDED,
        max_sequence_length=SEQ,
        position_embedding_type=f["position_embedding_type"],
        rotary_base=f["rotary_base"],
        share_embeddings_and_output_weights=not f["untie_embeddings_and_output_weights"],
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
    )


def _ep_size():
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size()


def _tp_size():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def _pp_size():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def perturb(model) -> None:
    """Every parameter moved off its initial value, so that a loader ignoring one is seen."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("expert_bias"):  # the router's aux-loss-free balancing state
                b.add_(torch.randn(b.shape, generator=gen) * 0.1)


def state_dict(args, chunks: list) -> dict:
    """Megatron-LM's generate_state_dict: `model`, or `model0`, `model1`... under virtual pipeline
    stages, with its optimizer-scheduler state."""
    models = {"model": chunks[0]} if len(chunks) == 1 else {f"model{c}": m for c, m in enumerate(chunks)}
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": ITERATION,
        **models,
        "opt_param_scheduler": {
            "max_lr": 3e-4,
            "min_lr": 3e-5,
            "lr_warmup_steps": 64,
            "num_steps": CONSUMED,
            "lr_decay_steps": 3200,
            "lr_decay_style": "cosine",
        },
        "num_floating_point_operations_so_far": 1.5e12,
    }


def save_torch(root: str, family: str, chunks: list, *layout) -> None:
    """--ckpt-format torch: each expert-DP-rank-0 rank writes its own file (Megatron-LM's
    get_checkpoint_name: mp_rank_TT, _PPP when PP > 1, _EEE when EP > 1). layout: tp, pp[, ep, vp, first]."""
    from megatron.core import parallel_state as ps

    tp, pp, ep = (tuple(layout) + (1,))[:3]
    if ps.get_expert_data_parallel_rank() == 0:
        name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        if pp > 1:
            name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
        if ep > 1:
            name += f"_{ps.get_expert_model_parallel_rank():03d}"
        path = os.path.join(root, f"iter_{ITERATION:07d}", name)
        os.makedirs(path, exist_ok=True)
        args = megatron_args(family, *layout)
        sd = state_dict(args, [m.state_dict_for_save_checkpoint() for m in chunks])
        torch.save(sd, os.path.join(path, "model_optim_rng.pt"))
    _finish(root)


def save_dist(root: str, family: str, chunks: list, *layout, head_style: bool = False) -> None:
    """--ckpt-format torch_dist; head_style: the common state inside the .distcp files as the
    "common_state" object, no common.pt (as Megatron-LM's main branch saves it)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    path = os.path.join(root, f"iter_{ITERATION:07d}")
    os.makedirs(path, exist_ok=True)
    args = megatron_args(family, *layout)
    args.ckpt_format = "torch_dist"
    sd = state_dict(args, [m.sharded_state_dict() for m in chunks])
    if head_style:
        common = {k: sd.pop(k) for k in list(sd) if not k.startswith("model")}
        rank = torch.distributed.get_rank()
        sd["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=rank)
    dist_checkpointing.save(sd, path, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    if head_style and torch.distributed.get_rank() == 0:
        os.remove(os.path.join(path, "common.pt"))
    _finish(root)


def _finish(root: str) -> None:
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    torch.distributed.barrier()


def load_dist(chunks: list, path: str) -> None:
    from megatron.core import dist_checkpointing

    names = ["model"] if len(chunks) == 1 else [f"model{c}" for c in range(len(chunks))]
    loaded = dist_checkpointing.load({n: m.sharded_state_dict() for n, m in zip(names, chunks)}, path)
    for name, m in zip(names, chunks):
        m.load_state_dict(loaded[name])


def logits(model) -> dict:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(2, 1, SEQ, SEQ)  # True: masked
    with torch.no_grad():
        out = model.eval()(tokens, positions, mask)  # [b, s, padded vocab]
    return {"tokens": tokens, "logits": out}


def layout(tp: int, pp: int, ep: int = 1, vp=None, first=None) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=ep,
    )
    _LAYOUT.clear()
    _LAYOUT.update(vp=vp, first=first)


def make_family(out: str, family: str) -> None:
    base = os.path.join(out, family)
    layout(1, 1)
    torch.manual_seed(1234)
    model = build_model(family)
    perturb(model)
    if torch.distributed.get_rank() == 0:
        os.makedirs(base, exist_ok=True)
        torch.save(logits(model), os.path.join(base, "logits.pt"))
    model.train()
    first = "ep1" if family == "moe" else "tp1"
    save_dist(os.path.join(base, f"{first}_dist"), family, [model], 1, 1)
    save_torch(os.path.join(base, f"{first}_torch"), family, [model], 1, 1)
    source = os.path.join(base, f"{first}_dist", f"iter_{ITERATION:07d}")
    cases = MOE_LAYOUTS if family == "moe" else (("tp2", 2, 1, 1, None, None, ("dist", "torch")),)
    cases += () if family == "moe" else (("pp2", 1, 2, 1, None, None, ("dist", "torch")),)
    for name, tp, pp, ep, vp, first, formats in cases:
        layout(tp, pp, ep, vp, first)
        chunks = build_chunks(family)
        load_dist(chunks, source)
        shape = (tp, pp, ep, vp, first)
        for fmt in formats:
            (save_dist if fmt == "dist" else save_torch)(os.path.join(base, f"{name}_{fmt}"), family, chunks, *shape)
        if family == "llama" and tp == 2:
            save_dist(os.path.join(base, "tp2_dist_head"), family, chunks, *shape, head_style=True)


# ---- a run with megatron-core's own optimizer -----------------------------------------------------

OPTIM = dict(lr=3e-4, min_lr=3e-5, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
GLOBAL_BATCH = 32
# what Megatron-LM's _build_sharded_state_dict_metadata passes a non-distributed optimizer's sharded_state_dict
SAVE_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def optimizer_shims() -> None:
    """What megatron-core 0.16.1's FP32Optimizer, its gradient norm and clipping need on CPU: the
    scalars they make with device='cuda' (the loss scale of 1, the norm's all-reduce buffer, the
    no-op flag of multi_tensor_applier) made on the CPU, and Tensor.type() naming a CPU tensor as
    its CUDA kind (its asserts). The arithmetic is megatron-core's own."""
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        make = getattr(torch, name)
        setattr(torch, name, _on_cpu(make))
    cpu_type = torch.Tensor.type

    def type_(self, *args, **kwargs):  # its asserts that a gradient is a torch.cuda.FloatTensor
        name = cpu_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and isinstance(name, str) else name

    torch.Tensor.type = type_


def _on_cpu(make):
    def made(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return make(*args, device=device, **kwargs)

    return made


def mock_batch(start: int, count: int, vocab: int) -> tuple:
    """Samples start .. start + count - 1 of pretrain_gpt_sp.py --mock-data --vocab-size `vocab`
    (seed 1234): the samples our resumed run reads after Megatron-LM's `start` consumed ones."""
    from megatron_sp.data.mock import MockGPTDataset

    data = MockGPTDataset(start + count, SEQ, vocab, 1234)
    items = [data[i] for i in range(start, start + count)]
    return torch.stack([d["tokens"] for d in items]), torch.stack([d["labels"] for d in items])


def megatron_step(model, optimizer, scheduler, step: int, vocab: int) -> None:
    """One Megatron-LM train_step on global batch `step` (every micro-batch at once: with a full loss
    mask the mean over the global batch is its micro-batches' mean of means): zero_grad, the mean
    token loss's backward, finalize_model_grads (megatron-core's DDP wrapper only), optimizer.step()
    (clipping included), then the schedule's step."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    tokens, labels = mock_batch(step * GLOBAL_BATCH, GLOBAL_BATCH, vocab)
    positions = torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(GLOBAL_BATCH, 1, SEQ, SEQ)
    ddp = isinstance(model, DistributedDataParallel)
    if ddp:
        model.zero_grad_buffer()
    optimizer.zero_grad()
    model.train()(tokens, positions, mask, labels=labels).float().mean().backward()
    if ddp:
        finalize_model_grads([model])
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(increment=GLOBAL_BATCH)


def make_optimizer_run(out: str, family: str, vocab: int, bf16: bool = False, distributed: bool = False) -> None:
    """<family>/optim_dist: ITERATION steps of megatron-core's own AdamW (get_megatron_optimizer: the
    non-distributed FP32Optimizer, and its OptimizerParamScheduler) on the mock data, saved with
    --ckpt-format torch_dist as Megatron-LM's save_checkpoint does (its optimizer's sharded_state_dict:
    optimizer.state.exp_avg / exp_avg_sq.<model key>, the common step in common.pt); then step
    ITERATION + 1 taken and saved to <family>/optim_next_dist, and megatron-core's in-memory AdamW state
    by parameter name to <family>/optim_state.pt. vocab: the tokenizer's (args.vocab_size); our step on
    the same batch is Megatron's only with vocab = the padded size (Megatron's loss normalises over the
    padded rows too). bf16: optim_bf16_* (Float16OptimizerWithFloat16Params). distributed: distopt_*,
    at TP2 (DP1: gloo has no reduce-scatter) inside megatron-core's DistributedDataParallel, its
    DistributedOptimizer saved as --dist-ckpt-optim-fully-reshardable saves it (no state.pt), and at
    iteration 10 also as its default dp_reshardable (distopt_dp_reshardable_dist: flat buckets)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    tp = 2 if distributed else 1
    layout(1, 1)
    torch.manual_seed(1234)
    module = build_model(family)
    perturb(module)
    if distributed:  # the same weights at TP2, resharded by megatron-core's own load
        whole = os.path.join(out, family, "distopt_start")
        save_dist(whole, family, [module], 1, 1)
        layout(tp, 1)
        module = build_model(family)
        load_dist([module], os.path.join(whole, f"iter_{ITERATION:07d}"))
    if bf16:  # Megatron-LM's --bf16: bf16 parameters, Float16OptimizerWithFloat16Params's fp32 main weights
        module.bfloat16()
    tag = "distopt" if distributed else "optim_bf16" if bf16 else "optim"
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True)
    if distributed:
        model = DistributedDataParallel(module.config, ddp_config, module)
    else:
        model = module
        model.ddp_config = ddp_config  # what get_megatron_optimizer reads of its DDP wrapper
    config = OptimizerConfig(optimizer="adam", bf16=bf16, fp16=False, use_distributed_optimizer=distributed, **OPTIM)
    optimizer = get_megatron_optimizer(config, [model])
    args = megatron_args(family, tp, 1)
    args.ckpt_format, args.use_distributed_optimizer, args.vocab_size = "torch_dist", distributed, vocab
    args.dist_ckpt_optim_fully_reshardable = distributed
    for name, value in OPTIM.items():
        setattr(args, name, value)
    samples = lambda iters: iters * GLOBAL_BATCH  # noqa: E731
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=samples(args.lr_warmup_iters),
        lr_decay_steps=samples(args.train_iters),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=samples(args.train_iters),
        wd_incr_style="constant",
    )
    metadata = dict(SAVE_METADATA)
    if distributed:
        metadata.update(distrib_optim_sharding_type="fully_reshardable")
        metadata.update(distrib_optim_fully_reshardable_mem_efficient=False)
    for step in range(ITERATION + 1):
        if step == ITERATION:
            _save_with_optimizer(os.path.join(out, family, f"{tag}_dist"), args, module, optimizer, scheduler, metadata)
        if step == ITERATION and distributed:  # Megatron-LM's default for the distributed optimizer
            flat = dict(SAVE_METADATA, distrib_optim_sharding_type="dp_reshardable")
            root = os.path.join(out, family, "distopt_dp_reshardable_dist")
            _save_with_optimizer(root, args, module, optimizer, scheduler, flat)
        if step == ITERATION and not distributed and torch.distributed.get_rank() == 0:
            torch.save(_adam_by_name(module, optimizer), os.path.join(out, family, f"{tag}_state.pt"))
        megatron_step(model, optimizer, scheduler, step, vocab)
    args.iteration, args.consumed_train_samples = ITERATION + 1, CONSUMED + GLOBAL_BATCH
    _save_with_optimizer(os.path.join(out, family, f"{tag}_next_dist"), args, module, optimizer, scheduler, metadata)


def _save_with_optimizer(root: str, args, module, optimizer, scheduler, metadata: dict) -> None:
    """Megatron-LM's save_checkpoint for torch_dist (generate_state_dict of the unwrapped model, its
    optimizer's sharded_state_dict with _build_sharded_state_dict_metadata's flags), as iteration 10
    whatever the step (the directory names which)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    path = os.path.join(root, f"iter_{ITERATION:07d}")
    os.makedirs(path, exist_ok=True)
    sd = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": module.sharded_state_dict()}
    sd["optimizer"] = optimizer.sharded_state_dict(sd, metadata=metadata)
    sd["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(sd, path, TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    _finish(root)


def _adam_by_name(model, optimizer) -> dict:
    """{megatron-core parameter name: {exp_avg, exp_avg_sq, step, main}} of every optimizer (a
    ChainedOptimizer's: dense and expert parameters); main: the fp32 main weight the optimizer steps
    (Float16OptimizerWithFloat16Params's copy of a bf16 parameter, else the parameter)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        pairs = [(p, p) for g in opt.optimizer.param_groups for p in g["params"] if id(p) in names]
        mains = zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", []))
        pairs += [pair for model_group, main_group in mains for pair in zip(model_group, main_group)]
        for p, main in pairs:
            state = {k: v.clone() for k, v in opt.optimizer.state[main].items()}
            out[names[id(p)]] = {**state, "main": main.detach().clone()}
    return out


EXPORTS = (("torch_dist", 2, 1), ("torch", 2, 1), ("torch", 1, 2), ("torch_dist", 1, 2))
MOE_EXPORTS = (("torch_dist", 1, 1, 2), ("torch", 1, 1, 2), ("torch", 1, 2, 1))


def exports(family: str) -> tuple:
    """(format, tp, pp, ep) of each export of a family."""
    return MOE_EXPORTS if family == "moe" else tuple(case + (1,) for case in EXPORTS)


def export_name(fmt: str, tp: int, pp: int, ep: int = 1) -> str:
    return f"export_{fmt}_tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "")


def convert_all(out: str) -> None:
    """Each family's TP1 torch_dist checkpoint through tools/convert_megatron.py into ours, and ours out
    again at each of its exports (in a process of its own, without the fixture's process group)."""
    from tools import convert_megatron

    for family in FAMILIES:
        base = os.path.join(out, family)
        ours = os.path.join(base, "ours")
        source = os.path.join(base, "ep1_dist" if family == "moe" else "tp1_dist")
        assert convert_megatron.main(["--load", source, "--save", ours]) == 0
        for fmt, tp, pp, ep in exports(family):
            argv = ["export", "--load", ours, "--save", os.path.join(base, export_name(fmt, tp, pp, ep))]
            argv += ["--format", fmt, "--tensor-model-parallel-size", str(tp)]
            argv += ["--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep)]
            assert convert_megatron.main(argv) == 0


def check_exports(base: str, family: str) -> None:
    """megatron-core loads each export (dist_checkpointing.load of its sharded state dict, or
    torch.load of its rank's file and a strict load_state_dict) into the model of that layout; its
    tensors must equal those of the same model loaded from the original TP1 checkpoint (vocab rows
    beyond the tokenizer's 100: zeros). Writes base/export_check.json: {export: [mismatches]}."""
    import json

    from megatron.core import parallel_state as ps

    report = {}
    source = os.path.join(base, "ep1_dist" if family == "moe" else "tp1_dist", f"iter_{ITERATION:07d}")
    for fmt, tp, pp, ep in exports(family):
        layout(tp, pp, ep)
        exported, original = build_chunks(family), build_chunks(family)
        path = os.path.join(base, export_name(fmt, tp, pp, ep), "iter_0000000")
        if fmt == "torch_dist":
            load_dist(exported, path)
        else:
            name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
            name += f"_{ps.get_pipeline_model_parallel_rank():03d}" if pp > 1 else ""
            name += f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""
            sd = torch.load(os.path.join(path, name, "model_optim_rng.pt"))["model"]
            exported[0].load_state_dict(sd, strict=True)
        load_dist(original, source)
        mismatches = _compare(exported[0].state_dict(), original[0].state_dict(), tp)
        views = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(views, mismatches)
        report[export_name(fmt, tp, pp, ep)] = sorted({m for view in views for m in view})
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(base, "export_check.json"), "w") as f:
            json.dump(report, f)


def _compare(exported: dict, original: dict, tp: int) -> list:
    """Names whose tensors differ (this rank's shards)."""
    from megatron.core import parallel_state as ps

    bad = sorted(set(exported) ^ set(original))
    for name, t in original.items():
        if not torch.is_tensor(t) or name in bad:
            continue
        e = exported[name]
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):  # this rank's vocab rows
            real = max(0, min(t.shape[0], VOCAB - ps.get_tensor_model_parallel_rank() * t.shape[0]))
            ok = torch.equal(e[:real], t[:real]) and not e[real:].any()
        else:
            ok = torch.equal(e, t)
        if not ok:
            bad.append(name)
    return bad


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    cpu_shims()
    for family in FAMILIES:
        make_family(out, family)
    if rank == 0:
        import subprocess

        done = subprocess.run([sys.executable, __file__, "--convert", out], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    torch.distributed.barrier()
    for family in FAMILIES:
        check_exports(os.path.join(out, family), family)
    optimizer_shims()  # (last: Tensor.type() names CPU tensors as CUDA ones from here on)
    make_optimizer_run(out, "llama", PADDED)
    make_optimizer_run(out, "llama", PADDED, bf16=True)
    make_optimizer_run(out, "llama", PADDED, distributed=True)
    make_optimizer_run(out, "moe", VOCAB)
    torch.distributed.destroy_process_group()


def main(argv) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(argv[0], port), nprocs=2, start_method="fork")


if __name__ == "__main__":
    if sys.argv[1] == "--convert":
        convert_all(sys.argv[2])
    else:
        main(sys.argv[1:])

"""Bytes per GPU: weights, gradients, optimizer state, activations and buffers, for one layout.

The parameters of a rank are listed shape by shape (`rank_parameters`, the model's creation order:
embeddings, each layer's norm / QKV / projection / norm / FC1 / FC2, final norm, output layer), so
that the weights, gradients and the distributed optimizer's uneven shares (whole parameters per
owner, `share_owners`) are predicted exactly; tests/test_plan.py compares them with the tensors the
program builds.

Precision (bytes per parameter: weight + gradient + optimizer state):
    fp32                          4 + 4 + 8            moments / r with the distributed optimizer
    bf16 / fp16 as autocast       4 + 4 + 8            (--bf16 / --fp16 before issue 17)
    bf16 / fp16, Megatron's       2 + 4 + 12           what --bf16 / --fp16 run: main weights + moments / r
                                  2 + 2 + 12           with --grad-reduce-in-bf16
    FSDP2 (ZeRO-3), every mode    (4 + 4 + 8) / r      fp32 shards (the main weights), fp32 gradients;
                                                       plus two layers gathered (modelled); under
                                                       pipeline stages the stage stays gathered for the
                                                       step, its gradients unsharded in fp32: + 2|4 + 4
r = DP x CP replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_sp.distributed.distributed_optimizer import share_owners
from megatron_sp.distributed.grad_buffers import BUCKET_BYTES  # (one bucket in flight without overlap)
from megatron_sp.layer_options import cp_comm_types, is_moe_layer
from megatron_sp.planning import activations as act

GIB = 1024**3
SHARDINGS = ("replicated", "distributed", "fsdp2")  # AdamW state: every rank / over r (ZeRO-1) / ZeRO-3


@dataclass(frozen=True)
class Precision:
    name: str
    weight: int  # bytes per parameter of the model's weights
    grad: int  # of its gradients (main grads)
    master: int  # fp32 main weights kept by the optimizer (0: the weights are fp32)
    act: int  # bytes per activation element
    flat_bucket_copies: bool  # gradient buckets are concatenated copies (today's grad_sync), not views
    moments: int = 8  # AdamW exp_avg + exp_avg_sq, fp32

    @property
    def optimizer(self) -> int:
        return self.master + self.moments


def precision(mode: str, megatron_mixed: bool, grad_reduce_in_bf16: bool = False) -> Precision:
    """mode fp32 / bf16 / fp16; megatron_mixed: low-precision weights with fp32 main weights in the
    optimizer (Megatron's --bf16, the program since issue 17, whose gradients are views of contiguous
    buffers in every mode), else autocast over fp32 weights with flat bucket copies (the program before)."""
    if mode == "fp32":
        return Precision("fp32", 4, 4, 0, 4, not megatron_mixed)
    if not megatron_mixed:
        return Precision(f"{mode} (autocast, fp32 weights)", 4, 4, 0, 2, True)
    return Precision(f"{mode} (fp32 main weights)", 2, 2 if grad_reduce_in_bf16 else 4, 4, 2, False)


# ---- the parameters of one rank ----------------------------------------------------------------


def _norm(cfg, prefix: str, size: int):
    return [(f"{prefix}.weight", (size,))] + ([(f"{prefix}.bias", (size,))] if cfg.normalization == "LayerNorm" else [])


def _mlp_parameters(cfg, prefix: str, f: int, t: int):
    """A dense MLP of width f (fc1 column-, fc2 row-parallel over t)."""
    h, fc1 = cfg.hidden_size, (2 * f if cfg.gated_linear_unit else f) // t
    out = [(f"{prefix}.fc1.weight", (fc1, h))] + ([(f"{prefix}.fc1.bias", (fc1,))] if cfg.add_bias_linear else [])
    out += [(f"{prefix}.fc2.weight", (h, f // t))]
    return out + ([(f"{prefix}.fc2.bias", (h,))] if cfg.add_bias_linear else [])


def _moe_parameters(cfg, prefix: str, t: int):
    """An MoE layer's router [E, h] (and bias [E] with add_bias_linear; every rank), the rank's E / EP
    experts (fc1 rows and fc2 columns split over expert-TP; models/moe/experts.py) and the shared expert
    (TP-split as a dense MLP, with its gate [1, h] under --moe-shared-expert-gate)."""
    h, f, etp = cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.expert_tensor_parallel_size
    out = [(f"{prefix}.router.weight", (cfg.num_experts, h))]
    out += [(f"{prefix}.router.bias", (cfg.num_experts,))] if cfg.add_bias_linear else []
    rows = (2 * f if cfg.gated_linear_unit else f) // etp
    for e in range(cfg.num_experts // cfg.expert_model_parallel_size):
        x = f"{prefix}.experts.local_experts.{e}"
        out += [(f"{x}.fc1.weight", (rows, h))] + ([(f"{x}.fc1.bias", (rows,))] if cfg.add_bias_linear else [])
        out += [(f"{x}.fc2.weight", (h, f // etp))] + ([(f"{x}.fc2.bias", (h,))] if cfg.add_bias_linear else [])
    if cfg.moe_shared_expert_intermediate_size:
        out += _mlp_parameters(cfg, f"{prefix}.shared_experts", cfg.moe_shared_expert_intermediate_size, t)
        out += [(f"{prefix}.shared_experts.gate_weight", (1, h))] if cfg.moe_shared_expert_gate else []
    return out


def _layer_parameters(cfg, t: int, i: int):
    h, d = cfg.hidden_size, cfg.kv_channels
    nq = cfg.num_attention_heads // t
    nkv = cfg.num_query_groups // t if cfg.num_query_groups >= t else 1  # a copy of one head when t > g
    qkv = (nq + 2 * nkv) * d
    out = _norm(cfg, f"layers.{i}.ln1", h) + [(f"layers.{i}.attn.qkv.weight", (qkv, h))]
    out += [(f"layers.{i}.attn.qkv.bias", (qkv,))] if cfg.add_qkv_bias else []
    out += [(f"layers.{i}.attn.proj.weight", (h, nq * d))]
    out += [(f"layers.{i}.attn.proj.bias", (h,))] if cfg.add_bias_linear else []
    if cfg.qk_layernorm:
        out += _norm(cfg, f"layers.{i}.attn.q_norm", d) + _norm(cfg, f"layers.{i}.attn.k_norm", d)
    if cfg.softmax_type == "learnable":
        out += [(f"layers.{i}.attn.softmax_offset", (nq,))]
    out += _norm(cfg, f"layers.{i}.ln2", h)
    if is_moe_layer(cfg, i + 1):
        return out + _moe_parameters(cfg, f"layers.{i}.mlp", t)
    return out + _mlp_parameters(cfg, f"layers.{i}.mlp", cfg.ffn_hidden_size, t)


def is_expert(name: str) -> bool:
    """An expert's parameter (reduced and sharded over the expert-data-parallel group)."""
    return ".mlp.experts." in name


def expert_replicas(cfg, dp: int) -> int:
    """The expert-data-parallel size: a stage's TP x CP x DP ranks over EP x expert-TP."""
    stage = cfg.tensor_model_parallel_size * cfg.context_parallel_size * dp
    return stage // (cfg.expert_model_parallel_size * cfg.expert_tensor_parallel_size)


def rank_parameters(cfg, stage: int = 0, stages: int = 1):
    """(name, shape) of the parameters one TP rank of pipeline stage `stage` holds, in creation order.
    Every TP rank holds the same shapes. With stages > 1 the last stage keeps its own copy of a tied
    embedding (Megatron)."""
    t, h, vocab = cfg.tensor_model_parallel_size, cfg.hidden_size, cfg.padded_vocab_size
    per_stage = cfg.num_layers // stages
    first, last = stage == 0, stage == stages - 1
    out = [("embedding.word_embeddings.weight", (vocab // t, h))] if first else []
    if first and cfg.position_embedding_type == "learned_absolute":
        out.append(("embedding.position_embeddings.weight", (cfg.max_position_embeddings, h)))
    for i in range(stage * per_stage, (stage + 1) * per_stage):
        out += _layer_parameters(cfg, t, i)
    if last:
        norm = [("weight", (h,))] + ([("bias", (h,))] if cfg.normalization == "LayerNorm" else [])
        out += [(f"final_ln.{n}", s) for n, s in norm]
        if cfg.untie_embeddings_and_output_weights or not first:
            out.append(("output_layer.weight", (vocab // t, h)))
    return out


def numel(shape) -> int:
    return math.prod(shape)


def optimizer_shares(shapes, opt_bytes: int, sharding: str, replicas: int) -> list:
    """Optimizer-state bytes of each replica (index = rank in the replica group)."""
    sizes = [numel(s) for s in shapes]
    if sharding == "replicated" or replicas == 1:
        return [opt_bytes * sum(sizes)] * replicas
    if sharding == "fsdp2":
        return [opt_bytes * _fsdp_shard(shapes, replicas)] * replicas
    owners = share_owners(list(reversed(sizes)), replicas)
    shares = [0] * replicas
    for owner, n in zip(owners, reversed(sizes)):
        shares[owner] += opt_bytes * n
    return shares


def largest_optimizer_share(shapes, opt_bytes: int, sharding: str, replicas: int) -> int:
    """max(optimizer_shares(...)) without a list per replica (a cluster may have 10^12 of them)."""
    if sharding == "replicated" or replicas == 1:
        return opt_bytes * sum(numel(s) for s in shapes)
    if sharding == "fsdp2":
        return opt_bytes * _fsdp_shard(shapes, replicas)
    sizes = list(reversed([numel(s) for s in shapes]))
    shares = {}
    for owner, n in zip(share_owners(sizes, replicas), sizes):
        shares[owner] = shares.get(owner, 0) + opt_bytes * n
    return max(shares.values())


def _fsdp_shard(shapes, replicas: int) -> int:
    """Elements of one FSDP2 shard: each parameter's dim 0 padded to a multiple of the replicas."""
    return sum(math.ceil(s[0] / replicas) * numel(s[1:]) for s in shapes)


# ---- the split ---------------------------------------------------------------------------------


@dataclass
class MemorySplit:
    """Bytes per GPU (the worst rank: the first pipeline stage, the largest optimizer share)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: dict = field(default_factory=dict)  # name -> bytes (transient workspaces)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + sum(self.buffers.values())


def states_bytes(shapes, prec: Precision, sharding: str, replicas: int) -> tuple:
    """(weights, gradients, optimizer state of the largest share) bytes on a rank."""
    n = sum(numel(s) for s in shapes)
    if sharding == "fsdp2" and replicas > 1:  # distributed/fsdp.py: fp32 shards and gradients in every mode
        shard = _fsdp_shard(shapes, replicas)
        return act.FP32 * shard, act.FP32 * shard, prec.moments * shard
    return prec.weight * n, prec.grad * n, largest_optimizer_share(shapes, prec.optimizer, sharding, replicas)


def rank_states(named, prec: Precision, sharding: str, replicas: int, expert_reps: int = 1) -> tuple:
    """(weights, gradients, optimizer state) bytes of a rank holding the parameters `named` ((name, shape),
    rank_parameters): the dense ones shared over the DP x CP replicas, the experts' over the
    expert-data-parallel ones (`expert_reps`), each by its own owners (distributed/distributed_optimizer.py's
    Partition); the optimizer state is the largest dense share plus the largest expert share."""
    dense = [s for n, s in named if not is_expert(n)]
    experts = [s for n, s in named if is_expert(n)]
    states = states_bytes(dense, prec, sharding, replicas)
    if experts:
        states = tuple(a + b for a, b in zip(states, states_bytes(experts, prec, sharding, expert_reps)))
    return states


def rank_optimizer(named, prec: Precision, sharding: str, replicas: int, expert_reps: int, rank: int, expert_rank: int):
    """The optimizer-state bytes of the rank at `rank` in its replica group and `expert_rank` in its
    expert-data-parallel group (tests/test_plan.py compares it with each rank's tensors)."""
    dense = [s for n, s in named if not is_expert(n)]
    experts = [s for n, s in named if is_expert(n)]
    if sharding == "fsdp2":
        return states_bytes(dense, prec, sharding, replicas)[2] + (
            states_bytes(experts, prec, sharding, expert_reps)[2] if experts else 0
        )
    out = optimizer_shares(dense, prec.optimizer, sharding, replicas)[rank]
    return out + (optimizer_shares(experts, prec.optimizer, sharding, expert_reps)[expert_rank] if experts else 0)


def activation_bytes(
    cfg, micro_batch: int, act_bytes: int, layers=None, in_flight: int = 1, head: bool = True, first: int = 1
):
    """(saved, transient) bytes on one rank: what the forward saves for the backward (`layers`
    layers from layer `first` (1-based), default all; `in_flight` micro-batches at once, as a 1F1B
    pipeline's first stage holds;
    the embedding and loss terms when `head`), and what a fully recomputed chunk holds again while
    it reruns in the backward."""
    L = cfg.num_layers if layers is None else layers
    selective = cfg.recompute_granularity == "selective"
    shapes = [act.LayerShape.from_config(cfg, micro_batch, act_bytes, layer) for layer in range(first, first + L)]
    fulls = [act.layer_bytes(x, selective=selective) for x in shapes]
    shape = shapes[0] if shapes else act.LayerShape.from_config(cfg, micro_batch, act_bytes)
    inputs = act.layer_input_bytes(shape)  # (the same for every layer)
    per_mb, transient = sum(fulls), 0.0
    if cfg.recompute_granularity == "full" and L:
        n = min(cfg.recompute_num_layers, L)
        if cfg.recompute_method == "block":  # the first n layers keep their inputs only
            per_mb, transient = n * inputs + sum(fulls[n:]), (max(fulls[:n]) if n else 0.0)
        else:  # every chunk of n layers keeps its input; one chunk reruns at a time
            chunks = [sum(fulls[i : i + n]) for i in range(0, L, n)]
            per_mb, transient = len(chunks) * inputs, max(chunks)
    head_bytes = 0.0
    if head:
        terms = act.head_terms(
            shape,
            cfg.padded_vocab_size,
            embedding_dropout=cfg.hidden_dropout > 0,
            learned_positions=cfg.position_embedding_type == "learned_absolute",
        )
        head_bytes = sum(b for _, b in terms)
    return in_flight * per_mb + head_bytes, transient


def buffer_bytes(
    cfg, micro_batch, prec: Precision, sharding, replicas, shapes, overlap_grad_reduce=True, pipeline=False, params=None
) -> dict:
    """The transient workspaces: gradient buckets, the logits' gradient, the SP gather, FSDP2's gathered
    layers (pipeline: the stage's weights and unsharded fp32 gradients, held for the step; distributed/fsdp.py)."""
    shape = act.LayerShape.from_config(cfg, micro_batch, prec.act)
    n = sum(numel(s) for s in shapes) if params is None else params
    out = {}
    if replicas > 1 and prec.flat_bucket_copies and sharding != "fsdp2":
        out["DP buckets"] = prec.grad * n if overlap_grad_reduce else min(BUCKET_BYTES, prec.grad * n)
    sb = shape.s * shape.b
    out["logits + their gradient"] = (prec.act + act.FP32) * sb * cfg.padded_vocab_size / shape.t
    if shape.sp:
        out["SP gather (input + gradient)"] = 2 * prec.act * sb * shape.h
    if cfg.context_parallel_size > 1 and "allgather" in cp_comm_types(cfg):  # one layer's, while it runs
        whole = sb * cfg.context_parallel_size * 2 * shape.kv_heads * shape.d
        out["CP all-gathered K, V (+ fp32 dK, dV)"] = (prec.act + act.FP32) * whole
    if sharding == "fsdp2" and replicas > 1 and pipeline:
        out["FSDP2 under PP: the stage gathered + its unsharded fp32 grads"] = (prec.weight + act.FP32) * n
    elif sharding == "fsdp2" and replicas > 1:
        first_moe = next((i for i in range(cfg.num_layers) if is_moe_layer(cfg, i + 1)), 0)
        per_layer = max(sum(numel(s) for _, s in _layer_parameters(cfg, shape.t, i)) for i in {0, first_moe})
        out["FSDP2: 2 layers gathered + 1 unsharded grad"] = (2 * prec.weight + prec.grad) * per_layer
    return out

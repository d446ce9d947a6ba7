"""Bytes each GPU sends per training step, and the step-time model that ranks layouts.

Collective costs per rank, ring algorithms (as bench/comm_volume.py charges them), N the bytes of the
tensor: all-reduce 2(t-1)/t N, all-gather / reduce-scatter / all-to-all (t-1)/t N.
Per layer and micro-batch, N = act_bytes * (s/c) b h (bench/comm_volume.py measures these counts):
    TP        4 all-reduces                       (2 forward, 2 backward)
    TP + SP   6 all-gathers + 4 reduce-scatters   (the backward gathers the GEMM inputs again)
    full recomputation repeats the forward's: + 2 all-reduces / + 2 AG + 2 RS
    CP p2p    K, V sent c-1 times forward and again backward, dK, dV (fp32) c times on their way home:
              (2(c-1)e + 4c) · KV,  KV = 2 (s/c) b g d (the rank's keys and values)
    CP a2a    q, k, v, out forward and their gradients backward: 2 all-to-alls of (s/c) b (2n + 2g') d e
              (g' = g, or n when g does not split over c: the key/value heads are repeated)
    CP allgather  K, V gathered forward and again backward, dK, dV (fp32) reduce-scattered: (c-1)(2e + 4) · KV
    CP a2a+p2p    a2a over the A inner ranks (as a2a with c = A), then the ring over the P outer ones on
              A times the tokens and 1/A of the heads (as p2p with c = P, KV = 2 (s/c) b g' d)
    head      embedding + logits GEMM: 2 all-reduces (SP: 5 AG/RS), cross entropy: 3 fp32 all-reduces
              of the rank's tokens; CP: the loss sum and count (two fp32 all-reduces)
    MoE       (EP P, expert-TP T, per MoE layer; n the rank's tokens in the SP region, N = n k its routed
              rows (capacity: capped, planning/activations.py), rh = e h a row, rp the router's bytes)
              all-to-all: forward the counts (8E), the rows there and back and their weights,
                  2 ring_a2a(P, N rh) + ring_a2a(P, N rp) + ring_a2a(P, 8E); backward the same without
                  the counts; expert-TP gathers the peers' rows and weights and reduce-scatters the
                  outputs: (T-1)(2 N rh + N rp) + (T-1) 8E forward, (T-1)(2 N rh + N rp) backward
              all-gather (G = P T): the tokens, weights [n, E] and choices (1 byte) gathered, the
                  outputs reduce-scattered: (G-1) n (2 rh + E rp + E) forward, (G-1) n (2 rh + E rp)
                  backward
              capacity over TP x CP > 1 ranks: the keys [n, E] and positions all-gathered (forward)
              (routing taken balanced: each rank receives the rows it sends; the load-balancing
              statistics' E-sized all-reduces are left out)
(tests/test_plan.py checks TP, CP and MoE bytes against the collectives of one forward + backward.)
Per step: DP x CP gradient all-reduce of the dense parameters, and of the experts' over the
expert-data-parallel group (TP x CP x DP / (EP x expert-TP) ranks) (distributed optimizer: reduce +
broadcast, the same bytes; Megatron's: reduce-scatter grads + all-gather weights); FSDP2: per micro-batch, the weights
gathered twice (forward, backward) and the gradients reduce-scattered; pipeline: one activation
send forward and one gradient send backward per micro-batch and stage boundary.

Step time = compute + exposed communication + pipeline bubble, where
    compute   = FLOPs per GPU / (peak x MFU), FLOPs = GPTConfig.flops_per_token x tokens
                (+ one forward of the layers with full recomputation, of attention with selective)
    TP, CP a2a and allgather, MoE dispatch, pipeline sends: exposed (nothing overlaps them here; the
              dispatch over NVLink when EP x expert-TP fits a node, its ranks being consecutive)
    CP p2p    overlaps the attention compute of the step it feeds (a2a+p2p: its ring part does; the
              a2a part runs over the inner group's links, the ring over the whole CP group's)
    DP        overlaps the last micro-batch's backward (--overlap-grad-reduce); FSDP2 all compute; the
              expert-DP reduction with it
    bubble    (pp - 1) / micro-batches x compute
over NVLink when a group fits in a node, InfiniBand (per GPU) when it spans nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sp.layer_options import cp_comm_types, is_moe_layer
from megatron_sp.planning.activations import LayerShape, MoEShape

FP32 = 4


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu_memory_gib: float
    reserved_gib: float  # CUDA context, allocator slack, NCCL workspaces
    peak_tflops: float  # per GPU, dense bf16; fp32 runs at half (TF32)
    mfu: float  # fraction of peak the model's FLOPs reach
    nvlink_gbps: float  # GB/s per GPU, within a node
    ib_gbps: float  # GB/s per GPU, across nodes

    def bandwidth(self, group_span: int) -> float:
        """Bytes/s of a group whose ranks lie within `group_span` consecutive GPUs."""
        return 1e9 * (self.nvlink_gbps if group_span <= self.gpus_per_node else self.ib_gbps)


def ring(kind: str, t: int, nbytes: float) -> float:
    if t <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (t - 1) / t * nbytes


def tp_bytes_per_layer(t: int, sp: bool, n_bytes: float, recompute_full: bool) -> float:
    if sp:
        calls = 10 + (4 if recompute_full else 0)
        return calls * ring("all_gather", t, n_bytes)
    return (4 + (2 if recompute_full else 0)) * ring("all_reduce", t, n_bytes)


@dataclass(frozen=True)
class CPTraffic:
    """Bytes one rank sends for one layer's attention and micro-batch, over a group spanning `span`
    GPUs; `overlaps`: hidden under the attention compute (the ring's steps)."""

    nbytes: float
    span: int
    overlaps: bool


def _ring_bytes(c: int, act_bytes: int, kv: float) -> float:
    return (2 * (c - 1) * act_bytes + c * FP32) * kv if c > 1 else 0.0


def cp_traffic(cfg, comm: str, micro_batch: int, act_bytes: int) -> list:
    """The CPTraffic of one layer of CP type `comm` (module docstring's formulas)."""
    c, t, d = cfg.context_parallel_size, cfg.tensor_model_parallel_size, cfg.kv_channels
    if c == 1:
        return []
    tokens = cfg.seq_length // c * micro_batch
    g = cfg.num_query_groups // t if cfg.num_query_groups >= t else 1
    nq = cfg.num_attention_heads // t

    def heads(parts):  # key/value heads after Ulysses' split over `parts` (repeated when too few)
        return g if g % parts == 0 else nq

    def a2a(parts):
        return 2 * ring("all_to_all", parts, act_bytes * tokens * (2 * nq + 2 * heads(parts)) * d)

    if comm == "a2a":
        return [CPTraffic(a2a(c), t * c, False)]
    kv = 2 * tokens * g * d
    if comm == "allgather":
        return [CPTraffic((c - 1) * (2 * act_bytes + FP32) * kv, t * c, False)]
    if comm == "a2a+p2p":
        inner, outer = cfg.hierarchical_context_parallel_sizes
        ring_kv = 2 * tokens * heads(inner) * d
        return [CPTraffic(a2a(inner), t * inner, False), CPTraffic(_ring_bytes(outer, act_bytes, ring_kv), t * c, True)]
    return [CPTraffic(_ring_bytes(c, act_bytes, kv), t * c, True)]


def cp_bytes_per_layer(cfg, micro_batch: int, act_bytes: int, comm=None) -> float:
    """Bytes a rank sends per layer and micro-batch for CP type `comm` (default: the mean over cfg's layers)."""
    types = [comm] if comm is not None else list(cp_comm_types(cfg))
    return sum(x.nbytes for kind in types for x in cp_traffic(cfg, kind, micro_batch, act_bytes)) / len(types)


def _head_bytes(t: int, sp: bool, n_bytes: float, tokens: int) -> float:
    """Embedding and logits GEMM (SP: RS + AG, and AG + RS + the backward's re-gather), plus the
    vocab-parallel cross entropy's three fp32 all-reduces over the tokens."""
    gemms = 5 * ring("all_gather", t, n_bytes) if sp else 2 * ring("all_reduce", t, n_bytes)
    return gemms + 3 * ring("all_reduce", t, FP32 * tokens)


@dataclass
class Communication:
    """Bytes sent per GPU per step, by group."""

    tp: float = 0.0
    cp: float = 0.0
    dp: float = 0.0
    pp: float = 0.0
    ep: float = 0.0  # MoE token dispatch (and capacity's key gathers)
    edp: float = 0.0  # the experts' gradient reduction over the expert-data-parallel group

    @property
    def total(self) -> float:
        return self.tp + self.cp + self.dp + self.pp + self.ep + self.edp


def moe_bytes_per_layer(cfg, micro_batch: int, act_bytes: int) -> tuple:
    """(forward, backward) bytes a rank sends in one MoE layer's dispatch for one micro-batch (module
    docstring)."""
    shape = LayerShape.from_config(cfg, micro_batch, act_bytes)
    n = shape.tokens_sp
    m = MoEShape.from_config(cfg, n, act_bytes)
    p, t, e = cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size, cfg.num_experts
    row, rp, rows = act_bytes * cfg.hidden_size, m.router_bytes, m.rows
    fwd = bwd = 0.0
    if cfg.moe_token_dispatcher_type == "alltoall":
        if p > 1:
            moved = 2 * ring("all_to_all", p, rows * row) + ring("all_to_all", p, rows * rp)
            fwd, bwd = moved + ring("all_to_all", p, 8 * e), moved
        if t > 1:
            moved = (t - 1) * (2 * rows * row + rows * rp)
            fwd, bwd = fwd + moved + (t - 1) * 8 * e, bwd + moved
    elif p * t > 1:
        g = p * t
        fwd, bwd = (g - 1) * n * (2 * row + e * rp + e), (g - 1) * n * (2 * row + e * rp)
    seq = cfg.tensor_model_parallel_size * cfg.context_parallel_size
    factor = cfg.moe_expert_capacity_factor
    if factor is not None and seq > 1:
        cap = math.ceil(cfg.seq_length * cfg.moe_router_topk / e * factor)
        if cap <= cfg.seq_length:  # the keys of the sample's other tokens, and their positions
            s_sp = n / micro_batch
            fwd += (seq - 1) * (n * e * rp + 8 * s_sp)
    return fwd, bwd


def communication(cfg, layout, prec, micro_batch: int, micro_batches: int, params: int, expert_params: int = 0):
    """Bytes per GPU per step (the worst pipeline stage's layers: num_layers / pp); `params` of the
    rank, `expert_params` of them the experts'."""
    t, c, r = cfg.tensor_model_parallel_size, cfg.context_parallel_size, layout.dp * cfg.context_parallel_size
    layers = cfg.num_layers // layout.pp
    n_bytes = prec.act * cfg.seq_length // c * micro_batch * cfg.hidden_size
    full = cfg.recompute_granularity == "full"
    head = _head_bytes(t, cfg.sequence_parallel, n_bytes, cfg.seq_length // c * micro_batch)
    tp = micro_batches * (layers * tp_bytes_per_layer(t, cfg.sequence_parallel, n_bytes, full) + head)
    loss_mean = 2 * ring("all_reduce", c, FP32)  # the sequence's loss sum and count
    cp = micro_batches * (layers * cp_bytes_per_layer(cfg, micro_batch, prec.act) + loss_mean)
    dp = _grad_bytes(layout.sharding, prec, r, params - expert_params, micro_batches)
    ep = edp = 0.0
    if cfg.num_experts is not None:
        moe_layers = sum(is_moe_layer(cfg, layer) for layer in range(1, layers + 1))  # (the first stage's)
        fwd, bwd = moe_bytes_per_layer(cfg, micro_batch, prec.act)
        ep = micro_batches * moe_layers * ((2 if full else 1) * fwd + bwd)
        edp = _grad_bytes(layout.sharding, prec, _expert_reps(cfg, layout), expert_params, micro_batches)
    pp = 2 * micro_batches * n_bytes / (t if cfg.sequence_parallel else 1) if layout.pp > 1 else 0.0
    return Communication(tp, cp, dp, pp, ep, edp)


def _expert_reps(cfg, layout) -> int:
    stage = cfg.tensor_model_parallel_size * cfg.context_parallel_size * layout.dp
    return stage // (cfg.expert_model_parallel_size * cfg.expert_tensor_parallel_size)


def _grad_bytes(sharding: str, prec, r: int, params: int, micro_batches: int) -> float:
    """The gradient reduction of `params` parameters over r replicas."""
    if sharding == "fsdp2":
        return micro_batches * (
            2 * ring("all_gather", r, prec.weight * params) + ring("all_gather", r, prec.grad * params)
        )
    if sharding == "distributed" and not prec.flat_bucket_copies:  # Megatron's RS + AG
        return ring("all_gather", r, prec.grad * params) + ring("all_gather", r, prec.weight * params)
    return ring("all_reduce", r, prec.grad * params)


@dataclass
class StepTime:
    compute: float
    tp: float
    cp: float
    dp: float
    pp: float
    bubble: float
    ep: float = 0.0  # the MoE dispatch (exposed)

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.dp + self.pp + self.bubble + self.ep


def compute_flops(cfg, global_batch: int) -> float:
    """Training FLOPs of one step (whole model), recomputation included."""
    L, s, hd = cfg.num_layers, cfg.seq_length, cfg.num_attention_heads * cfg.kv_channels
    tokens = global_batch * s
    flops = cfg.flops_per_token() * tokens
    if cfg.recompute_granularity == "full":
        flops += 2 * (_active_layer_weights(cfg) + 2 * L * s * hd) * tokens  # one more forward of the layers
    elif cfg.recompute_granularity == "selective":
        flops += 2 * 2 * L * s * hd * tokens  # one more forward of the attention core
    return flops


def step_time(cfg, layout, prec, cluster: Cluster, micro_batch, micro_batches, comm: Communication) -> StepTime:
    t, c = cfg.tensor_model_parallel_size, cfg.context_parallel_size
    peak = cluster.peak_tflops * 1e12 * (0.5 if prec.name == "fp32" else 1.0) * cluster.mfu
    gpus = t * c * layout.dp * layout.pp
    compute = compute_flops(cfg, micro_batch * micro_batches * layout.dp) / gpus / peak
    tp = comm.tp / cluster.bandwidth(t)
    cp_time = _cp_time(cfg, cluster, prec, micro_batch, micro_batches, layout.pp, compute)
    dp_time = (comm.dp + comm.edp) / cluster.bandwidth(t * c * layout.dp)
    ep_time = comm.ep / cluster.bandwidth(cfg.expert_model_parallel_size * cfg.expert_tensor_parallel_size)
    overlap = compute if layout.sharding == "fsdp2" else compute * 2 / 3 / micro_batches
    dp_time = max(0.0, dp_time - overlap)
    pp_time = comm.pp / cluster.bandwidth(t * c * layout.dp * layout.pp) if layout.pp > 1 else 0.0
    bubble = compute * (layout.pp - 1) / micro_batches
    return StepTime(compute, tp, cp_time, dp_time, pp_time, bubble, ep_time)


def _cp_time(cfg, cluster, prec, micro_batch, micro_batches, pp, compute) -> float:
    """Exposed CP time of a step: each layer's traffic over its links, less the attention compute
    its ring steps hide."""
    if cfg.context_parallel_size == 1:
        return 0.0
    types = cp_comm_types(cfg)  # a stage holds len(types) / pp of them: per layer, compute's share × pp / L
    attention = compute * _attention_share(cfg) * pp / len(types)
    total = 0.0
    for comm in types:
        for x in cp_traffic(cfg, comm, micro_batch, prec.act):
            seconds = micro_batches * x.nbytes / cluster.bandwidth(x.span)
            total += (max(0.0, seconds - attention) if x.overlaps else seconds) / pp
    loss_mean = micro_batches * 2 * ring("all_reduce", cfg.context_parallel_size, FP32)
    return total + loss_mean / cluster.bandwidth(cfg.tensor_model_parallel_size * cfg.context_parallel_size)


def _attention_share(cfg) -> float:
    """Fraction of the training FLOPs in the attention core (QK^T, PV)."""
    attention = cfg.num_layers * 2 * cfg.seq_length * cfg.num_attention_heads * cfg.kv_channels
    return attention / (_active_layer_weights(cfg) + cfg.vocab_size * cfg.hidden_size + attention)


def _active_layer_weights(cfg) -> int:
    """The layers' matmul weights one token goes through (an MoE layer's router, top-k and shared experts)."""
    if cfg.num_experts is None:
        return cfg.num_layers * cfg._layer_matmul_params()[0]
    return sum(cfg._layer_matmul_params(layer, active=True)[0] for layer in range(1, cfg.num_layers + 1))

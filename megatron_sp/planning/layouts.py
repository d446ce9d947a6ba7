"""The layouts of a cluster, each with its memory split, bytes sent and modelled step time.

A layout is (tp, cp, dp, pp, sp, recompute, sharding, CP type) with tp * cp * dp * pp = GPUs, tp
within a node; with cp > 1 each of Megatron's CP types is a layout (a2a+p2p with the a2a level the
largest part of cp that fits in a node with tp, the ring across, when both levels exceed 1).
GPTConfig's own checks decide whether the model splits that way (heads, groups, MLP width,
sequence). A layout is runnable when the program offers it today: FSDP2 where the program's parser
accepts --use-torch-fsdp2 (with pipeline stages too).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

from megatron_sp.config import RECOMPUTE_GRANULARITIES, GPTConfig
from megatron_sp.layer_options import CP_COMM_TYPES
from megatron_sp.planning import cost
from megatron_sp.planning import memory as mem

RECOMPUTE = (None,) + RECOMPUTE_GRANULARITIES  # what the program offers, and none


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    dp: int
    pp: int
    sp: bool
    recompute: str | None
    sharding: str  # memory.SHARDINGS
    cp_comm: str | tuple = "p2p"  # --cp-comm-type (one type, or one per layer)
    levels: tuple | None = None  # --hierarchical-context-parallel-sizes (a2a+p2p)
    ep: int = 1  # --expert-model-parallel-size (MoE models)
    etp: int | None = None  # --expert-tensor-parallel-size (None: a dense model, or the TP size)

    def describe(self) -> str:
        cp = f"cp{self.cp}"
        if self.cp > 1:
            types = self.cp_comm if isinstance(self.cp_comm, str) else "/".join(self.cp_comm)
            cp += f"({types}{f' {self.levels[0]}x{self.levels[1]}' if self.levels and 'a2a+p2p' in types else ''})"
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else ""), cp, f"dp{self.dp}", f"pp{self.pp}"]
        if self.etp is not None:
            parts.append(f"ep{self.ep} etp{self.etp}")
        return " ".join(parts + [self.recompute or "no-recompute", self.sharding])


@dataclass
class Plan:
    layout: Layout
    memory: mem.MemorySplit
    comm: cost.Communication
    time: cost.StepTime
    micro_batches: int
    runnable: bool
    note: str = ""


@dataclass(frozen=True)
class Batch:
    micro: int
    global_: int | None  # None: one micro-batch per DP rank


MAX_LAYOUTS = 10_000  # layouts planned per search (~1 ms each); the search says when it stopped there


def divisors(n: int) -> list:
    """The divisors of n, ascending, by trial division up to sqrt(n). Callers pass a gcd with a model
    size (layers, sequence, node width), never a bare GPU count, so n stays small."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def layout_config(base: dict, layout: Layout) -> GPTConfig | None:
    """The model at this layout, or None when GPTConfig refuses the split."""
    fields = dict(
        base,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sp,
        recompute_granularity=layout.recompute,
        recompute_method=None,
        recompute_num_layers=None,
        tp_comm_overlap=False,
        cp_comm_type=layout.cp_comm,
        hierarchical_context_parallel_sizes=layout.levels,
    )
    if layout.etp is not None:
        fields.update(expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    try:
        return GPTConfig(**fields)
    except ValueError:
        return None


def cp_choices(cluster: cost.Cluster, tp: int, cp: int, fixed: dict) -> list:
    """(cp_comm, levels) to try: one p2p without CP; else every type (or the pinned one), a2a+p2p
    with the largest a2a level that fits a node with tp (levels pinned by the flag are kept)."""
    if cp == 1:
        return [("p2p", None)]
    inner = max((a for a in divisors(cp) if tp * a <= cluster.gpus_per_node), default=1)
    levels = fixed.get("levels") or ((inner, cp // inner) if 1 < inner < cp else None)
    types = [fixed["cp_comm"]] if "cp_comm" in fixed else [t for t in CP_COMM_TYPES if t != "a2a+p2p" or levels]
    return [(t, levels if "a2a+p2p" in (t if isinstance(t, tuple) else (t,)) else None) for t in types]


def expert_choices(num_experts, tp: int, stage: int, fixed: dict) -> list:
    """(ep, etp) to try: none for a dense model; else EP dividing the experts and, with expert-TP 1 or
    the TP size, the stage's TP x CP x DP ranks (pinned by --expert-model-parallel-size /
    --expert-tensor-parallel-size)."""
    if num_experts is None:
        return [(1, None)]
    etps = [fixed["etp"]] if "etp" in fixed else sorted({1, tp})
    eps = [fixed["ep"]] if "ep" in fixed else divisors(math.gcd(num_experts, stage))
    return [(ep, etp) for etp in etps for ep in eps if stage % (ep * etp) == 0]


def candidate_layouts(cluster: cost.Cluster, num_layers: int, fixed: dict, seq_length: int, num_experts=None):
    """Every (tp, cp, dp, pp, sp, recompute, sharding, CP type, EP, expert-TP) the cluster allows; `fixed`
    pins dimensions. pp divides the layers and cp the sequence, so both come from a gcd with those: the
    work depends on the model's sizes, not on the GPU count. An MoE model takes SP whenever tp > 1
    (Megatron's rule) and, unless --cp-comm-type is pinned, the p2p ring for CP (the search would
    otherwise multiply CP's four types by every EP and expert-TP)."""
    pinned = {k: v for k, v in fixed.items() if k not in ("cp_comm", "levels", "ep", "etp")}
    for tp in divisors(math.gcd(cluster.gpus_per_node, cluster.gpus)):
        for pp in divisors(math.gcd(num_layers, cluster.gpus // tp)):
            for cp in divisors(math.gcd(seq_length, cluster.gpus // (tp * pp))):
                dp = cluster.gpus // (tp * pp * cp)
                experts = expert_choices(num_experts, tp, tp * cp * dp, fixed)
                sps = (True,) if num_experts is not None and tp > 1 else (False, True) if tp > 1 else (False,)
                for sp, recompute, sharding in itertools.product(sps, RECOMPUTE, mem.SHARDINGS):
                    if sharding != "replicated" and dp * cp == 1:
                        continue  # one replica: nothing to shard
                    comms = cp_choices(cluster, tp, cp, fixed)
                    if num_experts is not None and "cp_comm" not in fixed:
                        comms = comms[:1]  # MoE: the ring only (the CP type is chosen apart from the experts)
                    for (comm, levels), (ep, etp) in itertools.product(comms, experts):
                        layout = Layout(tp, cp, dp, pp, sp, recompute, sharding, comm, levels, ep, etp)
                        if all(getattr(layout, k) == v for k, v in pinned.items()):
                            yield layout


def plan_layout(
    base: dict, layout: Layout, prec, cluster, batch: Batch, runnable_fsdp2: bool, moe_refused=frozenset()
) -> Plan | None:
    cfg = layout_config(base, layout)
    if cfg is None:
        return None
    per_step = batch.micro * layout.dp
    global_batch = batch.global_ if batch.global_ is not None else per_step
    if global_batch % per_step:
        return None
    m = global_batch // per_step
    memory, params, expert_params = memory_split(cfg, layout, prec, batch.micro, m)
    comm = cost.communication(cfg, layout, prec, batch.micro, m, params, expert_params)
    time = cost.step_time(cfg, layout, prec, cluster, batch.micro, m, comm)
    notes = fsdp2_notes(prec, runnable_fsdp2) if layout.sharding == "fsdp2" else []
    if cfg.num_experts is not None:
        notes += moe_notes(layout, moe_refused)
    return Plan(layout, memory, comm, time, m, not notes, "; ".join(notes))


def moe_notes(layout: Layout, refused) -> list:
    """Why an MoE layout does not run today: `refused` names what the program refuses with experts
    ("pp": pipeline stages, "fsdp2"), as tools/plan.py reads it from the program's own checks."""
    out = ["MoE under pipeline stages not runnable yet"] if "pp" in refused and layout.pp > 1 else []
    return out + (["MoE with FSDP2 not runnable yet"] if "fsdp2" in refused and layout.sharding == "fsdp2" else [])


def fsdp2_notes(prec, offered: bool) -> list:
    """Why an FSDP2 layout does not run today, or nothing (it runs wherever the parser offers the flag)."""
    return [] if offered else ["FSDP2 modelled, not runnable yet"]


def _parameter_config(cfg):
    """cfg without the fields a rank's parameter shapes do not depend on (CP, recomputation), so that
    layouts differing only there share one inventory."""
    if cfg.context_parallel_size == 1 and cfg.recompute_granularity is None:
        return cfg
    return dataclasses.replace(
        cfg,
        context_parallel_size=1,
        cp_comm_type="p2p",
        hierarchical_context_parallel_sizes=None,
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
    )


class _Inventory:
    """One rank's parameters (mem.rank_parameters), split by role, with their counts; hashed by identity
    so that the states of one inventory are computed once per sharding."""

    def __init__(self, named):
        self.named = tuple(named)
        self.shapes = [shape for _, shape in self.named]
        self.dense = [shape for n, shape in self.named if not mem.is_expert(n)]
        self.experts = [shape for n, shape in self.named if mem.is_expert(n)]
        self.total = sum(mem.numel(x) for x in self.shapes)
        self.expert_total = sum(mem.numel(x) for x in self.experts)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (inventories live as long as the module's cache)
    def states(self, prec, sharding: str, replicas: int, expert_reps: int) -> tuple:
        """mem.rank_states of these parameters."""
        states = mem.states_bytes(self.dense, prec, sharding, replicas)
        if self.experts:
            experts = mem.states_bytes(self.experts, prec, sharding, expert_reps)
            states = tuple(a + b for a, b in zip(states, experts))
        return states


@functools.lru_cache(maxsize=256)
def _inventory(cfg, stage: int, stages: int) -> _Inventory:
    return _Inventory(mem.rank_parameters(cfg, stage, stages))


def memory_split(cfg, layout: Layout, prec, micro_batch: int, micro_batches: int):
    """The worst rank's split (the first pipeline stage: it holds pp micro-batches in 1F1B), its
    parameter count and how many of them are experts'."""
    replicas = layout.dp * layout.cp
    shape_cfg = _parameter_config(cfg)
    inv = _inventory(shape_cfg, 0, layout.pp)
    if layout.pp > 1:  # the last stage may hold more (the output layer): take the larger
        inv = max(inv, _inventory(shape_cfg, layout.pp - 1, layout.pp), key=lambda x: x.total)
    expert_reps = mem.expert_replicas(cfg, layout.dp) if cfg.num_experts is not None else 1
    weights, grads, optimizer = inv.states(prec, layout.sharding, replicas, expert_reps)
    in_flight = min(layout.pp, micro_batches)
    saved, transient = mem.activation_bytes(
        cfg, micro_batch, prec.act, layers=cfg.num_layers // layout.pp, in_flight=in_flight
    )
    buffers = mem.buffer_bytes(
        cfg, micro_batch, prec, layout.sharding, replicas, inv.shapes, pipeline=layout.pp > 1, params=inv.total
    )
    if transient:
        buffers["recomputed chunk (backward)"] = transient
    return mem.MemorySplit(weights, grads, optimizer, saved, buffers), inv.total, inv.expert_total


class Search(NamedTuple):
    fits: list  # feasible plans, runnable first, then by step time
    too_big: int  # layouts that split the model but exceed the memory
    capped: bool  # the search stopped at MAX_LAYOUTS candidates (more exist)


def plans(
    base: dict, prec, cluster: cost.Cluster, batch: Batch, fixed: dict, runnable_fsdp2: bool, moe_refused=frozenset()
) -> Search:
    """The feasible plans among the first MAX_LAYOUTS candidates (`moe_refused`: see moe_notes)."""
    budget = (cluster.gpu_memory_gib - cluster.reserved_gib) * mem.GIB
    fits, too_big = [], 0
    candidates = candidate_layouts(cluster, base["num_layers"], fixed, base["seq_length"], base.get("num_experts"))
    layouts = list(itertools.islice(candidates, MAX_LAYOUTS + 1))
    for layout in layouts[:MAX_LAYOUTS]:
        plan = plan_layout(base, layout, prec, cluster, batch, runnable_fsdp2, moe_refused)
        if plan is None:
            continue
        if plan.memory.total <= budget:
            fits.append(plan)
        else:
            too_big += 1
    fits.sort(key=lambda p: (not p.runnable, p.time.total, p.memory.total))  # runnable ones first
    return Search(fits, too_big, len(layouts) > MAX_LAYOUTS)

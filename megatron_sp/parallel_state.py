"""Process groups for tensor (TP), context (CP), data (DP) and pipeline (PP) parallelism.

One frozen dataclass, `ParallelState`, holds the groups and this rank's coordinates. The rank grid is
Megatron's order ("tp-cp-ep-dp-pp") with TP fastest-varying and PP slowest:

    global_rank = tp_rank + tp_size * (cp_rank + cp_size * (dp_rank + dp_size * pp_rank))

so a TP group is `tp_size` consecutive ranks (one node's GPUs in practice, where NVLink is) and a
pipeline stage is a contiguous block of tp·cp·dp ranks. With pp_size 1 the grid is the (tp, cp, dp)
one. The embedding group is, per (tp, cp, dp) coordinate, the first and the last stage of the
pipeline: the ranks holding a tied word embedding's copies, whose gradients are summed (Megatron's).
The groups live on whatever backend torch.distributed was initialised with (gloo on CPU, NCCL on
GPU). Without torch.distributed every size is 1 and every group is None, so the serial path needs no
set-up at all.

    from megatron_sp import parallel_state
    ps = parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    ps.tp_group, ps.tp_rank, ps.dp_size ...

Group roles name the ranks a parameter or a shard means, so that code above asks "the replicas of this
parameter" rather than rebuilding a group from the axes:

    role        group / size / rank                  what it is
    "tp"        tp_group / tp_size / tp_rank         the ranks a ShardSpec's dim is split over
    "replicas"  replica_group / replicas /           DP×CP: the ranks holding the same shards; a dense
                replica_rank                         parameter's gradient is reduced over them and the
                                                     distributed optimizer and FSDP2 shard over them

A parameter's replica group is the parameter's (`replica_role`): dense parameters carry no mark and
mean "replicas". Expert parallelism adds its roles to ROLES with their groups (in Megatron's rank order
tp-cp-ep-dp-pp): "expert_tp" (an expert's weight shards) and "expert_replicas" (expert-DP: the ranks
holding the same expert shards), and marks its expert parameters `replica_role = "expert_replicas"`;
the gradient buckets, the distributed optimizer and the norms already group parameters by their role.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the (pp, dp, cp, tp) grid and the process groups along each axis."""

    tp_size: int = 1
    cp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    tp_group: Optional[object] = None  # ranks that share one layer's weight shards
    cp_group: Optional[object] = None  # ranks that share one sequence (context parallel)
    dp_group: Optional[object] = None  # ranks holding the same shards, different data
    dp_cp_group: Optional[object] = None  # gradient reduction group: data and context parallel ranks
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Optional[object] = None  # the stages of one pipeline (same tp, cp, dp coordinates)
    pp_ranks: tuple = (0,)  # global ranks of pp_group, by stage (torch.distributed.pipelining's peers)
    embedding_group: Optional[object] = None  # first and last stage of this pipeline (None at pp 1)
    hierarchical_cp_sizes: tuple = ()  # (A, P) of --hierarchical-context-parallel-sizes, or ()
    hierarchical_cp_groups: tuple = ()  # (A adjacent CP ranks: a2a, the P ranks of my place: p2p), or ()
    # The expert grid over the same ranks (Megatron's): expert-TP fastest, then EP, then expert-DP.
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Optional[object] = None  # ranks holding the other experts (tokens are exchanged there)
    etp_size: int = 1
    etp_rank: int = 0
    etp_group: Optional[object] = None  # ranks holding the other shards of the same experts
    edp_size: int = 1
    edp_rank: int = 0
    edp_group: Optional[object] = None  # expert-DP: ranks holding the same expert shards
    expert_group: Optional[object] = None  # EP × expert-TP (the all-gather dispatcher's), by expert-grid rank
    tp_cp_group: Optional[object] = None  # TP × CP: the ranks holding one micro-batch's samples
    stage_group: Optional[object] = None  # TP × CP × DP: every rank of this pipeline stage

    def __post_init__(self):
        for name in ("tp_size", "cp_size", "dp_size", "pp_size", "ep_size", "etp_size", "edp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelState.{name} must be >= 1, got {getattr(self, name)}.")
        for axis in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if not 0 <= rank < size:
                raise ValueError(f"ParallelState.{axis}_rank={rank} is outside [0, {axis}_size={size}).")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size * self.pp_size

    @property
    def replicas(self) -> int:
        """Ranks holding the same shards as this one: DP replicas × CP ranks."""
        return self.dp_size * self.cp_size

    @property
    def replica_rank(self) -> int:
        """This rank's place in replica_group (CP fastest, as the group's ranks are ordered)."""
        return self.cp_rank + self.cp_size * self.dp_rank

    @property
    def replica_group(self):
        """The DP×CP group (the DP group itself when CP is 1: the same ranks), or None with one replica."""
        if self.replicas == 1:
            return None
        return self.dp_cp_group if self.cp_size > 1 else self.dp_group

    def group(self, role: str):
        """The process group of a group role (see the module docstring)."""
        return getattr(self, _role(role)[0])

    def size(self, role: str) -> int:
        return getattr(self, _role(role)[1])

    def rank(self, role: str) -> int:
        return getattr(self, _role(role)[2])

    def coords(self, role: str) -> tuple:
        """(rank, size) of this rank in the group of `role` (a ShardSpec's dim is split over it)."""
        return self.rank(role), self.size(role)

    def replica_group_of(self, param):
        """The group `param`'s gradient is reduced over and its optimizer state sharded over."""
        return self.group(replica_role(param))

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


TENSOR = "tp"
REPLICAS = "replicas"
EXPERT = "ep"
EXPERT_TP = "expert_tp"
EXPERT_REPLICAS = "expert_replicas"
ROLES = {  # role -> ParallelState's (group, size, rank) names
    TENSOR: ("tp_group", "tp_size", "tp_rank"),
    REPLICAS: ("replica_group", "replicas", "replica_rank"),
    EXPERT: ("ep_group", "ep_size", "ep_rank"),
    EXPERT_TP: ("etp_group", "etp_size", "etp_rank"),
    EXPERT_REPLICAS: ("edp_group", "edp_size", "edp_rank"),
}


def _role(role: str) -> tuple:
    if role not in ROLES:
        raise ValueError(f"unknown process-group role {role!r}; the roles are {sorted(ROLES)}.")
    return ROLES[role]


def replica_role(param) -> str:
    """The role of `param`'s replicas: the mark it carries (`param.replica_role`), else REPLICAS (DP×CP)."""
    return getattr(param, "replica_role", REPLICAS)


_STATE: Optional[ParallelState] = None


def grid_ranks(tp_size: int, cp_size: int, dp_size: int, pp_size: int = 1):
    """Lists of global ranks forming each TP, CP, DP and DP×CP group (TP fastest, PP slowest), the
    groups of every pipeline stage in turn."""

    def rank(tp, cp, dp, pp=0):
        return tp + tp_size * (cp + cp_size * (dp + dp_size * pp))

    stages = range(pp_size)
    tp = [[rank(t, c, d, p) for t in range(tp_size)] for p in stages for d in range(dp_size) for c in range(cp_size)]
    cp = [[rank(t, c, d, p) for c in range(cp_size)] for p in stages for d in range(dp_size) for t in range(tp_size)]
    dp = [[rank(t, c, d, p) for d in range(dp_size)] for p in stages for c in range(cp_size) for t in range(tp_size)]
    dp_cp = [[rank(t, c, d, p) for d in range(dp_size) for c in range(cp_size)] for p in stages for t in range(tp_size)]
    return tp, cp, dp, dp_cp


def hierarchical_cp_ranks(cp_lists, sizes):
    """(inner, outer) rank lists of hierarchical CP (Megatron's): within each CP group (by CP rank),
    every A adjacent ranks form an inner group; the ranks at the same place i of their inner groups
    form an outer one, ordered by group."""
    a, _ = sizes
    inner = [ranks[g : g + a] for ranks in cp_lists for g in range(0, len(ranks), a)]
    outer = [ranks[i::a] for ranks in cp_lists for i in range(a)]
    return inner, outer


def pipeline_ranks(tp_size: int, cp_size: int, dp_size: int, pp_size: int):
    """Global ranks of every pipeline (one per (tp, cp, dp) coordinate), each by stage."""
    block = tp_size * cp_size * dp_size  # ranks per stage
    return [[r + block * p for p in range(pp_size)] for r in range(block)]


def expert_grid_ranks(stage_size: int, etp: int, ep: int, pp_size: int = 1):
    """(expert-TP, EP, expert-DP, EP × expert-TP) rank lists of Megatron's expert grid: within each
    pipeline stage's block of stage_size ranks, expert-TP fastest, then EP, then expert-DP."""
    edp = stage_size // (etp * ep)

    def rank(t, e, d, p):
        return p * stage_size + t + etp * (e + ep * d)

    stages = range(pp_size)
    etp_lists = [[rank(t, e, d, p) for t in range(etp)] for p in stages for d in range(edp) for e in range(ep)]
    ep_lists = [[rank(t, e, d, p) for e in range(ep)] for p in stages for d in range(edp) for t in range(etp)]
    edp_lists = [[rank(t, e, d, p) for d in range(edp)] for p in stages for e in range(ep) for t in range(etp)]
    expert_lists = [[rank(t, e, d, p) for e in range(ep) for t in range(etp)] for p in stages for d in range(edp)]
    return etp_lists, ep_lists, edp_lists, expert_lists


def sample_ranks(tp_size: int, cp_size: int, dp_size: int, pp_size: int = 1):
    """(TP × CP, TP × CP × DP) rank lists: the ranks holding one micro-batch's samples, every rank of a stage."""
    block = tp_size * cp_size * dp_size
    tp_cp = [
        [p * block + d * tp_size * cp_size + r for r in range(tp_size * cp_size)]
        for p in range(pp_size)
        for d in range(dp_size)
    ]
    stage = [list(range(p * block, (p + 1) * block)) for p in range(pp_size)]
    return tp_cp, stage


def _check_expert_factors(stage_size: int, ep: int, etp: int) -> None:
    if ep < 1 or etp < 1 or stage_size % (ep * etp):
        raise ValueError(
            f"expert_model_parallel_size ({ep}) × expert_tensor_parallel_size ({etp}) must divide the "
            f"{stage_size} ranks of a pipeline stage (tensor × context × data parallel); choose sizes that fit."
        )


def _check_factors(world_size: int, tp: int, cp: int, pp: int = 1) -> int:
    if tp < 1 or cp < 1 or pp < 1:
        raise ValueError(
            f"tensor_model_parallel_size ({tp}), context_parallel_size ({cp}) and "
            f"pipeline_model_parallel_size ({pp}) must be >= 1."
        )
    if world_size % (tp * cp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) × "
            f"context_parallel_size ({cp}) × pipeline_model_parallel_size ({pp}); choose sizes whose "
            f"product divides the number of ranks."
        )
    return world_size // (tp * cp * pp)


# (world process group, axis, ranks, timeout) -> its group. Initialising again in the same world (the test
# worlds do, once per layout) reuses the groups: every gloo group keeps threads of its own for the
# life of the process, and new ones per initialisation piled up to thousands of busy threads a rank.
# The world's group is part of the key (and kept alive by it), so a new world gets new groups.
_GROUPS: dict = {}


def _new_groups(axis, rank_lists, my_rank, timeout):
    """Creates every group of one axis (collectively, same order on all ranks); returns mine. Each axis
    has groups of its own, as before, even where two axes hold the same ranks."""
    mine = None
    for ranks in rank_lists:
        key = (dist.group.WORLD, axis, tuple(ranks), timeout)
        if key not in _GROUPS:  # (the same on every rank: the keys come in the same order)
            _GROUPS[key] = dist.new_group(ranks, timeout=timeout)
        if my_rank in ranks:
            mine = _GROUPS[key]
    return mine


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    timeout: Optional[timedelta] = None,
    pipeline_model_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[tuple] = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
) -> ParallelState:
    """Builds the TP/CP/DP/PP groups (collective over the whole world) and makes them current.

    timeout: every group's collective timeout. `dist.new_group` does not inherit the world's, so pass
    the one given to init_process_group (pretrain.py passes --distributed-timeout-minutes): a dead or
    hung peer then fails its TP/CP/DP group as fast as the world. None: torch's default for a new
    group (30 min on gloo, 10 min on NCCL).
    hierarchical_context_parallel_sizes: (A, P) with A·P = CP size, for --cp-comm-type a2a+p2p.
    expert_model_parallel_size, expert_tensor_parallel_size (default the TP size): the expert grid
    (expert_grid_ranks), whose EP × expert-TP must divide a stage's ranks.
    """
    global _STATE
    tp, cp, pp = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
    sizes = _hierarchical_sizes(hierarchical_context_parallel_sizes, cp)
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size or tp
    if not dist.is_initialized():
        _check_factors(1, tp, cp, pp)
        _check_expert_factors(1, ep, etp)
        _STATE = ParallelState()
        return _STATE
    world, me = dist.get_world_size(), dist.get_rank()
    dp = _check_factors(world, tp, cp, pp)
    _check_expert_factors(tp * cp * dp, ep, etp)
    tp_lists, cp_lists, dp_lists, dp_cp_lists = grid_ranks(tp, cp, dp, pp)
    groups = dict(
        tp_group=_new_groups("tp_group", tp_lists, me, timeout),
        cp_group=_new_groups("cp_group", cp_lists, me, timeout),
        dp_group=_new_groups("dp_group", dp_lists, me, timeout),
        dp_cp_group=_new_groups("dp_cp_group", dp_cp_lists, me, timeout),
    )
    groups.update(_pipeline_groups(tp, cp, dp, pp, me, timeout))
    if sizes:
        inner, outer = hierarchical_cp_ranks(cp_lists, sizes)
        groups["hierarchical_cp_groups"] = (
            _new_groups("cp_inner", inner, me, timeout),
            _new_groups("cp_outer", outer, me, timeout),
        )
        groups["hierarchical_cp_sizes"] = sizes
    groups.update(_expert_groups(tp, cp, dp, pp, ep, etp, me, timeout))
    _STATE = ParallelState(
        tp_size=tp,
        cp_size=cp,
        dp_size=dp,
        pp_size=pp,
        tp_rank=me % tp,
        cp_rank=(me // tp) % cp,
        dp_rank=(me // (tp * cp)) % dp,
        pp_rank=me // (tp * cp * dp),
        **groups,
    )
    return _STATE


def _hierarchical_sizes(sizes, cp: int) -> tuple:
    """(A, P) with A·P = cp for --cp-comm-type a2a+p2p, or () without them."""
    sizes = tuple(sizes or ())
    if sizes and (len(sizes) != 2 or sizes[0] * sizes[1] != cp):
        raise ValueError(
            f"hierarchical_context_parallel_sizes {list(sizes)} must be two sizes whose product is "
            f"context_parallel_size ({cp})."
        )
    return sizes


def _pipeline_groups(tp, cp, dp, pp, me, timeout) -> dict:
    """The pipeline's group, the first and last stages' embedding group, and this rank's pipeline."""
    if pp == 1:
        return {"pp_ranks": (me,)}
    pipelines = pipeline_ranks(tp, cp, dp, pp)
    return dict(
        pp_group=_new_groups("pp_group", pipelines, me, timeout),
        embedding_group=_new_groups("embedding_group", [[ranks[0], ranks[-1]] for ranks in pipelines], me, timeout),
        pp_ranks=tuple(next(ranks for ranks in pipelines if me in ranks)),
    )


def _expert_groups(tp, cp, dp, pp, ep, etp, me, timeout) -> dict:
    """The expert grid's groups and coordinates, and the sample groups (TP × CP, the stage)."""
    stage_size = tp * cp * dp
    etp_lists, ep_lists, edp_lists, expert_lists = expert_grid_ranks(stage_size, etp, ep, pp)
    tp_cp_lists, stage_lists = sample_ranks(tp, cp, dp, pp)
    local = me % stage_size
    return dict(
        ep_size=ep,
        ep_rank=(local // etp) % ep,
        etp_size=etp,
        etp_rank=local % etp,
        edp_size=stage_size // (ep * etp),
        edp_rank=local // (ep * etp),
        etp_group=_new_groups("etp_group", etp_lists, me, timeout),
        ep_group=_new_groups("ep_group", ep_lists, me, timeout),
        edp_group=_new_groups("edp_group", edp_lists, me, timeout),
        expert_group=_new_groups("expert_group", expert_lists, me, timeout),
        tp_cp_group=_new_groups("tp_cp_group", tp_cp_lists, me, timeout),
        stage_group=_new_groups("stage_group", stage_lists, me, timeout),
    )


def collective_device():
    """Where a rank with no tensor of its own (a replica owning no parameter) puts its share of a
    collective: NCCL reduces only CUDA tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get() -> ParallelState:
    """The current ParallelState; a serial one when initialize_model_parallel was never called."""
    return _STATE if _STATE is not None else ParallelState()


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forgets the current groups (the process groups themselves are freed with the world)."""
    global _STATE
    _STATE = None

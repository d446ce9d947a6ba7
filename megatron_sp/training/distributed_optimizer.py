"""The distributed optimizer (`--use-distributed-optimizer`, ZeRO stage 1): the ranks that hold the
same shards (DP replicas × CP ranks: the "replicas") split the AdamW state between them.

Each replica owns a contiguous run of the parameters in backward order (reverse creation order,
balanced by size; the same run on every TP rank), so that gradient buckets never straddle two
owners. Per step, instead of an all-reduce of every gradient bucket:
  1. each bucket is *reduced* to its owner (grad_sync), overlapped with the backward as before;
     the other replicas drop their copy (`.grad = None`: clipping, the norm and fp16 checks then
     see only the gradients this rank owns);
  2. the owner steps its parameters with its AdamW;
  3. every owner *broadcasts* its parameters, held in one flat buffer per owner (the parameters
     are views of it, so nothing is copied).
A reduce plus a broadcast move what an all-reduce moves (a ring all-reduce is a reduce-scatter plus
an all-gather), so the communication is that of plain data parallelism; the AdamW moments (8 bytes
per parameter) take 1 / replicas of the memory, and gradients are freed after their reduction. The
update is the replicated optimizer's, bit for bit: the same summed gradients, the same AdamW.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import ParallelState


def replica_group(ps: ParallelState):
    """The ranks holding the same shards (DP replicas × CP ranks), or None when there is one."""
    if ps.dp_size * ps.cp_size == 1:
        return None
    return ps.dp_cp_group if ps.cp_size > 1 else ps.dp_group


def share_owners(sizes, replicas: int) -> list:
    """The owner of each parameter, given their sizes in backward order: the replica whose share
    of the run holds the parameter's middle (tools/plan.py predicts the shares with this too)."""
    total, seen, owners = sum(sizes), 0, []
    for n in sizes:
        owners.append(min(replicas - 1, (2 * seen + n) * replicas // (2 * total)))
        seen += n
    return owners


class Partition:
    """Which replica owns each parameter (see the module docstring)."""

    def __init__(self, params, ps: ParallelState):
        self.group = replica_group(ps)
        if self.group is None:
            raise ValueError("a Partition needs more than one replica (DP × CP > 1)")
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        backward = list(reversed(list(params)))
        owners = share_owners([p.numel() for p in backward], self.size)
        if ps.tp_size > 1:  # shards are the same size on every TP rank; make sure
            shared = [owners]
            dist.broadcast_object_list(shared, src=dist.get_global_rank(ps.tp_group, 0), group=ps.tp_group)
            owners = shared[0]
        self._owner = {id(p): r for p, r in zip(backward, owners)}
        self.params_of = [[p for p, r in zip(backward, owners) if r == owner] for owner in range(self.size)]

    def owner(self, p) -> int:
        return self._owner[id(p)]

    def mine(self, p) -> bool:
        return self._owner[id(p)] == self.rank

    def global_rank(self, owner: int) -> int:
        return dist.get_global_rank(self.group, owner)


class _NoParameters:
    """The local optimizer of a replica that owns no parameter (a model with fewer, larger
    parameters than replicas)."""

    def __init__(self):
        self.param_groups, self.state = [], {}

    def step(self):
        pass


class DistributedOptimizer:
    """AdamW state sharded over the replicas; `optim` is this rank's AdamW over what it owns."""

    def __init__(self, groups, partition: Partition, make_optimizer):
        self.partition = partition
        self.params = [p for g in groups for p in g["params"]]
        local = [dict(g, params=[p for p in g["params"] if partition.mine(p)]) for g in groups]
        local = [g for g in local if g["params"]]
        self.optim = make_optimizer(local) if local else _NoParameters()
        self.buffers = []  # per owner: one flat tensor; its parameters are views
        with torch.no_grad():
            for params in partition.params_of:
                flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else None
                offset = 0
                for p in params:
                    p.data = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                self.buffers.append(flat)

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.optim.step()
        handles = [
            dist.broadcast(flat, src=self.partition.global_rank(owner), group=self.partition.group, async_op=True)
            for owner, flat in enumerate(self.buffers)
            if flat is not None
        ]
        for handle in handles:
            handle.wait()

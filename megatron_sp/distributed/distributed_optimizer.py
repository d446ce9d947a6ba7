"""The distributed optimizer (`--use-distributed-optimizer`, ZeRO stage 1): the ranks that hold the
same shards (DP replicas × CP ranks: the "replicas") split the AdamW state between them.

Each replica owns a contiguous run of the parameters in backward order (reverse creation order,
balanced by size; the same run on every TP rank), so that gradient buckets never straddle two
owners. Per step, instead of an all-reduce of every gradient bucket:
  1. each bucket is *reduced* to its owner (grad_sync), in place in the gradient buffers, overlapped
     with the backward as before; the other replicas ignore those gradients (clipping, the norm and
     fp16 checks see only the gradients this rank owns);
  2. the owner steps the fp32 main weights of its parameters with its AdamW (distributed/optimizer.py)
     and copies them into the model's parameters;
  3. every owner *broadcasts* its parameters, held in one flat buffer per owner (the parameters
     are views of it, so nothing is copied), in the parameters' dtype.
A reduce plus a broadcast move what an all-reduce moves (a ring all-reduce is a reduce-scatter plus
an all-gather), so the communication is that of plain data parallelism; the main weights and AdamW
moments (12 bytes per parameter) take 1 / replicas of the memory: Megatron's 2 + 4 + 12/r bytes per
parameter under --bf16 (bf16 weights, fp32 gradient buffer). The update is the replicated
optimizer's, bit for bit: the same summed gradients, the same AdamW.
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


class ParamBroadcast:
    """Step 3 above: every owner's model parameters are views of one flat buffer (in the parameters'
    dtype: bf16 under --bf16), which the owner broadcasts after its step."""

    def __init__(self, partition: Partition):
        self.partition, self.buffers = partition, []
        with torch.no_grad():
            for params in partition.params_of:
                flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else None
                offset = 0
                for p in params:
                    p.data = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                self.buffers.append(flat)

    @torch.no_grad()
    def broadcast(self):
        handles = [
            dist.broadcast(flat, src=self.partition.global_rank(owner), group=self.partition.group, async_op=True)
            for owner, flat in enumerate(self.buffers)
            if flat is not None
        ]
        for handle in handles:
            handle.wait()

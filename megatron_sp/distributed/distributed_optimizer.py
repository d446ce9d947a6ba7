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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import REPLICAS, ParallelState, replica_role


def share_owners(sizes, replicas: int) -> list:
    """The owner of each parameter, given their sizes in backward order: the replica whose share
    of the run holds the parameter's middle (tools/plan.py predicts the shares with this too)."""
    total, seen, owners = sum(sizes), 0, []
    for n in sizes:
        owners.append(min(replicas - 1, (2 * seen + n) * replicas // (2 * total)))
        seen += n
    return owners


@dataclass
class ReplicaShare:
    """One replica group's split of its parameters: `params_of[r]` are the ones replica r owns."""

    group: object
    size: int
    rank: int  # this rank's place in the group
    params_of: list


class Partition:
    """Which replica owns each parameter (see the module docstring), within the parameter's own replica
    group (parallel_state.replica_role): each role's parameters are split over that role's group."""

    def __init__(self, params, ps: ParallelState):
        by_role = {}
        for p in params:
            by_role.setdefault(replica_role(p), []).append(p)
        self.shares, self._owner = {}, {}
        for role, same in by_role.items():
            group = ps.group(role)  # None: one replica (experts whose EP group spans the DP ranks) owns all
            size = dist.get_world_size(group) if group is not None else 1
            backward = list(reversed(same))
            owners = _owners_agreed_over_tp(share_owners([p.numel() for p in backward], size), ps)
            self._owner.update({id(p): r for p, r in zip(backward, owners)})
            params_of = [[p for p, r in zip(backward, owners) if r == owner] for owner in range(size)]
            rank = dist.get_rank(group) if group is not None else 0
            self.shares[role] = ReplicaShare(group, size, rank, params_of)

    @property
    def groups(self) -> dict:
        """{replica role: its group}, the groups the norms sum each role's whole parameters over."""
        return {role: share.group for role, share in self.shares.items()}

    def owner(self, p) -> int:
        """The owner's place in p's replica group."""
        return self._owner[id(p)]

    def mine(self, p) -> bool:
        return self._owner[id(p)] == self.shares[replica_role(p)].rank

    def global_rank(self, owner: int, role: str = REPLICAS) -> int:
        group = self.shares[role].group
        return dist.get_global_rank(group, owner) if group is not None else dist.get_rank()


def _owners_agreed_over_tp(owners: list, ps: ParallelState) -> list:
    """Shards are the same size on every TP rank, so the owners are too; make sure (rank 0's win)."""
    if ps.tp_size == 1:
        return owners
    shared = [owners]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(ps.tp_group, 0), group=ps.tp_group)
    return shared[0]


class ParamBroadcast:
    """Step 3 above: every owner's model parameters are views of one flat buffer (in the parameters'
    dtype: bf16 under --bf16), which the owner broadcasts over its replica group after its step."""

    def __init__(self, partition: Partition, exclude=()):
        """exclude: parameters broadcast otherwise (--fp8-param-gather's FP8 weights)."""
        self.buffers = []  # (group, owner's global rank, flat buffer)
        skip = {id(p) for p in exclude}
        with torch.no_grad():
            for role, share in partition.shares.items():
                if share.group is None:  # one replica: nothing to broadcast
                    continue
                for owner, params in enumerate(share.params_of):
                    params = [p for p in params if id(p) not in skip]
                    if params:
                        flat = _flatten(params)
                        self.buffers.append((share.group, partition.global_rank(owner, role), flat))

    @torch.no_grad()
    def broadcast(self):
        handles = [dist.broadcast(flat, src=src, group=group, async_op=True) for group, src, flat in self.buffers]
        for handle in handles:
            handle.wait()


def _flatten(params) -> torch.Tensor:
    """One buffer holding `params`, which become views of it."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat

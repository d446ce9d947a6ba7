"""AdamW over this rank's shards, the true global gradient norm, clipping and fp16 loss scaling.

AdamW is elementwise, so stepping every shard with its own slice of the gradient is the serial
update. What needs care is the gradient norm: each parameter must count once however it is sharded
(TP-split: sum the squares over the TP group) or replicated (identical on the TP ranks and on the
DP replicas: count one copy).

Distributed optimizer (`--use-distributed-optimizer`, ZeRO-1): training/distributed_optimizer.py;
here, the gradient norm then sums the squares each replica owns.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import ParallelState
from megatron_sp.tensor_parallel.sharding import split_local
from megatron_sp.training.distributed_optimizer import DistributedOptimizer, Partition, replica_group  # noqa: F401

# Megatron-LM's "embedding or output" parameters, which --decoupled-lr trains with an LR of their own.
DECOUPLED = ("embedding.word_embeddings.weight", "output_layer.weight")


def param_groups(model, weight_decay: float, decoupled: bool = False):
    """Weight decay on matrices only: no decay on biases and LayerNorm parameters (1-D tensors).
    decoupled: the word embedding and output layer in a group of their own ("decoupled": True)."""
    decay, no_decay, own = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (own if decoupled and name in DECOUPLED else no_decay if p.dim() < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if own:
        groups.append({"params": own, "weight_decay": weight_decay, "decoupled": True})
    return groups


def build_optimizer(model, args, device: str, ps: ParallelState | None = None):
    """AdamW; apex's FusedAdam (decoupled weight decay) when apex is installed and we run on CUDA.
    With args.use_distributed_optimizer and replicas (ps), the moments are sharded over them."""
    groups = param_groups(model, args.weight_decay, decoupled=getattr(args, "decoupled_lr", None) is not None)
    kw = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    if ps is not None and getattr(args, "use_distributed_optimizer", False) and replica_group(ps) is not None:
        extra = {"fused": True} if device == "cuda" else {"foreach": True}
        return DistributedOptimizer(
            groups,
            Partition([p for p in model.parameters() if p.requires_grad], ps),
            lambda local: torch.optim.AdamW(local, **kw, **extra),
        )
    if device == "cuda":
        try:
            from apex.optimizers import FusedAdam  # type: ignore

            return FusedAdam(groups, adam_w_mode=True, **kw)
        except ImportError:
            return torch.optim.AdamW(groups, fused=True, **kw)
    return torch.optim.AdamW(groups, foreach=True, **kw)


def local_optimizer(optimizer):
    """The optimizer that holds this rank's AdamW state (a DistributedOptimizer's own one)."""
    return getattr(optimizer, "optim", optimizer)


def owned_parameters(optimizer) -> set:
    """ids of the parameters whose AdamW state this rank holds (all of them unless distributed)."""
    return {id(p) for g in local_optimizer(optimizer).param_groups for p in g["params"]}


def _collective_device():
    """Where a rank with no gradients of its own (distributed optimizer) puts its share: NCCL
    reduces only CUDA tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sum_of_squares(grads, device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()  # one fused kernel per dtype


def global_grad_norm(params, ps: ParallelState, partition: Partition | None = None) -> torch.Tensor:
    """L2 norm of the full (serial) gradient: each parameter counted once. With a distributed
    optimizer's `partition`, each replica holds (and passes) only the gradients it owns."""
    grads = [p for p in params if p.grad is not None]
    return _global_sum(grads, lambda p: p.grad.detach(), _sum_of_squares, ps, partition).sqrt()


def global_param_norm(params, ps: ParallelState) -> float:
    """L2 norm of the full (serial) parameters, each counted once (--log-params-norm)."""
    return _global_sum(list(params), lambda p: p.detach(), _sum_of_squares, ps, None).sqrt().item()


def count_zero_grads(params, ps: ParallelState, partition: Partition | None = None) -> int:
    """Zero elements of the full (serial) gradient, each parameter counted once (--log-num-zeros-in-grad)."""
    grads = [p for p in params if p.grad is not None]
    return int(_global_sum(grads, lambda p: p.grad.detach(), _count_zeros, ps, partition).item())


def _count_zeros(tensors, device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        total += (t == 0).sum()
    return total


def _global_sum(params, tensor_of, measure, ps: ParallelState, partition) -> torch.Tensor:
    """measure(tensors) summed over the full (serial) model: TP shards summed over the group,
    replicated tensors and copies counted once (with a partition: what each replica owns)."""
    device = tensor_of(params[0]).device if params else _collective_device()
    split, replicated = [], []
    for p in params:
        spec = getattr(p, "shard_spec", None)
        if spec is None or spec.dim is None:
            replicated.append(tensor_of(p))
        elif not spec.segments:
            split.append(tensor_of(p))
        else:  # segments held in copies (GQA key/value heads): only the first copy counts
            split += [
                view for shard, view in split_local(tensor_of(p), spec, ps.tp_rank, ps.tp_size) if shard.first_copy
            ]
    sharded, whole = measure(split, device), measure(replicated, device)
    if partition is not None:  # every shard has one owner in the world,
        dist.all_reduce(sharded)  # every whole parameter one per replica group
        dist.all_reduce(whole, group=partition.group)
    elif ps.tp_size > 1:
        dist.all_reduce(sharded, group=ps.tp_group)  # TP shards: sum over the group
    return sharded + whole  # replicas: this rank's copy


def clip_grads(params, max_norm: float, ps: ParallelState, partition: Partition | None = None) -> float:
    """Scales gradients so the global norm is at most max_norm (0 disables); returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, ps, partition)
    if max_norm > 0 and params:  # (a distributed optimizer's replica may own none)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params], coef)
    return norm.item()


class DynamicLossScaler:
    """fp16 loss scaling: multiply the loss, skip steps whose gradients overflow (on any rank) and
    halve the scale; double it after `growth_interval` clean steps.

    Underflow is the opposite failure: with a scale too small (a tiny --initial-loss-scale) every
    fp16 gradient rounds to zero and AdamW would "train" on zeros without any error. A step whose
    unscaled gradient norm is exactly 0 is skipped and the scale multiplied by `underflow_growth`;
    if gradients are still all zero at `max_scale`, `update` says "no_gradient" and the caller
    stops the run (the model then produces no gradient at any usable scale). A scale below
    `min_scale` only shrinks gradients (some still round to zero), so clean steps raise it by
    `underflow_growth` too until it reaches `min_scale`; above it the usual rules apply.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        underflow_growth: float = 2.0**8,
        max_scale: float = 2.0**24,
    ):
        if not (initial_scale > 0 and math.isfinite(initial_scale)):
            raise ValueError(f"the initial loss scale must be positive and finite, got {initial_scale}.")
        self.scale, self.growth_interval, self.min_scale = initial_scale, growth_interval, min_scale
        self.underflow_growth, self.max_scale = underflow_growth, max_scale
        self._clean_steps = 0

    def unscale_and_check(self, params) -> bool:
        """Divides gradients by the scale; True when every rank's gradients are finite. An overflow
        halves the scale here; a finite step is judged by `update` once the gradient norm is known."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        bad = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else _collective_device())
        for g in grads:
            bad += (~torch.isfinite(g)).any().float()
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        finite = bad.item() == 0
        if not finite:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self._clean_steps = 0
        return finite

    def update(self, grad_norm: float) -> str:
        """After a finite step: "ok" (apply it), "underflow" (all gradients zero: skip it, the scale
        was raised) or "no_gradient" (still all zero at max_scale: stop)."""
        if grad_norm == 0.0:
            self._clean_steps = 0
            if self.scale >= self.max_scale:
                return "no_gradient"
            self.scale = min(self.scale * self.underflow_growth, self.max_scale)
            return "underflow"
        self._clean_steps += 1
        if self.scale < self.min_scale:
            self.scale = min(self.scale * self.underflow_growth, self.min_scale)
        elif self._clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return "ok"

    def state_dict(self):
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state):
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]

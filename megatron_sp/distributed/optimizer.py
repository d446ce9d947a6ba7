"""AdamW on fp32 main weights of this rank's shards (Megatron's mixed-precision optimizer), the true
global gradient norm and clipping.

Megatron's meaning of --bf16 / --fp16: the model's parameters are bf16/fp16; the optimizer keeps an
fp32 *main* copy of each and the AdamW moments in fp32, and steps those with the fp32 gradients that the
gradient buffers accumulated (distributed/grad_buffers.py: `param.main_grad`); after the step the main
weights are copied into the model. In fp32 the parameter is its own main weight. Bytes per parameter
on a rank (r = DP × CP replicas; --grad-reduce-in-bf16 makes the gradient 2):

                       weights  gradient  main + moments
    fp32                  4        4          0 + 8        16        (distributed: 8 + 8/r)
    bf16 / fp16           2        4         4 + 8        18        (distributed: 6 + 12/r)

AdamW is elementwise, so stepping every shard with its own slice of the gradient is the serial
update. What needs care is the gradient norm: each parameter must count once however it is sharded
(TP-split: sum the squares over the TP group) or replicated (identical on the TP ranks and on the
DP replicas: count one copy).

Distributed optimizer (`--use-distributed-optimizer`, ZeRO-1): distributed/distributed_optimizer.py; a
rank then holds main weights and moments only for the parameters it owns, and the gradient norm sums
the squares each replica owns. fp16 loss scaling: distributed/loss_scale.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.distributed.distributed_optimizer import ParamBroadcast, Partition
from megatron_sp.distributed.fp8_param_gather import Fp8ParamGather, fp8_weights
from megatron_sp.distributed.grad_buffers import GradBuffers
from megatron_sp.distributed.grad_sync import finalize_model_grads
from megatron_sp.distributed.protocol import TrainingOptimizer
from megatron_sp.parallel_state import EXPERT_REPLICAS, ParallelState, collective_device, replica_role
from megatron_sp.tensor_parallel.sharding import split_local

PARAM_ATTRS = (
    "shard_spec",
    "sequence_parallel",
    "init_tag",
    "pipeline_copy",
    "replica_role",
)  # what the norm, the partial sums, FSDP2 and its checkpoints read

# Megatron-LM's "embedding or output" parameters, which --decoupled-lr trains with an LR of their own.
DECOUPLED = ("embedding.word_embeddings.weight", "output_layer.weight")


def param_groups(named_params, weight_decay: float, decoupled: bool = False):
    """Weight decay on matrices only: no decay on biases and LayerNorm parameters (1-D tensors).
    decoupled: the word embedding and output layer in a group of their own ("decoupled": True)."""
    decay, no_decay, own = [], [], []
    for name, p in named_params:
        (own if decoupled and name in DECOUPLED else no_decay if p.dim() < 2 else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},  # (the schedule's weight decay × wd_mult)
    ]
    if own:
        groups.append({"params": own, "weight_decay": weight_decay, "wd_mult": 1.0, "decoupled": True})
    return groups


def _main_weight(p: torch.Tensor) -> torch.Tensor:
    """p itself in fp32; an fp32 copy carrying p's sharding attributes otherwise."""
    if p.dtype == torch.float32:
        return p
    main = p.detach().float()
    for name in PARAM_ATTRS:
        if hasattr(p, name):
            setattr(main, name, getattr(p, name))
    return main


class _NoParameters:
    """The local optimizer of a replica that owns no parameter (a model with fewer, larger
    parameters than replicas)."""

    def __init__(self):
        self.param_groups, self.state = [], {}

    def step(self):
        pass


class MixedPrecisionOptimizer(TrainingOptimizer):
    """AdamW (`optim`, made by `make_optimizer(groups)`) over the fp32 main weights of the parameters
    this rank steps: all of them, or with a distributed optimizer's `partition` the ones it owns.

    Per step: zero_grad() (the gradient buffers), backward, finalize_grads() (distributed/grad_sync.py),
    then prepare_grads() -> the main weights, each with `.grad` its gradient in fp32 (clip and unscale
    those), step() -> AdamW, main weights copied into the model, owners broadcast (distributed).
    """

    def __init__(
        self,
        model,
        buffers: GradBuffers,
        make_optimizer,
        weight_decay: float,
        partition=None,
        decoupled=False,
        fp8_param_gather: bool = False,
        tp_group=None,
    ):
        """fp8_param_gather: cast the FP8 linears' weights once per step and broadcast them in FP8, their
        amaxes reduced over tp_group (--fp8-param-gather: distributed/fp8_param_gather.py)."""
        self.grad_buffers, self.partition = buffers, partition
        fp8 = fp8_weights(model) if fp8_param_gather else []
        self.broadcast = ParamBroadcast(partition, exclude=[w for w, _ in fp8]) if partition is not None else None
        params = [p for p in model.parameters() if p.requires_grad]
        self.pairs = [(p, _main_weight(p)) for p in params if partition is None or partition.mine(p)]
        self.fp8_gather = None
        if fp8:
            mains = {id(p): main for p, main in self.pairs}
            self.fp8_gather = Fp8ParamGather(fp8, mains, partition, tp_group)
        self._names = {id(p): n for n, p in model.named_parameters()}
        named = [(self._names[id(p)], m) for p, m in self.pairs]
        groups = [g for g in param_groups(named, weight_decay, decoupled) if g["params"]]
        self.optim = make_optimizer(groups) if groups else _NoParameters()

    def main_params(self) -> dict:
        """{parameter name: fp32 main weight} of the parameters this rank steps (checkpoints save these)."""
        return {self._names[id(p)]: main for p, main in self.pairs}

    def zero_grad(self, set_to_none: bool = True):
        self.grad_buffers.zero()
        for p, main in self.pairs:
            main.grad = None

    def finalize_grads(self, model, ps: ParallelState, overlapped=None) -> None:
        finalize_model_grads(model, ps, self.grad_buffers, overlapped, self.partition)

    def prepare_grads(self) -> list:
        """The main weights with `.grad` = their reduced gradient (a view of the buffer in fp32, an fp32
        copy of a bf16 buffer)."""
        for p, main in self.pairs:
            main.grad = p.main_grad if p.main_grad.dtype == main.dtype else p.main_grad.float()
        return [main for _, main in self.pairs]

    @torch.no_grad()
    def step(self):
        self.optim.step()
        copies = [(p, main) for p, main in self.pairs if main is not p]
        if copies:
            torch._foreach_copy_([p for p, _ in copies], [main for _, main in copies])
        for _, main in self.pairs:
            main.grad = None  # (a parameter that is its own main weight must not keep a buffer view as .grad)
        if self.broadcast is not None:
            self.broadcast.broadcast()
        if self.fp8_gather is not None:
            self.fp8_gather.cast()

    def cast_fp8_weights(self) -> None:
        if self.fp8_gather is not None:
            self.fp8_gather.cast(after_step=False)

    def params_norm(self, model, ps: ParallelState) -> float:
        return global_param_norm(list(model.parameters()), ps)  # (every replica holds every parameter)

    def zero_grads_count(self, model, ps: ParallelState) -> int:
        stepped = [p for p in model.parameters() if self.partition is None or self.partition.mine(p)]
        return count_zero_grads(stepped, ps, self.partition)


def adamw_factory(args, device: str, distributed: bool):
    """The torch optimizer factory: apex's FusedAdam (decoupled weight decay) when apex is installed and
    we run on CUDA, else torch's fused (CUDA) or foreach AdamW."""
    kw = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    if device == "cuda" and not distributed:
        try:
            from apex.optimizers import FusedAdam  # type: ignore

            return lambda groups: FusedAdam(groups, adam_w_mode=True, **kw)
        except ImportError:
            pass
    extra = {"fused": True} if device == "cuda" else {"foreach": True}
    return lambda groups: torch.optim.AdamW(groups, **kw, **extra)


def build_optimizer(model, args, device: str, ps: ParallelState | None = None) -> MixedPrecisionOptimizer:
    """The run's optimizer and gradient buffers (fp32, or bf16 with args.grad_reduce_in_bf16). With
    args.use_distributed_optimizer and replicas (ps), main weights and moments are sharded over them."""
    distributed = ps is not None and getattr(args, "use_distributed_optimizer", False) and ps.replicas > 1
    partition = Partition([p for p in model.parameters() if p.requires_grad], ps) if distributed else None
    grad_dtype = torch.bfloat16 if getattr(args, "grad_reduce_in_bf16", False) else torch.float32
    buffers = GradBuffers(model, dtype=grad_dtype, owner=partition.owner if partition is not None else None)
    decoupled = getattr(args, "decoupled_lr", None) is not None
    return MixedPrecisionOptimizer(
        model,
        buffers,
        adamw_factory(args, device, distributed),
        args.weight_decay,
        partition,
        decoupled,
        fp8_param_gather=getattr(args, "fp8_param_gather", False),
        tp_group=ps.tp_group if ps is not None else None,
    )


def _sum_of_squares(grads, device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()  # one fused kernel per dtype


def global_grad_norm(params, ps: ParallelState, partition: Partition | None = None) -> torch.Tensor:
    """L2 norm of the full (serial) gradient: each parameter counted once. With a distributed
    optimizer's `partition`, each replica holds (and passes) only the gradients it owns."""
    grads = [p for p in params if p.grad is not None]
    return _global_sum(grads, lambda p: p.grad.detach(), _sum_of_squares, ps, partition).sqrt()


def global_param_norm(params, ps: ParallelState, partition=None) -> float:
    """L2 norm of the full (serial) parameters, each counted once (--log-params-norm); partition: the
    replicas each hold their own part of `params` (FSDP2's shards: distributed/fsdp.py)."""
    return _global_sum(list(params), lambda p: p.detach(), _sum_of_squares, ps, partition).sqrt().item()


def count_zero_grads(params, ps: ParallelState, partition: Partition | None = None) -> int:
    """Zero elements of the full (serial) gradient, each parameter counted once (--log-num-zeros-in-grad):
    the model's parameters, whose reduced gradients are their `main_grad` buffers until the next step."""
    grads = [p for p in params if getattr(p, "main_grad", None) is not None]
    return int(_global_sum(grads, lambda p: p.main_grad.detach(), _count_zeros, ps, partition).item())


def _count_zeros(tensors, device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        total += (t == 0).sum()
    return total


def _dense_tensors(params, tensor_of, ps: ParallelState) -> tuple:
    """(TP-split tensors, {replica role: replicated tensors}) of the dense parameters, each counted
    once: a copy other ranks count is left out, and of key/value heads held in copies the first."""
    split, replicated = [], {}
    for p in params:
        if not getattr(p, "norm_counted", True):  # a copy that other ranks count (distributed/fsdp.py)
            continue
        spec = getattr(p, "shard_spec", None)
        if spec is None or spec.dim is None:
            replicated.setdefault(replica_role(p), []).append(tensor_of(p))
        elif not spec.segments:
            split.append(tensor_of(p))
        else:  # segments held in copies (GQA key/value heads): only the first copy counts
            split += [
                view
                for shard, view in split_local(tensor_of(p), spec, ps.rank(spec.group), ps.size(spec.group))
                if shard.first_copy
            ]
    return split, replicated


def _global_sum(params, tensor_of, measure, ps: ParallelState, partition) -> torch.Tensor:
    """measure(tensors) summed over the full (serial) model: TP shards summed over the group,
    replicated tensors and copies counted once (with a partition: what each replica owns)."""
    device = tensor_of(params[0]).device if params else collective_device()
    params = [p for p in params if not getattr(p, "pipeline_copy", False)]  # a tied copy: counted once
    experts = [tensor_of(p) for p in params if replica_role(p) == EXPERT_REPLICAS]  # this rank's shards
    split, replicated = _dense_tensors([p for p in params if replica_role(p) != EXPERT_REPLICAS], tensor_of, ps)
    if partition is not None:  # each expert shard has one owner in the world, as every TP shard
        split, experts = experts + split, []
    sharded = measure(split, device)
    if partition is not None:  # every shard has one owner in the world,
        dist.all_reduce(sharded)  # every whole parameter one per replica group
        whole = _summed_over_replicas(replicated, partition.groups, measure, device)
    else:
        whole = measure([t for tensors in replicated.values() for t in tensors], device)
    if partition is None and ps.tp_size > 1:
        dist.all_reduce(sharded, group=ps.tp_group)  # TP shards: sum over the group
    if ps.ep_size * ps.etp_size > 1:  # every expert's shard once: summed over EP × expert-TP
        in_experts = measure(experts, device)
        dist.all_reduce(in_experts, group=ps.expert_group)
        sharded = sharded + in_experts
    elif experts:
        sharded = sharded + measure(experts, device)
    if ps.pp_size > 1:  # each stage its own parameters (the world-wide sum above already spans them)
        total = whole if partition is not None else sharded + whole
        dist.all_reduce(total, group=ps.pp_group)
        return sharded + total if partition is not None else total
    return sharded + whole  # replicas: this rank's copy


def _summed_over_replicas(replicated: dict, groups: dict, measure, device) -> torch.Tensor:
    """measure of each replica group's whole parameters summed over that group (each replica owns its
    part), added up over the groups (every rank of a group holds the same roles)."""
    total = None
    for role, group in groups.items():
        whole = measure(replicated.get(role, []), device)
        dist.all_reduce(whole, group=group)
        total = whole if total is None else total + whole
    return total


def clip_grads(params, max_norm: float, ps: ParallelState, partition: Partition | None = None) -> float:
    """Scales gradients so the global norm is at most max_norm (0 disables); returns the norm before."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, ps, partition)
    if max_norm > 0 and params:  # (a distributed optimizer's replica may own none)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params], coef)
    return norm.item()

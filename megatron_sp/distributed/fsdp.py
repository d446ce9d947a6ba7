"""ZeRO-3 with torch's FSDP2 (`--use-torch-fsdp2`, Megatron-LM's flag): the weights, gradients and AdamW
state of every TP rank's shards are sharded again over that rank's DP×CP replicas.

    module               fully_shard group       all-gather                   reshard after forward
    transformer layer i  its parameters          in its forward (layer i+1's  yes (the last layer: no, its
                                                 prefetched by layer i; in    backward follows at once)
                                                 the backward layer i-1's)
    the root (GPTModel)  embedding, final norm,  before the embedding         no
                         output layer

Our TP shards are plain tensors (tensor_parallel/sharding.py), so FSDP2 over the 1-D mesh of this rank's
DP×CP group shards each TP rank's local tensors on dim 0 (torch.chunk, the last chunks padded); every TP
rank shards the same way, so our TP collectives and partial sums act on matching slices.

Gradients: FSDP2 reduce-scatters each micro-batch's gradients in the backward and accumulates them in
the sharded `.grad` (DTensors); its reduction is a *sum* over DP×CP divided by dp_size, which is plain
DP's semantics (the DP mean of the CP partial sums: distributed/grad_sync.py). The gradient buffers and the
DP sync of distributed/grad_buffers.py / grad_sync.py are not built: FSDP2 owns the gradients. What is
left after the backward is ours (`FSDPOptimizer.finalize_grads`): the SP-region partial sums over TP, on
the local shards. Clipping sums the squares of the local shards: TP-split ones over the whole world,
TP-replicated ones over the DP×CP group only (every TP rank holds the same shard of those).

--bf16 / --fp16 (Megatron's meaning: low-precision compute, fp32 main weights): the model is built in
bf16 / fp16 as usual and turned to fp32 before sharding, so the fp32 shards are the main weights holding
the rounded initial values, exactly the plain run's; FSDP2's MixedPrecisionPolicy gathers them in the
low precision and reduces the gradients in fp32. Layer inputs are not cast (an --fp32-residual-connection
residual stays fp32). fp16's loss scaler unscales and checks the gradient shards (loop.py, as ever).

Bytes per parameter on a rank (r = DP × CP replicas), in every precision mode: weights 4/r, gradient 4/r, AdamW
8/r, plus the gathered layers (the one computing and the one prefetched) and one layer's unsharded gradient.

Under pipeline parallelism (PipelineGPT) each of the rank's stages is a root, because its forward
(pipeline_parallel/model.py's StageChunk) is what the schedule calls:

    module               fully_shard group       reshard after forward
    transformer layer i  its parameters          no
    a stage              its embedding (first),  no
                         final norm and output
                         layer (last)

torch.distributed.pipelining drives FSDP2 itself when a stage's module is an FSDP2 root (as Megatron's
schedules and torchtitan do): every micro-batch's forward and backward runs with the stage's weights
gathered and its gradients accumulated unsharded, in fp32 (FSDP2's reduce dtype); after the last
micro-batch the schedule reduce-scatters them once and reshards, in every schedule, zero-bubble ones
included. So a pipeline rank holds, during the step, its stages' weights gathered (2 or 4 bytes per
parameter) and their unsharded fp32 gradients (4) on top of the 16/r of shards: the optimizer state is
what PP × FSDP2 saves over PP with the replicated optimizer. A tied word embedding (GPT-2) has a copy on
the last stage sharded as the first stage's, so their gradient sum over the embedding group runs on the
shards (PipelineGPT.finalize_embedding_grads); the V of zbv puts both ends on rank 0, where one tied
parameter would belong to two roots: refused (`model_problem`).

Key/value heads held in copies over TP (grouped-query attention with fewer heads than TP ranks): their
copy sums need the TP-local layout, so those parameters' gradient shards are placed in a zeroed TP-local
tensor for the sum (a QKV weight's worth, transient) and taken back; the norms count the copied rows on
the first copy's ranks only.

Mixture of experts: each layer's experts module (expert_modules: the top-most submodule holding only
parameters with replica_role "expert_replicas") is fully_shard over the expert-DP mesh, before its
layer, whose other parameters go over DP×CP; the layer's forward prefetches its experts. The experts'
reduction is the same sum divided by dp_size (over expert-DP: the expert gradient of partial_grads.py).

Checkpoints keep the canonical entries (distributed/fsdp_checkpoint.py).

--fp8-param-gather: each FP8 linear's weight carries FSDP2's all-gather extension, which gathers its
shard as FP8 bytes cast once per step from the fp32 shard (distributed/fp8_param_gather.py).

What does not compose (refused in one sentence by `problem(args)`): --use-distributed-optimizer
(FSDP2 shards the optimizer state itself), --grad-reduce-in-bf16 (FSDP2 reduces in fp32), a
single replica (nothing to shard over) and --torch-compile (not verified with it).
--overlap-grad-reduce (on by default) has no effect: FSDP2 overlaps its own reduce-scatters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from megatron_sp.distributed.optimizer import (  # PARAM_ATTRS: what our sums, norms and checkpoints read
    PARAM_ATTRS,
    adamw_factory,
    count_zero_grads,
    global_param_norm,
    param_groups,
)
from megatron_sp.distributed.protocol import TrainingOptimizer
from megatron_sp.models.trainable import TrainableModel
from megatron_sp.parallel_state import EXPERT_REPLICAS, REPLICAS, ParallelState, replica_role
from megatron_sp.pipeline_parallel.model import PipelinedModel
from megatron_sp.tensor_parallel.sharding import ShardSpec, segment_shards

FLAG = "--use-torch-fsdp2"


def problem(args) -> str | None:
    """The one-sentence reason the command line cannot run with --use-torch-fsdp2, or None."""
    if not getattr(args, "use_torch_fsdp2", False):
        return None
    ours = "--use-megatron-fsdp" if getattr(args, "use_megatron_fsdp", False) else FLAG  # (the user's)
    conflicts = (
        ("use_distributed_optimizer", "--use-distributed-optimizer", "FSDP2 shards the optimizer state itself"),
        ("grad_reduce_in_bf16", "--grad-reduce-in-bf16", "FSDP2 reduce-scatters its gradients in fp32"),
        ("torch_compile", "--torch-compile", "compiled layers are not verified under fully_shard"),
    )
    for name, flag, why in conflicts:
        if getattr(args, name, False):
            return f"{ours} cannot be combined with {flag}: {why}."
    replicas = args.data_parallel_size * args.context_parallel_size
    if replicas == 1:
        return (
            f"{ours} shards over the data- and context-parallel replicas and this layout has one "
            f"(world size {args.world_size} = --tensor-model-parallel-size); drop {ours} or add ranks."
        )
    return None


def model_problem(cfg, layout) -> str | None:
    """The one-sentence reason --use-torch-fsdp2 cannot shard this model under the pipeline `layout`
    (pipeline_parallel/layout.py; None without pipeline parallelism), or None."""
    if layout is not None and layout.v_shape and not cfg.untie_embeddings_and_output_weights:
        return (
            f"{FLAG} with --pipeline-schedule zbv needs --untie-embeddings-and-output-weights: rank 0 holds both "
            f"ends of the V, and their tied word embedding cannot belong to two FSDP2 stage roots; or use "
            f"another --pipeline-schedule."
        )
    return None


# ---- wrapping --------------------------------------------------------------------------------------


def reshard(model) -> None:
    """Frees the weights an FSDP2 root keeps gathered after a forward that no backward follows (an
    evaluation): its parameters are this rank's DTensor shards again, as the checkpoint reads them."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def replica_mesh(ps: ParallelState, device: str, role: str = REPLICAS):
    """The 1-D DeviceMesh of this rank's group of a replica role: DP×CP (the ranks holding the same TP
    shards) by default, expert-DP (the ranks holding the same expert shards) for EXPERT_REPLICAS."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(ps.group(role), "cuda" if device == "cuda" else "cpu")


def expert_modules(layer) -> list:
    """The top-most submodules of `layer` whose parameters are all experts' (replica_role
    EXPERT_REPLICAS: the MoE layer's `experts`), each fully_shard over the expert-DP mesh; a module
    mixing expert and dense parameters directly cannot be split over two meshes (ValueError)."""
    found = []
    for name, module in layer.named_modules():
        if any(name.startswith(f"{top}.") for top, _ in found):
            continue
        roles = {replica_role(p) for p in module.parameters()}
        if roles == {EXPERT_REPLICAS}:
            found.append((name, module))
    inside = {id(p) for _, m in found for p in m.parameters()}
    stray = [n for n, p in layer.named_parameters() if replica_role(p) == EXPERT_REPLICAS and id(p) not in inside]
    if stray:
        raise ValueError(
            f"{FLAG}: expert parameter {stray[0]} sits in a module with dense parameters; put a model's "
            f"experts in a module of their own, which FSDP2 shards over the expert-data-parallel ranks."
        )
    return [m for _, m in found]


def shard_model(model: TrainableModel, ps: ParallelState, device: str, reshard_after_forward: bool = True):
    """fully_shard the model in place (see the module docstring); returns the mesh. The parameters become
    DTensors sharded on dim 0 and keep their attributes. reshard_after_forward=False (Megatron's
    --torch-fsdp2-no-reshard-after-forward, and --data-parallel-sharding-strategy optim_grads): every
    layer keeps its gathered weights from its forward to its backward (ZeRO-2's memory: gradients and
    optimizer state sharded, weights whole during the step)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    attrs = {n: {a: getattr(p, a) for a in PARAM_ATTRS if hasattr(p, a)} for n, p in model.named_parameters()}
    policy = MixedPrecisionPolicy()
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(model.cfg.params_dtype)
    if low is not None:  # fp32 shards (the main weights: the rounded values, as --bf16's / --fp16's are)
        policy = MixedPrecisionPolicy(low, torch.float32, cast_forward_inputs=False)  # (fp32 residual kept)
        model.float()  # (in place: the same Parameter objects)
    mesh = replica_mesh(ps, device)
    meshes = Meshes(mesh, replica_mesh(ps, device, EXPERT_REPLICAS) if model.cfg.num_experts else None, policy)
    if not isinstance(model, PipelinedModel):  # the last layer keeps its weights: its backward follows at once
        layers = list(model.layers)
        again = [reshard_after_forward and i < len(layers) - 1 for i in range(len(layers))]
        groups = [_shard_root(model, layers, again, meshes)]
    else:  # each pipeline stage is a root (its forward is what the schedule calls), gathered for the step
        groups = [_shard_root(c, list(c.blocks), [False] * len(c.blocks), meshes) for c in model.stage_chunks]
    for name, p in model.named_parameters():
        for a, value in attrs[name].items():
            setattr(p, a, value)
    for module in [m for group in groups for m in group]:  # a sum over DP×CP (experts: expert-DP) divided
        module.set_gradient_divide_factor(float(ps.dp_size))  # by dp: the DP mean of the CP partial sums
        # (torch 2.13 divides a one-rank mesh's gradients twice with the forced sum; there is nothing to sum)
        module.set_force_sum_reduction_for_comms(_mesh_of(module, meshes).size() > 1)
    return mesh


@dataclass(frozen=True)
class Meshes:
    """The meshes a model is sharded over: `dense` (DP×CP) and `experts` (expert-DP; None without
    experts), and the mixed-precision policy of both."""

    dense: object
    experts: object
    policy: object


def _mesh_of(module, meshes: Meshes):
    """The mesh an FSDP2 module was sharded over (expert_modules' hold expert parameters only)."""
    experts = meshes.experts is not None and all(replica_role(p) == EXPERT_REPLICAS for p in module.parameters())
    return meshes.experts if experts else meshes.dense


def _shard_root(root, layers, reshard, meshes: Meshes) -> list:
    """fully_shard each of `layers` (reshard[i]: layer i frees its gathered weights after its forward),
    its experts first over the expert-DP mesh, then `root` (the rest of its parameters), with the next
    layer's all-gather and this layer's experts' prefetched in the forward and the previous layer's in
    the backward; returns the FSDP2 modules."""
    from torch.distributed.fsdp import fully_shard

    experts = [expert_modules(layer) if meshes.experts is not None else [] for layer in layers]
    for layer, again, own in zip(layers, reshard, experts):
        for module in own:
            fully_shard(module, mesh=meshes.experts, reshard_after_forward=again, mp_policy=meshes.policy)
        fully_shard(layer, mesh=meshes.dense, reshard_after_forward=again, mp_policy=meshes.policy)
    fully_shard(root, mesh=meshes.dense, reshard_after_forward=False, mp_policy=meshes.policy)
    for i, layer in enumerate(layers):
        ahead = experts[i] + ([layers[i + 1]] if i + 1 < len(layers) else [])
        if ahead:
            layer.set_modules_to_forward_prefetch(ahead)
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    return [*layers, *(m for own in experts for m in own), root]


# ---- the optimizer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaShards:
    """Stands where a distributed optimizer's Partition stands for the gradient norm (optimizer.py's
    _global_sum): every rank holds a disjoint shard of its TP rank's tensors over its replica group
    (`groups`: {replica role: group}: the dense parameters' DP×CP, and the experts' expert-DP)."""

    groups: dict


def _chunk_rows(p) -> tuple:
    """The rows [a, b) of dim 0 of p's TP-local tensor that this rank's FSDP2 shard holds (torch.chunk)."""
    n, mesh = p.shape[0], p.device_mesh
    size = math.ceil(n / mesh.size())
    a = min(mesh.get_local_rank() * size, n)
    return a, min(a + size, n)


def _copy_rows(p, ps: ParallelState) -> list:
    """[(start, stop, first copy?)] of dim 0 of p's TP-local tensor, one per segment, when a segment is
    held in copies over TP (grouped-query key/value heads with fewer heads than TP ranks); else []."""
    spec = getattr(p, "shard_spec", None)
    if spec is None or not spec.segments or spec.dim % p.dim() != 0:
        return []
    shards = segment_shards(spec, p.shape[0], ps.rank(spec.group), ps.size(spec.group))
    if all(s.copies == 1 for s in shards):
        return []
    rows, start = [], 0
    for s in shards:
        rows.append((start, start + s.size, s.first_copy))
        start += s.size
    return rows


def _unsegmented(spec: ShardSpec) -> ShardSpec:
    """The spec of a piece of one segment: split on the same dim over the same group."""
    return ShardSpec(spec.dim, group=spec.group)


def _view(t, grad, spec, sequence_parallel, counted=True, pipeline_copy=False, role=REPLICAS) -> torch.Tensor:
    view = t.detach()
    view.replica_role = role  # (experts': their norms count each expert shard once, over EP × expert-TP)
    view.grad = grad
    view.main_grad = grad  # (the reduced gradient, where count_zero_grads reads it)
    view.shard_spec = _unsegmented(spec) if spec is not None and spec.dim is not None else spec
    view.sequence_parallel = sequence_parallel
    view.norm_counted = counted  # (False: a copy that other TP ranks count)
    view.pipeline_copy = pipeline_copy  # (the last stage's tied embedding: the first stage's counts)
    return view


def _local_views(p, ps: ParallelState) -> list:
    """Plain tensors aliasing this rank's shard of p (a DTensor), each with its gradient's shard as .grad
    and p's attributes (a TP-split spec without segments). Rows held in copies over TP come as their own
    views, counted by the norms on the first copy's ranks only."""
    local = p._local_tensor
    grad = p.grad._local_tensor if p.grad is not None else None
    spec, sp = getattr(p, "shard_spec", None), getattr(p, "sequence_parallel", False)
    copy, role = getattr(p, "pipeline_copy", False), replica_role(p)
    rows = _copy_rows(p, ps)
    if not rows:
        return [_view(local, grad, spec, sp, pipeline_copy=copy, role=role)]
    a, b = _chunk_rows(p)
    out = []
    for start, stop, first in rows:
        lo, hi = max(start, a) - a, min(stop, b) - a
        if lo < hi:
            out.append(_view(local[lo:hi], grad[lo:hi] if grad is not None else None, spec, sp, first, copy, role))
    return out


def _reduce_partial_grads(model, params, ps: ParallelState) -> None:
    """The SP-region partial sums over TP on the gradient shards (every TP rank holds the same rows);
    a parameter with rows held in copies is summed on its TP-local layout (zeros outside this rank's
    rows), which the copy sums need, then its rows are taken back."""
    items, copied = [], []
    for p in params:
        if p.grad is None:
            continue
        spec, sp, grad = getattr(p, "shard_spec", None), getattr(p, "sequence_parallel", False), p.grad._local_tensor
        if not _copy_rows(p, ps):
            plain = _unsegmented(spec) if spec is not None and spec.split else spec
            items.append(
                SimpleNamespace(shard_spec=plain, sequence_parallel=sp, grad=grad, replica_role=replica_role(p))
            )
            continue
        a, b = _chunk_rows(p)
        full = grad.new_zeros(p.shape)  # [TP-local rows, ...]
        full[a:b] = grad
        items.append(SimpleNamespace(shard_spec=spec, sequence_parallel=sp, grad=full))
        copied.append((grad, full, a, b))
    model.partial_grads.reduce(items, cp_summed=True, grad=lambda q: q.grad)
    for grad, full, a, b in copied:
        grad.copy_(full[a:b])


def _local_grad(p) -> torch.Tensor:
    """This rank's shard of p's gradient (zeros when p got none), the tensor the embedding sum adds into."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad._local_tensor


class FSDPOptimizer(TrainingOptimizer):
    """AdamW over the model's FSDP2-sharded fp32 parameters (DTensors), for the training loop
    (distributed/protocol.py), with no gradient buffers: FSDP2 owns the gradients."""

    grad_buffers = None
    fp8_weights = ()  # --fp8-param-gather: fp8_param_gather.Fsdp2Fp8Weight per FP8 weight (their all-gathers)

    def __init__(self, model, ps: ParallelState, make_optimizer, weight_decay: float, decoupled=False):
        self.model, self.ps = model, ps
        roles = {REPLICAS: ps.replica_group}
        if model.cfg.num_experts:
            roles[EXPERT_REPLICAS] = ps.edp_group
        self.partition = ReplicaShards(roles)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optim = make_optimizer([g for g in param_groups(named, weight_decay, decoupled) if g["params"]])

    def main_params(self) -> dict:
        return dict(self.model.named_parameters())

    def zero_grad(self, set_to_none: bool = True):
        self.optim.zero_grad(set_to_none=True)

    def cast_fp8_weights(self) -> None:
        for weight in self.fp8_weights:
            weight.cast(after_step=False)

    @torch.no_grad()
    def finalize_grads(self, model, ps: ParallelState, overlapped=None):
        """After the last backward: FSDP2 has reduce-scattered over DP×CP (overlapping its own: no
        `overlapped`); the partial sums over TP remain (SP-region parameters, key/value copies), on the
        local shards, and under pipeline parallelism the tied embedding's two copies (first and last
        stage: the same chunk of rows)."""
        _reduce_partial_grads(model, self.params, self.ps)
        model.finalize_embedding_grads(grad=_local_grad)

    def local_params(self) -> list:
        """This rank's shards as plain tensors, their gradient shards as .grad and .main_grad (the norm and
        zero-count logs read them with `partition`)."""
        return [v for p in self.params for v in _local_views(p, self.ps)]

    def prepare_grads(self) -> list:
        """This rank's shards, each with its gradient shard as .grad (clip and scale those in place)."""
        return [v for p in self.params if p.grad is not None for v in _local_views(p, self.ps)]

    @torch.no_grad()
    def step(self):
        self.optim.step()
        for weight in self.fp8_weights:  # (--fp8-param-gather: the shards' FP8 bytes, once per step)
            weight.cast()

    def params_norm(self, model, ps: ParallelState) -> float:
        return global_param_norm(self.local_params(), ps, self.partition)

    def zero_grads_count(self, model, ps: ParallelState) -> int:
        return count_zero_grads(self.local_params(), ps, self.partition)


def build_fsdp_optimizer(model, args, device: str, ps: ParallelState) -> FSDPOptimizer:
    """Shards the model (shard_model) and returns its optimizer (optimizer.py's AdamW factory)."""
    shard_model(model, ps, device, getattr(args, "torch_fsdp2_reshard_after_forward", True))
    decoupled = getattr(args, "decoupled_lr", None) is not None
    opt = FSDPOptimizer(model, ps, adamw_factory(args, device, distributed=True), args.weight_decay, decoupled)
    if getattr(args, "fp8_param_gather", False):  # FP8 all-gathers of the FP8 linears' weights
        from megatron_sp.distributed.fp8_param_gather import shard_fp8_weights

        opt.fp8_weights = shard_fp8_weights(model, ps.tp_group)
    return opt

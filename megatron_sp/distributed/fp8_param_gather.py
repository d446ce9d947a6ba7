"""`--fp8-param-gather`: the FP8 linears' weights are cast to FP8 once per step, from the fp32 main
weights, and moved as FP8 bytes. With the distributed optimizer (Fp8ParamGather, below) the replica that
owns a weight casts it and broadcasts the bytes; under FSDP2 (Fsdp2Fp8Weight, at the end) each rank casts
its shard and FSDP2 all-gathers the bytes.

Megatron-LM's meaning is "keep the compute param in FP8 and all-gather it in FP8". With the distributed
optimizer, per step after the AdamW step (distributed/optimizer.py):

  1. the owner of an FP8 linear's weight takes the amax of its fp32 main weight, all-reduced (MAX) over
     the TP group, so that it is the whole logical tensor's (every TP rank of a replica owns its shard
     of the same weights: the owners are agreed over TP); the scale follows the recipe: `tensorwise`
     fp8_max / amax, `delayed` the weight's amax history after this amax enters it (so the weight is
     cast with a scale that covers it; Transformer Engine casts with the scale before it);
  2. it casts the main weight to e4m3 with that scale, into one uint8 buffer per owner, and broadcasts
     those bytes with the amaxes over its replica group (gloo and NCCL both move uint8): one byte per
     weight element where the bf16 broadcast moves two;
  3. every replica writes the FP8 values into the model's bf16 weight (q / scale, rounded to bf16) and
     hands the layer its scale (tensor_parallel/fp8.py: `Fp8Gemms.weight_scale`), which the forward and
     backward GEMMs cast the weight with instead of its own amax.

Step 3 is lossless: an e4m3 value has 3 mantissa bits, so q / scale rounded to bf16's 8 is within
2^-9 of it, far inside half an e4m3 step (2^-4 relative), and the GEMM's cast of the bf16 weight with
the same scale gives back q bit for bit (tests/test_fp8_param_gather.py), subnormals and saturation
included; bf16 keeps fp32's exponent range, so no value underflows (fp16 would: --bf16 is required).
So every GEMM sees the FP8 weight cast once from the fp32 main weight, as in Megatron-LM, and any
layout computes the same FP8 weights. What is not Megatron-LM's: the model holds that weight in bf16
storage (two bytes per element, not one), so the saving is in the broadcast, not in memory.

A weight's amax enters its delayed-scaling history when new weights are cast (after each step, and at
the start of a run whose history holds none); a resume casts with the checkpointed history's scale
without recording, so it continues the straight run bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import REPLICAS, replica_role
from megatron_sp.tensor_parallel import fp8 as fp8_gemms


def fp8_weights(model) -> list:
    """(weight, its layer's Fp8Gemms) of every linear whose GEMMs run in FP8, in module order."""
    found = []
    for name, m in model.named_modules():
        fp8 = getattr(m, "fp8", None)
        if fp8 is None or getattr(m, "weight", None) is None:
            continue
        if replica_role(m.weight) != REPLICAS:
            raise ValueError(f"{name}: an FP8 weight outside the dense replicas is not handled by --fp8-param-gather.")
        found.append((m.weight, fp8))
    return found


class _Owner:
    """One owner's FP8 weights: their bytes and amaxes, broadcast from `src` over `group`."""

    def __init__(self, weights, group, src):
        self.weights, self.group, self.src = weights, group, src
        self.bytes = torch.empty(sum(w.numel() for w, _ in weights), dtype=torch.uint8, device=weights[0][0].device)
        self.amax = torch.zeros(len(weights), dtype=torch.float32, device=weights[0][0].device)

    def views(self):
        offset = 0
        for w, _ in self.weights:
            yield self.bytes[offset : offset + w.numel()].view(w.shape)
            offset += w.numel()


class Fp8ParamGather:
    """Steps 1–3 of the module docstring for one rank: `weights` as fp8_weights(model) gives them, `mains`
    {id(weight): fp32 main weight} for the weights this rank steps, `partition` the distributed optimizer's
    (None: this rank steps every weight and nothing is broadcast)."""

    def __init__(self, weights, mains: dict, partition, tp_group):
        self.tp_group, self.mains = tp_group, mains
        if any(fp8.recipe.recipe not in ("tensorwise", "delayed") for _, fp8 in weights):
            raise ValueError("--fp8-param-gather needs a tensor-scaled recipe (tensorwise or delayed).")
        self.mine, self.owners = [], []
        if partition is None or REPLICAS not in partition.shares or partition.shares[REPLICAS].group is None:
            self.mine = [_Owner(weights, None, None)] if weights else []
            return
        share, of = partition.shares[REPLICAS], {id(w): (w, fp8) for w, fp8 in weights}
        for owner, params in enumerate(share.params_of):
            owned = [of[id(p)] for p in params if id(p) in of]
            if owned:
                entry = _Owner(owned, share.group, partition.global_rank(owner))
                self.owners.append(entry)
                if owner == share.rank:
                    self.mine.append(entry)

    @torch.no_grad()
    def cast(self, after_step: bool = True) -> None:
        """The FP8 weights from the main weights (after_step False: at the start or after a load)."""
        scales = {}
        for entry in self.mine:  # 1. and 2.: the weights this rank steps
            amaxes = [self.mains[id(w)].abs().max() for w, _ in entry.weights]
            entry.amax.copy_(torch.stack(fp8_gemms.reduce_amax(amaxes, (self.tp_group,))).view(-1))
            scales[id(entry)] = _scales(entry, after_step)
            for (w, fp8), q, s in zip(entry.weights, entry.views(), scales[id(entry)]):
                q.copy_(fp8_gemms.to_fp8(self.mains[id(w)], s, fp8.recipe.dtype(fp8_gemms.WEIGHT)).view(torch.uint8))
        handles = []
        for entry in self.owners:
            for t in (entry.bytes, entry.amax):
                handles.append(dist.broadcast(t, src=entry.src, group=entry.group, async_op=True))
        for handle in handles:
            handle.wait()
        everyone = self.owners or self.mine
        for entry in everyone:  # 3.
            if id(entry) not in scales:  # (the scale of a weight another replica owns, from its amax)
                scales[id(entry)] = _scales(entry, after_step)
            for (w, fp8), q, s in zip(entry.weights, entry.views(), scales[id(entry)]):
                w.copy_(q.view(fp8.recipe.dtype(fp8_gemms.WEIGHT)).float().div(s))
        for entry in everyone:  # (after every write: the weights share their buffers' version counters)
            for (w, fp8), s in zip(entry.weights, scales[id(entry)]):
                fp8.hold_weight(w, s)


def _scales(entry: _Owner, after_step: bool) -> list:
    """The cast scale of each of an owner's weights, from its amax (all replicas compute the same)."""
    return [_scale(fp8, amax, after_step) for (_, fp8), amax in zip(entry.weights, entry.amax)]


def _scale(fp8, amax: torch.Tensor, after_step: bool) -> torch.Tensor:
    dtype = fp8.recipe.dtype(fp8_gemms.WEIGHT)
    if fp8.delayed is None:
        return fp8_gemms.amax_to_scale(amax, dtype)
    if after_step or not bool((fp8.delayed.amax_history[:, fp8_gemms.WEIGHT] > 0).any()):
        fp8.delayed.record([fp8_gemms.WEIGHT], [amax])
    return fp8.delayed.current(fp8_gemms.WEIGHT, amax.device)


class Fsdp2Fp8Weight:
    """--fp8-param-gather under FSDP2 (distributed/fsdp.py): FSDP2's all-gather extension on one FP8
    linear's weight. Before the all-gather (`fsdp_pre_all_gather`) this rank's fp32 shard, its main
    weight, is cast to e4m3 with the whole tensor's scale (amax all-reduced over the shard mesh and TP)
    and handed over as uint8 bytes, padded to FSDP2's shard size (a uint8 all-gather, which gloo runs
    too: torchao's extension hands float8 tensors, which gloo cannot move); after it
    (`fsdp_post_all_gather`) the gathered FP8 values are written into the bf16 weight the layer computes
    with, and the layer is handed the scale (as with the distributed optimizer, above). The cast runs
    once per step, after it (`cast`: FSDPOptimizer.step, and at the start), so the forward's all-gather,
    the backward's re-gather and every micro-batch move the same bytes; a shard changed otherwise is
    cast again at its next all-gather."""

    def __init__(self, fsdp_param, fp8, tp_group):
        self.param, self.fp8, self.tp_group = fsdp_param, fp8, tp_group
        self.bytes, self.scale, self.version = None, None, None
        local = fsdp_param._sharded_local_tensor
        local.fsdp_pre_all_gather, local.fsdp_post_all_gather = self.pre_all_gather, self.post_all_gather
        fsdp_param._init_extensions()  # (FSDP2 looks for the extension when it builds its FSDPParam)

    @torch.no_grad()
    def cast(self, after_step: bool = True) -> None:
        """This rank's shard in FP8, with the whole tensor's scale (delayed scaling: recorded as above)."""
        local = self.param._sharded_local_tensor
        amax = local.abs().max().float() if local.numel() else torch.zeros((), device=local.device)
        (amax,) = fp8_gemms.reduce_amax([amax], (self.param.mesh_info.mesh.get_group(), self.tp_group))
        self.scale = _scale(self.fp8, amax, after_step)
        q = fp8_gemms.to_fp8(local, self.scale, self.fp8.recipe.dtype(fp8_gemms.WEIGHT)).view(torch.uint8)
        self.bytes = q.new_zeros(self.param.padded_sharded_param_size)
        self.bytes[: q.shape[0]] = q
        self.version = local._version

    def pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if self.bytes is None or self.param._sharded_local_tensor._version != self.version:
            self.cast(after_step=False)
        return (self.bytes,), self.scale

    @torch.no_grad()
    def post_all_gather(self, outputs, scale, param_dtype, *, out=None):
        (data,) = outputs
        weight = data.view(self.fp8.recipe.dtype(fp8_gemms.WEIGHT)).float().div(scale).to(param_dtype)
        if out is not None:  # (the same values: the backward's re-gather, as FSDP2's own copies do)
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight)
            self.fp8.hold_weight(out, scale)
            return None
        self.fp8.hold_weight(weight, scale)
        return weight, ()


def shard_fp8_weights(model, tp_group) -> list:
    """Fsdp2Fp8Weight on every FP8 linear's weight of an FSDP2-sharded model (after fully_shard)."""
    from torch.distributed.fsdp import FSDPModule

    fp8_of = {id(w): fp8 for w, fp8 in fp8_weights(model)}
    hooked = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            fp8 = fp8_of.get(id(fsdp_param.sharded_param))
            if fp8 is not None:
                hooked.append(Fsdp2Fp8Weight(fsdp_param, fp8, tp_group))
    if len(hooked) != len(fp8_of):
        raise RuntimeError(f"--fp8-param-gather found {len(hooked)} of {len(fp8_of)} FP8 weights in FSDP2's groups.")
    return hooked

"""Checkpoints of an FSDP2 run (`--use-torch-fsdp2`, distributed/fsdp.py) in the canonical entries every
other run reads (checkpointing/canonical.py): each parameter and AdamW moment is gathered over the DP×CP
replicas (an expert's over its expert-DP ranks) to its TP-local tensor on save, and on load each rank
takes its dim-0 chunk of it (torch.chunk, as FSDP2 shards), so FSDP2, distributed-optimizer and
replicated runs resume each other at any layout, pipeline stages and experts (per-expert entries, the
routers' expert biases) included."""

from __future__ import annotations

import torch

from megatron_sp.checkpointing.canonical import empty_dcp_target, from_canonical_local, to_dcp_tensor
from megatron_sp.checkpointing.states import ModelState, OptimizerState, adam_load_target, kept_buffers
from megatron_sp.distributed.fsdp import FSDPOptimizer
from megatron_sp.distributed.optimizer import PARAM_ATTRS


def _like(p) -> torch.Tensor:
    """A zero fp32 tensor of p's TP-local shape with p's attributes (what canonical.py converts)."""
    t = torch.zeros(p.shape, dtype=torch.float32, device=p._local_tensor.device)
    for a in PARAM_ATTRS:
        if hasattr(p, a):
            setattr(t, a, getattr(p, a))
    return t


def _gathered(dt, p) -> torch.Tensor:
    """The TP-local tensor of a DP×CP-sharded DTensor (collective over the mesh), with p's attributes."""
    t = dt.full_tensor()
    for a in PARAM_ATTRS:
        if hasattr(p, a):
            setattr(t, a, getattr(p, a))
    return t


def _my_chunk(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's dim-0 chunk of a TP-local tensor, as FSDP2 shards it (torch.chunk; empty past the end)."""
    mesh = p.device_mesh
    chunks = torch.chunk(full, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else full.new_zeros((0,) + tuple(full.shape[1:]))


class FSDPModelState(ModelState):
    """ModelState of an FSDP2 model: saves each parameter's TP-local tensor (gathered over DP×CP), so
    the entries are canonical.py's; loads by taking this rank's chunk of them."""

    def _saved(self):
        return [(n, _gathered(p, p)) for n, p in self.model.named_parameters()]

    def load_target(self) -> dict:
        target = {n: empty_dcp_target(_like(p), self.ps) for n, p in self.model.named_parameters()}
        return {**target, **{n: torch.zeros_like(b) for n, b in kept_buffers(self.model)}}

    @torch.no_grad()
    def load_state_dict(self, loaded: dict) -> None:
        for name, b in kept_buffers(self.model):  # (the routers' expert biases: not sharded)
            b.copy_(loaded[name])
        for name, p in self.model.named_parameters():
            value = from_canonical_local(loaded[name], _like(p), self.ps)
            p._local_tensor.copy_(_my_chunk(value, p))


class FSDPOptimizerState(OptimizerState):
    """OptimizerState of an FSDPOptimizer: the AdamW moments gathered to their TP-local tensors (the
    replicated optimizer's canonical entries) on save, this rank's chunk of them on load."""

    def state_dict(self) -> dict:
        out = {}
        for name, p in self.params:
            st = self.optimizer.state.get(p, {})
            local = {"step": torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).cpu().clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                full = _gathered(st[key], p) if key in st else _like(p)
                local[key] = to_dcp_tensor(full, full, self.ps)
            out[name] = local
        return out

    def load_target(self) -> dict:
        return adam_load_target(self.params, self.ps, like=_like)

    @torch.no_grad()
    def load_state_dict(self, loaded: dict) -> None:
        fused = any(g.get("fused") or g.get("capturable") for g in self.optimizer.param_groups)
        for name, p in self.params:
            saved = loaded[name]
            state = {"step": saved["step"].clone().to(p.device if fused else "cpu")}
            for key in ("exp_avg", "exp_avg_sq"):
                moment = torch.zeros_like(p)  # a DTensor sharded as p
                moment._local_tensor.copy_(_my_chunk(from_canonical_local(saved[key], _like(p), self.ps), p))
                state[key] = moment
            self.optimizer.state[p] = state


def checkpoint_states(model, optimizer: FSDPOptimizer, ps) -> dict:
    """The model and optimizer entries of a checkpoint of an FSDP2 run (pretrain.Trainer's others as usual)."""
    return {"model": FSDPModelState(model, ps), "optim": FSDPOptimizerState(optimizer.optim, model, ps)}

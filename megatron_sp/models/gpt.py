"""GPTModel: the tensor + sequence parallel model of a spec. Same function and state-dict keys as
ReferenceGPT (models/language_model.py); this file adds moving between full and sharded state.

One pre-norm layer on a rank of a TP group of size t (n query heads, n_kv key/value heads, f MLP
width, V padded vocab):

    x        [s/t, b, h]  SP region: norms, dropout, residual   ([s, b, h] without SP)
    qkv      [s, b, (n + 2 n_kv) d / t] after g (all-gather) + ColumnParallelLinear: whole heads
    attn     [b, n/t, s, d]
    proj     [s/t, b, h]  RowParallelLinear + ḡ (reduce-scatter), then bias-dropout-add
    fc1      [s, b, f/t]  g + ColumnParallelLinear (SwiGLU: [s, b, 2f/t]), activation
    fc2      [s/t, b, h]  RowParallelLinear + ḡ, then bias-dropout-add
    logits   [s, b, V/t]  g + embedding or output-layer shard; vocab-parallel cross entropy

Parameters are created on the meta device and materialised on `device` in cfg.params_dtype, each
rank drawing only its shard of the serial initial tensors (models/init.py): building a TP=t model
allocates a rank's shard, never the whole model.

Built with `stages` (models/language_model.py), it is a pipeline rank's share of the model
(pipeline_parallel/model.py: PipelineGPT), loading and gathering only what it holds.

Gradients that a backward leaves as partial sums (over TP: parameters marked `sequence_parallel`,
key/value heads held in copies; over CP: all of them) are summed by `partial_grads`
(tensor_parallel/partial_grads.py), which full_grad_dict and the training loop both call.
"""

from __future__ import annotations

import torch

from megatron_sp import parallel_state
from megatron_sp.models.builders import ParallelBuilder
from megatron_sp.models.language_model import LanguageModel
from megatron_sp.models.moe.state import expert_of, gather_experts
from megatron_sp.tensor_parallel.partial_grads import PartialGrads
from megatron_sp.tensor_parallel.sharding import full_dim_size, gather_full, shard_full


class GPTModel(LanguageModel):
    """The parallel model of cfg.model's family (or of `spec`); see DESIGN.md for the API.
    device: where the parameters are materialised (default: torch's default device, the CPU); stages:
    the shares built here (default: the whole model). A models.trainable.TrainableModel."""

    def __init__(self, cfg, ps: parallel_state.ParallelState | None = None, spec=None, *, device=None, stages=None):
        ps = ps if ps is not None else parallel_state.get()
        check_parallel_sizes(cfg, ps)
        super().__init__(cfg, ParallelBuilder(cfg, ps), spec, stages=stages)
        self.ps = ps
        self.partial_grads = PartialGrads(ps)
        self.materialise(device if device is not None else torch.get_default_device(), coords=ps.coords)

    def forward(self, tokens, labels=None, **inputs):
        """LanguageModel.forward; a forward that will have a backward leaves partial gradients."""
        if torch.is_grad_enabled():
            self.partial_grads.expect()
        return super().forward(tokens, labels, **inputs)

    # ---- full <-> sharded state ---------------------------------------------------------------
    @torch.no_grad()
    def load_full_state_dict(self, state_dict):
        """Loads a ReferenceGPT-shaped state dict, keeping this rank's shards (of its stages: the other
        stages' tensors are ignored)."""
        params = dict(self.named_parameters())
        check_full_keys(params, state_dict, self.cfg, whole=self.is_whole)
        for name, p in params.items():
            want = _full_shape(p, self.ps)
            if tuple(state_dict[name].shape) != want:
                raise ValueError(f"{name}: full tensor {tuple(state_dict[name].shape)} is not the model's {want}.")
            rank, size = self.ps.coords(p.shard_spec.group)
            p.copy_(shard_full(state_dict[name].to(p.device), p.shard_spec, tuple(p.shape), rank, size))

    @torch.no_grad()
    def full_state_dict(self):
        """Collective over the TP group (and the expert groups): unsharded parameters (of this model's
        stages), ReferenceGPT keys and shapes, every expert's."""
        full = {
            name: gather_full(p.detach(), p.shard_spec, self.ps.group(p.shard_spec.group))
            for name, p in self.named_parameters()
        }
        return gather_experts(full, self.ps, self.cfg.num_experts)

    @torch.no_grad()
    def full_grad_dict(self):
        """Collective: unsharded gradients (partial sums reduced first if still pending, then the tied
        embedding's copies); a parameter's gradient is its `.grad`, or its `main_grad` when gradient
        buffers hold it (distributed/grad_buffers.py)."""
        self.partial_grads.reduce(self.parameters(), grad=gradient_of)
        self.finalize_embedding_grads()
        full = {
            name: gather_full(gradient_of(p), p.shard_spec, self.ps.group(p.shard_spec.group))
            for name, p in self.named_parameters()
            if gradient_of(p) is not None
        }
        return gather_experts(full, self.ps, self.cfg.num_experts)

    def finalize_embedding_grads(self, grad=None) -> None:
        """Sums the tied word embedding's gradient over the ranks that hold a copy of it: none here, the
        one model holds both ends (PipelineGPT's stages sum theirs)."""


def gradient_of(p):
    """A parameter's gradient: `.grad`, else the gradient buffers' `main_grad` (None: no gradient)."""
    return p.grad if p.grad is not None else getattr(p, "main_grad", None)


def _full_shape(p, ps):
    shape = list(p.shape)
    spec = p.shard_spec
    if spec.dim is not None:
        dim = spec.dim % p.dim()
        shape[dim] = full_dim_size(spec, shape[dim], ps.size(spec.group))
    return tuple(shape)


def check_full_keys(params: dict, state_dict: dict, cfg, *, whole: bool = True) -> None:
    """A full state dict has this model's keys, and every other expert's (held by other EP ranks); a
    model of some stages (whole=False) ignores the other stages' keys."""
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(k for k in set(state_dict) - set(params) if expert_of(k) is None or cfg.num_experts is None)
    if missing or (unexpected and whole):
        raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")


def check_parallel_sizes(cfg, ps: parallel_state.ParallelState):
    """The config's TP, CP and expert sizes are the initialised groups' (one sentence otherwise)."""
    if cfg.tensor_model_parallel_size != ps.tp_size:
        raise ValueError(
            f"GPTConfig.tensor_model_parallel_size ({cfg.tensor_model_parallel_size}) does not "
            f"match the initialised TP group size ({ps.tp_size})."
        )
    if cfg.context_parallel_size != ps.cp_size:
        raise ValueError(
            f"GPTConfig.context_parallel_size ({cfg.context_parallel_size}) does not match the "
            f"initialised CP group size ({ps.cp_size})."
        )
    experts = (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size)
    if cfg.num_experts is not None and experts != (ps.ep_size, ps.etp_size):
        raise ValueError(
            f"GPTConfig.expert_model_parallel_size ({cfg.expert_model_parallel_size}) and "
            f"expert_tensor_parallel_size ({cfg.expert_tensor_parallel_size}) do not match the initialised "
            f"expert groups ({ps.ep_size}, {ps.etp_size}); pass them to initialize_model_parallel."
        )
    wanted = tuple(cfg.hierarchical_context_parallel_sizes or ())
    if ps.cp_size > 1 and wanted and wanted != tuple(ps.hierarchical_cp_sizes):
        raise ValueError(
            f"GPTConfig.hierarchical_context_parallel_sizes {list(wanted)} do not match the initialised "
            f"groups' {list(ps.hierarchical_cp_sizes)}; pass them to initialize_model_parallel."
        )

"""The stateful objects a run gives checkpointer.save / load, and where each is stored.

    key           object               stored in
    model         ModelState           DCP (canonical layout, resharded on load)
    optim         OptimizerState       DCP (AdamW moments and step, canonical layout)
    train_state   TrainState           metadata.json (iteration, samples consumed: the data position;
                                       the LR schedule is a function of it, so it has no state of its own)
    loss_scale    DynamicLossScaler    metadata.json (fp16 only; None without a scaler)
    rng           RNGState             rng_rank<r>.pt, one file per rank

The protocol: every state has `state_dict()` and `load_state_dict(state)`, which updates the object in
place (the caller's objects are restored, never replaced). A state with `load_target()` is tensors:
DCP reads into the target (this rank's slices), then `load_state_dict` takes them. A state with
`per_rank = True` is one torch file per rank, read with weights_only=True; its `load_state_dict`
raises ValueError for a state that is not its kind. Any other state is a JSON-able dict in
metadata.json under its key. `label` names a state in messages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_sp.checkpointing.canonical import empty_dcp_target, from_canonical_local, to_dcp_tensor


@dataclass
class TrainState:
    """Where training stands: the iteration and the samples consumed (the data position)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, state[f.name])


class ModelState:
    """The model's weights, each as its slice of the canonical tensor (canonical.py), in fp32.

    main_params: {name: fp32 main weight} of the parameters this rank's optimizer steps (distributed/
    optimizer.py; with a distributed optimizer only the ones it owns): those are what a rank saves, so
    a bf16 run stores its fp32 main weights and a checkpoint does not depend on the run's precision.
    On load every parameter is read (cast to the model's dtype) and so is every main weight. Without
    main_params (tools, tests): the model's parameters themselves."""

    label = "model"

    def __init__(self, model, ps, main_params: dict | None = None):
        self.model, self.ps, self.main_params = model, ps, main_params

    def _saved(self):
        params = dict(self.model.named_parameters())
        if self.main_params is None:
            return params.items()
        return [(n, self.main_params[n]) for n in params if n in self.main_params]

    def state_dict(self) -> dict:
        saved = {n: to_dcp_tensor(t.detach().float(), t, self.ps) for n, t in self._saved()}
        return {**saved, **{n: b.detach().clone() for n, b in kept_buffers(self.model)}}

    def load_target(self) -> dict:
        target = {n: empty_dcp_target(p, self.ps) for n, p in self.model.named_parameters()}
        return {**target, **{n: torch.zeros_like(b) for n, b in kept_buffers(self.model)}}

    @torch.no_grad()
    def load_state_dict(self, loaded: dict) -> None:
        for name, b in kept_buffers(self.model):
            b.copy_(loaded[name])
        for name, p in self.model.named_parameters():
            value = from_canonical_local(loaded[name], p, self.ps)
            p.copy_(value)
            main = (self.main_params or {}).get(name)
            if main is not None and main is not p:
                main.copy_(value)


def kept_buffers(model) -> list:
    """Buffers a checkpoint keeps: the routers' expert biases (aux-loss-free balancing's state), the
    same on every rank."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith(".expert_bias")]


class OptimizerState:
    """The AdamW state of the parameters `optimizer` holds (a distributed optimizer's own torch
    optimizer holds those this rank owns), keyed by the model's parameter names; main_params: the
    tensors it steps by name when they are not the model's parameters (fp32 main weights of a bf16
    model). The entries are the replicated fp32 optimizer's, so any run, at any layout and precision,
    reads them."""

    label = "optimizer state"

    def __init__(self, optimizer, model, ps, main_params: dict | None = None):
        self.optimizer, self.ps = optimizer, ps
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        named = [(n, (main_params or {}).get(n, p)) for n, p in model.named_parameters()]
        self.params = [(n, p) for n, p in named if id(p) in held]

    def state_dict(self) -> dict:
        out = {}
        for name, p in self.params:
            st = self.optimizer.state.get(p, {})
            out[name] = {
                "exp_avg": to_dcp_tensor(st.get("exp_avg", torch.zeros_like(p)), p, self.ps),
                "exp_avg_sq": to_dcp_tensor(st.get("exp_avg_sq", torch.zeros_like(p)), p, self.ps),
                "step": torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).cpu().clone(),
            }
        return out

    def load_target(self) -> dict:
        return adam_load_target(self.params, self.ps)

    @torch.no_grad()
    def load_state_dict(self, loaded: dict) -> None:
        fused = any(g.get("fused") or g.get("capturable") for g in self.optimizer.param_groups)
        for name, p in self.params:
            saved = loaded[name]
            self.optimizer.state[p] = {
                "step": saved["step"].to(p.device if fused else "cpu"),
                "exp_avg": from_canonical_local(saved["exp_avg"], p, self.ps).to(p.dtype),
                "exp_avg_sq": from_canonical_local(saved["exp_avg_sq"], p, self.ps).to(p.dtype),
            }


class RNGState:
    """This process's torch (and CUDA) random generator state."""

    label = "RNG state"
    per_rank = True

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state) -> None:
        ok = (
            isinstance(state, dict)
            and isinstance(state.get("torch"), torch.Tensor)
            and state["torch"].dtype == torch.uint8
            and state["torch"].shape == torch.get_rng_state().shape
        )
        if not ok:
            raise ValueError("not a torch RNG state")
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def adam_load_target(named, ps, like=lambda p: p) -> dict:
    """DCP's load target of AdamW's state per (name, parameter): moments shaped as `like(p)`'s canonical
    slice (distributed/fsdp.py passes the TP-local tensor of a sharded parameter), and the step."""
    return {
        name: {
            "exp_avg": empty_dcp_target(like(p), ps),
            "exp_avg_sq": empty_dcp_target(like(p), ps),
            "step": torch.zeros((), dtype=torch.float32),
        }
        for name, p in named
    }

"""The experts: E small MLPs, each on the tokens routed to it (Megatron's SequentialMLP / GroupedMLP).

One expert, width f (--moe-ffn-hidden-size), on its tokens x [N_e, h] with routing weights p [N_e]:

    y = fc2(p · act(fc1 x + b1)) + p · b2    fc1 [f, h] ([2f, h]: SwiGLU gate rows, then up rows), fc2 [h, f]

(the weights scale the activation and fc2's bias, as Megatron's experts apply the probabilities: MLP's
per_token_scale, TEGroupedMLP._apply_bias; so y = p · expert(x), transformers' gpt-oss). A rank holds the
experts of its expert-parallel rank, each under its global index (`experts.{e}.fc1.weight`: the same
names, values and initial draws at any EP), its fc1 rows and fc2 columns split over expert-TP.
--moe-grouped-gemm runs every local expert in one torch._grouped_mm per projection; the per-expert
loop is the reference, and both give the same numbers (tests/test_moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_sp.models.blocks import _activation


class ExpertMLP(nn.Module):
    """One expert's fc1 and fc2 (this rank's expert-TP shard of them)."""

    def __init__(self, cfg, *, builder):
        super().__init__()
        h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size
        gated = cfg.gated_linear_unit  # [gate; up] rows, as the dense MLP's (--swiglu, --quick-geglu)
        rows = 2 * f if gated else f
        self.fc1 = builder.expert_linear(h, rows, split=0, segments=(f, f) if gated else (), init="normal")
        self.fc2 = builder.expert_linear(f, h, split=1, init="scaled_normal")


class Experts(nn.Module):
    """forward(x [N, h], counts, probs [N]) -> [N, h]: rows grouped by local expert, `counts` rows each."""

    def __init__(self, cfg, *, builder, expert_ids):
        super().__init__()
        self.cfg, self.expert_ids = cfg, tuple(expert_ids)
        self.local_experts = nn.ModuleDict({str(e): ExpertMLP(cfg, builder=builder) for e in self.expert_ids})
        self.act = _activation(cfg)

    def _activate(self, a, probs):
        """The dense MLP's activation (models/blocks.py MLP), gated ones with their offset and clamp."""
        if self.cfg.gated_linear_unit:
            gate, up = a.chunk(2, dim=-1)
            clamp, offset = self.cfg.activation_func_clamp_value, self.cfg.glu_linear_offset
            if clamp is not None:
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            a = self.act(gate) * (up + offset if offset else up)
        else:
            a = self.act(a)
        return a * probs.unsqueeze(-1).to(a.dtype)

    def forward(self, x, counts, probs):
        if self.cfg.moe_grouped_gemm and _grouped_mm_runs(x, self):
            return self._grouped(x, counts, probs)
        return self._loop(x, counts, probs)

    def _loop(self, x, counts, probs):
        outs = []
        for expert, xs, ps in zip(self.local_experts.values(), x.split(counts), probs.split(counts)):
            a = self._activate(expert.fc1(xs), ps)  # [N_e, f(×2)/etp]
            out = expert.fc2(a, add_bias=False)  # [N_e, h]
            outs.append(out if expert.fc2.bias is None else out + ps.unsqueeze(-1).to(out.dtype) * expert.fc2.bias)
        return torch.cat(outs) if outs else x.new_zeros((0, self.cfg.hidden_size))

    def _grouped(self, x, counts, probs):
        experts = list(self.local_experts.values())
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        w1 = torch.stack([e.fc1.weight.t() for e in experts]).to(x.dtype)  # [E_l, h, f(×2)]
        w2 = torch.stack([e.fc2.weight.t() for e in experts]).to(x.dtype)  # [E_l, f, h]
        a = _GroupedMM.apply(x, w1, offs) + self._bias_rows(experts, "fc1", counts, x)
        a = self._activate(a, probs)
        out = _GroupedMM.apply(a, w2, offs)
        if experts[0].fc2.bias is None:
            return out
        return out + probs.unsqueeze(-1).to(x.dtype) * self._bias_rows(experts, "fc2", counts, x)

    @staticmethod
    def _bias_rows(experts, name, counts, x):
        if getattr(experts[0], name).bias is None:
            return 0.0
        biases = torch.stack([getattr(e, name).bias for e in experts]).to(x.dtype)
        return biases.repeat_interleave(torch.tensor(counts, device=x.device), dim=0)


def _grouped_mm_runs(x, experts) -> bool:
    """torch._grouped_mm needs 16-byte aligned rows; the loop runs otherwise."""
    if not hasattr(torch, "_grouped_mm") or not len(experts.local_experts):
        return False
    first = next(iter(experts.local_experts.values()))
    widths = (first.fc1.weight.shape[0], first.fc1.weight.shape[1], first.fc2.weight.shape[0])
    return all((w * x.element_size()) % 16 == 0 for w in widths)


class _GroupedMM(torch.autograd.Function):
    """x [N, k] @ w [E, k, m] by row groups (offs: cumulative rows), torch's own backward given a
    contiguous gradient (torch._grouped_mm refuses broadcast strides such as sum()'s)."""

    @staticmethod
    def forward(ctx, x, w, offs):
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = torch._grouped_mm(x_, w_, offs=offs)
        ctx.graph = (x_, w_, y)
        return y.detach()

    @staticmethod
    def backward(ctx, grad):
        x_, w_, y = ctx.graph
        grad_x, grad_w = torch.autograd.grad(y, (x_, w_), grad.contiguous())
        return grad_x, grad_w, None

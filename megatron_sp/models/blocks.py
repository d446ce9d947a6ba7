"""The building blocks of a model spec, each written once for the serial and the parallel model.

A block only talks to its builder `b` (models/builders.py) to create layers — `b.column(...)`,
`b.row(...)`, `b.tp_size` — so the same code is the serial oracle under SerialBuilder and the
TP(+SP) model under ParallelBuilder. Activations in the SP region are [s_sp, b, h] (s_sp = s/t under
SP, s otherwise); column layers gather them, row layers scatter back.

Contracts (what a user's replacement must keep):
    norm(cfg, b)                      forward(x) -> x's shape
    attention(cfg, layer, b)          forward(x, ctx) -> [s_sp, b, h] before `output_bias`
    mlp(cfg, layer, b)                forward(x) -> [s_sp, b, h] before `output_bias`
    bias_dropout_add(cfg, layer)      forward(out, bias, residual, site, ctx) -> residual + dropout(out + bias)
    layout(cfg, layer, b, block_spec) forward(x, ctx) -> x: how one layer wires the above
    embedding(cfg, b)                 forward(tokens [b, s], ctx) -> [s_sp, b, h] (dropout applied)
Every parameter is created through the builder or tagged with tensor_parallel.layers.mark(init=...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp import ops
from megatron_sp.ops import philox
from megatron_sp.tensor_parallel.layers import mark


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight) over the last dim, fp32 statistics. In the SP
    region: each rank normalises its own tokens, so the parameters' gradients are partial sums."""

    def __init__(self, cfg, b):
        super().__init__()
        h, sp = cfg.hidden_size, b.sequence_parallel
        self.eps, self.fused, self.rms = cfg.layernorm_epsilon, cfg.use_fused_kernels, cfg.normalization == "RMSNorm"
        self.weight = mark(nn.Parameter(torch.ones(h)), sequence_parallel=sp, init="ones")
        if not self.rms:
            self.bias = mark(nn.Parameter(torch.zeros(h)), sequence_parallel=sp, init="zeros")

    def forward(self, x):
        if self.rms:
            return ops.rms_norm(x, self.weight, self.eps, fused=self.fused)
        return ops.layer_norm(x, self.weight, self.bias, self.eps, fused=self.fused)


def _activation(cfg):
    if cfg.activation == "openai_gelu":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.gelu


class MLP(nn.Module):
    """fc1 (column-parallel) -> activation -> fc2 (row-parallel). SwiGLU fuses the gate and up
    projections into fc1 ([gate; up] rows, each split on its own so a rank holds matching halves)."""

    def __init__(self, cfg, layer: int, b):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.swiglu = cfg.activation == "swiglu"
        self.fc1 = b.column(
            h,
            2 * f if self.swiglu else f,
            init="normal",
            bias=cfg.add_bias_linear,
            segments=(f, f) if self.swiglu else (),
        )
        self.fc2 = b.row(f, h, init="scaled_normal", bias=cfg.add_bias_linear)
        self.act = _activation(cfg)

    @property
    def output_bias(self):
        return self.fc2.bias

    def forward(self, x):
        a = self.fc1(x)  # [s, b, f(×2)/t]
        if self.swiglu:
            gate, up = a.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = self.act(a)
        return self.fc2(a, add_bias=False)  # [s_sp, b, h], no bias yet


class BiasDropoutAdd(nn.Module):
    """residual + dropout(out + bias) with the parallelism-invariant dropout, on this rank's tokens."""

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer

    def forward(self, out, bias, residual, site, ctx):
        return ops.bias_dropout_add(
            out,
            bias,
            residual,
            self.cfg.hidden_dropout,
            self.cfg.seed,
            self.layer,
            site,
            ctx.shard_index,
            training=ctx.training,
            fused=self.cfg.use_fused_kernels,
        )


class PreNormBlock(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)) (GPT-2, Llama)."""

    def __init__(self, cfg, layer: int, b, spec):
        super().__init__()
        self.ln1 = spec.norm(cfg, b)
        self.attn = spec.attention(cfg, layer, b)
        self.ln2 = spec.norm(cfg, b)
        self.mlp = spec.mlp(cfg, layer, b)
        self.bda = spec.bias_dropout_add(cfg, layer)

    def forward(self, x, ctx):
        a = self.attn(self.ln1(x), ctx)
        x = self.bda(a, self.attn.output_bias, x, philox.SITE_ATTENTION_OUT, ctx)
        m = self.mlp(self.ln2(x))
        return self.bda(m, self.mlp.output_bias, x, philox.SITE_MLP_OUT, ctx)


class Embedding(nn.Module):
    """Word embedding (vocab-parallel) + learned positions (when configured), then dropout."""

    def __init__(self, cfg, b):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = b.word_embedding(cfg)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            mark(self.position_embeddings.weight, sequence_parallel=b.sequence_parallel, init="normal")

    def forward(self, tokens, ctx):
        x = self.word_embeddings(tokens)  # [s_sp, b, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(ctx.sp_position_ids)  # [s_sp, b, h]
        return philox.dropout(
            x,
            self.cfg.hidden_dropout,
            self.cfg.seed,
            0,
            philox.SITE_EMBEDDING,
            ctx.shard_index,
            training=ctx.training,
        )

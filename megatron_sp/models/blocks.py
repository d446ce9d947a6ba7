"""The building blocks of a model spec, each written once for the serial and the parallel model.

A block only talks to its `builder` (models/builders.py) to create layers — `builder.column(...)`,
`builder.row(...)`, `builder.tp_size` — so the same code is the serial oracle under SerialBuilder
and the TP(+SP, CP) model under ParallelBuilder. Activations in the SP region are [s_sp, b, h]
(s_sp = s/t under SP, s otherwise); column layers gather them, row layers scatter back.

Every slot of a spec (models/spec.py) is constructed the same way,

    Slot(cfg, *, layer, builder, block_spec)

layer: 0 for the embedding, 1..L for the transformer layers, L + 1 for the final norm (it keys the
dropout masks); builder: SerialBuilder or ParallelBuilder; block_spec: the BlockSpec the slot
belongs to (the wiring builds its submodules from it, the attention its core). A slot ignores the
arguments it does not need. What forward must keep (`seq`: the models/sequence_context.py
SequenceContext of the micro-batch):

    norm, final_norm    forward(x) -> x's shape
    attention           forward(x, seq) -> [s_sp, b, h] before `output_bias`
    core_attention      forward(q, k, v, seq, head_offset) -> [b, n_q, s, d] (models/attention.py)
    mlp, moe            forward(x, seq) -> [s_sp, b, h] before `output_bias` (moe: the MLP of the layers
                        --moe-layer-freq chooses, models/moe/; BlockSpec.mlp_class picks)
    bias_dropout_add    forward(out, bias, residual, site, seq) -> residual + dropout(out + bias)
    wiring              forward(x, seq) -> x: how one layer wires the above
    embedding           forward(tokens [b, s_tp], seq) -> [s_sp, b, h] (dropout applied)
Every parameter is created through the builder or tagged with tensor_parallel.layers.mark(init=...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp import ops
from megatron_sp.ops import philox
from megatron_sp.tensor_parallel.layers import mark


def residual_dtype(cfg, activation_dtype):
    """The residual stream's dtype: fp32 with --fp32-residual-connection, else the activations'."""
    return torch.float32 if cfg.fp32_residual_connection else activation_dtype


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight) over the last dim, fp32 statistics; the output in
    the parameters' dtype (also for an fp32 residual stream, as Megatron's mixed-dtype norms). In the SP
    region: each rank normalises its own tokens, so the parameters' gradients are partial sums.
    With --apply-layernorm-1p the weight holds gamma - 1 (starts at 0; the norm applies 1 + weight).
    size: the normalised width (default h; the head dim for --qk-layernorm); partial_tp: the weight's
    gradient is a partial sum over TP (SP region, or heads split over the ranks)."""

    def __init__(self, cfg, *, layer, builder, block_spec, size=None, partial_tp=None):
        super().__init__()
        h = size or cfg.hidden_size
        sp = builder.sequence_parallel if partial_tp is None else partial_tp
        self.eps, self.fused, self.rms = cfg.layernorm_epsilon, cfg.use_fused_kernels, cfg.normalization == "RMSNorm"
        self.one_plus = cfg.layernorm_zero_centered_gamma
        weight = torch.zeros(h) if self.one_plus else torch.ones(h)
        self.weight = mark(nn.Parameter(weight), sequence_parallel=sp, init="zeros" if self.one_plus else "ones")
        if not self.rms:
            self.bias = mark(nn.Parameter(torch.zeros(h)), sequence_parallel=sp, init="zeros")

    def forward(self, x):
        weight = self.weight + 1.0 if self.one_plus else self.weight
        if self.rms:
            return ops.rms_norm(x, weight, self.eps, fused=self.fused)
        return ops.layer_norm(x, weight, self.bias, self.eps, fused=self.fused)


def quick_gelu(x):
    """x·sigmoid(1.702 x) (Hendrycks & Gimpel's sigmoid approximation of GELU; Megatron's quick_gelu)."""
    return x * torch.sigmoid(1.702 * x)


def _activation(cfg):
    if cfg.activation == "openai_gelu":
        return lambda x: F.gelu(x, approximate="tanh")
    if cfg.activation == "squared_relu":
        return lambda x: torch.square(F.relu(x))
    if cfg.activation == "swiglu":
        return F.silu
    if cfg.activation == "quick_geglu":
        return quick_gelu
    return F.gelu


class MLP(nn.Module):
    """fc1 (column-parallel) -> activation -> fc2 (row-parallel). A gated MLP (--swiglu, --quick-geglu)
    fuses the gate and up projections into fc1 ([gate; up] rows, each split on its own so a rank holds
    matching halves) and computes act(gate) * (up + --glu-linear-offset), the gate clamped to at most c
    and up to [-c, c] first with --activation-func-clamp-value c (gpt-oss's clamped GeGLU)."""

    def __init__(self, cfg, *, layer, builder, block_spec, ffn_hidden_size=None):
        super().__init__()
        h, f = cfg.hidden_size, ffn_hidden_size or cfg.ffn_hidden_size
        self.gated = cfg.gated_linear_unit
        self.offset, self.clamp = cfg.glu_linear_offset, cfg.activation_func_clamp_value
        self.fc1 = builder.column(
            h,
            2 * f if self.gated else f,
            init="normal",
            bias=cfg.add_bias_linear,
            segments=(f, f) if self.gated else (),
        )
        self.fc2 = builder.row(f, h, init="scaled_normal", bias=cfg.add_bias_linear)
        self.act = _activation(cfg)

    @property
    def output_bias(self):
        return self.fc2.bias

    def forward(self, x, seq=None):
        a = self.fc1(x)  # [s, b, f(×2)/t]
        if self.gated:
            gate, up = a.chunk(2, dim=-1)  # [s, b, f/t] each: this rank's halves
            if self.clamp is not None:
                gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            a = self.act(gate) * (up + self.offset if self.offset else up)
        else:
            a = self.act(a)
        return self.fc2(a, add_bias=False)  # [s_sp, b, h], no bias yet


class BiasDropoutAdd(nn.Module):
    """residual + dropout(out + bias) with the parallelism-invariant dropout, on this rank's tokens."""

    def __init__(self, cfg, *, layer, builder, block_spec):
        super().__init__()
        self.cfg, self.layer = cfg, layer

    def forward(self, out, bias, residual, site, seq):
        return ops.bias_dropout_add(
            out,
            bias,
            residual,
            self.cfg.hidden_dropout,
            self.cfg.seed,
            self.layer,
            site,
            seq.sp_index,
            training=seq.training,
            fused=self.cfg.use_fused_kernels,
        )


class PreNormBlock(nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(x)) (GPT-2, Llama)."""

    def __init__(self, cfg, *, layer, builder, block_spec):
        super().__init__()
        slot = dict(layer=layer, builder=builder, block_spec=block_spec)
        self.ln1 = block_spec.norm(cfg, **slot)
        self.attn = block_spec.attention(cfg, **slot)
        self.ln2 = block_spec.norm(cfg, **slot)
        self.mlp = block_spec.mlp_class(cfg, layer)(cfg, **slot)
        self.bda = block_spec.bias_dropout_add(cfg, **slot)

    def forward(self, x, seq):
        a = self.attn(self.ln1(x), seq)
        x = self.bda(a, self.attn.output_bias, x, philox.SITE_ATTENTION_OUT, seq)
        m = self.mlp(self.ln2(x), seq)
        return self.bda(m, self.mlp.output_bias, x, philox.SITE_MLP_OUT, seq)


class Embedding(nn.Module):
    """Word embedding (vocab-parallel) + learned positions (when configured), then dropout."""

    def __init__(self, cfg, *, layer, builder, block_spec):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.word_embeddings = builder.word_embedding(cfg)
        self.position_embeddings = None
        if cfg.position_embedding_type == "learned_absolute":
            # (_weight: nn.Embedding's own normal_ init would run on the meta device, whose first call imports
            # sympy, ~70 MiB resident; the values are drawn by models/init.py anyway)
            shape = (cfg.max_position_embeddings, cfg.hidden_size)
            self.position_embeddings = nn.Embedding(*shape, _weight=torch.empty(shape))
            mark(self.position_embeddings.weight, sequence_parallel=builder.sequence_parallel, init="embedding")

    def forward(self, tokens, seq):
        x = self.word_embeddings(tokens)  # [s_sp, b, h]
        positions = None
        if self.position_embeddings is not None:
            positions = self.position_embeddings(seq.sp_position_ids)  # [s_sp, b, h]
        return ops.embedding_dropout(
            x,
            positions,
            self.cfg.hidden_dropout,
            self.cfg.seed,
            self.layer,
            philox.SITE_EMBEDDING,
            seq.sp_index,
            training=seq.training,
            out_dtype=residual_dtype(self.cfg, x.dtype),
            fused=self.cfg.use_fused_kernels,
        )

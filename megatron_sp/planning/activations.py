"""Bytes saved for the backward, per transformer layer and for the head, per rank.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count
16-bit activations and 1-byte dropout masks (`paper_bytes`). Our layers save other things
(`layer_terms`, one term per storage autograd keeps, read from the code and checked against
bench/activation_memory.py's measurement by tests/test_plan.py):

    term                              elements per rank            paper
    norm inputs (2)                   2 s b h S                    4sbh (16-bit)
    norm statistics (fp32)            2 k s b S  (k: LayerNorm 2, RMSNorm 1)  -
    QKV and FC1 GEMM inputs           2 s b h S                    4sbh
    the QKV output (q, k, v views)    s b (n + 2g) d / t           6sbh/t
    RoPE: rotated q, k + cos/sin      s b (n + g) d / t + 4 b s r  -  (CP: the core's q, k, v are
                                                                    copies: no second q, k)
    attention output (proj input)     s b n d / t                  2sbh/t  (Ulysses: twice)
    logsumexp (fp32)                  b n s / t                    (no 5as^2b/t: flash/blockwise)
    MLP: GELU in + out                2 s b f / t                  16sbh/t
         SwiGLU: fc1 out, silu, prod  4 s b f / t
    dropout masks (1 byte)            2 s b h S  (reference ops only: the fused op regenerates them)

S = 1/t under sequence parallelism (else 1); s is the rank's tokens (seq / cp); g the key/value
heads a rank holds (g / t, or 1 copy when t > g).

An MoE layer (`moe_terms`) saves, instead of the MLP's terms, with n = s b S the rank's tokens, N its
routed rows (n k, capped by the capacity: pad-to-capacity n E C / seq), R = T N the rows its experts
take (T expert-TP: the peers' rows too), f the expert width, e_r the router's bytes (--moe-router-dtype):

    router: top-k indices, weights     n k (8 + e_r)     pre-softmax / sigmoid: + n E e_r (the scores)
    aux loss / z-loss                  n E e_r + 8 n k  /  n E e_r + n e_r
    capacity mask (bool)               n E
    permutation indices                16 N              (all-to-all with EP or expert-TP: + 8 R, the sort)
    expert inputs (fc1's rows)         e R h
    experts (SwiGLU / GELU)            e R f / T (5 / 3) + e R   (the activation, its product with the
                                                         routing weights, fc2's input; the weights)
    combined outputs (unpermute)       e N h             (all-gather dispatcher: e R h)
    all-to-all: outputs unsorted       e R h             (with EP or expert-TP)
    shared expert                      the dense MLP's term at its width
(--moe-grouped-gemm is modelled as the per-expert loop.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_sp.layer_options import cp_comm_types, is_moe_layer

FP32 = 4


def paper_bytes(s, b, h, a, t, sp):
    """Korthikanti et al. 2022 eqs. (TP) and (TP+SP): bytes per layer, 16-bit activations, 1-byte masks."""
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


# Korthikanti et al. 2022, Table 3: the models they measure (s = 2048, micro batch 1, t = 8)
PAPER_MODELS = {"22B": (6144, 64, 48), "175B": (12288, 96, 96), "530B": (20480, 128, 105), "1T": (25600, 160, 128)}


def paper_table(s: int = 2048, b: int = 1, t: int = 8) -> list:
    """Table 2's activation bytes per layer (16-bit) for each of the paper's models; `layers` to scale."""
    rows = []
    for name, (h, a, layers) in PAPER_MODELS.items():
        sbh, att = s * b * h, 5 * a * s / h
        rows.append(
            {
                "model": name, "s": s, "b": b, "h": h, "a": a, "t": t, "layers": layers,
                "no parallelism": sbh * (34 + att),
                "tensor parallel (baseline)": paper_bytes(s, b, h, a, t, False),
                "tensor + sequence parallel": paper_bytes(s, b, h, a, t, True),
                "tensor parallel + selective": sbh * (10 + 24 / t),
                "tensor + sequence parallel + selective": sbh * 34 / t,
                "full recompute": sbh * 2,
            }
        )  # fmt: skip
    return rows


@dataclass(frozen=True)
class MoEShape:
    """What one rank's MoE layer sees (module docstring)."""

    experts: int
    topk: int
    f: int  # each expert's width
    rows: float  # N: routed rows of this rank's tokens
    etp: int = 1
    all_to_all: bool = False  # the all-to-all dispatcher with EP x expert-TP > 1 (its sort's indices)
    all_gather: bool = False  # the all-gather dispatcher with EP x expert-TP > 1
    shared: int = 0  # the shared expert's width (0: none)
    router_bytes: int = FP32
    scores: str = "softmax"  # softmax (over the k chosen), pre-softmax, sigmoid
    aux_loss: bool = False
    z_loss: bool = False
    capacity: bool = False

    @classmethod
    def from_config(cls, cfg, tokens: float, act_bytes: int) -> "MoEShape":
        """`tokens`: the rank's tokens in the MoE layer (its SP region)."""
        e, k, seq = cfg.num_experts, cfg.moe_router_topk, cfg.seq_length
        rows = tokens * k
        factor = cfg.moe_expert_capacity_factor
        if factor is not None:  # each expert takes at most C tokens of a sample (models/moe/capacity.py)
            cap = math.ceil(seq * k / e * factor)
            if cap <= seq:
                rows = (
                    tokens * e * cap / seq
                    if cfg.moe_pad_expert_input_to_capacity
                    else min(rows, tokens * e * cap / seq)
                )
        parallel = cfg.expert_model_parallel_size * cfg.expert_tensor_parallel_size > 1
        return cls(
            experts=e,
            topk=k,
            f=cfg.moe_ffn_hidden_size,
            rows=rows,
            etp=cfg.expert_tensor_parallel_size,
            all_to_all=parallel and cfg.moe_token_dispatcher_type == "alltoall",
            all_gather=parallel and cfg.moe_token_dispatcher_type == "allgather",
            shared=cfg.moe_shared_expert_intermediate_size or 0,
            router_bytes={"fp32": FP32, "fp64": 8}.get(cfg.moe_router_dtype, act_bytes),
            scores="sigmoid"
            if cfg.moe_router_score_function == "sigmoid"
            else "pre-softmax"
            if cfg.moe_router_pre_softmax
            else "softmax",
            aux_loss=cfg.moe_router_load_balancing_type != "none" and cfg.moe_aux_loss_coeff > 0,
            z_loss=bool(cfg.moe_z_loss_coeff),
            capacity=factor is not None,
        )


@dataclass(frozen=True)
class LayerShape:
    """What one rank's layer sees: s = its tokens of a sequence (seq / cp), b = micro batch."""

    s: int
    b: int
    h: int
    n: int  # query heads (whole model)
    g: int  # key/value heads (whole model)
    d: int  # head dim
    f: int  # MLP width
    t: int = 1
    sp: bool = False
    swiglu: bool = False
    rmsnorm: bool = False
    rope_dim: int = 0  # channels RoPE rotates (0: no RoPE)
    masks: bool = False  # dropout masks saved (dropout on and the reference ops)
    cp: bool = False  # context parallel: the core saves its own q, k, v (not views of the QKV output)
    ulysses: bool = False  # CP a2a (a2a+p2p): the core's output is also kept in head layout
    act_bytes: int = FP32  # bytes per activation element
    moe: MoEShape | None = None  # the layer's MLP is a mixture of experts

    @classmethod
    def from_config(cls, cfg, micro_batch: int, act_bytes: int = FP32, layer: int | None = None) -> "LayerShape":
        """The rank's shape of layer `layer` (1-based; None: a dense layer's)."""
        shape = cls._dense(cfg, micro_batch, act_bytes)
        if layer is None or not is_moe_layer(cfg, layer):
            return shape
        return dataclasses.replace(shape, moe=MoEShape.from_config(cfg, shape.tokens_sp, act_bytes))

    @classmethod
    def _dense(cls, cfg, micro_batch: int, act_bytes: int) -> "LayerShape":
        return cls(
            s=cfg.seq_length // cfg.context_parallel_size,
            b=micro_batch,
            h=cfg.hidden_size,
            n=cfg.num_attention_heads,
            g=cfg.num_query_groups,
            d=cfg.kv_channels,
            f=cfg.ffn_hidden_size,
            t=cfg.tensor_model_parallel_size,
            sp=cfg.sequence_parallel,
            swiglu=cfg.gated_linear_unit,
            rmsnorm=cfg.normalization == "RMSNorm",
            rope_dim=cfg.rotary_dim if cfg.rotary else 0,
            masks=(cfg.hidden_dropout > 0 or cfg.attention_dropout > 0) and not cfg.use_fused_kernels,
            act_bytes=act_bytes,
            cp=cfg.context_parallel_size > 1,
            ulysses=cfg.context_parallel_size > 1 and bool({"a2a", "a2a+p2p"} & set(cp_comm_types(cfg))),
        )

    @property
    def tokens_sp(self) -> float:
        """Tokens of the SP region per rank (s b, / t under SP)."""
        return self.s * self.b / (self.t if self.sp else 1)

    @property
    def kv_heads(self) -> int:
        """Key/value heads a rank holds (a copy of one when t > g)."""
        return self.g // self.t if self.g >= self.t else 1


def layer_terms(x: LayerShape, selective: bool = False):
    """(term, bytes) saved per layer per rank; `selective`: the attention core is recomputed (its
    logsumexp is not kept; its inputs and the projection's input are)."""
    e, sb, sp_tokens = x.act_bytes, x.s * x.b, x.tokens_sp
    nq, nkv = x.n // x.t, x.kv_heads
    terms = [
        ("norm inputs (2)", 2 * e * sp_tokens * x.h),
        ("norm statistics (fp32)", 2 * (1 if x.rmsnorm else 2) * FP32 * sp_tokens),
        ("QKV + FC1 GEMM inputs", 2 * e * sp_tokens * x.h),
        ("QKV output (q, k, v)", e * sb * (nq + 2 * nkv) * x.d),
    ]
    if x.rope_dim:  # under CP the rotated q, k are the core's own copies (counted above)
        rotated = 0 if x.cp else e * sb * (nq + nkv) * x.d
        terms.append(("RoPE: rotated q, k; cos, sin", rotated + 4 * e * sb * x.rope_dim))
    terms.append(("attention output", e * sb * nq * x.d))
    if x.ulysses:  # bench/long_sequence.py measures (c=1)/c + 4sbh/c for it
        terms.append(("Ulysses: the output in head layout", e * sb * nq * x.d))
    if not selective:
        terms.append(("attention logsumexp (fp32)", FP32 * sb * nq))
    if x.moe is not None:
        terms += moe_terms(x)
    else:
        terms.append(_mlp_term(x, x.f))
    if x.masks:
        terms.append(("2 hidden dropout masks (bool)", 2 * sp_tokens * x.h))
    return terms


def _mlp_term(x: LayerShape, f: int):
    name = "MLP (SwiGLU: fc1 out, silu, product)" if x.swiglu else "MLP (GELU in, out)"
    return (name, (4 if x.swiglu else 2) * x.act_bytes * x.s * x.b * f / x.t)


def moe_terms(x: LayerShape):
    """(term, bytes) an MoE layer saves in place of the MLP's (module docstring)."""
    m, e, n = x.moe, x.act_bytes, x.tokens_sp
    r, k, big_e, rows = m.router_bytes, m.topk, m.experts, m.rows
    taken = m.etp * rows  # R
    router = n * k * (8 + r) + (n * big_e * r if m.scores != "softmax" else 0)
    if m.scores == "sigmoid":  # the renormalisation over the k keeps the weights and their sum
        router += n * k * r + n * r
    terms = [("MoE router: top-k indices, weights", router)]
    if m.aux_loss:
        terms.append(("MoE load-balancing loss: scores, top-k", n * big_e * r + 8 * n * k))
    if m.z_loss:
        terms.append(("MoE z-loss: logits, logsumexp", n * big_e * r + n * r))
    if m.capacity:
        terms.append(("MoE capacity mask (bool)", n * big_e))
    terms.append(
        ("MoE permutation indices", 16 * (taken if m.all_gather else rows) + (8 * taken if m.all_to_all else 0))
    )
    terms.append(("MoE expert inputs (rows)", e * taken * x.h))
    terms.append(
        ("MoE experts (SwiGLU: 5, GELU: 3 widths; weights)", e * taken * ((5 if x.swiglu else 3) * m.f / m.etp + 1))
    )
    terms.append(("MoE combined outputs", e * (taken if m.all_gather else rows) * x.h))
    if m.all_to_all:  # the experts' outputs put back in arrival order (index_copy keeps its source)
        terms.append(("MoE outputs in arrival order", e * taken * x.h))
    if m.shared:
        terms.append(("MoE shared expert: " + _mlp_term(x, m.shared)[0], _mlp_term(x, m.shared)[1]))
    return terms


def layer_bytes(x: LayerShape, selective: bool = False) -> float:
    return sum(b for _, b in layer_terms(x, selective))


def layer_input_bytes(x: LayerShape) -> float:
    """What a fully recomputed layer (or chunk) keeps: its input [s, b, h] (SP: the shard)."""
    return x.act_bytes * x.tokens_sp * x.h


def head_terms(x: LayerShape, padded_vocab: int, embedding_dropout: bool, learned_positions: bool):
    """(term, bytes) the embedding, the final norm and the loss save per rank."""
    e, sb, sp_tokens = x.act_bytes, x.s * x.b, x.tokens_sp
    terms = [
        ("token ids + vocab mask", 8 * sb + sb),
        ("final norm input + statistics", e * sp_tokens * x.h + (1 if x.rmsnorm else 2) * FP32 * sp_tokens),
        ("logits GEMM input", e * sp_tokens * x.h),
        ("cross entropy: softmax (fp32), target, mask", FP32 * sb * padded_vocab / x.t + 8 * sb + sb),
    ]
    if embedding_dropout:
        terms.append(("embedding dropout mask (bool)", sp_tokens * x.h))
    if learned_positions:
        terms.append(("position ids", 8 * sb))
    return terms


# ---- bench/activation_memory.py's table (GPT-2 layers, the reference ops, fp32) ----------------


def adjusted_terms(s, b, h, a, f, t, sp, dropout):
    """bench/activation_memory.py's rows: `layer_terms` of a GPT-2 layer with the reference ops."""
    shape = LayerShape(s=s, b=b, h=h, n=a, g=a, d=h // a, f=f, t=t, sp=sp, masks=dropout > 0)
    return [(name, nbytes, _VS_PAPER.get(name, "")) for name, nbytes in layer_terms(shape)]


_VS_PAPER = {
    "norm inputs (2)": "fp32 x2 (paper 4sbh)",
    "norm statistics (fp32)": "not in paper: LayerNorm saves mean, rstd",
    "QKV + FC1 GEMM inputs": "fp32 x2 (paper 4sbh); SP: the local shard only",
    "QKV output (q, k, v)": "fp32 x2 (paper 6sbh/t): one storage, q, k, v are views",
    "attention output": "fp32 x2 (paper 2sbh/t); the core saves it, proj's view shares it",
    "attention logsumexp (fp32)": "not in paper; and no s^2 term (paper 5as^2b/t): SDPA / blockwise",
    "MLP (GELU in, out)": "fp32 x2 (paper 16sbh/t at f=4h)",
    "2 hidden dropout masks (bool)": "1 byte each (as paper: 2sbh); the fused op regenerates them",
}


def adjusted_formula_text(h, f, dropout):
    """Closed form of sum(adjusted_terms) (bytes), in the paper's sbh(...) notation."""
    ct = 12 + 4 + 8 * f / h  # QKV, attention output, GELU input + FC2 input
    cs = 16 + (2 if dropout > 0 else 0)  # LN inputs, QKV/FC1 GEMM inputs (+ 2 bool masks)
    ct_s = f"{ct:g}"
    return f"TP: sbh({cs} + 16/h + {ct_s}/t + 4a/(ht))    TP+SP: sbh/t({cs + ct:g} + 16/h + 4a/h)"

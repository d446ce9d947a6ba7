"""Attention: the self-attention layer (QKV projection, RoPE, core, output projection) and the causal
core shared by the serial and the parallel model. The core is a BlockSpec slot (`core_attention`,
CausalAttention by default); the builder wraps it for context parallelism (models/builders.py).

    q         [b, n_q, s, d]     (n_q: the query heads this rank holds)
    k, v      [b, n_kv, s, d]    grouped-query attention: query head i uses key/value head i // (n_q / n_kv)
    returns   [b, n_q, s, d]

A sliding window (--window-size, on the layers --window-attn-skip-freq chooses) and an attention sink
(--softmax-type off-by-one / learnable: one logit per head in every denominator) are the core's too:
the explicit softmax defines them, and the kernels run them as planned blocks merged by log-sum-exp
(ops/attention_runs.py), the sink merged once.

Without attention dropout the core is F.scaled_dot_product_attention (flash / memory-efficient kernels,
no s² score tensor kept), documents included (as a mask). With attention dropout it is our blockwise
attention (ops/flash_attention.py), because the dropout mask must be the parallelism-invariant one
(ops/philox.py), which SDPA cannot take; it regenerates the mask per block and keeps no s² tensor either.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_sp.layer_options import layer_window
from megatron_sp.models.blocks import Norm
from megatron_sp.models.rope import RotaryEmbedding
from megatron_sp.ops.attention_runs import Keys, Run, runs_attention
from megatron_sp.ops.flash_attention import AttentionDropout, flash_attention
from megatron_sp.ops.philox import DropoutIndex, apply_keep_mask, attention_keep_mask
from megatron_sp.tensor_parallel.layers import mark
from megatron_sp.tensor_parallel.sharding import ShardSpec

EXPLICIT_BACKENDS = ("unfused", "local")  # --attention-backend values that never use SDPA


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True = masked out (Megatron's convention): keys of another document."""
    return (document_ids[:, :, None] != document_ids[:, None, :]).unsqueeze(1)


def allowed_mask(
    attention_mask: Optional[torch.Tensor], s: int, device, window: Optional[int] = None
) -> Optional[torch.Tensor]:
    """Megatron's mask (True = masked out, [b, 1, s, s]) combined with causality and the sliding window
    (a query sees itself and the `window` tokens before it), as True = allowed; None when causal alone."""
    if attention_mask is None and window is None:
        return None
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    if window is not None:
        causal = causal & ~torch.ones(s, s, dtype=torch.bool, device=device).tril(-window - 1)
    return causal if attention_mask is None else causal & ~attention_mask.bool()


def softmax_with_sink(scores: torch.Tensor, sink: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax over the last dim of scores [b, n, s_q, s_k], with one more logit per head (sink [n],
    Megatron's softmax offset) in each denominator and no value: the probabilities of the keys."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    b, n, sq, _ = scores.shape
    column = sink.to(scores.dtype).view(1, n, 1, 1).expand(b, n, sq, 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def causal_attention(
    q,
    k,
    v,
    *,
    attention_mask=None,
    dropout_p: float = 0.0,
    seed: int = 0,
    layer: int = 0,
    index: Optional[DropoutIndex] = None,
    head_offset: int = 0,
    explicit: bool = False,
    qk_scale_divisor: float = 1.0,
    softmax_in_fp32: bool = True,
    window: Optional[int] = None,
    sink: Optional[torch.Tensor] = None,
):
    """Causal attention; attention_mask [b, 1, s, s] bool with True = masked out (documents).
    window: a query sees itself and the `window` tokens before it (--window-size); sink [n_q]: one
    logit per head in every softmax denominator (--softmax-type off-by-one / learnable; explicit only).
    head_offset: global index of local query head 0 (keys the dropout mask). qk_scale_divisor
    (--apply-query-key-layer-scaling: the layer number): Q·K^T is computed divided by it, and
    multiplied back in fp32 before the softmax, so low-precision scores stay in range;
    softmax_in_fp32: the explicit path's scores, softmax and dropout in fp32 (else in q's dtype)."""
    b, nq, s, d = q.shape
    rep = nq // k.shape[1]
    allowed = allowed_mask(attention_mask, s, q.device, window)
    if dropout_p == 0.0 and not explicit and sink is None:
        gqa = {"enable_gqa": True} if rep > 1 else {}
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, **gqa)
    if allowed is None:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if rep > 1:  # grouped: broadcast each key/value head over its rep query heads, no copies
        q, k, v = q.view(b, nq // rep, rep, s, d), k.unsqueeze(2), v.unsqueeze(2)  # [b, n_kv, rep|1, s, d]
    scores = torch.matmul(q * (1.0 / (math.sqrt(d) * qk_scale_divisor)), k.transpose(-1, -2)).view(b, nq, s, s)
    scores = (scores.float() if softmax_in_fp32 or qk_scale_divisor != 1.0 else scores) * qk_scale_divisor
    probs = softmax_with_sink(scores.masked_fill(~allowed, float("-inf")), sink)  # [b, n_q, s, s]
    if dropout_p > 0.0:
        keep = attention_keep_mask(
            tuple(probs.shape), dropout_p, seed, layer, index, head_offset, index.token_positions
        )
        probs = apply_keep_mask(probs, keep, dropout_p)
    probs = probs.to(q.dtype)
    if rep > 1:
        probs = probs.view(b, nq // rep, rep, s, s)
    return torch.matmul(probs, v).view(b, nq, s, d)


class CausalAttention(nn.Module):
    """The default `core_attention` slot, over the tokens in `seq` (no context parallelism, or
    Ulysses' whole sequence): q, k, v [b, heads, s, d] -> [b, n_q, s, d]; head_offset: the global
    index of local query head 0 (it keys the dropout mask).

    No dropout: SDPA, with the mask if any (documents given as ids under context parallelism become
    one). Dropout: blockwise attention (ops/flash_attention.py), which keeps no s×s tensor and draws
    the same dropout bits. `--attention-backend unfused`/`local`, or a mask that is not block-diagonal
    by documents: the explicit softmax."""

    def __init__(self, cfg, *, layer, builder, block_spec):
        super().__init__()
        self.cfg, self.layer = cfg, layer

    def _torch_attention(self, q, k, v, seq, head_offset, p, explicit, window, sink):
        """Masked attention on torch's kernels, or the explicit softmax (backends, masks without ids)."""
        mask = seq.attention_mask
        if mask is None and seq.document_ids is not None:  # Ulysses' whole sequence: ids, no mask
            mask = document_mask(seq.document_ids)
        return causal_attention(
            q,
            k,
            v,
            attention_mask=mask,
            dropout_p=p,
            seed=self.cfg.seed,
            layer=self.layer,
            index=seq.tp_index,
            head_offset=head_offset,
            explicit=explicit,
            qk_scale_divisor=float(self.layer) if self.cfg.apply_query_key_layer_scaling else 1.0,
            softmax_in_fp32=self.cfg.attention_softmax_in_fp32 or q.dtype == torch.float32,
            window=window,
            sink=sink,
        )

    def forward(self, q, k, v, seq, head_offset: int, sink=None):
        p = self.cfg.attention_dropout if seq.training else 0.0
        explicit = self.cfg.attention_backend in EXPLICIT_BACKENDS or (
            seq.attention_mask is not None and seq.document_ids is None
        )
        index, window = seq.tp_index, layer_window(self.cfg, self.layer)
        if explicit or (p == 0.0 and sink is None):
            return self._torch_attention(q, k, v, seq, head_offset, p, explicit, window, sink)
        drop = AttentionDropout(p, self.cfg.seed, self.layer, head_offset)
        positions, documents = index.token_positions, seq.document_ids
        if window is not None or sink is not None:  # planned blocks, merged by log-sum-exp
            runs, keys = (Run(0, 0, q.shape[2]),), Keys(positions, documents)
            fused = self.cfg.use_fused_kernels
            sample_ids = index.sample_ids
            return runs_attention(
                q, k, v, runs, runs, keys, keys, sample_ids, drop, fused=fused, window=window, sink=sink
            )
        # Queries and keys are the same tokens; torch.compile refuses one tensor passed as two inputs,
        # so the keys get a view (no copy).
        return flash_attention(
            q,
            k,
            v,
            positions,
            positions.view(-1),
            index.sample_ids,
            drop,
            documents,
            None if documents is None else documents.view(documents.shape),
            fused=self.cfg.use_fused_kernels,
        )


class SelfAttention(nn.Module):
    """Fused QKV projection (column-parallel: whole heads per rank), optional RoPE, the core, and
    the output projection (row-parallel). forward(x [s_sp, b, h]) -> [s_sp, b, h] *before* the
    output bias (`output_bias`, added by the bias-dropout-add that follows).

    Heads on a rank of t: n_q/t query heads; n_kv/t key/value heads, or, with fewer key/value
    heads than ranks, the one its query heads use (held by t/n_kv ranks, see sharding.py).
    """

    def __init__(self, cfg, *, layer, builder, block_spec):
        super().__init__()
        h, d, nq, nkv = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
        tp = builder.tp_size
        self.d = d
        self.nq_local = nq // tp
        self.nkv_local = nkv // tp if nkv % tp == 0 else 1
        self.head_offset = builder.tp_rank * self.nq_local
        self.qkv = builder.column(
            h,
            (nq + 2 * nkv) * d,
            init="normal",
            bias=cfg.add_qkv_bias,
            segments=(nq * d, nkv * d, nkv * d),
            units=(nq, nkv, nkv),
            layer=layer,
        )
        self.proj = builder.row(nq * d, h, init="scaled_normal", bias=cfg.add_bias_linear, layer=layer)
        self.rope = RotaryEmbedding(cfg) if cfg.rotary else None
        self.q_norm = self.k_norm = None
        if cfg.qk_layernorm:  # over the head dim; each rank sees its heads: gradients partial over TP
            norm = dict(layer=layer, builder=builder, block_spec=block_spec, size=d, partial_tp=tp > 1)
            self.q_norm, self.k_norm = Norm(cfg, **norm), Norm(cfg, **norm)
        core = block_spec.core_attention(cfg, layer=layer, builder=builder, block_spec=block_spec)
        self.core = builder.wrap_core_attention(core, cfg, layer=layer)
        self.recompute = cfg.recompute_granularity == "selective"
        self.softmax_type = cfg.softmax_type
        if cfg.softmax_type == "learnable":  # one logit per query head, split with the heads (Megatron's name)
            offset = nn.Parameter(torch.empty(self.nq_local))
            self.softmax_offset = mark(offset, ShardSpec(0), init="normal")

    @property
    def output_bias(self):
        return self.proj.bias

    def forward(self, x, seq):
        qkv = self.qkv(x)  # [s, b, (n_q + 2 n_kv) d] local
        s, batch = qkv.shape[:2]
        nq, nkv, d = self.nq_local, self.nkv_local, self.d
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        q = q.view(s, batch, nq, d).permute(1, 2, 0, 3)  # [b, n_q, s, d]
        k = k.view(s, batch, nkv, d).permute(1, 2, 0, 3)  # [b, n_kv, s, d]
        v = v.view(s, batch, nkv, d).permute(1, 2, 0, 3)
        if self.q_norm is not None:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.rope is not None:
            q, k = self.rope(q, seq.position_ids), self.rope(k, seq.position_ids)
        sink = self._sink(q)
        extra = {} if sink is None else {"sink": sink}  # a core of the vanilla softmax needs no sink argument
        if self.recompute:  # selective recomputation: the core runs again in the backward
            out = checkpoint(self.core, q, k, v, seq, self.head_offset, use_reentrant=False, **extra)
        else:
            out = self.core(q, k, v, seq, self.head_offset, **extra)  # [b, n_q, s, d]
        out = out.permute(2, 0, 1, 3).reshape(s, batch, nq * d)  # [s, b, n_q d]
        return self.proj(out, add_bias=False)

    def _sink(self, q):
        """[n_q local] logits in every softmax denominator: the learnt ones, zeros (off-by-one), or None."""
        if self.softmax_type == "learnable":
            return self.softmax_offset
        if self.softmax_type == "off-by-one":
            return torch.zeros(self.nq_local, dtype=torch.float32, device=q.device)
        return None

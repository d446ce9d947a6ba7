"""GPTModel: the tensor + sequence parallel GPT. Same function and state-dict keys as ReferenceGPT.

One layer on a rank of a TP group of size t (n heads, f MLP width, V padded vocab):

    x        [s/t, b, h]  SP region: LayerNorm, dropout, residual   ([s, b, h] without SP)
    qkv      [s, b, 3h/t] after g (all-gather) + ColumnParallelLinear: whole heads of q, k, v
    attn     [b, n/t, s, d]
    proj     [s/t, b, h]  RowParallelLinear + ḡ (reduce-scatter), then bias-dropout-add
    fc1      [s, b, f/t]  g + ColumnParallelLinear, GELU
    fc2      [s/t, b, h]  RowParallelLinear + ḡ, then bias-dropout-add
    logits   [s, b, V/t]  g + tied embedding shard; vocab-parallel cross entropy

Parameters marked `sequence_parallel` (LayerNorms, row biases, position embedding under SP) have
partial gradients; `reduce_sequence_parallel_grads()` sums them over the TP group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_sp import ops, parallel_state
from megatron_sp.config import GPTConfig
from megatron_sp.models.attention import causal_attention
from megatron_sp.models.init import init_full_tensor
from megatron_sp.models.reference import masked_mean
from megatron_sp.models.sharding import gather_full, shard_full
from megatron_sp.tensor_parallel import mappings
from megatron_sp.tensor_parallel import random as tp_random
from megatron_sp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_sp.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                VocabParallelEmbedding, mark, parallel_linear)
from megatron_sp.tensor_parallel.random import DropoutIndex


class _Context:
    """What every layer needs to know about the current micro-batch."""

    def __init__(self, full_index: DropoutIndex, shard_index: DropoutIndex, attention_mask, training):
        self.full_index, self.shard_index = full_index, shard_index
        self.attention_mask, self.training = attention_mask, training


class LayerNorm(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h, sp = cfg.hidden_size, cfg.sequence_parallel
        self.eps, self.fused = cfg.layernorm_epsilon, cfg.use_fused_kernels
        self.weight = mark(nn.Parameter(torch.ones(h)), sequence_parallel=sp)
        self.bias = mark(nn.Parameter(torch.zeros(h)), sequence_parallel=sp)

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps, fused=self.fused)


class ParallelAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int, ps: parallel_state.ParallelState):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, sp, g = cfg.hidden_size, cfg.sequence_parallel, ps.tp_group
        self.heads_local = cfg.num_attention_heads // ps.tp_size
        self.head_offset = ps.tp_rank * self.heads_local
        self.qkv = ColumnParallelLinear(h, 3 * h, group=g, sequence_parallel=sp, groups=3)
        self.proj = RowParallelLinear(h, h, group=g, sequence_parallel=sp)

    def forward(self, x, ctx: _Context):
        """x [s/t, b, h] (SP) -> [s/t, b, h] before the projection bias (added by the caller)."""
        qkv = self.qkv(x)                                                # [s, b, 3 n/t d]
        s, b = qkv.shape[:2]
        n, d = self.heads_local, self.cfg.head_dim
        q, k, v = qkv.view(s, b, 3, n, d).permute(2, 1, 3, 0, 4)         # 3 × [b, n/t, s, d]
        p = self.cfg.attention_dropout if ctx.training else 0.0
        out = causal_attention(q, k, v, attention_mask=ctx.attention_mask, dropout_p=p,
                               seed=self.cfg.seed, layer=self.layer, index=ctx.full_index,
                               head_offset=self.head_offset)
        out = out.permute(2, 0, 1, 3).reshape(s, b, n * d)               # [s, b, h/t]
        return self.proj(out, add_bias=False)


class ParallelMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: parallel_state.ParallelState):
        super().__init__()
        h, f, sp, g = cfg.hidden_size, cfg.ffn_hidden_size, cfg.sequence_parallel, ps.tp_group
        self.fc1 = ColumnParallelLinear(h, f, group=g, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(f, h, group=g, sequence_parallel=sp)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)), add_bias=False)            # [s/t, b, h], no bias yet


class ParallelBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int, ps: parallel_state.ParallelState):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ln1, self.ln2 = LayerNorm(cfg), LayerNorm(cfg)
        self.attn = ParallelAttention(cfg, layer, ps)
        self.mlp = ParallelMLP(cfg, ps)

    def _bias_dropout_add(self, out, bias, residual, site, ctx):
        return ops.bias_dropout_add(out, bias, residual, self.cfg.hidden_dropout, self.cfg.seed,
                                    self.layer, site, ctx.shard_index, training=ctx.training,
                                    fused=self.cfg.use_fused_kernels)

    def forward(self, x, ctx: _Context):
        a = self.attn(self.ln1(x), ctx)
        x = self._bias_dropout_add(a, self.attn.proj.bias, x, tp_random.SITE_ATTENTION_OUT, ctx)
        m = self.mlp(self.ln2(x))
        return self._bias_dropout_add(m, self.mlp.fc2.bias, x, tp_random.SITE_MLP_OUT, ctx)


class ParallelEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: parallel_state.ParallelState):
        super().__init__()
        sp = cfg.sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.padded_vocab_size,
                                                      cfg.hidden_size, group=ps.tp_group,
                                                      sequence_parallel=sp)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        mark(self.position_embeddings.weight, sequence_parallel=sp)

    def forward(self, tokens, position_ids, shard_rows: slice):
        words = self.word_embeddings(tokens)                             # [s/t, b, h] (SP)
        positions = self.position_embeddings(position_ids.t()[shard_rows])  # [s/t, b, h]
        return words + positions


class GPTModel(nn.Module):
    """The parallel GPT; see the module docstring for shard shapes and DESIGN.md for the API."""

    def __init__(self, cfg: GPTConfig, ps: parallel_state.ParallelState | None = None):
        super().__init__()
        self.ps = ps if ps is not None else parallel_state.get()
        _check_layout(cfg, self.ps)
        self.cfg = cfg
        self.embedding = ParallelEmbedding(cfg, self.ps)
        self.layers = nn.ModuleList(ParallelBlock(cfg, i + 1, self.ps) for i in range(cfg.num_layers))
        self.final_ln = LayerNorm(cfg)
        self._sp_grads_pending = False
        self._initialise()

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, tokens, labels=None, *, loss_mask=None, position_ids=None, attention_mask=None,
                sample_ids=None):
        """tokens/labels [b, s] (the full sequence on every rank) -> mean loss, identical on every
        TP rank; labels=None -> full logits [b, s, V]. attention_mask [b, 1, s, s] bool, True =
        masked (Megatron); sample_ids [b] global sample indices keying the dropout masks."""
        ctx, shard_rows = self._context(tokens, attention_mask, sample_ids)
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embedding(tokens, position_ids, shard_rows)
        x = tp_random.dropout(x, self.cfg.hidden_dropout, self.cfg.seed, 0, tp_random.SITE_EMBEDDING,
                              ctx.shard_index, training=ctx.training)
        for block in self.layers:
            x = block(x, ctx)
        if self.cfg.sequence_parallel and torch.is_grad_enabled():
            self._sp_grads_pending = True
        return self._head(self.final_ln(x), labels, loss_mask)

    def _context(self, tokens, attention_mask, sample_ids):
        b, s = tokens.shape
        if s > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence of {s} tokens exceeds max_position_embeddings "
                             f"({self.cfg.max_position_embeddings}).")
        device = tokens.device
        if sample_ids is None:
            sample_ids = torch.arange(b, device=device)
        positions = torch.arange(s, device=device)
        rows = slice(0, s)
        if self.cfg.sequence_parallel:
            if s % self.ps.tp_size != 0:
                raise ValueError(f"sequence length {s} is not divisible by TP size {self.ps.tp_size} "
                                 f"under sequence parallelism.")
            local = s // self.ps.tp_size
            rows = slice(self.ps.tp_rank * local, (self.ps.tp_rank + 1) * local)
        full = DropoutIndex(positions, sample_ids)
        ctx = _Context(full, DropoutIndex(positions[rows], sample_ids), attention_mask, self.training)
        return ctx, rows

    def _head(self, hidden, labels, loss_mask):
        """Tied output layer and loss: hidden [s/t, b, h] -> logits [s, b, V/t] -> loss."""
        cfg, group = self.cfg, self.ps.tp_group
        weight = self.embedding.word_embeddings.weight
        logits = parallel_linear(hidden, weight, None, group, "sp" if cfg.sequence_parallel else "tp")
        if labels is None:
            full = mappings.gather_from_tensor_parallel_region(logits, group)
            return full[..., : cfg.vocab_size].transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), group=group, vocab_size=cfg.vocab_size,
                                            vocab_start=self.embedding.word_embeddings.vocab_start)
        return masked_mean(loss.t(), loss_mask)

    # ---- full <-> sharded state ---------------------------------------------------------------
    def _initialise(self):
        full = {name: init_full_tensor(name, _full_shape(p, self.ps.tp_size), self.cfg)
                for name, p in self.named_parameters()}
        self.load_full_state_dict(full)

    @torch.no_grad()
    def load_full_state_dict(self, state_dict):
        """Loads a ReferenceGPT-shaped state dict, keeping this rank's shards."""
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(params))
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, p in params.items():
            local = shard_full(state_dict[name].to(p.device), p.shard_spec, tuple(p.shape),
                               self.ps.tp_rank, self.ps.tp_size)
            if local.shape != p.shape:
                raise ValueError(f"{name}: full tensor {tuple(state_dict[name].shape)} does not shard to "
                                 f"{tuple(p.shape)} at TP={self.ps.tp_size}.")
            p.copy_(local)

    @torch.no_grad()
    def full_state_dict(self):
        """Collective over the TP group: unsharded parameters, ReferenceGPT keys and shapes."""
        return {name: gather_full(p.detach(), p.shard_spec, self.ps.tp_group)
                for name, p in self.named_parameters()}

    @torch.no_grad()
    def full_grad_dict(self):
        """Collective: unsharded gradients (SP partial sums reduced first if still pending)."""
        self.reduce_sequence_parallel_grads()
        return {name: gather_full(p.grad, p.shard_spec, self.ps.tp_group)
                for name, p in self.named_parameters() if p.grad is not None}

    @torch.no_grad()
    def reduce_sequence_parallel_grads(self):
        """Sums the gradients of SP-region parameters over the TP group (once per backward)."""
        if not self._sp_grads_pending:
            return
        grads = [p.grad for p in self.sequence_parallel_params() if p.grad is not None]
        if grads and self.ps.tp_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.ps.tp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
        self._sp_grads_pending = False

    def sequence_parallel_params(self):
        return [p for p in self.parameters() if getattr(p, "sequence_parallel", False)]


def _full_shape(p, tp_size):
    shape = list(p.shape)
    spec = p.shard_spec
    if spec.dim is not None:
        shape[spec.dim] = spec.full if spec.full is not None else shape[spec.dim] * tp_size
    return tuple(shape)


def _check_layout(cfg: GPTConfig, ps: parallel_state.ParallelState):
    if cfg.tensor_model_parallel_size != ps.tp_size:
        raise ValueError(f"GPTConfig.tensor_model_parallel_size ({cfg.tensor_model_parallel_size}) does not "
                         f"match the initialised TP group size ({ps.tp_size}).")
    if ps.cp_size != 1 or cfg.context_parallel_size != 1:
        raise NotImplementedError("context parallelism is not implemented yet; use context_parallel_size=1.")

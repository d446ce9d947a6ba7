"""ReferenceGPT: the serial oracle. Plain torch.nn, no parallel code; it defines the function.

GPT-2 architecture: learned positions, pre-LayerNorm blocks, GELU MLP, tied input/output
embeddings, final LayerNorm, causal attention. Activations are [s, b, h] like the parallel model,
and dropout is the parallelism-invariant one, so GPTModel at any TP/SP matches it with dropout on.

State-dict keys (GPTModel uses the same):
    embedding.word_embeddings.weight   [V, h]       (also the output layer: tied)
    embedding.position_embeddings.weight [P, h]
    layers.{i}.ln1.{weight,bias}       [h]
    layers.{i}.attn.qkv.{weight,bias}  [3h, h], [3h]   rows laid out (3, n, d): q heads, k heads, v heads
    layers.{i}.attn.proj.{weight,bias} [h, h], [h]
    layers.{i}.ln2.{weight,bias}       [h]
    layers.{i}.mlp.fc1.{weight,bias}   [f, h], [f]
    layers.{i}.mlp.fc2.{weight,bias}   [h, f], [h]
    final_ln.{weight,bias}             [h]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp.config import GPTConfig
from megatron_sp.models.attention import causal_attention
from megatron_sp.models.init import init_full_tensor
from megatron_sp.tensor_parallel import random as tp_random
from megatron_sp.tensor_parallel.random import DropoutIndex


def masked_mean(loss_bs: torch.Tensor, loss_mask) -> torch.Tensor:
    """Mean per-token loss [b, s] over the tokens whose loss_mask is 1 (all when None)."""
    if loss_mask is None:
        return loss_bs.mean()
    loss_mask = loss_mask.to(loss_bs.dtype)
    return (loss_bs * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)

    def forward(self, tokens, position_ids):
        return (self.word_embeddings(tokens) + self.position_embeddings(position_ids)).transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x, index, attention_mask, training):
        s, b, h = x.shape
        n, d = self.cfg.num_attention_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).view(s, b, 3, n, d).permute(2, 1, 3, 0, 4)  # 3 × [b, n, s, d]
        p = self.cfg.attention_dropout if training else 0.0
        ctx = causal_attention(q, k, v, attention_mask=attention_mask, dropout_p=p, seed=self.cfg.seed,
                               layer=self.layer, index=index)
        return self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, h))   # [s, b, h]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = Attention(cfg, layer)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)

    def _dropout(self, x, site, index, training):
        return tp_random.dropout(x, self.cfg.hidden_dropout, self.cfg.seed, self.layer, site, index,
                                 training=training)

    def forward(self, x, index, attention_mask, training):
        a = self.attn(self.ln1(x), index, attention_mask, training)
        x = x + self._dropout(a, tp_random.SITE_ATTENTION_OUT, index, training)
        m = self.mlp(self.ln2(x))
        return x + self._dropout(m, tp_random.SITE_MLP_OUT, index, training)


class ReferenceGPT(nn.Module):
    """Serial GPT. forward(tokens [b, s], labels [b, s]) -> mean loss; labels=None -> logits [b, s, V]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = Embedding(cfg)
        # Transformer layer i draws dropout with layer id i + 1; id 0 is the embedding's.
        self.layers = nn.ModuleList(Block(cfg, i + 1) for i in range(cfg.num_layers))
        self.final_ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(init_full_tensor(name, tuple(param.shape), cfg))

    def forward(self, tokens, labels=None, *, loss_mask=None, position_ids=None, attention_mask=None,
                sample_ids=None):
        b, s = tokens.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=tokens.device).expand(b, s)
        if sample_ids is None:
            sample_ids = torch.arange(b, device=tokens.device)
        index = DropoutIndex(torch.arange(s, device=tokens.device), sample_ids)
        training = self.training
        x = self.embedding(tokens, position_ids)                          # [s, b, h]
        x = tp_random.dropout(x, self.cfg.hidden_dropout, self.cfg.seed, 0, tp_random.SITE_EMBEDDING,
                              index, training=training)
        for block in self.layers:
            x = block(x, index, attention_mask, training)
        logits = torch.matmul(self.final_ln(x), self.embedding.word_embeddings.weight.t())  # [s, b, V]
        if labels is None:
            return logits.transpose(0, 1)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.t().flatten(), reduction="none")
        return masked_mean(loss.view(s, b).t(), loss_mask)

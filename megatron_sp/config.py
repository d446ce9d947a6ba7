"""GPTConfig: the model's shape, regularisation and parallel layout, validated on construction."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional


@dataclass
class GPTConfig:
    """A GPT-2-style decoder. Defaults follow Megatron-LM where it has one."""

    num_layers: int                 # transformer layers
    hidden_size: int                # model width h
    num_attention_heads: int        # heads n; head dim d = h / n
    vocab_size: int                 # tokenizer's vocabulary; padded internally (see padded_vocab_size)
    seq_length: int                 # tokens per sample s
    ffn_hidden_size: Optional[int] = None      # MLP width; 4*h when None
    max_position_embeddings: Optional[int] = None  # learned positions; seq_length when None
    hidden_dropout: float = 0.1     # dropout after embeddings, attention projection and MLP
    attention_dropout: float = 0.1  # dropout on the attention probabilities
    init_method_std: float = 0.02   # std of the normal init; output projections use std/sqrt(2L)
    layernorm_epsilon: float = 1e-5
    seed: int = 1234                # weights and dropout masks are pure functions of this seed
    tensor_model_parallel_size: Optional[int] = None  # TP size t (heads, MLP, vocab split t ways);
    #                                                   None: the current parallel_state's TP size
    context_parallel_size: int = 1  # CP size (in the rank grid; 1 for now)
    sequence_parallel: bool = False  # shard LayerNorm/dropout/residual along the sequence (needs t > 1)
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of this times t (Megatron)
    use_fused_kernels: bool = True  # use megatron_sp._C ops when built; references otherwise

    def __post_init__(self):
        if self.tensor_model_parallel_size is None:
            from megatron_sp import parallel_state
            self.tensor_model_parallel_size = parallel_state.get().tp_size
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        self._check_positive()
        self._check_divisibility()
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {p}.")
        if self.max_position_embeddings < self.seq_length:
            raise ValueError(
                f"GPTConfig.max_position_embeddings ({self.max_position_embeddings}) is smaller than "
                f"seq_length ({self.seq_length}); raise it or shorten the sequence.")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn("GPTConfig.sequence_parallel has no effect with tensor_model_parallel_size=1; "
                          "turning it off.", stacklevel=3)
            self.sequence_parallel = False

    def _check_positive(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "ffn_hidden_size", "max_position_embeddings", "tensor_model_parallel_size",
                     "context_parallel_size", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.init_method_std <= 0 or self.layernorm_epsilon <= 0:
            raise ValueError("GPTConfig.init_method_std and layernorm_epsilon must be positive.")

    def _check_divisibility(self):
        h, n, t = self.hidden_size, self.num_attention_heads, self.tensor_model_parallel_size
        if h % n != 0:
            raise ValueError(f"GPTConfig.hidden_size ({h}) must be divisible by num_attention_heads ({n}).")
        if n % t != 0:
            raise ValueError(f"GPTConfig.num_attention_heads ({n}) must be divisible by "
                             f"tensor_model_parallel_size ({t}).")
        if self.ffn_hidden_size % t != 0:
            raise ValueError(f"GPTConfig.ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                             f"tensor_model_parallel_size ({t}).")
        if self.sequence_parallel and self.seq_length % (t * self.context_parallel_size) != 0:
            raise ValueError(f"GPTConfig.seq_length ({self.seq_length}) must be divisible by "
                             f"tensor_model_parallel_size ({t}) with sequence_parallel on.")
        if self.seq_length % self.context_parallel_size != 0:
            raise ValueError(f"GPTConfig.seq_length ({self.seq_length}) must be divisible by "
                             f"context_parallel_size ({self.context_parallel_size}).")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by × t (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameters of the (unpadded) model, tied embedding counted once."""
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return self.vocab_size * h + self.max_position_embeddings * h + L * per_layer + 2 * h

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3× forward), attention scores included."""
        h, f, L, s = self.hidden_size, self.ffn_hidden_size, self.num_layers, self.seq_length
        matmul_params = L * (4 * h * h + 2 * h * f) + self.vocab_size * h
        attention = L * 2 * s * h  # QK^T and PV, causal half not discounted (Megatron convention)
        return 3 * 2 * (matmul_params + attention)

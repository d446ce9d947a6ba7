"""GPTConfig: the model's shape, family, regularisation and parallel layout, validated on construction."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "openai_gelu", "swiglu")  # gelu: erf; openai_gelu: tanh approximation (GPT-2)
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
CP_COMM_TYPES = ("p2p", "a2a")

# What a field left at None becomes when the model family (registry spec) does not say: GPT-2.
FAMILY_FIELDS = {
    "normalization": "LayerNorm",
    "activation": "gelu",
    "position_embedding_type": "learned_absolute",
    "untie_embeddings_and_output_weights": False,
    "add_bias_linear": True,
}


@dataclass
class GPTConfig:
    """A decoder-only transformer. Defaults follow Megatron-LM where it has one; fields left at None
    take the model family's value (`model`, see models/registry.py), then GPT-2's."""

    num_layers: int  # transformer layers
    hidden_size: int  # model width h
    num_attention_heads: int  # query heads n
    vocab_size: int  # tokenizer's vocabulary; padded internally (see padded_vocab_size)
    seq_length: int  # tokens per sample s
    ffn_hidden_size: Optional[int] = None  # MLP width; 4*h (SwiGLU: Megatron's 8h/3 rounded to 64)
    max_position_embeddings: Optional[int] = None  # longest sequence; learned positions; seq_length when None
    hidden_dropout: float = 0.1  # dropout after embeddings, attention projection and MLP
    attention_dropout: float = 0.1  # dropout on the attention probabilities
    init_method_std: float = 0.02  # std of the normal init; output projections use std/sqrt(2L)
    layernorm_epsilon: float = 1e-5  # epsilon of LayerNorm / RMSNorm (Megatron's --norm-epsilon)
    seed: int = 1234  # weights and dropout masks are pure functions of this seed
    tensor_model_parallel_size: Optional[int] = None  # TP size t (heads, MLP, vocab split t ways);
    #                                                   None: the current parallel_state's TP size
    context_parallel_size: Optional[int] = None  # CP size c: each sample's sequence split over c ranks;
    #                                              None: the current parallel_state's CP size
    cp_comm_type: str = "p2p"  # context parallel attention: p2p (ring) or a2a (Ulysses all-to-all)
    sequence_parallel: bool = False  # shard LayerNorm/dropout/residual along the sequence (needs t > 1)
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of this times t (Megatron)
    use_fused_kernels: bool = True  # use megatron_sp._C ops when built; references otherwise
    model: str = "gpt2"  # family: a models/registry.py name or "package.module:SPEC"
    normalization: Optional[str] = None  # LayerNorm | RMSNorm
    activation: Optional[str] = None  # gelu | openai_gelu | swiglu (fused gate/up projection)
    position_embedding_type: Optional[str] = None  # learned_absolute | rope | none
    rotary_base: float = 10000.0  # RoPE theta
    rotary_percent: float = 1.0  # fraction of each head's channels that RoPE rotates
    rotary_seq_len_interpolation_factor: Optional[float] = None  # linear RoPE scaling: theta / factor
    rope_scaling: bool = False  # Llama 3.1 RoPE frequency scaling (models/rope.py), with:
    rope_scaling_factor: float = 8.0  # low frequencies' theta / factor
    rope_scaling_low_freq_factor: float = 1.0  # wavelengths over original / low: scaled
    rope_scaling_high_freq_factor: float = 4.0  # wavelengths under original / high: kept
    rope_scaling_original_max_position_embeddings: int = 8192  # the context the model was trained at
    num_query_groups: Optional[int] = None  # key/value heads (GQA); None: one per query head
    kv_channels: Optional[int] = None  # head dim d; None: hidden_size / num_attention_heads
    untie_embeddings_and_output_weights: Optional[bool] = None  # separate output layer
    add_bias_linear: Optional[bool] = None  # biases in the linear layers
    add_qkv_bias: Optional[bool] = None  # bias of the QKV projection; None: add_bias_linear
    attention_backend: str = "auto"  # unfused/local: explicit softmax; else SDPA when dropout allows
    recompute_granularity: Optional[str] = None  # full (whole layers) | selective (attention core) | None
    recompute_method: Optional[str] = None  # full: uniform (chunks of recompute_num_layers) | block (first N)
    recompute_num_layers: Optional[int] = None  # full: layers per chunk (uniform, default 1) or N (block)

    def __post_init__(self):
        if self.tensor_model_parallel_size is None or self.context_parallel_size is None:
            from megatron_sp import parallel_state

            ps = parallel_state.get()
            self.tensor_model_parallel_size = self.tensor_model_parallel_size or ps.tp_size
            self.context_parallel_size = self.context_parallel_size or ps.cp_size
        self._fill_family_defaults()
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (
                int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.activation == "swiglu" else 4 * self.hidden_size
            )
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        self._check_choices()
        self._check_positive()
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads == 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        self._check_divisibility()
        self._check_ranges()
        self._check_recompute()
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn(
                "GPTConfig.sequence_parallel has no effect with tensor_model_parallel_size=1; turning it off.",
                stacklevel=3,
            )
            self.sequence_parallel = False

    def _fill_family_defaults(self):
        from megatron_sp.models.registry import get_spec

        try:
            spec = get_spec(self.model)
        except ValueError as err:
            raise ValueError(f"GPTConfig.model: {err}") from None
        for name, value in {**FAMILY_FIELDS, **spec.defaults}.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.add_qkv_bias is None:
            self.add_qkv_bias = self.add_bias_linear

    def _check_choices(self):
        for name, choices in (
            ("normalization", NORMALIZATIONS),
            ("activation", ACTIVATIONS),
            ("position_embedding_type", POSITION_EMBEDDINGS),
            ("attention_backend", ATTENTION_BACKENDS),
            ("cp_comm_type", CP_COMM_TYPES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"GPTConfig.{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}.")

    def _check_positive(self):
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "seq_length",
            "ffn_hidden_size",
            "max_position_embeddings",
            "tensor_model_parallel_size",
            "context_parallel_size",
            "make_vocab_size_divisible_by",
            "num_query_groups",
            "kv_channels",
        ):
            value = getattr(self, name)
            if value is None and name in ("num_query_groups", "kv_channels"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.init_method_std <= 0 or self.layernorm_epsilon <= 0:
            raise ValueError("GPTConfig.init_method_std and layernorm_epsilon must be positive.")

    def _check_divisibility(self):
        h, n, t = self.hidden_size, self.num_attention_heads, self.tensor_model_parallel_size
        g = self.num_query_groups
        if self.kv_channels is None:
            raise ValueError(
                f"GPTConfig.hidden_size ({h}) must be divisible by num_attention_heads ({n}), or give kv_channels."
            )
        if n % t != 0:
            raise ValueError(
                f"GPTConfig.num_attention_heads ({n}) must be divisible by tensor_model_parallel_size ({t})."
            )
        if n % g != 0:
            raise ValueError(f"GPTConfig.num_query_groups ({g}) must divide num_attention_heads ({n}).")
        if g % t != 0 and t % g != 0:
            raise ValueError(
                f"GPTConfig.num_query_groups ({g}) must be divisible by tensor_model_parallel_size "
                f"({t}), or divide it (then each key/value head is replicated on {t} // {g} ranks)."
            )
        if self.ffn_hidden_size % t != 0:
            raise ValueError(
                f"GPTConfig.ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                f"tensor_model_parallel_size ({t})."
            )
        c = self.context_parallel_size
        if self.sequence_parallel and self.seq_length % (t * c) != 0:
            raise ValueError(
                f"GPTConfig.seq_length ({self.seq_length}) must be divisible by "
                f"tensor_model_parallel_size ({t}){f' × context_parallel_size ({c})' if c > 1 else ''} "
                f"with sequence_parallel on."
            )
        if c > 1:
            self._check_context_parallel(t, c)

    def _check_context_parallel(self, t, c):
        parts = 2 * c if self.cp_comm_type == "p2p" else c
        if self.seq_length % parts != 0:
            raise ValueError(
                f"GPTConfig.seq_length ({self.seq_length}) must be divisible by {parts} "
                + (
                    "(2 × context_parallel_size: ring attention's zigzag chunks)."
                    if self.cp_comm_type == "p2p"
                    else "(context_parallel_size)."
                )
            )
        heads = self.num_attention_heads // t
        if self.cp_comm_type == "a2a" and heads % c != 0:
            raise ValueError(
                f"GPTConfig.num_attention_heads per TP rank ({heads}) must be divisible by "
                f"context_parallel_size ({c}) for cp_comm_type a2a (Ulysses); use p2p."
            )

    def _check_ranges(self):
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {p}.")
        if self.max_position_embeddings < self.seq_length:
            raise ValueError(
                f"GPTConfig.max_position_embeddings ({self.max_position_embeddings}) is smaller than "
                f"seq_length ({self.seq_length}); raise it or shorten the sequence."
            )
        if self.position_embedding_type == "rope":
            if not 0.0 < self.rotary_percent <= 1.0:
                raise ValueError(f"GPTConfig.rotary_percent must be in (0, 1], got {self.rotary_percent}.")
            if self.rotary_dim % 2 != 0 or self.rotary_dim == 0:
                raise ValueError(
                    f"GPTConfig.rotary_percent ({self.rotary_percent}) × kv_channels "
                    f"({self.kv_channels}) must be a positive even number of channels."
                )
            if not self.rotary_base > 0:
                raise ValueError(f"GPTConfig.rotary_base must be positive, got {self.rotary_base}.")
            self._check_rope_scaling()
        elif self.rope_scaling or self.rotary_seq_len_interpolation_factor is not None:
            raise ValueError(
                f"GPTConfig.rope_scaling / rotary_seq_len_interpolation_factor need "
                f"position_embedding_type rope, not {self.position_embedding_type}."
            )

    def _check_rope_scaling(self):
        f = self.rotary_seq_len_interpolation_factor
        if f is not None and not f > 0:
            raise ValueError(f"GPTConfig.rotary_seq_len_interpolation_factor must be positive, got {f}.")
        if not self.rope_scaling:
            return
        if not self.rope_scaling_factor > 0:
            raise ValueError(f"GPTConfig.rope_scaling_factor must be positive, got {self.rope_scaling_factor}.")
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        if not 0 < low < high:
            raise ValueError(
                f"GPTConfig.rope_scaling_low_freq_factor ({low}) must be positive and smaller than "
                f"rope_scaling_high_freq_factor ({high})."
            )
        if not self.rope_scaling_original_max_position_embeddings > 0:
            raise ValueError(
                f"GPTConfig.rope_scaling_original_max_position_embeddings must be positive, got "
                f"{self.rope_scaling_original_max_position_embeddings}."
            )

    def _check_recompute(self):
        g, m = self.recompute_granularity, self.recompute_method
        if g not in (None, "full", "selective"):
            raise ValueError(f"GPTConfig.recompute_granularity must be full, selective or None, got {g!r}.")
        if g != "full":
            if m is not None or self.recompute_num_layers is not None:
                raise ValueError("GPTConfig.recompute_method / recompute_num_layers need recompute_granularity full.")
            return
        if m is None:
            self.recompute_method = m = "uniform"
        if m not in ("uniform", "block"):
            raise ValueError(f"GPTConfig.recompute_method must be uniform or block, got {m!r}.")
        if self.recompute_num_layers is None:
            self.recompute_num_layers = 1 if m == "uniform" else self.num_layers
        n = self.recompute_num_layers
        if not isinstance(n, int) or not 1 <= n <= self.num_layers:
            raise ValueError(f"GPTConfig.recompute_num_layers must be in [1, num_layers={self.num_layers}], got {n!r}.")

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones)."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by × t (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def _layer_matmul_params(self) -> tuple[int, int]:
        """(weights, biases) of one layer's linear layers."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.kv_channels
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        fc1 = 2 * f if self.activation == "swiglu" else f
        weights = h * (q + 2 * kv) + q * h + h * fc1 + f * h
        biases = ((q + 2 * kv) if self.add_qkv_bias else 0) + ((2 * h + fc1) if self.add_bias_linear else 0)
        return weights, biases

    def num_parameters(self) -> int:
        """Parameters of the (unpadded) serial model, a tied embedding counted once."""
        h, L = self.hidden_size, self.num_layers
        norm = (2 if self.normalization == "LayerNorm" else 1) * h
        weights, biases = self._layer_matmul_params()
        embeddings = self.vocab_size * h * (2 if self.untie_embeddings_and_output_weights else 1)
        if self.position_embedding_type == "learned_absolute":
            embeddings += self.max_position_embeddings * h
        return embeddings + L * (weights + biases + 2 * norm) + norm

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3× forward), attention scores included."""
        L, s = self.num_layers, self.seq_length
        weights, _ = self._layer_matmul_params()
        matmul_params = L * weights + self.vocab_size * self.hidden_size
        attention = L * 2 * s * self.num_attention_heads * self.kv_channels  # QK^T and PV, causal half
        return 3 * 2 * (matmul_params + attention)  # not discounted (Megatron)

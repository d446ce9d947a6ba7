"""GPTConfig: the model's shape, family, regularisation and parallel layout, validated on construction.

The dataclass fields are the one table of model fields: each carries its command-line flags and its
resume rule (`model_field`, megatron_sp/fields.py); the CLI, build_config, the resume check and the
printed model flags derive from it (docs/model_fields.md). A GPTConfig is frozen and is given its
parallel sizes (default 1); it imports no model code: a family's defaults are data in
megatron_sp/families.py (a spec outside the registry is read for its own, `--model module:SPEC`).
Hugging Face names are each family's adapter's (megatron_sp/models/hf/).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Optional

from megatron_sp import config_checks as checks
from megatron_sp import families
from megatron_sp.fields import ALWAYS, IF_ROPE_SCALED, IF_ROTARY, IF_YARN, Switch, model_field
from megatron_sp.layer_options import (
    CP_COMM_TYPES,
    SOFTMAX_TYPES,
    format_layer_freq,
    format_window_size,
    format_words,
    is_moe_layer,
    layer_freq_type,
    normalised_list,
    window_size_type,
)
from megatron_sp.moe_config import MoEFields, check_moe, fill_moe_defaults

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# gelu: erf; openai_gelu: tanh approximation (GPT-2); squared_relu: relu(x)² (Primer, Nemotron);
# quick_geglu: x·sigmoid(1.702 x) gating a linear unit (gpt-oss)
ACTIVATIONS = ("gelu", "openai_gelu", "swiglu", "squared_relu", "quick_geglu")
GATED = ("swiglu", "quick_geglu")  # fc1 is [gate; up]: act(gate) * (up + --glu-linear-offset)
# yarn: RoPE with YaRN's frequencies and attention scaling (Megatron's --position-embedding-type yarn)
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "yarn", "none")
ROTARY = ("rope", "yarn")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
PRECISIONS = ("fp32", "bf16", "fp16")  # params_dtype values (torch.float32, bfloat16, float16)
FP8_FORMATS = ("e4m3", "hybrid")  # hybrid: output gradients e5m2 (Megatron's --fp8-format)
# Megatron's recipes, then rowwise (torchao's, ours); blockwise and custom are refused (config_checks)
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "rowwise", "blockwise", "custom")
FP8_AMAX_ALGOS = ("most_recent", "max")

_SCALED = "with --use-rope-scaling: "
_YARN = "with --position-embedding-type yarn: "
_PARALLEL = "parallelism"  # the --help group of the layout flags
_PRECISION = "mixed precision"  # the --help group of --bf16, --fp16 and the loss scale


@dataclass(frozen=True)
class GPTConfig(MoEFields):
    """A decoder-only transformer. Defaults follow Megatron-LM where it has one; fields left at None
    take the model family's value (`model`, see megatron_sp/families.py), which are GPT-2's where the
    family does not set them."""

    num_layers: int = model_field(
        help="transformer layers",
        flags=("--num-layers",),
        cli_default=4,
        resume=ALWAYS,
    )
    hidden_size: int = model_field(
        help="model width h",
        flags=("--hidden-size",),
        cli_default=128,
        resume=ALWAYS,
    )
    num_attention_heads: int = model_field(
        help="query heads n",
        flags=("--num-attention-heads",),
        cli_default=4,
        resume=ALWAYS,
    )
    vocab_size: int = model_field(  # no flag: the program takes it from the tokenizer
        help="the tokenizer's vocabulary; padded internally (see padded_vocab_size)",
        resume=ALWAYS,
    )
    seq_length: int = model_field(help="tokens per sample s", flags=("--seq-length",), cli_default=128)
    model: str = model_field(
        "gpt2",
        help="model family: gpt2, llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, qwen2_moe, gpt_oss "
        "(megatron_sp/families.py) or package.module:SPEC; sets the defaults of the architecture flags below",
        flags=("--model",),
    )
    ffn_hidden_size: Optional[int] = model_field(
        None,
        help="MLP width; default 4 * hidden size (SwiGLU: Megatron's 8h/3, rounded down to a multiple of 64)",
        flags=("--ffn-hidden-size",),
        resume=ALWAYS,
    )
    kv_channels: Optional[int] = model_field(
        None,
        help="head dim d; default hidden size / heads",
        flags=("--kv-channels",),
        resume=ALWAYS,
    )
    num_query_groups: Optional[int] = model_field(
        None,
        help="key/value heads (grouped-query attention); default one per query head, 1 with "
        "--group-query-attention alone",
        flags=("--num-query-groups",),
        switches=(Switch("--group-query-attention", 1, "grouped-query attention", if_unset=True),),
        resume=ALWAYS,
    )
    max_position_embeddings: Optional[int] = model_field(
        None,
        help="longest sequence (learned positions); default seq length",
        flags=("--max-position-embeddings",),
        resume=ALWAYS,
    )
    position_embedding_type: Optional[str] = model_field(
        None,
        help="positions: learned_absolute, rope, yarn (RoPE with YaRN scaling, the --yarn-* flags) or none; "
        "default: the family's",
        flags=("--position-embedding-type",),  # Megatron's older switches: training/arguments.py
        choices=POSITION_EMBEDDINGS,
        resume=ALWAYS,
    )
    rotary_base: float = model_field(10000.0, help="RoPE theta", flags=("--rotary-base",), resume=IF_ROTARY)
    rotary_percent: float = model_field(
        1.0, help="fraction of each head's channels that RoPE rotates", flags=("--rotary-percent",), resume=IF_ROTARY
    )
    rotary_seq_len_interpolation_factor: Optional[float] = model_field(
        None,
        help="linear RoPE scaling: positions / factor (HF rope_type linear)",
        flags=("--rotary-seq-len-interpolation-factor",),
        resume=IF_ROTARY,
    )
    rope_scaling: bool = model_field(
        False,
        help="Llama 3.1 RoPE frequency scaling (models/rope.py; HF rope_type llama3)",
        switches=(Switch("--use-rope-scaling", True),),
        resume=IF_ROTARY,
    )
    rope_scaling_factor: float = model_field(
        8.0, help=_SCALED + "low frequencies' theta / factor", flags=("--rope-scaling-factor",), resume=IF_ROPE_SCALED
    )
    rope_scaling_low_freq_factor: float = model_field(
        1.0,
        help=_SCALED + "wavelengths over original / low are scaled",
        flags=("--rope-scaling-low-freq-factor",),
        resume=IF_ROPE_SCALED,
    )
    rope_scaling_high_freq_factor: float = model_field(
        4.0,
        help=_SCALED + "wavelengths under original / high are kept",
        flags=("--rope-scaling-high-freq-factor",),
        resume=IF_ROPE_SCALED,
    )
    rope_scaling_original_max_position_embeddings: int = model_field(
        8192,
        help=_SCALED + "the context length the model was pretrained at",
        flags=("--rope-scaling-original-max-position-embeddings",),
        resume=IF_ROPE_SCALED,
    )
    yarn_rotary_scaling_factor: float = model_field(
        1.0,
        help=_YARN + "the context extension factor s (low frequencies' theta / s)",
        flags=("--rotary-scaling-factor",),
        resume=IF_YARN,
    )
    yarn_original_max_position_embeddings: int = model_field(
        4096,
        help=_YARN + "the context length the model was pretrained at",
        flags=("--yarn-original-max-position-embeddings",),
        resume=IF_YARN,
    )
    yarn_beta_fast: float = model_field(
        32.0,
        help=_YARN + "frequencies turning more than this often over the original context are kept",
        flags=("--yarn-beta-fast",),
        resume=IF_YARN,
    )
    yarn_beta_slow: float = model_field(
        1.0,
        help=_YARN + "frequencies turning less than this often are interpolated (theta / s)",
        flags=("--yarn-beta-slow",),
        resume=IF_YARN,
    )
    yarn_mscale: float = model_field(
        1.0,
        help=_YARN + "attention scaling: cos and sin times (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1)",
        flags=("--mscale",),
        resume=IF_YARN,
    )
    yarn_mscale_all_dim: float = model_field(
        0.0, help=_YARN + "the denominator's mscale (above)", flags=("--mscale-all-dim",), resume=IF_YARN
    )
    yarn_correction_range_round_to_int: bool = model_field(
        True,
        help=_YARN + "round the ramp's ends to whole channels (HF truncate)",
        switches=(
            Switch("--yarn-correction-range-round-to-int", True),
            Switch("--no-yarn-correction-range-round-to-int", False, "do not round them (gpt-oss)"),
        ),
        resume=IF_YARN,
    )
    normalization: Optional[str] = model_field(
        None,
        help="LayerNorm or RMSNorm; default: the family's",
        flags=("--normalization",),
        choices=NORMALIZATIONS,
        resume=ALWAYS,
    )
    layernorm_epsilon: float = model_field(
        1e-5,
        help="epsilon of LayerNorm / RMSNorm",
        flags=("--norm-epsilon", "--layernorm-epsilon"),
        describes_model=True,
    )
    activation: Optional[str] = model_field(
        None,
        help="MLP activation: gelu, openai_gelu, swiglu, squared_relu or quick_geglu; default: the family's",
        switches=(
            Switch("--swiglu", "swiglu", "SwiGLU MLP (fused gate/up projection)"),
            Switch("--openai-gelu", "openai_gelu", "GPT-2's tanh approximation of GELU"),
            Switch("--squared-relu", "squared_relu", "relu(x)² MLP activation"),
            Switch("--quick-geglu", "quick_geglu", "gated MLP with quick GELU, x·sigmoid(1.702 x) (gpt-oss)"),
        ),
        choices=ACTIVATIONS,
        resume=ALWAYS,
    )
    glu_linear_offset: float = model_field(
        0.0,
        help="gated MLPs (--swiglu, --quick-geglu): act(gate) * (up + offset); gpt-oss's 1",
        flags=("--glu-linear-offset",),
        resume=ALWAYS,
    )
    activation_func_clamp_value: Optional[float] = model_field(
        None,
        help="--quick-geglu: the gate clamped to at most c and the linear unit to [-c, c] first (gpt-oss's 7)",
        flags=("--activation-func-clamp-value",),
        resume=ALWAYS,
    )
    layernorm_zero_centered_gamma: bool = model_field(
        False,
        help="norm weights stored as gamma - 1 (initialised to 0, applied as 1 + weight; LayerNorm and RMSNorm)",
        switches=(Switch("--apply-layernorm-1p", True),),
        resume=ALWAYS,
    )
    qk_layernorm: Optional[bool] = model_field(
        None,
        help="normalise each head's queries and keys (--normalization's kind, over the head dim) before RoPE; "
        "default: the family's (Qwen3's: on)",
        switches=(Switch("--qk-layernorm", True),),
        resume=ALWAYS,
    )
    apply_query_key_layer_scaling: bool = model_field(
        False,
        help="compute Q·K^T scaled by 1/layer and undo it in the fp32 softmax (fp16 range; same function); "
        "turns --attention-softmax-in-fp32 on, as in Megatron-LM",
        switches=(Switch("--apply-query-key-layer-scaling", True),),
    )
    untie_embeddings_and_output_weights: Optional[bool] = model_field(
        None,
        help="an output layer of its own instead of the word embeddings; default: the family's",
        switches=(Switch("--untie-embeddings-and-output-weights", True),),
        resume=ALWAYS,
    )
    add_bias_linear: Optional[bool] = model_field(
        None,
        help="biases in the linear layers; default: the family's",
        switches=(Switch("--disable-bias-linear", False, "no biases in the linear layers"),),
        resume=ALWAYS,
    )
    add_qkv_bias: Optional[bool] = model_field(
        None,
        help="bias of the QKV projection; default: as the other linear layers",
        switches=(Switch("--add-qkv-bias", True),),
        resume=ALWAYS,
    )
    window_size: Optional[tuple] = model_field(
        None,
        help="sliding-window attention (left, right): a query sees the `left` tokens before it (-1: all); "
        "right must be 0 (causal)",
        flags=("--window-size",),
        parse=window_size_type,
        format=format_window_size,
        resume=ALWAYS,
    )
    window_attn_skip_freq: Optional[int | tuple] = model_field(
        None,
        help="with --window-size: N makes every N-th layer full attention, a pattern such as '[1,1,1,0]*2' "
        "chooses per layer (1 windowed); default every layer windowed",
        flags=("--window-attn-skip-freq",),
        parse=layer_freq_type,
        format=format_layer_freq,
        resume=ALWAYS,
    )
    softmax_type: str = model_field(
        "vanilla",
        help="attention softmax: vanilla, off-by-one (a zero logit joins each denominator) or learnable "
        "(one learnt logit per head, gpt-oss's sinks)",
        flags=("--softmax-type",),
        choices=SOFTMAX_TYPES,
        resume=ALWAYS,
    )
    attention_backend: str = model_field(
        "auto",
        help="unfused/local: explicit softmax; otherwise PyTorch SDPA whenever dropout allows",
        flags=("--attention-backend",),
        choices=ATTENTION_BACKENDS,
    )
    make_vocab_size_divisible_by: int = model_field(
        128,
        help="vocab padded to a multiple of this times TP size (Megatron)",
        flags=("--make-vocab-size-divisible-by",),
    )
    hidden_dropout: float = model_field(
        0.1,
        help="dropout after embeddings, attention projection and MLP",
        flags=("--hidden-dropout",),
        describes_model=True,
    )
    attention_dropout: float = model_field(
        0.1,
        help="dropout on the attention probabilities",
        flags=("--attention-dropout",),
        describes_model=True,
    )
    init_method_std: float = model_field(
        0.02,
        help="std of the normal init; output projections use std / sqrt(2 * layers)",
        flags=("--init-method-std",),
        describes_model=True,
    )
    embedding_init_method_std: Optional[float] = model_field(
        None,
        help="std of the word and position embeddings' normal init; default --init-method-std",
        flags=("--embedding-init-method-std",),
    )
    init_method_xavier_uniform: bool = model_field(
        False,
        help="Xavier-uniform init (on the full serial shape) instead of the normal ones",
        switches=(Switch("--init-method-xavier-uniform", True),),
    )
    seed: int = model_field(1234, help="weights and dropout masks are pure functions of this seed", flags=("--seed",))
    use_fused_kernels: bool = model_field(
        True,
        help="use megatron_sp._C ops when built; references otherwise",
        switches=(Switch("--no-fused-kernels", False, "use the PyTorch references instead of megatron_sp._C ops"),),
    )
    params_dtype: str = model_field(  # no flag: --bf16 / --fp16 set it (training/arguments.py)
        "fp32",
        help="dtype of the parameters and activations (Megatron's params_dtype): fp32, bf16 or fp16",
        choices=PRECISIONS,
    )
    fp32_residual_connection: bool = model_field(
        False,
        help="keep the residual stream (embedding output, bias-dropout-add results) in fp32 under bf16/fp16",
        switches=(Switch("--fp32-residual-connection", True),),
        group=_PRECISION,
    )
    attention_softmax_in_fp32: bool = model_field(
        False,
        help="the explicit attention softmax (and its dropout) in fp32 under bf16/fp16; the fused and "
        "SDPA kernels always accumulate in fp32",
        switches=(Switch("--attention-softmax-in-fp32", True),),
        group=_PRECISION,
    )
    fp8: Optional[str] = model_field(
        None,
        help="FP8 GEMMs in the transformer layers' linears (torchao): e4m3 everywhere, or hybrid (e4m3 "
        "forward, e5m2 output gradients); the embedding and output layer stay in the model's dtype",
        flags=("--fp8-format",),
        choices=FP8_FORMATS,
        group=_PRECISION,
    )
    fp8_recipe: str = model_field(
        "delayed",
        help="FP8 scaling: delayed (amax history of earlier steps), tensorwise (current amax per tensor), "
        "mxfp8 (an e8m0 scale per 32 elements), rowwise (torchao's, ours: a scale per row)",
        flags=("--fp8-recipe",),
        choices=FP8_RECIPES,
        group=_PRECISION,
    )
    fp8_margin: int = model_field(
        0, help="delayed scaling: scale = fp8_max / amax / 2^margin", flags=("--fp8-margin",), group=_PRECISION
    )
    fp8_amax_history_len: int = model_field(
        1, help="delayed scaling: amaxes kept per tensor", flags=("--fp8-amax-history-len",), group=_PRECISION
    )
    fp8_amax_compute_algo: str = model_field(
        "most_recent",
        help="delayed scaling: the history's max or its most recent amax",
        flags=("--fp8-amax-compute-algo",),
        choices=FP8_AMAX_ALGOS,
        group=_PRECISION,
    )
    first_last_layers_bf16: bool = model_field(
        False,
        help="with --fp8-format: keep the first and last transformer layers' GEMMs in the model's dtype",
        switches=(Switch("--first-last-layers-bf16", True),),
        group=_PRECISION,
    )
    num_layers_at_start_in_bf16: int = model_field(
        1,
        help="--first-last-layers-bf16: layers at the start",
        flags=("--num-layers-at-start-in-bf16",),
        group=_PRECISION,
    )
    num_layers_at_end_in_bf16: int = model_field(
        1, help="--first-last-layers-bf16: layers at the end", flags=("--num-layers-at-end-in-bf16",), group=_PRECISION
    )
    recompute_granularity: Optional[str] = model_field(
        None,
        help="activation recomputation: whole layers (full) or the attention core (selective)",
        flags=("--recompute-granularity",),
        switches=(Switch("--recompute-activations", "selective", "same as --recompute-granularity selective"),),
        choices=RECOMPUTE_GRANULARITIES,
    )
    recompute_method: Optional[str] = model_field(
        None,
        help="full: checkpoint chunks of --recompute-num-layers (uniform, the default) or the first N layers (block)",
        flags=("--recompute-method",),
        choices=RECOMPUTE_METHODS,
    )
    recompute_num_layers: Optional[int] = model_field(
        None,
        help="full: layers per chunk (uniform, default 1) or N (block, default all)",
        flags=("--recompute-num-layers",),
    )
    tensor_model_parallel_size: int = model_field(
        1,
        help="TP size t: heads, MLP and vocab split t ways",
        flags=("--tensor-model-parallel-size",),
        group=_PARALLEL,
    )
    context_parallel_size: int = model_field(
        1,
        help="split each sequence over this many ranks (world = TP × CP × DP)",
        flags=("--context-parallel-size",),
        group=_PARALLEL,
    )
    cp_comm_type: str | tuple = model_field(
        "p2p",
        help="context-parallel attention: p2p (ring), a2a (Ulysses), allgather (keys and values gathered) or "
        "a2a+p2p (a2a inside --hierarchical-context-parallel-sizes' first level, the ring across); one value "
        "or one per layer",
        flags=("--cp-comm-type",),
        choices=CP_COMM_TYPES,
        nargs="+",
        format=format_words,
        group=_PARALLEL,
    )
    hierarchical_context_parallel_sizes: Optional[tuple] = model_field(
        None,
        help="a2a+p2p: the inner (a2a, adjacent CP ranks) and outer (p2p) sizes, whose product is the CP size",
        flags=("--hierarchical-context-parallel-sizes",),
        nargs="+",
        parse=int,
        format=format_words,
        group=_PARALLEL,
    )
    sequence_parallel: bool = model_field(
        False,
        help="shard norms, dropout and the residual along the sequence (needs TP > 1)",
        switches=(Switch("--sequence-parallel", True),),
        group=_PARALLEL,
    )
    tp_comm_overlap: bool = model_field(
        False,
        help="overlap the sequence-parallel all-gathers and reduce-scatters with the linear layers' GEMMs, "
        "in t ring steps (needs --sequence-parallel)",
        switches=(Switch("--tp-comm-overlap", True),),
        group=_PARALLEL,
    )

    def __post_init__(self):
        for name in (
            "cp_comm_type",
            "hierarchical_context_parallel_sizes",
            "window_size",
            "window_attn_skip_freq",
            "moe_layer_freq",
        ):
            self._set(name, normalised_list(name, getattr(self, name)))
        self._fill_family_defaults()
        if self.ffn_hidden_size is None:
            swiglu = int(4 * self.hidden_size * 2 / 3 / 64) * 64
            self._set("ffn_hidden_size", swiglu if self.activation == "swiglu" else 4 * self.hidden_size)  # Megatron's
        if self.max_position_embeddings is None:
            self._set("max_position_embeddings", self.seq_length)
        if self.apply_query_key_layer_scaling:  # Megatron-LM's TransformerConfig: the scaling needs it
            self._set("attention_softmax_in_fp32", True)
        checks.check_choices(self)
        checks.check_positive(self)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads == 0:
            self._set("kv_channels", self.hidden_size // self.num_attention_heads)
        if self.num_query_groups is None:
            self._set("num_query_groups", self.num_attention_heads)
        checks.check_divisibility(self)
        checks.check_ranges(self)
        checks.check_attention_variants(self)
        checks.check_activation(self)
        self._fill_recompute()
        checks.check_recompute(self)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn(
                "GPTConfig.sequence_parallel has no effect with tensor_model_parallel_size=1; turning it off.",
                stacklevel=3,
            )
            self._set("sequence_parallel", False)
        checks.check_comm_overlap(self)
        fill_moe_defaults(self)
        check_moe(self)
        checks.check_fp8(self)

    def _set(self, name, value):
        """Fills a derived field during construction (the config is frozen afterwards)."""
        object.__setattr__(self, name, value)

    def _fill_recompute(self):
        """Full recomputation's defaults: uniform chunks of one layer; block: every layer."""
        if self.recompute_granularity != "full":
            return
        if self.recompute_method is None:
            self._set("recompute_method", "uniform")
        if self.recompute_num_layers is None:
            self._set("recompute_num_layers", 1 if self.recompute_method == "uniform" else self.num_layers)

    def _fill_family_defaults(self):
        try:
            defaults = families.family_defaults(self.model)
        except ValueError as err:
            raise ValueError(f"GPTConfig.model: {err}") from None
        for name, value in defaults.items():
            if getattr(self, name) is None:
                self._set(name, value)
        if self.add_qkv_bias is None:
            self._set("add_qkv_bias", self.add_bias_linear)

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 holds [gate; up] (2 × ffn rows): --swiglu, --quick-geglu."""
        return self.activation in GATED

    @property
    def rotary(self) -> bool:
        """Positions by rotation: rope, or yarn (RoPE with YaRN's frequencies)."""
        return self.position_embedding_type in ROTARY

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones)."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by × t (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def _layer_matmul_params(self, layer: int = 1, active: bool = False) -> tuple[int, int]:
        """(weights, biases) of layer `layer`'s linear layers; active: an MoE layer's router, top-k experts
        and shared expert (what one token goes through), else every expert."""
        h, d = self.hidden_size, self.kv_channels
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        weights = h * (q + 2 * kv) + q * h
        biases = ((q + 2 * kv) if self.add_qkv_bias else 0) + (h if self.add_bias_linear else 0)
        if not is_moe_layer(self, layer):
            mlp_w, mlp_b = self._mlp_params(self.ffn_hidden_size)
            return weights + mlp_w, biases + mlp_b
        experts = self.moe_router_topk if active else self.num_experts
        expert_w, expert_b = self._mlp_params(self.moe_ffn_hidden_size)
        weights += h * self.num_experts + experts * expert_w
        biases += experts * expert_b
        if self.moe_shared_expert_intermediate_size:
            shared_w, shared_b = self._mlp_params(self.moe_shared_expert_intermediate_size)
            gate = h if self.moe_shared_expert_gate else 0  # its sigmoid gate's [1, h]
            weights, biases = weights + shared_w + gate, biases + shared_b
        return weights, biases

    def _mlp_params(self, f: int) -> tuple[int, int]:
        fc1 = 2 * f if self.gated_linear_unit else f
        return self.hidden_size * fc1 + f * self.hidden_size, (fc1 + self.hidden_size) if self.add_bias_linear else 0

    def num_parameters(self) -> int:
        """Parameters of the (unpadded) serial model, a tied embedding counted once, every expert."""
        h, L = self.hidden_size, self.num_layers
        norm = (2 if self.normalization == "LayerNorm" else 1) * h
        embeddings = self.vocab_size * h * (2 if self.untie_embeddings_and_output_weights else 1)
        if self.position_embedding_type == "learned_absolute":
            embeddings += self.max_position_embeddings * h
        qk_norms = (2 * norm // h * self.kv_channels) if self.qk_layernorm else 0  # one q and one k norm of d
        layers = sum(sum(self._layer_matmul_params(layer)) for layer in range(1, L + 1))
        return embeddings + layers + L * (2 * norm + qk_norms) + norm

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward = 3× forward), attention scores included; an MoE
        layer counts the parameters a token goes through (router, top-k experts, shared expert)."""
        L, s = self.num_layers, self.seq_length
        weights = sum(self._layer_matmul_params(layer, active=True)[0] for layer in range(1, L + 1))
        matmul_params = weights + self.vocab_size * self.hidden_size
        attention = L * 2 * s * self.num_attention_heads * self.kv_channels  # QK^T and PV, causal half
        return 3 * 2 * (matmul_params + attention)  # not discounted (Megatron)


def config_from_dict(config: dict, **overrides) -> GPTConfig:
    """A serial fp32 GPTConfig (TP = CP = 1, no SP; checkpoints hold fp32 weights whatever the run's
    precision) from a saved config dict: fields this version does not know are ignored, fields the dict
    lacks take their defaults (what older checkpoints computed)."""
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    fields = {k: v for k, v in config.items() if k in known}
    serial = dict(
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        tp_comm_overlap=False,
        params_dtype="fp32",
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=None,
    )
    fields.update(serial, **overrides)
    return GPTConfig(**fields)

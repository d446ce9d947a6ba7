"""The one table of model fields (config.py, megatron_sp/fields.py): the model part of the command line
frozen against it (flag names, defaults, constants, choices), build_config and the resume rules
derived from it, and the flags that rebuild a config (tools/convert_hf.py prints them)."""

import dataclasses

import pytest

from megatron_sp.config import GPTConfig, config_from_dict
from megatron_sp.fields import cli_default, describes_model, info, mismatch
from megatron_sp.training.arguments import build_parser, parse_args
from megatron_sp.training.config_flags import model_flags
from megatron_sp.training.pretrain import build_config

# What users type, frozen: a flag taking a value -> its default; a switch -> (the constant it stores,).
# Changing a line here changes the command line of every user script (Megatron-LM's names).
MODEL_FLAGS = {
    "--num-layers": 4,
    "--hidden-size": 128,
    "--num-attention-heads": 4,
    "--seq-length": 128,
    "--model": "gpt2",
    "--ffn-hidden-size": None,
    "--kv-channels": None,
    "--num-query-groups": None,
    "--group-query-attention": (1,),
    "--max-position-embeddings": None,
    "--position-embedding-type": None,
    "--rotary-base": 10000.0,
    "--rotary-percent": 1.0,
    "--rotary-seq-len-interpolation-factor": None,
    "--use-rope-scaling": (True,),
    "--rope-scaling-factor": 8.0,
    "--rope-scaling-low-freq-factor": 1.0,
    "--rope-scaling-high-freq-factor": 4.0,
    "--rope-scaling-original-max-position-embeddings": 8192,
    "--rotary-scaling-factor": 1.0,
    "--yarn-original-max-position-embeddings": 4096,
    "--yarn-beta-fast": 32.0,
    "--yarn-beta-slow": 1.0,
    "--mscale": 1.0,
    "--mscale-all-dim": 0.0,
    "--yarn-correction-range-round-to-int": (True,),
    "--no-yarn-correction-range-round-to-int": (False,),
    "--normalization": None,
    "--norm-epsilon": 1e-05,
    "--layernorm-epsilon": 1e-05,
    "--swiglu": ("swiglu",),
    "--openai-gelu": ("openai_gelu",),
    "--squared-relu": ("squared_relu",),
    "--quick-geglu": ("quick_geglu",),
    "--glu-linear-offset": 0.0,
    "--activation-func-clamp-value": None,
    "--apply-layernorm-1p": (True,),
    "--qk-layernorm": (True,),
    "--apply-query-key-layer-scaling": (True,),
    "--untie-embeddings-and-output-weights": (True,),
    "--disable-bias-linear": (False,),
    "--add-qkv-bias": (True,),
    "--attention-backend": "auto",
    "--make-vocab-size-divisible-by": 128,
    "--hidden-dropout": 0.1,
    "--attention-dropout": 0.1,
    "--init-method-std": 0.02,
    "--embedding-init-method-std": None,
    "--init-method-xavier-uniform": (True,),
    "--seed": 1234,
    "--no-fused-kernels": (False,),
    "--recompute-granularity": None,
    "--recompute-activations": ("selective",),
    "--recompute-method": None,
    "--recompute-num-layers": None,
    "--tensor-model-parallel-size": 1,
    "--context-parallel-size": 1,
    "--cp-comm-type": "p2p",
    "--hierarchical-context-parallel-sizes": None,
    "--window-size": None,
    "--window-attn-skip-freq": None,
    "--softmax-type": "vanilla",
    "--sequence-parallel": (True,),
    "--fp32-residual-connection": (True,),
    "--attention-softmax-in-fp32": (True,),
    "--fp8-format": None,
    "--fp8-recipe": "delayed",
    "--fp8-margin": 0,
    "--fp8-amax-history-len": 1,
    "--fp8-amax-compute-algo": "most_recent",
    "--first-last-layers-bf16": (True,),
    "--num-layers-at-start-in-bf16": 1,
    "--num-layers-at-end-in-bf16": 1,
    "--tp-comm-overlap": (True,),
    # mixture of experts (megatron_sp/moe_config.py)
    "--num-experts": None,
    "--moe-layer-freq": 1,
    "--moe-ffn-hidden-size": None,
    "--moe-router-topk": 2,
    "--moe-router-score-function": "softmax",
    "--moe-router-pre-softmax": (True,),
    "--moe-router-topk-scaling-factor": None,
    "--moe-router-num-groups": None,
    "--moe-router-group-topk": None,
    "--moe-router-dtype": None,
    "--moe-input-jitter-eps": None,
    "--moe-router-load-balancing-type": "aux_loss",
    "--moe-aux-loss-coeff": 0.0,
    "--moe-z-loss-coeff": None,
    "--moe-router-enable-expert-bias": (True,),
    "--moe-router-bias-update-rate": 0.001,
    "--moe-grouped-gemm": (True,),
    "--moe-shared-expert-intermediate-size": None,
    "--moe-shared-expert-gate": (True,),
    "--moe-expert-capacity-factor": None,
    "--moe-pad-expert-input-to-capacity": (True,),
    "--moe-token-drop-policy": "probs",
    "--moe-token-dispatcher-type": "allgather",
    "--expert-model-parallel-size": 1,
    "--expert-tensor-parallel-size": None,
}
CHOICES = {
    "--position-embedding-type": ["learned_absolute", "rope", "yarn", "none"],
    "--normalization": ["LayerNorm", "RMSNorm"],
    "--attention-backend": ["auto", "flash", "fused", "unfused", "local"],
    "--recompute-granularity": ["full", "selective"],
    "--recompute-method": ["uniform", "block"],
    "--cp-comm-type": ["p2p", "a2a", "allgather", "a2a+p2p"],
    "--softmax-type": ["vanilla", "off-by-one", "learnable"],
    "--moe-router-score-function": ["softmax", "sigmoid"],
    "--moe-router-dtype": ["fp32", "fp64"],
    "--moe-router-load-balancing-type": ["aux_loss", "seq_aux_loss", "global_aux_loss", "none", "sinkhorn"],
    "--moe-token-drop-policy": ["probs", "position"],
    "--moe-token-dispatcher-type": ["allgather", "alltoall", "flex"],
    "--fp8-format": ["e4m3", "hybrid"],
    "--fp8-recipe": ["delayed", "tensorwise", "mxfp8", "rowwise", "blockwise", "custom"],
    "--fp8-amax-compute-algo": ["most_recent", "max"],
}
FIELDS = {f.name: f for f in dataclasses.fields(GPTConfig)}


def _config_actions():
    """(flag, action) of every flag in the model and parallelism groups that sets a GPTConfig field."""
    parser = build_parser()
    groups = [
        g for g in parser._action_groups if g.title in ("model", "mixture of experts", "parallelism", "mixed precision")
    ]
    return [(o, a) for g in groups for a in g._group_actions if a.dest in FIELDS for o in a.option_strings]


def test_model_flags_are_frozen_and_come_from_the_table():
    actions = _config_actions()
    seen = {o: ((a.const,) if a.nargs == 0 else a.default) for o, a in actions}
    assert seen == MODEL_FLAGS
    assert {o: a.choices for o, a in actions if a.choices} == CHOICES
    for flag, action in actions:  # each flag is its field's, with the table's default and help
        f = FIELDS[action.dest]
        assert flag in info(f).flags + tuple(s.flag for s in info(f).switches)
        assert action.default == cli_default(f) and action.help
    table = {flag for f in FIELDS.values() for flag in info(f).flags + tuple(s.flag for s in info(f).switches)}
    assert table == set(MODEL_FLAGS)


def _cfg(argv):
    return build_config(parse_args(argv + ["--mock-data"]), 300)


def test_build_config_follows_the_flags():
    assert _cfg(["--group-query-attention"]).num_query_groups == 1  # Megatron: MQA by default
    for argv in (
        ["--group-query-attention", "--num-query-groups", "2"],
        ["--num-query-groups", "2", "--group-query-attention"],
    ):
        assert _cfg(argv).num_query_groups == 2  # either order
    cfg = _cfg(["--layernorm-epsilon", "1e-6", "--no-fused-kernels", "--use-rope-scaling", "--model", "llama"])
    assert (cfg.layernorm_epsilon, cfg.use_fused_kernels, cfg.rope_scaling) == (1e-6, False, True)
    default = _cfg([])
    for f in FIELDS.values():  # without flags every field takes the table's CLI default (or GPT-2's)
        if f.name != "vocab_size" and cli_default(f) is not None:
            assert getattr(default, f.name) == cli_default(f), f.name


BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=97)


@pytest.mark.parametrize(
    "fields,family",
    [
        (dict(seq_length=32), "gpt2"),
        (
            dict(seq_length=32, activation="openai_gelu", untie_embeddings_and_output_weights=True, hidden_dropout=0.0),
            "gpt2",
        ),
        (dict(model="llama", seq_length=64, num_query_groups=2, ffn_hidden_size=96, attention_dropout=0.0), "llama"),
        (dict(model="llama", seq_length=64, kv_channels=8, untie_embeddings_and_output_weights=False), "gpt2"),
        (
            dict(model="llama", seq_length=256, rope_scaling=True, rope_scaling_original_max_position_embeddings=32),
            "llama",
        ),
        (
            dict(
                model="llama",
                seq_length=64,
                window_size=(16, 0),
                window_attn_skip_freq=(1, 0),
                softmax_type="learnable",
            ),
            "llama",
        ),
    ],
    ids=["gpt2", "gpt2-untied-dropout", "llama-gqa", "llama-tied", "llama3-scaled", "llama-window-sinks"],
)
def test_printed_flags_rebuild_the_model_at_any_sequence_length(fields, family):
    cfg = GPTConfig(**BASE, **fields)
    flags = model_flags(cfg)
    assert flags[:2] == ["--model", family]  # a tied Llama cannot be --model llama: spelled out on GPT-2
    for seq in (cfg.seq_length, 16):  # the user's --seq-length changes nothing the weights depend on
        rebuilt = _cfg(flags + ["--seq-length", str(seq)] + ["--vocab-size", "97", "--tokenizer-type", "NullTokenizer"])
        for f in FIELDS.values():
            if describes_model(f):
                want = 300 if f.name == "vocab_size" else getattr(cfg, f.name)  # build_config's vocabulary
                assert getattr(rebuilt, f.name) == want, (f.name, flags)


def test_list_valued_flags():
    """--cp-comm-type takes one type or one per layer, --hierarchical-context-parallel-sizes two sizes,
    --window-size Megatron's 'left,right', --window-attn-skip-freq an integer or a list pattern."""
    from megatron_sp.training.config_flags import _flags_parser, config_kwargs

    cp = ["--context-parallel-size", "4", "--cp-comm-type", "a2a", "a2a+p2p", "--num-layers", "2"]
    args = _flags_parser().parse_args(cp + ["--hierarchical-context-parallel-sizes", "2", "2"])
    cfg = GPTConfig(vocab_size=97, **config_kwargs(args))  # (the program's world-size check aside)
    assert cfg.cp_comm_type == ("a2a", "a2a+p2p") and cfg.hierarchical_context_parallel_sizes == (2, 2)
    assert _cfg(["--cp-comm-type", "allgather"]).cp_comm_type == "allgather"
    cfg = _cfg(["--num-layers", "4", "--window-size", "(128,0)", "--window-attn-skip-freq", "[1,1,0]+[0]"])
    assert cfg.window_size == (128, 0) and cfg.window_attn_skip_freq == (1, 1, 0, 0)
    assert _cfg(["--window-size", "8,0", "--window-attn-skip-freq", "2"]).window_attn_skip_freq == 2
    from megatron_sp.training.argument_checks import ArgumentError

    with pytest.raises(ArgumentError, match="list pattern"):  # read without eval
        _cfg(["--window-size", "8,0", "--window-attn-skip-freq", "__import__('os')"])


def test_hugging_face_keys_name_fields_the_printed_flags_carry():
    """Every field a family's Hugging Face adapter reads from config.json is one model_flags prints
    (a resume rule or describes_model), so the flags convert_hf.py prints after an import rebuild it."""
    from megatron_sp.models.hf import adapters

    by_name = {f.name: f for f in dataclasses.fields(GPTConfig)}
    for family, adapter in adapters().items():
        for name in adapter.config_keys:
            assert describes_model(by_name[name]), (family, name)


def test_resume_rules_and_what_old_checkpoints_imply():
    """A checkpoint written before a field existed lacks it: the field's default, resolved for the
    saved shape, is what that checkpoint computed (the values the hand-kept resume table held)."""
    old = config_from_dict(dict(BASE, seq_length=32))  # no family, GQA, head dim, bias or RoPE fields
    implied = dict(
        normalization="LayerNorm",
        activation="gelu",
        position_embedding_type="learned_absolute",
        num_query_groups=4,
        kv_channels=16,
        untie_embeddings_and_output_weights=False,
        add_bias_linear=True,
        add_qkv_bias=True,
        rotary_base=10000.0,
        rotary_percent=1.0,
        rotary_seq_len_interpolation_factor=None,
        rope_scaling=False,
        rope_scaling_factor=8.0,
        rope_scaling_low_freq_factor=1.0,
        rope_scaling_high_freq_factor=4.0,
        rope_scaling_original_max_position_embeddings=8192,
    )
    assert {k: getattr(old, k) for k in implied} == implied
    fields = dataclasses.fields(GPTConfig)
    same = GPTConfig(**BASE, seq_length=16, max_position_embeddings=32, hidden_dropout=0.0, seed=7)
    assert mismatch(fields, same, old) is None  # training choices may change on resume
    assert mismatch(fields, GPTConfig(**BASE, seq_length=32, num_query_groups=2), old) == "num_query_groups"
    rope = dict(BASE, seq_length=32, position_embedding_type="rope")
    assert mismatch(fields, GPTConfig(**rope), GPTConfig(**rope, rotary_base=5e5)) == "rotary_base"
    unused = GPTConfig(**rope, rope_scaling_factor=2.0)  # no scaling on either side: not compared
    assert mismatch(fields, GPTConfig(**rope), unused) is None
    scaled = GPTConfig(**rope, rope_scaling=True, rope_scaling_factor=2.0)
    assert mismatch(fields, GPTConfig(**rope), scaled) == "rope_scaling"
    assert mismatch(fields, dataclasses.replace(scaled, rope_scaling_factor=8.0), scaled) == "rope_scaling_factor"
    assert mismatch(fields, GPTConfig(**BASE, seq_length=32), GPTConfig(**BASE, seq_length=32, rotary_base=5e5)) is None

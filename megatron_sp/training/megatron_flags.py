"""Megatron-LM flags that pretrain_gpt_sp.py accepts although they change nothing here, and those it
refuses because they need a feature megatron_sp does not have. Both tables are read by
training/arguments.py (the parser) and by docs/megatron_flags.md's flag table (tools/megatron_flag_table.py), so a
flag's treatment is written once, here; the flags that do something are in arguments.py and config.py.

    NO_EFFECT   (flags, value, reason)      parsed and ignored; the reason is what docs/megatron_flags.md says
    REFUSED     (prefix or flag, feature)   one sentence naming the missing feature, before any check
                                            of the other flags (a Mixtral script is told "mixture of
                                            experts", not about its first unknown flag)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

# What a no-effect flag takes: a switch (no value), one value, or one value of a few choices.
SWITCH, VALUE = "switch", "value"

_KERNELS = "GPU kernel-fusion switch: the fused ops are chosen by megatron_sp (--no-fused-kernels turns ours off)"
_IMPL = "implementation switch: there is one implementation here"
_LOADER = "data-loader knob: samples are read in the training process from memory-mapped files"
_CKPT_IO = "checkpoint I/O knob: every rank writes and reads its own shards of one DCP checkpoint"
_MOE_GPU = "a GPU stream / kernel optimisation of Megatron-LM's MoE: the same function runs unfused here"
_MFSDP_KNOB = (
    "Megatron-FSDP's own buffers and registration: --use-megatron-fsdp runs on torch FSDP2 or the distributed "
    "optimizer here, which allocate their own"
)
_ALWAYS_TB = "always written with --tensorboard-dir (older Megatron-LM flag)"
# megatron/post_training's flags, which pretrain_gpt.py parses when ModelOpt is installed but which only
# ModelOpt's model builder reads, and Megatron-LM builds with it only from a ModelOpt checkpoint
_MODELOPT = "ModelOpt's: read only by its model builder, which Megatron-LM uses for ModelOpt checkpoints alone"


@dataclass(frozen=True)
class NoEffect:
    flags: tuple
    takes: object  # SWITCH, VALUE, or a tuple of the values accepted
    reason: str
    only: object = None  # of `takes`, the value (or tuple of values) without effect; others: refused with `reason`


NO_EFFECT = (
    NoEffect(("--use-mcore-models",), SWITCH, "deprecated in Megatron-LM too: the model is megatron_sp's"),
    NoEffect(("--transformer-impl",), ("local", "transformer_engine", "inference_optimized"), _IMPL),
    NoEffect(("--use-flash-attn",), SWITCH, "attention kernels are chosen per call (models/attention.py)"),
    NoEffect(("--use-cpu-initialization",), SWITCH, "weights are always initialised on CPU, the same at any TP"),
    NoEffect(("--DDP-impl",), ("local", "torch"), "older Megatron-LM flag: one data-parallel implementation here"),
    NoEffect(("--no-gradient-accumulation-fusion",), SWITCH, _KERNELS),
    NoEffect(("--no-masked-softmax-fusion",), SWITCH, _KERNELS),
    NoEffect(("--no-bias-dropout-fusion",), SWITCH, _KERNELS),
    NoEffect(("--no-bias-gelu-fusion",), SWITCH, _KERNELS),
    NoEffect(("--no-bias-swiglu-fusion",), SWITCH, _KERNELS),
    NoEffect(("--no-rope-fusion",), SWITCH, _KERNELS),
    NoEffect(("--no-persist-layer-norm",), SWITCH, _KERNELS),
    NoEffect(("--cross-entropy-loss-fusion",), SWITCH, _KERNELS),
    NoEffect(("--cross-entropy-fusion-impl",), ("native", "te"), _KERNELS),
    NoEffect(("--num-workers",), VALUE, _LOADER),
    NoEffect(("--no-mmap-bin-files",), SWITCH, _LOADER),
    NoEffect(
        ("--no-create-attention-mask-in-dataloader",),
        SWITCH,
        "causal masks are never materialised; document masks only with --reset-attention-mask",
    ),
    NoEffect(
        ("--rope-type",),
        ("rope", "yarn"),
        "multi-latent attention's switch; Megatron-LM's other attention takes rope only (YaRN: "
        "--position-embedding-type yarn)",
        "rope",
    ),
    NoEffect(
        ("--enable-gpt-oss",), SWITCH, _MODELOPT + " (YaRN with gpt-oss's values: --position-embedding-type yarn)"
    ),
    NoEffect(("--export-force-local-attention",), SWITCH, _MODELOPT + " (its attention class)"),
    NoEffect(
        ("--optimizer",),
        ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"),
        "AdamW (Megatron-LM's adam, decoupled weight decay) is the only optimizer here",
        "adam",
    ),
    NoEffect(
        ("--dataloader-type",),
        ("single", "cyclic", "external"),
        "Megatron-LM's single sampler is the only one here (consecutive positions of the shuffled index, resumable)",
        "single",
    ),
    NoEffect(("--num-dataset-builder-threads",), VALUE, _LOADER),
    NoEffect(
        ("--use-dist-ckpt",), SWITCH, "deprecated in Megatron-LM too: checkpoints are DCP (--ckpt-format torch_dist)"
    ),
    NoEffect(("--auto-detect-ckpt-format",), SWITCH, "one checkpoint format here (torch_dist)"),
    NoEffect(
        ("--exit-signal-handler",),
        SWITCH,
        "SIGTERM, SIGUSR1 and SIGINT always stop every rank at one iteration, after a save (training/signals.py)",
    ),
    NoEffect(("--tiktoken-pattern",), ("v1", "v2"), "TikTokenizer's only, which is refused"),
    NoEffect(("--use-persistent-ckpt-worker",), SWITCH, "--async-save runs in a background thread of its own"),
    NoEffect(("--ckpt-fully-parallel-load",), SWITCH, _CKPT_IO),
    NoEffect(("--no-ckpt-fully-parallel-save",), SWITCH, _CKPT_IO),
    NoEffect(("--ckpt-fully-parallel-save",), SWITCH, _CKPT_IO),
    NoEffect(("--ckpt-assume-constant-structure",), SWITCH, _CKPT_IO),
    NoEffect(
        ("--dist-ckpt-optim-fully-reshardable",),
        SWITCH,
        "optimizer state is always stored in the canonical, TP/DP-independent layout",
    ),
    NoEffect(
        ("--no-check-for-nan-in-loss-and-grad",),
        SWITCH,
        "the non-finite check always runs (the loss and norm are reduced anyway); a NaN stops the run",
    ),
    NoEffect(("--test-mode",), SWITCH, "Megatron-LM's in-run self tests; the suite tests megatron_sp"),
    NoEffect(("--use-pytorch-profiler",), SWITCH, "--profile always uses the PyTorch profiler (no nsys here)"),
    NoEffect(("--log-learning-rate-to-tensorboard",), SWITCH, _ALWAYS_TB),
    NoEffect(("--log-batch-size-to-tensorboard",), SWITCH, _ALWAYS_TB),
    NoEffect(("--moe-shared-expert-overlap",), SWITCH, _MOE_GPU),
    NoEffect(("--moe-permute-fusion",), SWITCH, _MOE_GPU),
    NoEffect(("--moe-router-fusion",), SWITCH, _MOE_GPU),
    NoEffect(("--use-nccl-ub",), SWITCH, _MFSDP_KNOB),
    NoEffect(("--fsdp-double-buffer",), SWITCH, _MFSDP_KNOB),
    NoEffect(("--fsdp-manual-registration",), SWITCH, _MFSDP_KNOB),
    NoEffect(("--fsdp-db-use-persist-buf-on-alloc-fail",), SWITCH, _MFSDP_KNOB),
    NoEffect(("--megatron-fsdp-max-pool-double-buffer",), SWITCH, _MFSDP_KNOB),
    NoEffect(("--megatron-fsdp-enable-fine-grained-param-gather",), SWITCH, _MFSDP_KNOB),
    NoEffect(("--megatron-fsdp-version",), ("1", "2"), _MFSDP_KNOB),
    NoEffect(
        ("--enable-full-sharding-in-hsdp",), SWITCH, "HSDP's (--outer-dp-sharding-strategy optim), which is refused"
    ),
    NoEffect(
        ("--outer-dp-sharding-strategy",),
        ("no_shard", "optim"),
        "hybrid sharded data parallelism (HSDP) is not implemented: without its outer group, no_shard "
        "(Megatron-LM's default) changes nothing",
        "no_shard",
    ),
    NoEffect(
        ("--megatron-fsdp-main-params-dtype",),
        ("fp32", "bf16", "fp16", "auto"),
        "the main weights are fp32 (FSDP2's shards, the distributed optimizer's)",
        "fp32",
    ),
    NoEffect(
        ("--megatron-fsdp-main-grads-dtype",),
        ("fp32", "bf16", "fp16", "auto"),
        "gradients are accumulated in fp32 (auto: Megatron's choice for the run, fp32 here)",
        ("auto", "fp32"),
    ),
    NoEffect(
        ("--megatron-fsdp-grad-comm-dtype",),
        ("fp32", "bf16", "fp16", "auto"),
        "FSDP2 reduce-scatters in fp32 (auto: Megatron's choice for the run, fp32 here)",
        ("auto", "fp32"),
    ),
    NoEffect(
        ("--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load"),
        SWITCH,
        "fsdp_dtensor checkpoints are written as torch_dist ones, loaded by --dist-ckpt-strictness",
    ),
    NoEffect(
        ("--overlap-param-gather",),
        SWITCH,
        "with --use-distributed-optimizer (required, as in Megatron-LM) the owners' broadcast follows the "
        "step: same weights, not overlapped with the next forward",
    ),
)

MOE = (
    "this mixture-of-experts option is not implemented in megatron_sp (docs/models.md, Mixture of experts, "
    "lists the MoE flags it takes)"
)
_FP8 = (
    "this FP8 option is not implemented: FP8 here (torchao) takes --fp8-format, --fp8-recipe, --fp8-margin, "
    "--fp8-amax-history-len, --fp8-amax-compute-algo and --first-last-layers-bf16"
)

# (flag, or prefix ending in "-", the missing feature): in this order, the first match is reported.
REFUSED = (
    ("--moe-", MOE),
    ("--fp8-", _FP8),
    ("--fp8", _FP8),
    ("--multi-latent-attention", "multi-latent attention (DeepSeek's MLA) is not implemented"),
)


@lru_cache(maxsize=1)
def _rule_refusals() -> dict:
    """flag -> feature, for every flag of a Megatron option that megatron_rules.py refuses."""
    from megatron_sp.training.megatron_rules import Refuse, megatron_options, rule_for

    out = {}
    for option in megatron_options()["options"]:
        verdict = rule_for(option)
        if isinstance(verdict, Refuse):
            out.update({flag: verdict.feature for flag in option["flags"]})
    return out


def _matches(token: str, flag: str) -> bool:
    name = token.split("=", 1)[0]
    return name.startswith(flag) if flag.endswith("-") else name == flag


def refusal(unknown_tokens) -> Optional[str]:
    """The sentence for the first refused feature among the command line's unknown tokens, or None."""
    flags = [t for t in unknown_tokens if t.startswith("--")]
    for flag, feature in REFUSED:
        hits = [t.split("=", 1)[0] for t in flags if _matches(t, flag)]
        if hits:
            return f"{hits[0]}: {feature}."
    by_rule = _rule_refusals()
    for name in (t.split("=", 1)[0] for t in flags):
        if name in by_rule:
            return f"{name}: {by_rule[name]}."
    return None


def refused_value(args) -> Optional[str]:
    """The sentence for a no-effect flag given a value other than its `only` one, or None."""
    for entry in NO_EFFECT:
        value = getattr(args, entry.flags[0].lstrip("-").replace("-", "_"))
        allowed = entry.only if isinstance(entry.only, tuple) else (entry.only,)
        if entry.only is not None and value not in (None, *allowed):
            return f"{entry.flags[0]} {value}: {entry.reason}."
    for dest, (flag, only, reason) in _IGNORED_ONLY.items():
        value = getattr(args, dest, None)
        if value is not None and value != only:
            return f"{flag} {value}: {reason}."
    return None


_IGNORED_ONLY = {}  # dest -> (flag, the one value, reason) of megatron_rules.py's Ignore(..., only)


def add_rule_flags(parser, group) -> None:
    """Every Megatron-LM option (megatron_arguments.json) that the parser does not know and that
    megatron_rules.py ignores: parsed into args.ignored_<Megatron's dest> and otherwise unused."""
    from megatron_sp.training.megatron_rules import Ignore, megatron_options, rule_for

    known = parser._option_string_actions
    for option in megatron_options()["options"]:
        verdict = rule_for(option)
        if any(f in known for f in option["flags"]) or not isinstance(verdict, Ignore):
            continue
        dest = f"ignored_{option['dest']}"
        help = f"accepted, no effect: {verdict.reason}"
        if verdict.only is not None:
            help = f"{verdict.only}: accepted, no effect; other values refused: {verdict.reason}"
            _IGNORED_ONLY[dest] = (option["flags"][0], verdict.only, verdict.reason)
        if option["kind"] == "switch":
            group.add_argument(*option["flags"], dest=dest, action="store_true", help=help)
            continue
        choices = [str(c) for c in option["choices"]] if option["choices"] else None
        group.add_argument(*option["flags"], dest=dest, default=None, nargs=option["nargs"], choices=choices, help=help)


def add_no_effect_flags(group) -> None:
    """Every NO_EFFECT flag, parsed into args.<name> and otherwise unused."""
    for entry in NO_EFFECT:
        help = f"accepted, no effect: {entry.reason}"
        if entry.only is not None:
            only = "/".join(entry.only) if isinstance(entry.only, tuple) else entry.only
            help = f"{only}: accepted, no effect; other values refused: {entry.reason}"
        if entry.takes == SWITCH:
            group.add_argument(*entry.flags, action="store_true", help=help)
        elif entry.takes == VALUE:
            group.add_argument(*entry.flags, default=None, help=help)
        else:
            group.add_argument(*entry.flags, default=None, choices=entry.takes, help=help)

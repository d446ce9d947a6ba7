#!/usr/bin/env python
"""Which layouts fit a model on a cluster: per-GPU memory split, bytes sent, modelled step time.

    python tools/plan.py --model llama --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --num-query-groups 8 --ffn-hidden-size 14336 --vocab-size 128256 --seq-length 8192 --bf16 \\
        --gpus 64 --gpus-per-node 8 --gpu-memory-gib 80 --micro-batch-size 1 --global-batch-size 256
    python tools/plan.py --largest-llama --seq-length 8192 --gpus 64 --gpu-memory-gib 80 --bf16
    python tools/plan.py --longest-sequence 8B,70B --gpus 64 --gpu-memory-gib 80 --bf16 --micro-batch-size 1
    python tools/plan.py --largest-moe --seq-length 4096 --gpus 1024 --gpu-memory-gib 80 --bf16 --micro-batch-size 1

It takes pretrain_gpt_sp.py's flags (the program's own parser): the model flags describe the model,
and the layout flags given (--tensor-model-parallel-size, --context-parallel-size, --cp-comm-type,
--hierarchical-context-parallel-sizes, --sequence-parallel, --recompute-granularity,
--use-distributed-optimizer, --use-torch-fsdp2, --pipeline-model-parallel-size, and for a mixture of
experts (--num-experts ...) --expert-model-parallel-size, --expert-tensor-parallel-size) pin that
dimension; the others are enumerated (with CP, each of Megatron's four types; EP dividing the experts,
expert-TP 1 or the TP size). The memory and time
models are megatron_sp/planning/ (their docstrings state every term and constant); the constants
of the step-time model are the flags of the "cluster" group.
"""

from __future__ import annotations

import argparse
import math
import sys

from megatron_sp.config import GPTConfig
from megatron_sp.planning import cost, ladder
from megatron_sp.planning import layouts as lay
from megatron_sp.planning import memory as mem
from megatron_sp.training.arguments import ArgumentError, build_parser
from megatron_sp.training.config_flags import config_kwargs

LAYOUT_FLAGS = {  # planner dimension: the program's flag (its dest)
    "tp": "tensor_model_parallel_size",
    "cp": "context_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "sp": "sequence_parallel",
    "recompute": "recompute_granularity",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}


def build_plan_parser():
    parser = build_parser()
    parser.prog, parser.description = "tools/plan.py", __doc__.splitlines()[1]
    offered = {opt for action in parser._actions for opt in action.option_strings}
    if "--use-torch-fsdp2" not in offered:  # modelled before the program has it
        parser.add_argument("--use-torch-fsdp2", action="store_true", help="ZeRO-3 (modelled, not runnable yet)")
    g = parser.add_argument_group("cluster (the step-time model's constants)")
    g.add_argument("--gpus", type=int, required=True)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gpu-memory-gib", type=float, default=80.0)
    g.add_argument("--reserved-gib", type=float, default=4.0, help="per GPU: CUDA context, allocator, NCCL")
    g.add_argument("--gpu-peak-tflops", type=float, default=989.0, help="dense bf16 per GPU (H100 SXM); fp32: half")
    g.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak the model's FLOPs reach")
    g.add_argument("--nvlink-gbps", type=float, default=360.0, help="GB/s per GPU within a node (bus bandwidth)")
    g.add_argument("--ib-gbps", type=float, default=45.0, help="GB/s per GPU across nodes (one 400 Gb/s NIC)")
    g.add_argument(
        "--mixed-precision",
        choices=["auto", "autocast", "megatron"],
        default="auto",
        help="what --bf16/--fp16 mean: autocast over fp32 weights (the program before issue 17), megatron "
        "(bf16 weights, fp32 main weights and grads); auto: megatron once the program offers --grad-reduce-in-bf16",
    )
    g.add_argument("--top", type=int, default=10, help="layouts printed")
    g.add_argument(
        "--largest-llama", action="store_true", help="the largest Llama of a ladder that fits, before/after FSDP2"
    )
    g.add_argument(
        "--largest-moe",
        action="store_true",
        help="Mixtral 8x7B / 8x22B and DeepSeek-V2 / V3 sizes: which train on the cluster, and the layout",
    )
    g.add_argument(
        "--longest-sequence",
        default=None,
        metavar="SIZES",
        help="the longest sequence each of these Llamas (e.g. 8B,70B) trains at on the cluster, any layout",
    )
    return parser, offered


def _given(parser, argv) -> set:
    """The dests the command line sets explicitly."""
    saved = {a.dest: a.default for a in parser._actions}
    for a in parser._actions:
        a.default = argparse.SUPPRESS
    try:
        return set(vars(parser.parse_known_args(argv)[0]))
    finally:
        for a in parser._actions:
            a.default = saved[a.dest]


POSITIVE = ("gpus", "gpus_per_node", "tensor_model_parallel_size", "context_parallel_size",
            "pipeline_model_parallel_size", "micro_batch_size", "num_layers", "num_attention_heads",
            "hidden_size", "seq_length", "top")  # fmt: skip
POSITIVE_IF_GIVEN = ("global_batch_size", "ffn_hidden_size", "vocab_size", "num_query_groups")
LARGEST_INT = 2**53  # counts beyond this lose exactness as floats in the cost model
POSITIVE_REAL = ("gpu_memory_gib", "gpu_peak_tflops", "nvlink_gbps", "ib_gbps")  # divisors of the models
NON_NEGATIVE_REAL = ("reserved_gib",)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _number_rules(args) -> list:
    """Every numeric input: integers positive and at most 2^53, reals finite (and positive where the
    models divide by them)."""
    rules = []
    for name in POSITIVE + tuple(n for n in POSITIVE_IF_GIVEN if getattr(args, n, None) is not None):
        v = getattr(args, name)
        rules.append((not 0 < v <= LARGEST_INT, f"{_flag(name)} must be a positive integer up to 2^53, got {v}."))
    for name in POSITIVE_REAL + NON_NEGATIVE_REAL:
        v = getattr(args, name)
        low = "positive" if name in POSITIVE_REAL else "zero or more"
        bad = not math.isfinite(v) or (v <= 0 if name in POSITIVE_REAL else v < 0)
        rules.append((bad, f"{_flag(name)} must be a finite number, {low}, got {v}."))
    return rules


def check(args, given: set) -> None:
    """Bad numbers and impossible combinations: one sentence naming the flag(s)."""
    for bad, sentence in _number_rules(args):
        if bad:
            raise ArgumentError(sentence)
    for bad, sentence in _cluster_rules(args) + _layout_rules(args, given):
        if bad:
            raise ArgumentError(sentence)


def _cluster_rules(args) -> list:
    return [
        (
            args.use_torch_fsdp2 and args.use_distributed_optimizer,
            "--use-torch-fsdp2 shards the optimizer state itself; do not combine it with --use-distributed-optimizer.",
        ),
        (
            args.gpus_per_node > args.gpus,
            f"--gpus-per-node ({args.gpus_per_node}) must not exceed --gpus ({args.gpus}).",
        ),
        (
            args.gpus % args.gpus_per_node != 0,
            f"--gpus ({args.gpus}) must be a multiple of --gpus-per-node ({args.gpus_per_node}) (whole nodes).",
        ),
        (not 0 < args.mfu <= 1, f"--mfu must be in (0, 1], got {args.mfu}."),
        (
            args.gpu_memory_gib <= args.reserved_gib,
            f"--gpu-memory-gib ({args.gpu_memory_gib}) must exceed --reserved-gib ({args.reserved_gib}).",
        ),
    ]


def _layout_rules(args, given: set) -> list:
    return [
        (
            args.tensor_model_parallel_size > args.gpus_per_node,
            f"--tensor-model-parallel-size "
            f"({args.tensor_model_parallel_size}) must not exceed --gpus-per-node ({args.gpus_per_node}): "
            "TP stays in a node.",
        ),
        (
            args.num_attention_heads % args.tensor_model_parallel_size != 0,
            f"--tensor-model-parallel-size "
            f"({args.tensor_model_parallel_size}) must divide --num-attention-heads ({args.num_attention_heads}).",
        ),
        (
            args.num_layers % args.pipeline_model_parallel_size != 0,
            f"--pipeline-model-parallel-size "
            f"({args.pipeline_model_parallel_size}) must divide --num-layers ({args.num_layers}).",
        ),
        (
            "sequence_parallel" in given
            and args.tensor_model_parallel_size == 1
            and "tensor_model_parallel_size" in given,
            "--sequence-parallel needs --tensor-model-parallel-size > 1.",
        ),
        (
            args.gpus
            % (args.tensor_model_parallel_size * args.context_parallel_size * args.pipeline_model_parallel_size),
            f"--gpus ({args.gpus}) must be divisible by --tensor-model-parallel-size × --context-parallel-size × "
            f"--pipeline-model-parallel-size ({args.tensor_model_parallel_size} × {args.context_parallel_size} × "
            f"{args.pipeline_model_parallel_size}).",
        ),
        (
            args.global_batch_size is not None and args.global_batch_size % args.micro_batch_size != 0,
            f"--global-batch-size ({args.global_batch_size}) must be a multiple of --micro-batch-size "
            f"({args.micro_batch_size}).",
        ),
    ]


def fixed_dimensions(args, given: set) -> dict:
    fixed = {dim: getattr(args, dest) for dim, dest in LAYOUT_FLAGS.items() if dest in given}
    if "cp_comm_type" in given:  # one type, or one per layer
        types = args.cp_comm_type
        fixed["cp_comm"] = types if isinstance(types, str) else (types[0] if len(types) == 1 else tuple(types))
    if "hierarchical_context_parallel_sizes" in given:
        fixed["levels"] = tuple(args.hierarchical_context_parallel_sizes)
    if args.use_torch_fsdp2:
        fixed["sharding"] = "fsdp2"
    elif args.use_distributed_optimizer:
        fixed["sharding"] = "distributed"
    return fixed


def precision_of(args, offered: set) -> mem.Precision:
    """Today --bf16 / --fp16 autocast over fp32 weights; once the program offers
    --grad-reduce-in-bf16 (Megatron's mixed precision), bf16 weights and fp32 main weights."""
    mode = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    megatron = args.mixed_precision == "megatron" or (
        args.mixed_precision == "auto" and "--grad-reduce-in-bf16" in offered
    )
    return mem.precision(mode, megatron, getattr(args, "grad_reduce_in_bf16", False))


def moe_refused() -> frozenset:
    """What the program refuses with --num-experts, read from its own argument checks: "pp" (pipeline
    stages), "fsdp2" (--use-torch-fsdp2). Those MoE layouts are modelled, not runnable."""
    from megatron_sp.training import argument_checks

    check_experts = getattr(argument_checks, "_check_experts", None)
    if check_experts is None:
        return frozenset()
    base = dict(num_experts=8, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    base.update(tensor_model_parallel_size=1, world_size=8, pipeline_model_parallel_size=1, use_torch_fsdp2=False)
    refused = set()
    for name, change in (("pp", dict(pipeline_model_parallel_size=2)), ("fsdp2", dict(use_torch_fsdp2=True))):
        try:
            check_experts(argparse.Namespace(**dict(base, **change)))
        except ArgumentError:
            refused.add(name)
    return frozenset(refused)


def cluster_of(args) -> cost.Cluster:
    return cost.Cluster(
        args.gpus,
        args.gpus_per_node,
        args.gpu_memory_gib,
        args.reserved_gib,
        args.gpu_peak_tflops,
        args.mfu,
        args.nvlink_gbps,
        args.ib_gbps,
    )


def base_config(args, given: set) -> dict:
    """The model's GPTConfig fields; checked serially and at the layout flags given."""
    fields = config_kwargs(args)
    if args.vocab_size is None:
        from megatron_sp.data import build_tokenizer

        tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model, None, args.vocab_file, args.merge_file)
        args.vocab_size = tok.vocab_size
    fields["vocab_size"] = args.vocab_size
    serial = dict(tensor_model_parallel_size=1, context_parallel_size=1, sequence_parallel=False)
    serial.update(cp_comm_type="p2p", hierarchical_context_parallel_sizes=None)
    pinned = {k: v for k, v in fields.items() if k in serial and k in given}
    try:
        GPTConfig(**dict(fields, **serial))
        GPTConfig(**dict(fields, **dict(serial, **pinned)))
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    return fields


# ---- printing -------------------------------------------------------------------------------


def _gib(x: float) -> str:
    return f"{x / mem.GIB:.1f}"


def _row(i, p: lay.Plan, moe: bool = False) -> list:
    m, t = p.memory, p.time
    sent = f"{p.comm.tp / 1e9:.1f}/{p.comm.cp / 1e9:.1f}/{p.comm.dp / 1e9:.1f}/{p.comm.pp / 1e9:.2f}"
    if moe:
        sent += f"/{p.comm.ep / 1e9:.1f}/{p.comm.edp / 1e9:.1f}"
    return [
        i,
        p.layout.describe(),
        "yes" if p.runnable else "no",
        _gib(m.weights),
        _gib(m.grads),
        _gib(m.optimizer),
        _gib(m.activations),
        _gib(sum(m.buffers.values())),
        _gib(m.total),
        sent,
        p.micro_batches,
        f"{t.total:.3f}",
        f"{t.compute:.3f}",
    ]


HEADERS = [
    "#",
    "layout",
    "runs",
    "weights",
    "grads",
    "optim",
    "acts",
    "buffers",
    "total GiB",
    "GB sent tp/cp/dp/pp",
    "m",
    "step s",
    "compute s",
]


def table(headers, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" if i <= 1 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(
        [fmt.format(*headers), "  ".join("-" * w for w in widths)] + [fmt.format(*map(str, r)) for r in rows]
    )


def _headers(moe: bool) -> list:
    return [h + ("/ep/edp" if moe and h.startswith("GB sent") else "") for h in HEADERS]


def moe_summary(cfg) -> str:
    """Total and active parameters of an MoE model, and the experts' share."""
    weights, biases = cfg._mlp_params(cfg.moe_ffn_hidden_size)
    experts = cfg.num_moe_layers() * cfg.num_experts * (weights + biases)
    shared = f", a shared expert of width {cfg.moe_shared_expert_intermediate_size}"
    return (
        f"MoE: {cfg.num_experts} experts of width {cfg.moe_ffn_hidden_size}, top-{cfg.moe_router_topk}"
        f"{shared if cfg.moe_shared_expert_intermediate_size else ''}, on {cfg.num_moe_layers()} of "
        f"{cfg.num_layers} layers; {cfg.num_parameters() / 1e9:.2f} B parameters in total, "
        f"{ladder.active_parameters(cfg) / 1e9:.2f} B active per token, {experts / 1e9:.2f} B in the experts"
    )


def moe_detail(base, plan, prec, cluster) -> str:
    """Where #1's experts live and what their exchange costs."""
    layout = plan.layout
    cfg = lay.layout_config(base, layout)
    named = mem.rank_parameters(cfg)
    edp = mem.expert_replicas(cfg, layout.dp)
    experts = [s for n, s in named if mem.is_expert(n)]
    w, g, o = mem.states_bytes(experts, prec, layout.sharding, edp)
    group = layout.ep * layout.etp
    link = "NVLink" if group <= cluster.gpus_per_node else "InfiniBand"
    return (
        f"experts of #1 per GPU: {cfg.num_experts // layout.ep} per MoE layer (EP {layout.ep}, expert-TP "
        f"{layout.etp}, expert-DP {edp}), {sum(mem.numel(s) for s in experts) / 1e9:.2f} B parameters: weights "
        f"{_gib(w)}, grads {_gib(g)}, optimizer {_gib(o)} GiB; {cfg.moe_token_dispatcher_type} dispatch "
        f"{plan.comm.ep / 1e9:.2f} GB sent per step over {link} (EP x expert-TP = {group} consecutive ranks), "
        f"{plan.time.ep:.3f} s exposed; expert-DP gradient reduction {plan.comm.edp / 1e9:.2f} GB"
    )


def report(args, base, prec, cluster, fits, too_big) -> None:
    serial = dict(tensor_model_parallel_size=1, context_parallel_size=1, sequence_parallel=False)
    cfg = GPTConfig(**dict(base, **serial, hierarchical_context_parallel_sizes=None, expert_model_parallel_size=1))
    moe = cfg.num_experts is not None
    print(
        f"model: {cfg.model}, {cfg.num_parameters() / 1e9:.2f} B parameters, seq {cfg.seq_length}, micro batch "
        f"{args.micro_batch_size}, global batch {args.global_batch_size}; precision {prec.name} "
        f"({prec.weight}+{prec.grad}+{prec.optimizer} B/param)"
    )
    if moe:
        print(moe_summary(cfg))
    print(
        f"cluster: {cluster.gpus} GPUs, {cluster.gpus_per_node} per node, {cluster.gpu_memory_gib:g} GiB "
        f"(-{cluster.reserved_gib:g} reserved); {cluster.peak_tflops:g} TFLOP/s peak x MFU {cluster.mfu:g}, "
        f"NVLink {cluster.nvlink_gbps:g} GB/s, IB {cluster.ib_gbps:g} GB/s per GPU"
    )
    runnable = [p for p in fits if p.runnable]
    modelled = [p for p in fits if not p.runnable]
    print(
        f"{len(fits)} layouts fit ({len(runnable)} runnable today; {too_big} more split the model "
        "but exceed the memory)"
    )
    if runnable:
        print("runnable today, fastest first:")
        print(table(_headers(moe), [_row(i + 1, p, moe) for i, p in enumerate(runnable[: args.top])]))
    if modelled:
        why = "; ".join(sorted({note for p in modelled for note in p.note.split("; ")}))
        print(f"modelled, not runnable yet ({why}), fastest first:")
        start = len(runnable[: args.top])
        shown = modelled[: max(3, args.top // 2)]
        print(table(_headers(moe), [_row(start + i + 1, p, moe) for i, p in enumerate(shown)]))
    best = fits[0]
    print("\nbuffers of #1 (GiB): " + ", ".join(f"{k} {_gib(v)}" for k, v in best.memory.buffers.items()))
    t = best.time
    print(
        f"step time of #1 (s): compute {t.compute:.3f}, TP {t.tp:.3f}, CP {t.cp:.3f}, DP exposed {t.dp:.3f}, "
        f"PP sends {t.pp:.3f}, bubble {t.bubble:.3f}" + (f", MoE dispatch {t.ep:.3f}" if moe else "")
    )
    if moe:
        print(moe_detail(base, best, prec, cluster))
    print(
        "note: pp > 1 is 1F1B with even stages (with FSDP2 a stage stays gathered for the step); FSDP2 runs in "
        "every precision mode; recompute full = uniform chunks of 1 layer."
    )


# ---- the Llama ladder ---------------------------------------------------------------------


def largest_llama(args, base, prec, cluster, fixed) -> None:
    batch = lay.Batch(args.micro_batch_size, args.global_batch_size)
    rows = []
    for size in ladder.LLAMA_LADDER:
        fields = ladder.llama_fields(base, size)
        row = [size, f"{GPTConfig(**fields).num_parameters() / 1e9:.1f}"]
        for sharding, pins in (
            (("replicated", "distributed"), {"pp": 1}),
            (("fsdp2",), {"pp": 1}),
            (mem.SHARDINGS, {}),  # pipeline stages allowed (even stages), any sharding
        ):
            fits = []
            for s in sharding:
                found = lay.plans(fields, prec, cluster, batch, dict(fixed, **pins, sharding=s), True).fits
                fits += found
            fits.sort(key=lambda p: p.time.total)
            row += [f"{fits[0].layout.describe()} ({_gib(fits[0].memory.total)} GiB)" if fits else "does not fit"]
        rows.append(row)
    print(
        f"Llama ladder on {cluster.gpus} x {cluster.gpu_memory_gib:g} GiB GPUs, seq {base['seq_length']}, global batch "
        f"{args.global_batch_size} x micro {args.micro_batch_size}, precision {prec.name}; fastest fitting layout:"
    )
    headers = ["model", "B params", "pp 1: replicated weights (+ distributed optimizer)", "pp 1: FSDP2"]
    print(table(headers + ["any pp (even stages), any sharding"], rows))


def largest_moe(args, base, prec, cluster, fixed) -> None:
    """Each MoE rung on the cluster: the fastest layout the program runs today, and the fastest of any
    layout modelled (pipeline stages, FSDP2 with experts)."""
    batch = lay.Batch(args.micro_batch_size, args.global_batch_size)
    refused = moe_refused()
    rows = []
    for name in ladder.MOE_LADDER:
        fields = ladder.moe_fields(base, name)
        cfg = GPTConfig(**fields)
        search = lay.plans(fields, prec, cluster, batch, fixed, True, refused)
        runnable = [p for p in search.fits if p.runnable]
        modelled = sorted(search.fits, key=lambda p: p.time.total)
        row = [name, f"{cfg.num_parameters() / 1e9:.1f}", f"{ladder.active_parameters(cfg) / 1e9:.1f}"]
        for found in (runnable, modelled):
            row.append(f"{found[0].layout.describe()} ({_gib(found[0].memory.total)} GiB)" if found else "does not fit")
        rows.append(row)
        if search.capped:
            print(f"note: {name}: only the first {lay.MAX_LAYOUTS:,} layouts were planned.", file=sys.stderr)
    print(
        f"MoE ladder on {cluster.gpus} x {cluster.gpu_memory_gib:g} GiB GPUs, seq {base['seq_length']}, global batch "
        f"{args.global_batch_size} x micro {args.micro_batch_size}, precision {prec.name}; fastest fitting layout "
        f"(DeepSeek's attention modelled as standard attention, megatron_sp/planning/ladder.py):"
    )
    headers = ["model", "B params", "B active", "runnable today", "any layout (modelled)"]
    print(table(headers, rows))
    if refused:
        print(f"(not runnable today with experts: {', '.join(sorted(refused))}; the program refuses them)")


def longest_sequence(args, base, prec, cluster, fixed, sizes) -> None:
    batch = lay.Batch(args.micro_batch_size, args.global_batch_size)
    rows = []
    for size in sizes:
        s, best = ladder.longest_sequence(ladder.llama_fields(base, size), prec, cluster, batch, fixed)
        if best is None:
            rows.append([size, "under 8192", "does not fit", "", ""])
            continue
        tokens = best.micro_batches * args.micro_batch_size * best.layout.dp * s
        rows.append(
            [
                size,
                f"{s} or more" if s >= ladder.LONGEST_SEQUENCE else s,
                best.layout.describe(),
                _gib(best.memory.total),
                f"{tokens / best.time.total:,.0f}",
            ]
        )
    print(
        f"Longest sequence on {cluster.gpus} x {cluster.gpu_memory_gib:g} GiB GPUs ({cluster.gpus_per_node} per node), "
        f"micro batch {args.micro_batch_size}, global batch {args.global_batch_size}, precision {prec.name}:"
    )
    print(table(["model", "longest s", "fastest layout there", "GiB/GPU", "tokens/s (modelled)"], rows))


def paper_table() -> None:
    from megatron_sp.planning.activations import paper_table as rows

    table_rows = rows()
    keys = [k for k in table_rows[0] if k not in ("model", "s", "b", "h", "a", "t", "layers")]
    print("Korthikanti et al. 2022, Table 2 (16-bit, s=2048, b=1, t=8): activations per GPU, GiB for all layers")
    print(
        table(
            ["configuration"] + [f"{r['model']} ({r['layers']} L)" for r in table_rows],
            [[k] + [f"{r[k] * r['layers'] / mem.GIB:.1f}" for r in table_rows] for k in keys],
        )
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--paper-table" in argv:  # needs no model
        paper_table()
        return 0
    parser, offered = build_plan_parser()
    try:
        args = parser.parse_args(argv)
        given = _given(parser, argv)
        check(args, given)
        base = base_config(args, given)
    except ArgumentError as err:
        print(f"tools/plan.py: error: {err}", file=sys.stderr)
        return 2
    if args.global_batch_size is None:  # the same tokens per step for every layout
        args.global_batch_size = args.gpus * args.micro_batch_size
    prec, cluster, fixed = precision_of(args, offered), cluster_of(args), fixed_dimensions(args, given)
    if args.largest_llama:
        largest_llama(args, base, prec, cluster, fixed)
        return 0
    if args.largest_moe:
        largest_moe(args, base, prec, cluster, fixed)
        return 0
    if args.longest_sequence:
        longest_sequence(args, base, prec, cluster, fixed, args.longest_sequence.split(","))
        return 0
    batch = lay.Batch(args.micro_batch_size, args.global_batch_size)
    refused = moe_refused() if base.get("num_experts") is not None else frozenset()
    fits, too_big, capped = lay.plans(base, prec, cluster, batch, fixed, "--use-torch-fsdp2" in offered, refused)
    if capped:
        print(
            f"note: more than {lay.MAX_LAYOUTS:,} layouts; only the first {lay.MAX_LAYOUTS:,} were planned "
            "(pin a dimension, e.g. --tensor-model-parallel-size, to search the rest).",
            file=sys.stderr,
        )
    if not fits:
        why = (
            f"{too_big} layouts split it but exceed the memory; add GPUs or shrink the model or batch"
            if too_big
            else "no layout splits it (heads, key/value groups, MLP width, sequence or batch do not divide)"
        )
        print(
            f"tools/plan.py: no layout fits this model in {args.gpus} x {args.gpu_memory_gib:g} GiB: {why}.",
            file=sys.stderr,
        )
        return 1
    report(args, base, prec, cluster, fits, too_big)
    return 0


if __name__ == "__main__":
    sys.exit(main())

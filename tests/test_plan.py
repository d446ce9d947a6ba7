"""tools/plan.py and megatron_sp/planning/: the predictions against what the program builds.

* weights, gradients and optimizer state per rank: exactly the bytes of the tensors the program's
  Trainer holds, for several layouts and every precision mode its parser accepts;
* activations saved for the backward: within 5% of bench/activation_memory.py's measurement
  (its SavedTensorCounter) for several layouts, serial and parallel;
* Korthikanti et al.'s Table 2 at the paper's model sizes;
* bad input: one sentence naming both flags, exit 2.
"""

import re

import pytest
import torch
from activation_memory import SavedTensorCounter
from comm_volume import CollectiveCounter
from launch_helpers import bounded

from megatron_sp.config import GPTConfig
from megatron_sp.planning import activations as act
from megatron_sp.planning import layouts as lay
from megatron_sp.planning import memory as mem
from tools import plan

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
TINY += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "97", "--mock-data", "--micro-batch-size", "2"]
TINY += ["--train-iters", "4", "--lr-warmup-iters", "0", "--log-interval", "100", "--eval-interval", "100"]
TINY += ["--peak-tflops", "1"]  # (no CPU matmul benchmark)
LAYOUTS = {  # world of 4
    "tp1-dp4": ["--model", "gpt2"],
    "tp2-sp-dp2-distopt": [
        "--model",
        "gpt2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--use-distributed-optimizer",
    ],
    "cp2-dp2-distopt": [
        "--model",
        "llama",
        "--num-query-groups",
        "2",
        "--context-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ],
    "tp4-gqa-copies": ["--model", "llama", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
}
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
SHARED = ["--moe-shared-expert-intermediate-size", "48"]
MOE_LAYOUTS = {  # Megatron's MoE flags: EP1 with expert-TP 2, EP2 over the DP ranks (alltoall, allgather)
    "moe-ep1-etp2-tp2-sp-distopt": ["--model", "llama", "--num-query-groups", "2", *MOE, *SHARED]
    + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"]
    + ["--moe-token-dispatcher-type", "alltoall"],
    "moe-ep2-dp4-alltoall-distopt": ["--model", "llama", "--num-query-groups", "2", *MOE, *SHARED]
    + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer"],
    "moe-ep2-dp4-allgather-gelu": ["--model", "gpt2", *MOE, "--expert-model-parallel-size", "2"]
    + ["--moe-token-dispatcher-type", "allgather"],
}
FSDP2_LAYOUTS = {  # --use-torch-fsdp2: only the states are compared (its collectives run over the replicas)
    "tp2-sp-dp2-fsdp2": ["--model", "llama", "--num-query-groups", "2", "--tensor-model-parallel-size", "2"]
    + ["--sequence-parallel", "--use-torch-fsdp2"],
}


ALL_MODES = (
    "tp2-sp-dp2-distopt",
    "cp2-dp2-distopt",
    "moe-ep2-dp4-alltoall-distopt",
)  # every precision mode; the others fp32 (test time)


def precision_modes():
    """fp32 and every low-precision flag pretrain_gpt_sp.py's parser accepts."""
    parser, offered = plan.build_plan_parser()
    return [[]] + [[flag] for flag in ("--bf16", "--fp16") if flag in offered]


def _tensor_bytes(tensors) -> int:
    """Bytes this rank holds (of a DTensor: its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def _measure(argv):
    """On every rank: the program's Trainer built from argv; its weights, the gradients of one
    backward, the optimizer state after a step, the bytes saved for the backward."""
    import torch.distributed as dist

    from megatron_sp.training import loop
    from megatron_sp.training.arguments import parse_args
    from megatron_sp.training.pretrain import Trainer, check_inputs, data_iterator

    args = parse_args(argv, world_size=dist.get_world_size())
    args.device, args.distributed_backend, args.data_cache_path = "cpu", "gloo", None
    trainer = Trainer(check_inputs(args))
    model, ps = trainer.model, trainer.ps
    batches = data_iterator(trainer.train_ds, 0, args, ps)
    for iteration in range(1, 4):  # fp16: a first step may be skipped (overflow)
        kw = dict(device="cpu", clip_grad=1.0, iteration=iteration, scaler=trainer.scaler)
        with CollectiveCounter() as step:
            skipped = loop.train_step(model, trainer.optimizer, batches, args.num_micro_batches, ps, **kw).skipped
        if not skipped:
            break
    opt = trainer.optimizer.optim
    own = {id(p) for p in model.parameters()}
    state = [t for st in opt.state.values() for k, t in st.items() if k != "step" and torch.is_tensor(t)]
    masters = [p for g in opt.param_groups for p in g["params"] if id(p) not in own]
    model.zero_grad(set_to_none=True)
    batch = loop.to_device(next(batches), "cpu")
    if args.use_torch_fsdp2:  # (the counter reads plain parameters; only the states are compared)
        loss, sent, counter = loop.forward_loss(model, batch), None, None
        loss.backward()
    else:
        with CollectiveCounter() as sent:
            with SavedTensorCounter(model) as counter:
                loss = loop.forward_loss(model, batch)
            loss.backward()
    grads = [p.grad for p in model.parameters()] + [getattr(p, "main_grad", None) for p in model.parameters()]
    assert ps.replica_group is None or dist.get_rank(ps.replica_group) == ps.replica_rank
    return dict(
        weights=_tensor_bytes(model.parameters()),
        grads=_tensor_bytes(grads),
        optimizer=_tensor_bytes(state + masters),
        replica=ps.replica_rank,
        saved=counter.total() if counter else None,
        sent={
            kind: sum(c["sent"] for c in sent.calls if c["t"] == size)
            for kind, size in (("tp", ps.tp_size), ("cp", ps.cp_size))
        }
        if sent
        else None,
        cfg=trainer.cfg,
        dp=ps.dp_size,
        shapes=[tuple(p.shape) for p in model.parameters()],
        names=[n for n, _ in model.named_parameters()],
        expert_replica=ps.edp_rank,
        calls=[{k: c[k] for k in ("kind", "site", "t", "sent")} for c in sent.calls] if sent else None,
        step_calls=[{k: c[k] for k in ("kind", "site", "t", "sent")} for c in step.calls],
    )


@pytest.fixture(scope="module")
def world():
    from megatron_sp.testing import LocalWorld

    with LocalWorld(4) as w:
        yield w


@pytest.fixture(scope="module")
def measured(world):
    out = {}
    for name, flags in {**LAYOUTS, **MOE_LAYOUTS, **FSDP2_LAYOUTS}.items():
        modes = precision_modes() if name in ALL_MODES or name in FSDP2_LAYOUTS else [[]]
        for mode in modes:
            # fp16: a scale that lets the first steps update (Megatron's 2^32 skips ~32 steps halving it)
            scale = ["--initial-loss-scale", "128"] if "--fp16" in mode else []
            out[name, " ".join(mode) or "fp32"] = world.run(_measure, TINY + flags + mode + scale)
    return out


def _predict(rank, argv):
    parser, offered = plan.build_plan_parser()
    args = parser.parse_args(argv + ["--gpus", "4", "--gpus-per-node", "4"])
    prec = plan.precision_of(args, offered)
    sharding = "fsdp2" if args.use_torch_fsdp2 else "distributed" if args.use_distributed_optimizer else "replicated"
    cfg = rank["cfg"]
    named = mem.rank_parameters(cfg)
    replicas, expert_reps = rank["dp"] * cfg.context_parallel_size, mem.expert_replicas(cfg, rank["dp"])
    weights, grads, _ = mem.rank_states(named, prec, sharding, replicas, expert_reps)
    opt = mem.rank_optimizer(named, prec, sharding, replicas, expert_reps, rank["replica"], rank["expert_replica"])
    assert [mem.is_expert(n) for n, _ in named] == [mem.is_expert(n) for n in rank["names"]]
    return [s for _, s in named], prec, weights, grads, opt


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(MOE_LAYOUTS) + list(FSDP2_LAYOUTS))
def test_states_per_rank_are_the_tensor_bytes(measured, layout):
    for (name, mode), ranks in measured.items():
        if name != layout:
            continue
        for rank in ranks:
            argv = TINY + {**LAYOUTS, **MOE_LAYOUTS, **FSDP2_LAYOUTS}[name] + ([] if mode == "fp32" else [mode])
            shapes, prec, weights, grads, opt = _predict(rank, argv)
            assert shapes == rank["shapes"], (mode, "parameter shapes")
            assert (rank["weights"], rank["grads"], rank["optimizer"]) == (weights, grads, opt), (mode, prec.name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp_and_cp_bytes_sent_are_the_collectives(measured, layout):
    from megatron_sp.planning import cost
    from megatron_sp.planning.layouts import Layout

    for rank in measured[layout, "fp32"]:
        cfg = rank["cfg"]
        shapes, prec, *_ = _predict(rank, TINY + LAYOUTS[layout])
        grid = Layout(cfg.tensor_model_parallel_size, cfg.context_parallel_size, rank["dp"], 1, cfg.sequence_parallel,
                      None, "replicated")  # fmt: skip
        predicted = cost.communication(cfg, grid, prec, 2, 1, sum(mem.numel(s) for s in shapes))
        assert rank["sent"] == {"tp": predicted.tp, "cp": predicted.cp}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_activations_within_5_percent_parallel(measured, layout):
    for rank in measured[layout, "fp32"]:
        predicted, _ = mem.activation_bytes(rank["cfg"], 2, act.FP32)
        assert abs(rank["saved"] / predicted - 1) < 0.05, (rank["saved"], predicted)


MOE_SITES = {"_a2a_once", "_counts_a2a", "AllToAllDispatcher.__call__", "AllGatherDispatcher.__call__"}
STATISTICS = "MoEGroups.sum_all"  # the load-balancing statistics' E-sized all-reduces (left out by the planner)


def _moe_sent(rank) -> float:
    """Bytes the MoE dispatch sent in one forward + backward: its own sites, and at TP = CP = 1 every
    collective but the statistics' (the all-gather dispatcher's gathers are the SP mappings')."""
    cfg = rank["cfg"]
    alone = cfg.tensor_model_parallel_size * cfg.context_parallel_size == 1
    return sum(c["sent"] for c in rank["calls"] if c["site"] in MOE_SITES or (alone and c["site"] != STATISTICS))


def _moe_comm(rank, layout):
    from megatron_sp.planning import cost
    from megatron_sp.planning.layouts import Layout

    cfg = rank["cfg"]
    named = mem.rank_parameters(cfg)
    shapes, prec, *_ = _predict(rank, TINY + MOE_LAYOUTS[layout])
    sharding = "distributed" if "--use-distributed-optimizer" in MOE_LAYOUTS[layout] else "replicated"
    grid = Layout(cfg.tensor_model_parallel_size, 1, rank["dp"], 1, cfg.sequence_parallel, None, sharding,
                  ep=cfg.expert_model_parallel_size, etp=cfg.expert_tensor_parallel_size)  # fmt: skip
    experts = sum(mem.numel(s) for n, s in named if mem.is_expert(n))
    return cost.communication(cfg, grid, prec, 2, 1, sum(mem.numel(s) for s in shapes), experts)


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_dispatch_bytes_are_the_collectives(measured, layout):
    """Every rank's routed rows are n k; the rows it receives vary with the routing but average to n k
    over the EP group, so the mean over the ranks is the balanced-routing formula exactly."""
    ranks = measured[layout, "fp32"]
    sent = [_moe_sent(rank) for rank in ranks]
    assert sum(sent) / len(sent) == pytest.approx(_moe_comm(ranks[0], layout).ep, rel=1e-12), sent
    assert min(sent) > 0


def test_expert_data_parallel_reduction_bytes_are_the_step_collectives(measured):
    """EP2 over DP4 (replicated AdamW): the experts' gradients all-reduced over their 2 expert-DP
    replicas, the dense ones over the 4 DP ranks, as the planner's edp and dp bytes."""
    layout = "moe-ep2-dp4-allgather-gelu"
    for rank in measured[layout, "fp32"]:
        reduced = [c for c in rank["step_calls"] if c["site"] == "_start"]  # (grad_sync's bucket reductions)
        comm = _moe_comm(rank, layout)
        assert sum(c["sent"] for c in reduced if c["t"] == 2) == comm.edp > 0
        assert sum(c["sent"] for c in reduced if c["t"] == 4) == comm.dp > 0


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_activations_within_5_percent(measured, layout):
    """The mean over the ranks (each rank's experts take the rows routing sends them)."""
    ranks = measured[layout, "fp32"]
    predicted, _ = mem.activation_bytes(ranks[0]["cfg"], 2, act.FP32)
    saved = sum(r["saved"] for r in ranks) / len(ranks)
    assert abs(saved / predicted - 1) < 0.05, (saved, predicted)


SERIAL_MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01)


def _saved_serial(**fields):
    from megatron_sp.models.gpt import GPTModel

    cfg = GPTConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=97, seq_length=32, **fields)
    model = GPTModel(cfg).train()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    with SavedTensorCounter(model) as counter:
        model(tokens, tokens)
    return cfg, counter.total()


@pytest.mark.parametrize(
    "fields",
    [
        dict(model="gpt2", use_fused_kernels=False),
        dict(model="gpt2", recompute_granularity="selective"),
        dict(model="llama", num_query_groups=2),
        dict(model="llama", recompute_granularity="full", recompute_num_layers=2),
        dict(model="llama", recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        dict(
            model="llama", **SERIAL_MOE, moe_z_loss_coeff=0.01, moe_shared_expert_intermediate_size=48, moe_layer_freq=2
        ),
        dict(model="llama", **SERIAL_MOE, moe_expert_capacity_factor=0.5, moe_router_score_function="sigmoid"),
        dict(model="gpt2", **SERIAL_MOE, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    ],
    ids=["gpt2-reference-ops", "gpt2-selective", "llama-gqa", "llama-full-uniform2", "llama-full-block1"]
    + ["moe-z-loss-shared-freq2", "moe-capacity-sigmoid", "moe-gpt2-padded"],
)
def test_activations_within_5_percent_serial(fields):
    cfg, saved = _saved_serial(**fields)
    predicted, _ = mem.activation_bytes(cfg, 2, act.FP32)
    assert abs(saved / predicted - 1) < 0.05, (saved, predicted)


def test_paper_table_2():
    """Korthikanti et al. 2022, Table 2 (bytes per layer, 16-bit) at their Table 3 model sizes; SP
    with selective recomputation cuts the TP-only activations about 5x (their abstract)."""
    rows = act.paper_table()
    assert [r["model"] for r in rows] == ["22B", "175B", "530B", "1T"]
    for r in rows:
        s, b, h, a, t = r["s"], r["b"], r["h"], r["a"], r["t"]
        sbh = s * b * h
        assert r["no parallelism"] == sbh * (34 + 5 * a * s / h)
        assert r["tensor parallel (baseline)"] == sbh * (10 + 24 / t + 5 * a * s / (h * t))
        assert r["tensor + sequence parallel"] == sbh * (34 / t + 5 * a * s / (h * t))
        assert r["tensor parallel + selective"] == sbh * (10 + 24 / t)
        assert r["tensor + sequence parallel + selective"] == sbh * 34 / t
        assert r["full recompute"] == sbh * 2
        assert 4.5 < r["tensor parallel (baseline)"] / r["tensor + sequence parallel + selective"] < 6.5


def _plan_error(capsys, argv):
    code = plan.main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "extra, flags",
    [
        (["--use-torch-fsdp2", "--use-distributed-optimizer"], ("--use-torch-fsdp2", "--use-distributed-optimizer")),
        (["--tensor-model-parallel-size", "3"], ("--tensor-model-parallel-size", "--num-attention-heads")),
        (["--gpus-per-node", "16"], ("--gpus-per-node", "--gpus")),
        (
            ["--tensor-model-parallel-size", "8", "--gpus-per-node", "4"],
            ("--tensor-model-parallel-size", "--gpus-per-node"),
        ),
        (["--pipeline-model-parallel-size", "3"], ("--pipeline-model-parallel-size", "--num-layers")),
        (["--global-batch-size", "7"], ("--global-batch-size", "--micro-batch-size")),
    ],
)
def test_bad_input_is_one_sentence_naming_both_flags(capsys, extra, flags):
    code, err = _plan_error(capsys, TINY + ["--gpus", "8"] + extra)
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert all(f in err for f in flags), err


def test_plan_prints_runnable_layouts_first(capsys):
    assert plan.main(TINY + ["--gpus", "4", "--gpus-per-node", "4", "--bf16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "runnable today, fastest first:" in out and "modelled, not runnable yet" not in out  # (all are)
    runnable = out.split("runnable today, fastest first:")[1]
    assert " pp1 " in runnable or " pp2 " in runnable  # pipeline layouts run too


def test_pipeline_layouts_are_runnable_with_fsdp2_holding_the_stage_for_the_step():
    from megatron_sp.planning import cost

    base = dict(model="llama", num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1000, seq_length=512)
    cluster = cost.Cluster(8, 8, 80.0, 4.0, 100.0, 0.5, 300.0, 25.0)
    prec, batch = mem.precision("bf16", True), lay.Batch(1, 64)
    pp = lay.plan_layout(base, lay.Layout(2, 1, 2, 2, True, None, "distributed"), prec, cluster, batch, True)
    assert pp.runnable and pp.time.bubble > 0
    fsdp2 = lay.plan_layout(base, lay.Layout(2, 1, 2, 2, True, None, "fsdp2"), prec, cluster, batch, True)
    assert fsdp2.runnable and fsdp2.note == ""
    # torch's schedule keeps the stage gathered (bf16) and its gradients unsharded (fp32) for the step
    stage = sum(mem.numel(s) for _, s in mem.rank_parameters(GPTConfig(**base, tensor_model_parallel_size=2), 0, 2))
    held = [b for name, b in fsdp2.memory.buffers.items() if "under PP" in name]
    assert held == [pytest.approx((2 + 4) * stage, rel=0.2)]  # (the larger of the first and last stage)


def test_step_time_model_compute_is_the_flops_over_every_gpu():
    """Without recomputation every layout of a cluster does the same FLOPs per GPU; full
    recomputation adds one forward of the layers; communication over IB costs more than NVLink."""
    from megatron_sp.planning import cost

    base = dict(model="llama", num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1000, seq_length=512)
    cluster = cost.Cluster(16, 8, 80.0, 4.0, 100.0, 0.5, 300.0, 25.0)
    prec, batch = mem.precision("bf16", True), lay.Batch(1, 64)
    flops = GPTConfig(**base).flops_per_token() * 64 * 512
    for grid in [(1, 1, 16), (8, 1, 2), (2, 4, 2), (4, 2, 2)]:
        plan_ = lay.plan_layout(base, lay.Layout(*grid, 1, False, None, "distributed"), prec, cluster, batch, False)
        assert plan_.time.compute == pytest.approx(flops / 16 / (100e12 * 0.5))
    full = lay.plan_layout(base, lay.Layout(2, 1, 8, 1, False, "full", "distributed"), prec, cluster, batch, False)
    assert flops / 16 / 50e12 < full.time.compute < 4 / 3 * flops / 16 / 50e12 * 1.01
    assert cluster.bandwidth(8) == 300e9 and cluster.bandwidth(16) == 25e9


def test_the_planner_chooses_among_the_cp_types():
    """Every CP type is a layout (a2a+p2p with the a2a level filling a node with TP, the ring across);
    Llama-3-8B at CP16 on 64 GPUs (two nodes' rings): at 8k tokens the ring's traffic cannot hide
    under the attention and a2a inside the node wins; at 128k the ring is hidden and wins; all-gather,
    never overlapped, comes after the ring; a pinned --cp-comm-type is the only one tried."""
    from megatron_sp.planning import cost
    from megatron_sp.planning.ladder import llama_fields

    cluster = cost.Cluster(64, 8, 80.0, 4.0, 989.0, 0.4, 360.0, 45.0)
    prec, batch = mem.precision("bf16", True), lay.Batch(1, 64)
    fixed = dict(tp=1, cp=16, pp=1, recompute="selective", sharding="fsdp2")
    assert [c for c, _ in lay.cp_choices(cluster, 1, 16, {})] == ["p2p", "a2a", "allgather", "a2a+p2p"]
    assert lay.cp_choices(cluster, 2, 16, {})[-1] == ("a2a+p2p", (4, 4)) and len(lay.cp_choices(cluster, 8, 4, {})) == 3
    order = {}
    for s in (8192, 131072):
        fits = lay.plans(dict(llama_fields({}, "8B"), seq_length=s), prec, cluster, batch, fixed, True).fits
        order[s] = [p.layout.cp_comm for p in fits]
        assert set(order[s]) == {"p2p", "a2a", "allgather", "a2a+p2p"}
        assert order[s].index("p2p") < order[s].index("allgather")
    assert order[8192][0] == "a2a+p2p" and order[131072][0] == "p2p"
    pinned = lay.plans(dict(llama_fields({}, "8B"), seq_length=8192), prec, cluster, batch,
                       dict(fixed, cp_comm="allgather"), True)[0]  # fmt: skip
    assert {p.layout.cp_comm for p in pinned} == {"allgather"}


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--nvlink-gbps", "0"], "--nvlink-gbps"),
        (["--ib-gbps", "0"], "--ib-gbps"),
        (["--gpu-peak-tflops", "0"], "--gpu-peak-tflops"),
        (["--global-batch-size", "0"], "--global-batch-size"),
        (["--gpu-memory-gib", "nan"], "--gpu-memory-gib"),
        (["--gpu-memory-gib", "inf"], "--gpu-memory-gib"),
        (["--reserved-gib", "-1"], "--reserved-gib"),
        (["--top", "0"], "--top"),
        (["--gpus", str(10**20)], "--gpus"),
    ],
)
def test_bad_number_is_one_sentence_naming_the_flag(capsys, extra, flag):
    code, err = _plan_error(capsys, TINY + ["--gpus", "8"] + extra)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"tools/plan.py: error: {flag} must be"), err


def test_divisors_are_every_divisor_ascending():
    for n in (1, 2, 12, 36, 97, 8192, 7 * 11 * 13 * 13):
        assert lay.divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_a_trillion_gpus_is_answered_and_the_cap_said(capsys, monkeypatch):
    """The enumeration depends on the model's sizes (gcds), not on the GPU count, and stops at MAX_LAYOUTS
    with a note (was: a scan of 10^12 candidate divisors, then a list per replica)."""
    monkeypatch.setattr(lay, "MAX_LAYOUTS", 200)
    with bounded(20):
        code = plan.main(TINY + ["--gpus", str(10**12), "--top", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "only the first 200 were planned" in err and "1000000000000 GPUs" in out


def test_largest_optimizer_share_is_the_max_of_the_shares():
    shapes = [(97, 64), (64,), (256, 64), (64, 256), (64,), (64, 64)]
    for sharding in mem.SHARDINGS:
        for replicas in (1, 2, 3, 8, 13):
            shares = mem.optimizer_shares(shapes, 12, sharding, replicas)
            assert mem.largest_optimizer_share(shapes, 12, sharding, replicas) == max(shares)


def test_plan_prints_the_moe_rows(capsys):
    """An MoE model: its total and active parameters, EP / expert-TP layouts with the dispatch and
    expert-DP bytes, and the layouts the program refuses with experts (read from its own checks)
    listed as modelled only."""
    assert plan.main(TINY + MOE + ["--gpus", "8", "--gpus-per-node", "4", "--bf16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "MoE: 4 experts of width 32, top-2, on 2 of 2 layers" in out
    assert "GB sent tp/cp/dp/pp/ep/edp" in out and re.search(r" ep\d etp\d ", out) and "experts of #1 per GPU" in out
    refused = plan.moe_refused()
    runnable = out.split("runnable today, fastest first:")[1].split("modelled, not runnable yet")[0]
    assert ("pp" not in refused or " pp2 " not in runnable) and ("fsdp2" not in refused or "fsdp2" not in runnable)

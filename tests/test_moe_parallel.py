"""Expert parallelism computes the serial MoE model (issue 31, item 4): loss, every gradient and the
parameters after 3 AdamW steps within the parity tolerances (fp32), dropout on, through the parity
harness (megatron_sp/testing/parity.py) in one 4-rank gloo world.

Layouts: EP 2 and 4 with both dispatchers, EP2 × TP2+SP with expert-TP 1 and 2, EP2 × CP2, EP2 × DP2,
capacity with drops (both policies), top-1, group-limited sigmoid routing, Sinkhorn routing (TP2+SP ×
DP2), a shared expert, seq_aux_loss,
full recomputation (the dispatch runs again in the backward), --tp-comm-overlap's ring GEMMs around the
experts, Llama-style and GPT-style (biases, GELU) blocks; PP2 × EP2 under every pipeline schedule and
PP2 × TP2+SP × EP2 (the serial model accumulating the pipeline's micro-batches); and under
--use-torch-fsdp2 (experts sharded over expert-DP, dense parameters over DP×CP) at DP2, DP4 with the
all-gather dispatcher, TP2+SP, CP2 and EP4 (one expert-DP rank). A layout smaller than the world runs
its remaining ranks as further data-parallel replicas (repeating the asked parts of the batch).
"""

import pytest
import torch

from megatron_sp.testing import LocalWorld
from megatron_sp.testing.layouts import Layout, parse_layout
from megatron_sp.testing.parity import compare, make_batches, run_layout, run_serial

VOCAB, SEQ, BATCH, STEPS = 97, 16, 4, 3
BATCHES = make_batches(VOCAB, SEQ, BATCH, STEPS)
LLAMA = dict(model="llama", num_query_groups=2)
GPT = dict(model="gpt2")
MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(4)
    yield w
    w.close()


def _fields(family, extra, ep, etp, dispatcher):
    return dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_length=SEQ,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_fused_kernels=False,
        **family,
        **{**MOE, **extra},
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type=dispatcher,
    )


CASES = {  # name: (family, MoE fields, layout, ep, etp, dispatcher)
    "ep2": (LLAMA, {}, Layout(), 2, 1, "alltoall"),
    "ep4": (LLAMA, {}, Layout(), 4, 1, "alltoall"),
    "ep2-allgather": (LLAMA, {}, Layout(), 2, 1, "allgather"),
    "ep4-allgather-top1": (LLAMA, dict(moe_router_topk=1), Layout(), 4, 1, "allgather"),
    "tp2+sp/ep2/etp1": (LLAMA, {}, Layout(tp=2, sp=True), 2, 1, "alltoall"),
    "tp2+sp/ep2/etp2": (LLAMA, {}, Layout(tp=2, sp=True), 2, 2, "alltoall"),
    "tp2+sp/ep2/etp2-allgather": (LLAMA, {}, Layout(tp=2, sp=True), 2, 2, "allgather"),
    "cp2/ep2": (LLAMA, {}, Layout(cp=2), 2, 1, "alltoall"),
    "dp2/ep2": (LLAMA, {}, Layout(dp=2), 2, 1, "alltoall"),
    "tp2+sp/ep2-sinkhorn-top1": (  # the balancing's column sums over SP and DP ranks
        LLAMA,
        dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0, moe_router_topk=1),
        Layout(tp=2, sp=True),
        2,
        1,
        "alltoall",
    ),
    "ep2-capacity-probs": (LLAMA, dict(moe_expert_capacity_factor=0.5), Layout(tp=2, sp=True), 2, 1, "alltoall"),
    "ep2-capacity-position": (
        LLAMA,
        dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"),
        Layout(cp=2),
        2,
        1,
        "alltoall",
    ),
    "ep2-group-limited": (
        LLAMA,
        dict(moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1),
        Layout(),
        2,
        1,
        "alltoall",
    ),
    "ep2-shared-seq-aux": (
        LLAMA,
        dict(moe_shared_expert_intermediate_size=64, moe_router_load_balancing_type="seq_aux_loss"),
        Layout(tp=2, sp=True),
        2,
        1,
        "alltoall",
    ),
    "gpt-ep2": (GPT, dict(moe_grouped_gemm=True), Layout(dp=2), 2, 1, "alltoall"),
    "tp2+sp/ep2-recompute": (LLAMA, dict(recompute_granularity="full"), Layout(tp=2, sp=True), 2, 1, "alltoall"),
    "tp2+sp/ep2-tp-comm-overlap": (LLAMA, dict(tp_comm_overlap=True), Layout(tp=2, sp=True), 2, 1, "alltoall"),
}


# AdamW's eps in these runs (the harness's adam_eps; torch's and --adam-eps's default is 1e-8). AdamW's
# first step is lr·g/(|g|+eps), which a gradient difference δ moves by at most lr·δ/eps (at g = 0). At 1e-8 an
# element whose gradient cancels to ~1e-9 turns the layouts' rounding there (δ ≈ 3e-10) into a ~lr-sized
# weight difference: one element made ep2-shared-seq-aux 3.5e-5 (layer 1 expert 1 fc2.weight, g -2.4e-9) and
# fsdp2/dp4/ep2-allgather 3.2e-5 (layer 0 expert 0 fc2.weight, g 9.0e-9), over the 3e-5 of the weights with
# every gradient within 3.3e-7 (gpt-ep2: 2.9e-5). Those two runs' first gradients: median |g| 2.3e-4 and
# 9.8e-4, δ <= 4.7e-9 wherever |g| < 1e-4; at eps 1e-4 a step moves by <= lr·δ/eps = 4.7e-8, and the
# elements with |g| > eps (about half) keep AdamW's normalized step. Worst weights over this file's cases:
# 1.2e-6 (it was 3.5e-5). It also makes the weights see the gradients' scale, to which AdamW at eps << |g|
# is blind: one local expert's gradients x 1.001 from the second step on (the first gradients untouched)
# give 3.4e-5 and 2.5e-4 in those two cases (at 1e-8: 3.9e-5 and 2.4e-4, against 3.5e-5 and 3.2e-5 clean).
ADAM_EPS = 1e-4


@pytest.mark.parametrize("name", CASES)
def test_expert_parallel_parity(world, name):
    family, extra, layout, ep, etp, dispatcher = CASES[name]
    fields = _fields(family, extra, ep, etp, dispatcher)
    serial_fields = {
        **fields,
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": None,
        "tp_comm_overlap": False,
    }
    serial = run_serial(serial_fields, BATCHES, adam_eps=ADAM_EPS)
    results = world.run(run_layout, fields, layout, BATCHES, state=serial.init, adam_eps=ADAM_EPS)
    row = compare(serial, results[0], name)
    assert not row.failures(), row
    assert row.init is None  # every expert drew its serial initial values


PIPELINE_CASES = {  # layout name (testing/layouts.py), dispatcher: EP inside each stage of 2 ranks
    "pp2/ep2": "alltoall",  # 1F1B; EP over the stage's 2 DP ranks
    "tp2+sp/pp2/ep2/etp1": "alltoall",  # EP over the stage's 2 TP ranks
    "pp2:interleaved/ep2": "alltoall",
    "pp2:zbv/ep2": "alltoall",
    "pp2:interleaved-zb/ep2": "alltoall",
    "pp2:gpipe/ep2": "allgather",
}


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_pipeline_expert_parallel_parity(world, name):
    """MoE under every pipeline schedule: each stage's load-balancing and z losses reach its backward
    through the schedule. A micro-batch's balancing loss is the micro-batch's (Megatron's), so the serial
    model accumulates the same pp micro-batches (run_serial's micro_batches), each weighted 1 / pp."""
    layout = parse_layout(name)
    layers = layout.pipeline_layout().num_stages  # one MoE layer per stage
    fields = {**_fields(LLAMA, {}, 1, None, PIPELINE_CASES[name]), "num_layers": layers}
    serial = run_serial(fields, BATCHES, micro_batches=layout.pp, adam_eps=ADAM_EPS)
    results = world.run(
        run_layout, {**fields, **layout.config_fields()}, layout, BATCHES, state=serial.init, adam_eps=ADAM_EPS
    )
    for run in (r for r in results if r is not None):  # (one per TP rank)
        row = compare(serial, run, name)
        assert not row.failures() and row.init is None, row


FSDP_CASES = {  # name: (family, MoE fields, layout, ep, etp, dispatcher)
    "fsdp2/dp2/ep2": (LLAMA, {}, Layout(dp=2), 2, 1, "alltoall"),
    "fsdp2/dp4/ep2-allgather": (GPT, {}, Layout(dp=4), 2, 1, "allgather"),
    "fsdp2/tp2+sp/ep2": (LLAMA, {}, Layout(tp=2, sp=True), 2, 1, "alltoall"),
    "fsdp2/cp2/ep2": (LLAMA, dict(moe_grouped_gemm=True), Layout(cp=2), 2, 1, "alltoall"),
    "fsdp2/ep4": (LLAMA, {}, Layout(dp=2), 4, 1, "alltoall"),
}


@pytest.mark.parametrize("name", FSDP_CASES)
def test_fsdp2_expert_parallel_parity(world, name):
    """--use-torch-fsdp2 with experts: dense parameters sharded over DP×CP, experts over expert-DP
    (one rank at EP4: unsharded), FSDP2's reduce-scatters and FSDPOptimizer's sums; the serial model's
    loss, gradients and weights after the steps."""
    family, extra, layout, ep, etp, dispatcher = FSDP_CASES[name]
    fields = _fields(family, extra, ep, etp, dispatcher)
    serial_fields = {**fields, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None}
    serial = run_serial(serial_fields, BATCHES, adam_eps=ADAM_EPS)
    run = world.run(
        run_layout, fields, layout, BATCHES, state=serial.init, adam_eps=ADAM_EPS, fsdp=True, probe=_fsdp_meshes
    )[0]
    row = compare(serial, run, name)
    assert not row.failures(), row
    assert run.extra["wrong"] == [], run.extra
    assert name != "fsdp2/dp2/ep2" or run.extra["sizes"] == (4, 2)  # dense over 4 ranks, experts over 2


def _fsdp_meshes(model, ps):
    """{parameter: whether its FSDP2 mesh spans its replica group} (experts: expert-DP, the rest DP×CP)
    and those groups' sizes."""
    import torch.distributed as dist

    from megatron_sp.parallel_state import EXPERT_REPLICAS, REPLICAS, replica_role

    def spans(p):
        mesh = dist.get_process_group_ranks(p.device_mesh.get_group())
        return mesh == dist.get_process_group_ranks(ps.group(replica_role(p)))

    wrong = [n for n, p in model.named_parameters() if not spans(p)]
    return {"wrong": wrong, "sizes": (ps.size(REPLICAS), ps.size(EXPERT_REPLICAS))}


def _distributed_optimizer_shares(ep):
    """(this rank's expert-DP and DP×CP group ranks, {role: names of the parameters it steps}, {role:
    names of all its parameters}) under --use-distributed-optimizer at EP `ep` (DP 4)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.parallel_state import EXPERT_REPLICAS, REPLICAS, replica_role

    ps = parallel_state.initialize_model_parallel(1, expert_model_parallel_size=ep)
    model = GPTModel(GPTConfig(**_fields(LLAMA, {}, ep, 1, "alltoall")), ps)
    args = SimpleNamespace(weight_decay=0.1, lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    opt = build_optimizer(model, SimpleNamespace(**vars(args), use_distributed_optimizer=True), "cpu", ps)
    roles = {n: replica_role(p) for n, p in model.named_parameters()}
    groups = {r: tuple(dist.get_process_group_ranks(ps.group(r))) for r in (EXPERT_REPLICAS, REPLICAS)}
    stepped, held = {}, {}
    for name, role in roles.items():
        held.setdefault(role, set()).add(name)
    for name in opt.main_params():
        stepped.setdefault(roles[name], set()).add(name)
    return groups, stepped, held


def test_distributed_optimizer_shards_experts_over_expert_dp(world):
    """--use-distributed-optimizer with experts (EP2 in DP 4): each expert parameter's AdamW state lives
    on exactly one rank of its expert-DP group (2 ranks holding the same experts), each dense one on
    exactly one of the 4 data-parallel replicas (the program's parity: test_moe_training)."""
    results = world.run(_distributed_optimizer_shares, 2)
    for role, size in (("expert_replicas", 2), ("replicas", 4)):
        for group in {r[0][role] for r in results}:
            assert len(group) == size, (role, group)
            members = [results[rank] for rank in group]
            assert all(m[2][role] == members[0][2][role] for m in members)  # the same experts (or dense ones)
            owned = [m[1].get(role, set()) for m in members]
            assert all(owned) and sum(map(len, owned)) == len(set().union(*owned)), (role, owned)  # disjoint
            assert set().union(*owned) == members[0][2][role]  # together: every parameter of the role


def test_expert_groups_follow_megatrons_rank_order():
    """Expert-TP fastest, then EP, then expert-DP, per pipeline stage."""
    from megatron_sp.parallel_state import expert_grid_ranks

    etp, ep, edp, both = expert_grid_ranks(8, etp=2, ep=2, pp_size=1)
    assert etp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ep == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert edp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert both == [[0, 1, 2, 3], [4, 5, 6, 7]]
    etp, ep, edp, _ = expert_grid_ranks(4, etp=1, ep=2, pp_size=2)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]] and edp == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _too_big(ep):
    from megatron_sp import parallel_state

    try:
        parallel_state.initialize_model_parallel(1, expert_model_parallel_size=ep)
    except ValueError as err:
        return str(err)
    finally:
        parallel_state.destroy_model_parallel()
    return None


def test_expert_grid_that_does_not_fit_is_refused(world):
    message = world.run(_too_big, 8)[0]
    assert "must divide the 4 ranks of a pipeline stage" in message
    assert world.run(_too_big, 4) == [None] * 4


def test_grouped_gemm_backward_matches_the_loop():
    """Row counts that are no multiple of 4 (torch._grouped_mm's alignment), an empty group, sum()'s
    broadcast gradient."""
    from megatron_sp.models.moe.experts import _GroupedMM

    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    _GroupedMM.apply(x, w, offs).sum().backward()
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.cat([x2[:3] @ w2[0], x2[3:3] @ w2[1], x2[3:] @ w2[2]]).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)

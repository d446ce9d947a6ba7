"""FP8 GEMMs (--fp8-format, --fp8-recipe; megatron_sp/tensor_parallel/fp8.py) on torchao.

- At TP1 our tensorwise GEMMs are torchao's own Float8Linear's, bit for bit.
- Layout invariance: every recipe at TP2+SP (and the tensor-scaled ones at CP2) computes what it
  computes at TP1, within FP8_LAYOUT (fp32 summation order only: the FP8 operands are the same), while a
  planted bug that scales each shard by its own amax is off by orders of magnitude more.
  (Data parallelism is not in this list: a rank's micro-batch is another tensor than the whole batch,
  so its scale differs, as in Megatron-LM; bench/precision_drift.py measures FP8 at DP2.)
- Delayed scaling follows Transformer Engine's rule (history, max / most_recent, margin).
- What cannot run is refused in one sentence.
"""

import pytest
import torch

pytest.importorskip("torchao", reason="FP8 needs torchao (requirements.txt)")

from megatron_sp.config import GPTConfig  # noqa: E402
from megatron_sp.tensor_parallel import fp8 as fp8_gemms  # noqa: E402
from megatron_sp.testing import LocalWorld  # noqa: E402
from megatron_sp.testing.layouts import Layout, parse_layout  # noqa: E402
from megatron_sp.testing.parity import compare, make_batches, run_layout  # noqa: E402

FIELDS = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=97,
    seq_length=32,
    model="llama",
    hidden_dropout=0.1,
    attention_dropout=0.1,
    fp8="hybrid",
)
# Relative, fp32 master weights: the first step's loss and gradients, and the loss of every step. The
# FP8 operands are bit-identical across layouts; what is left is the GEMMs' fp32 summation order
# (measured <= 4e-7), and a rounding flipped by it now and then in a later step.
FP8_LAYOUT = dict(loss=1e-5, grad=1e-5)
FP8_VS_BF16_RTOL = 2e-3  # the program's losses, --bf16 with and without FP8 (README "FP8"); measured 2.5e-4


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(4)
    yield w
    w.close()


@pytest.fixture(scope="module")
def batches():
    return make_batches(97, 32, 4, 3)


def _run(fields, layout, batches, per_shard_scales=False):
    """run_layout, optionally with the planted bug: every amax left as its shard's."""
    if per_shard_scales:
        fp8_gemms.reduce_amax = lambda amaxes, groups: amaxes
    try:
        return run_layout(fields, Layout() if layout == "serial" else parse_layout(layout), batches)
    finally:
        fp8_gemms.reduce_amax = _REDUCE_AMAX


_REDUCE_AMAX = fp8_gemms.reduce_amax


def _row(world, fields, layout, batches, per_shard=False):
    base = world.run(_run, fields, "serial", batches)[0]
    run = world.run(_run, fields, layout, batches, per_shard)[0]
    return compare(base, run, layout)


def _off(row) -> list:
    return [f"{k} {getattr(row, k):.2e}" for k, tol in FP8_LAYOUT.items() if not getattr(row, k) <= tol]


@pytest.mark.parametrize(
    "recipe,layouts",
    [("tensorwise", ("tp2+sp", "cp2")), ("delayed", ("tp2+sp", "cp2")), ("rowwise", ("tp2+sp",))]
    + [("mxfp8", ("tp2+sp",))],  # (mxfp8: 4 key/value heads, so a rank's k and v are 32 wide: one block)
)
def test_fp8_is_layout_invariant(world, batches, recipe, layouts):
    fields = dict(FIELDS, fp8_recipe=recipe, **({"num_query_groups": 4} if recipe == "mxfp8" else {}))
    base = world.run(_run, fields, "serial", batches)[0]
    for layout in layouts:
        row = compare(base, world.run(_run, fields, layout, batches)[0], layout)
        assert not _off(row), (layout, row)


@pytest.mark.parametrize("recipe,layout", [("tensorwise", "tp2+sp"), ("delayed", "tp2"), ("rowwise", "tp2+sp")])
def test_per_shard_scales_fail(world, batches, recipe, layout):
    """The planted bug (each shard's amax instead of the tensor's) is caught by the check above (delayed
    scaling casts the first step with scale 1 everywhere: the later steps' losses catch it)."""
    row = _row(world, dict(FIELDS, fp8_recipe=recipe), layout, batches, per_shard=True)
    assert max(row.loss / FP8_LAYOUT["loss"], row.grad / FP8_LAYOUT["grad"]) > 3, row


def test_tensorwise_is_torchaos_float8_linear():
    """At TP1 a column layer's three GEMMs are torchao's Float8Linear's (tensorwise, emulated), bitwise."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from megatron_sp.tensor_parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    recipe = fp8_gemms.Fp8Recipe("hybrid", "tensorwise")
    ours = ColumnParallelLinear(
        64, 48, init="normal", bias=False, fp8=fp8_gemms.Fp8Gemms(recipe, fp8_gemms.AmaxGroups(), row=False)
    )
    ours.weight.data.normal_()
    ref = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))
    ref[0].weight.data.copy_(ours.weight.data)
    convert_to_float8_training(ref, config=Float8LinearConfig(emulate=True))
    x = torch.randn(8, 2, 64)
    grad = torch.randn(8, 2, 48) * 1e-3
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), ref(xb)
    ya.backward(grad), yb.backward(grad)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ours.weight.grad, ref[0].weight.grad)


def _two_steps(recipe, row, dtype, hold=False):
    """A TP1 column (or row) FP8 linear, two forward/backward steps in `dtype`: outputs and gradients.
    hold: the weight holds FP8 values with a held scale, as --fp8-param-gather leaves it."""
    from megatron_sp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    gemms = fp8_gemms.Fp8Gemms(fp8_gemms.Fp8Recipe("hybrid", recipe), fp8_gemms.AmaxGroups(), row=row)
    lin = (RowParallelLinear if row else ColumnParallelLinear)(64, 48, init="normal", bias=False, fp8=gemms)
    lin.weight.data.normal_()
    lin = lin.to(dtype)
    if hold:
        scale = fp8_gemms.amax_to_scale(lin.weight.detach().abs().amax().float(), torch.float8_e4m3fn)
        q = fp8_gemms.to_fp8(lin.weight.detach(), scale, torch.float8_e4m3fn)
        lin.weight.data.copy_((q.float() / scale).to(dtype))
        gemms.hold_weight(lin.weight, scale)
    out = []
    for step in range(2):
        x = torch.randn(16, 2, 64, dtype=dtype, requires_grad=True)
        y = lin(x)
        y.backward((torch.randn(16, 2, 48) * 1e-3).to(dtype))
        out += [y.detach(), x.grad, lin.weight.grad.clone()]
        lin.weight.grad = None
    return out


def _cpu_scaled_mm_is_rowwise() -> bool:
    a, b = torch.ones(16, 16).to(torch.float8_e4m3fn), torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize(
    "recipe,hold", [("tensorwise", False), ("delayed", False), ("tensorwise", True), ("rowwise", False)]
)
@pytest.mark.parametrize("row", [False, True], ids=["column", "row"])
def test_cuda_gemm_path_gives_the_emulations_numbers(monkeypatch, recipe, hold, row):
    """The GEMMs a GPU runs (torch._scaled_mm through torchao, fast accumulation in the output GEMM:
    _mm_config's CUDA settings), forced on CPU, where _scaled_mm runs too: in bf16 the tensor-scaled
    recipes give the emulated CPU path's outputs and gradients bit for bit (a held --fp8-param-gather
    weight included), rowwise within bf16's rounding of the same products; so what the CPU tests hold
    holds for that path."""
    if recipe == "rowwise" and not _cpu_scaled_mm_is_rowwise():
        pytest.skip("this torch's CPU _scaled_mm takes only per-tensor scales (torch 2.11's; 2.13's takes rows)")
    calls, scaled_mm = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))
    emulated = _two_steps(recipe, row, torch.bfloat16, hold)
    assert not calls
    real = fp8_gemms._mm_config
    monkeypatch.setattr(fp8_gemms, "_mm_config", lambda device: real(device, emulate=False))
    cuda_path = _two_steps(recipe, row, torch.bfloat16, hold)
    assert len(calls) == 6, len(calls)  # fprop, dgrad and wgrad of each step
    for name, a, b in zip(["y", "dx", "dw"] * 2, emulated, cuda_path):
        if recipe == "rowwise":
            torch.testing.assert_close(b, a, rtol=2**-7, atol=1e-5, msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 1)])
def test_delayed_scaling_rule(algo, margin):
    """Transformer Engine's: cast with the scale of the history so far (1 at first), then record."""
    state = fp8_gemms.DelayedScaling(fp8_gemms.Fp8Recipe("hybrid", "delayed", margin, 3, algo))
    amaxes = [4.0, 0.5, 2.0, 1.0]
    for step, amax in enumerate(amaxes):
        seen = amaxes[max(0, step - 3) : step]  # the history holds the last 3 amaxes before this one
        chosen = (max(seen) if algo == "max" else seen[-1]) if seen else None
        want = 1.0 if chosen is None else 448.0 / chosen / 2**margin
        assert state.current(fp8_gemms.INPUT, "cpu").item() == pytest.approx(want, rel=1e-6)
        state.record([fp8_gemms.INPUT], [torch.tensor(amax)])
    grad = fp8_gemms.DelayedScaling(fp8_gemms.Fp8Recipe("hybrid", "delayed"))
    grad.record([fp8_gemms.GRAD], [torch.tensor(2.0)])
    assert grad.current(fp8_gemms.GRAD, "cpu").item() == 57344.0 / 2  # e5m2's max under hybrid


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(fp8_recipe="blockwise"), "through triton only"),
        (dict(fp8_recipe="custom"), "--fp8-quantizer-factory"),
        (dict(fp8_recipe="delayed", first_last_layers_bf16=True), "Megatron-LM's rule"),
        (dict(fp8_recipe="delayed", recompute_granularity="full"), "record its amaxes twice"),
        (dict(fp8=None, first_last_layers_bf16=True), "needs fp8"),
        (dict(fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_end_in_bf16=3), "[0, num_layers=2]"),
    ],
)
def test_fp8_refusals_are_one_sentence(fields, needle):
    with pytest.raises(ValueError) as err:
        GPTConfig(**{**FIELDS, **fields})
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_delayed_scaling_with_selective_recomputation_records_once():
    """Selective recomputation runs the attention core again, which holds no FP8 GEMM: delayed
    scaling under it records every amax once, as without it (full recomputation is refused)."""
    from megatron_sp.models.gpt import GPTModel

    batch = make_batches(97, 32, 2, 1)[0]
    runs = []
    for recompute in (None, "selective"):
        fields = dict(FIELDS, fp8_recipe="delayed", fp8_amax_history_len=4, recompute_granularity=recompute)
        model = GPTModel(GPTConfig(**fields))
        model(batch.tokens, batch.labels).backward()
        linears = [m for m in model.modules() if getattr(m, "fp8", None) is not None]
        runs.append([m.fp8.delayed.amax_history.clone() for m in linears])
    assert len(runs[0]) == 8 and all(torch.equal(a, b) for a, b in zip(*runs))
    assert all(int((h[:, 0] > 0).sum()) == 1 for h in runs[1])  # one forward recorded, not two


def test_first_last_layers_bf16_keeps_those_layers_out_of_fp8():
    from megatron_sp.models.gpt import GPTModel

    cfg = GPTConfig(**{**FIELDS, "num_layers": 3, "fp8_recipe": "tensorwise", "first_last_layers_bf16": True})
    model = GPTModel(cfg)
    in_fp8 = [layer.attn.qkv.fp8 is not None and layer.mlp.fc2.fp8 is not None for layer in model.layers]
    assert in_fp8 == [False, True, False]


def train_losses(argv, iters, log) -> list:
    from launch_helpers import losses

    from megatron_sp.training import pretrain

    assert pretrain.main(argv + ["--train-iters", str(iters), "--log-jsonl", str(log)]) == 0
    return losses(log)


def test_delayed_scaling_resumes_exactly_and_drifts_within_tolerance(tmp_path, monkeypatch, capsys):
    """The program with --bf16 --fp8-format hybrid (delayed, history 4, max). The amax histories are
    checkpointed (fp8_rank<r>.pt): 3 iterations, a save, 3 more from it log the losses of 6 straight,
    bit for bit; resumed without the histories the losses differ. The 6 losses stay within
    FP8_VS_BF16_RTOL of --bf16 alone (README; bench/fp8_drift.py measures 50 iterations of the
    default job)."""
    import glob
    import os
    import shutil

    from launch_helpers import TINY

    monkeypatch.chdir(tmp_path)
    fp8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
    run = TINY + ["--bf16", "--global-batch-size", "4", "--lr-decay-iters", "6"]
    bf16 = train_losses(run, 6, tmp_path / "bf16.jsonl")
    run += fp8
    ckpt = tmp_path / "ckpt"

    def train(iters, log, *extra):
        return train_losses(run + list(extra), iters, tmp_path / log)

    straight = train(6, "straight.jsonl")
    assert "bf16 + FP8 GEMMs (hybrid delayed, torchao)" in capsys.readouterr().out  # the start-up line
    drift = [abs(a - b) / b for a, b in zip(straight, bf16)]
    print("fp8 vs bf16 drift", drift)
    assert 0 < max(drift) <= FP8_VS_BF16_RTOL, drift
    train(3, "first.jsonl", "--save", str(ckpt))
    shutil.copytree(ckpt, tmp_path / "bare")
    assert train(6, "resumed.jsonl", "--load", str(ckpt)) == straight[3:]
    for f in glob.glob(str(tmp_path / "bare" / "iter_*" / "fp8_rank*.pt")):
        os.remove(f)
    assert train(6, "bare.jsonl", "--load", str(tmp_path / "bare")) != straight[3:]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--torch-compile"], "does not run with --torch-compile"),
        (["--fp8-dot-product-attention"], "this FP8 option is not implemented"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"], "with --tp-comm-overlap"),
    ],
)
def test_program_refusals_are_one_sentence(flags, needle):
    from megatron_sp.training.arguments import ArgumentError, parse_args
    from megatron_sp.training.pretrain import check_inputs

    argv = ["--mock-data", "--device", "cpu", "--fp8-format", "hybrid"] + flags
    with pytest.raises((ArgumentError, ValueError)) as err:
        check_inputs(parse_args(argv, world_size=2))
    assert needle in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_without_torchao_fp8_is_one_sentence(monkeypatch):
    import importlib.util

    from megatron_sp.training.arguments import ArgumentError, parse_args

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    with pytest.raises(ArgumentError, match=r"needs the torchao package, .*torchao==0\.18\.0"):
        parse_args(["--mock-data", "--fp8-format", "e4m3"])


def test_moe_experts_stay_out_of_fp8_and_the_start_up_line_says_so():
    """The shared expert is a dense MLP of column/row linears (FP8); the routed experts' grouped GEMMs
    keep the parameters' dtype (no FP8 grouped GEMM runs here), and the start-up line names that."""
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.training.trainer_report import _precision_words

    moe = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_shared_expert_intermediate_size=48)
    cfg = GPTConfig(**{**FIELDS, "fp8_recipe": "tensorwise", **moe})
    mlp = GPTModel(cfg).layers[0].mlp
    assert mlp.shared_experts.fc1.fp8 is not None and mlp.shared_experts.fc2.fp8 is not None
    assert not any(hasattr(m, "fp8") and m.fp8 is not None for m in mlp.experts.modules())
    assert _precision_words(cfg).endswith(f"; MoE experts' grouped GEMMs in {cfg.params_dtype}, not FP8")
    assert "MoE" not in _precision_words(GPTConfig(**{**FIELDS, "fp8_recipe": "tensorwise"}))

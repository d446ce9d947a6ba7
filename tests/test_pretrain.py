"""pretrain_gpt_sp.py end to end on gloo: the same tiny model from the same seed on the same data with
dropout on trains to the same per-iteration losses at TP=1, TP=2+SP, TP=2 × DP=2, TP=4+SP (with
--tp-comm-overlap: the flag through the command line), PP=2 × DP=2 interleaved and PP=4 with the
interleaved zero-bubble schedule (both from layout strings; PP=2 × TP=2+SP and PP=2 × CP=2 under FSDP2
in the program: tests/test_checkpoint.py)."""

import pytest
from launch_helpers import TINY, check, losses, torchrun

LAYOUTS = {
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "tp4_sp_overlap": (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--tp-comm-overlap"]),
    # PP2 × DP2, interleaved: 2 chunks per rank from Megatron's layout string over TINY's 2 layers
    "pp2_dp2_interleaved": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|t|t|L"]),
    # PP4 over the 2 layers: an embedding-only and a loss-only stage, Megatron's layout string, zero bubble
    "pp4_layout_izb": (
        4,
        ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "E|t|t|L"]
        + ["--pipeline-schedule", "interleaved-zb"],
    ),
}
ITERS = ["--train-iters", "20", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.fixture(scope="module")
def serial_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1")
    check(torchrun(1, TINY + ITERS + ["--log-jsonl", str(out / "log.jsonl")], cwd=out))
    return losses(out / "log.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_match_serial_losses(serial_losses, layout, tmp_path):
    nproc, flags = LAYOUTS[layout]
    check(torchrun(nproc, TINY + ITERS + flags + ["--log-jsonl", str(tmp_path / "log.jsonl")], cwd=tmp_path))
    got = losses(tmp_path / "log.jsonl")
    assert len(got) == len(serial_losses) == 20
    for it, (a, b) in enumerate(zip(got, serial_losses), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), (layout, it, a, b)
    assert serial_losses[-1] < serial_losses[0]  # it does train


# bf16 tolerances (README "Precision and memory"), from bench/precision_drift.py over 50 iterations of this
# model: layouts differ from bf16 TP=1 by <= 1.7e-4 relative, bf16 from fp32 by <= 7.6e-4.
BF16_LAYOUT_RTOL, BF16_VS_FP32_RTOL = 1e-3, 5e-3


@pytest.mark.slow
def test_bf16_and_fp16_train_close_to_fp32(serial_losses, tmp_path):
    """--bf16 at TP=2+SP follows --bf16 at TP=1 within BF16_LAYOUT_RTOL, which follows fp32 (same layout)
    within BF16_VS_FP32_RTOL, and so does --fp16 (from a 2^16 loss scale: Megatron's 2^32 default skips
    about 17 overflowing steps on the way down, more than this run has). 5 iterations on the
    20-iteration learning-rate schedule."""
    tp2_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    got = {}
    for name, nproc, flags in (
        ("bf16_tp1", 1, ["--bf16"]),
        ("bf16", 2, tp2_sp + ["--bf16"]),
        ("fp16", 2, tp2_sp + ["--fp16", "--initial-loss-scale", "65536"]),
    ):
        log = tmp_path / f"{name}.jsonl"
        schedule = ["--train-iters", "5", "--lr-decay-iters", "20"]
        check(torchrun(nproc, TINY + schedule + ITERS[2:] + flags + ["--log-jsonl", str(log)], cwd=tmp_path))
        got[name] = losses(log)
        assert len(got[name]) == 5
    close = lambda a, b, rtol: all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))  # noqa: E731
    assert close(got["bf16"], got["bf16_tp1"], BF16_LAYOUT_RTOL), got
    assert close(got["bf16_tp1"], serial_losses[:5], BF16_VS_FP32_RTOL), (got, serial_losses[:5])
    assert got["bf16_tp1"] != serial_losses[:5]  # it did run in bf16
    assert close(got["fp16"], serial_losses[:5], BF16_VS_FP32_RTOL), (got, serial_losses[:5])

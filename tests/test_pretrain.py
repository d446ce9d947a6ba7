"""pretrain_gpt_sp.py end to end on gloo: the same tiny model from the same seed on the same data with
dropout on trains to the same per-iteration losses at TP=1, TP=2+SP, TP=2 × DP=2 and TP=4+SP (the last
with --tp-comm-overlap: the flag through the command line)."""

import pytest
from launch_helpers import TINY, check, losses, torchrun

LAYOUTS = {
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2_dp2": (4, ["--tensor-model-parallel-size", "2"]),
    "tp4_sp_overlap": (4, ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--tp-comm-overlap"]),
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


@pytest.mark.slow
def test_bf16_and_fp16_train_close_to_fp32(serial_losses, tmp_path):
    for flag in ("--bf16", "--fp16"):
        log = tmp_path / f"{flag[2:]}.jsonl"
        check(
            torchrun(
                2,
                TINY
                + ["--train-iters", "5"]
                + ITERS[2:]
                + ["--tensor-model-parallel-size", "2", "--sequence-parallel", flag, "--log-jsonl", str(log)],
                cwd=tmp_path,
            )
        )
        got = losses(log)
        assert len(got) == 5
        for a, b in zip(got, serial_losses):
            assert abs(a - b) < 0.05 * b, (flag, got, serial_losses[:5])

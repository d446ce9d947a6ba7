"""Context parallelism and GQA checkpoints in the real program (torchrun, gloo), with a Llama of 2
key/value heads and dropout on: a TP=2 × CP=2 ring-attention run logs the losses of a single-process
run; its checkpoint (key/value heads split over 2 TP ranks) resumes at TP=1 × CP=2 with Ulysses
(another CP size, TP size and attention algorithm) and at TP=4 + SP (each key/value head held in
copies by 2 ranks), both on the uninterrupted loss curve, optimizer state included."""

import pytest
from launch_helpers import TINY, check, losses, torchrun

RUN = TINY + [
    "--train-iters",
    "8",
    "--global-batch-size",
    "4",
    "--model",
    "llama",
    "--group-query-attention",
    "--num-query-groups",
    "2",
]


@pytest.mark.slow
def test_context_parallel_training_and_gqa_resharded_resume(tmp_path):
    check(torchrun(1, RUN + ["--log-jsonl", str(tmp_path / "serial.jsonl")], cwd=tmp_path))
    cp = [
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--context-parallel-size",
        "2",
        "--cp-comm-type",
        "p2p",
    ]
    out = check(
        torchrun(
            4,
            RUN
            + cp
            + ["--save", str(tmp_path / "ckpt"), "--exit-interval", "4", "--log-jsonl", str(tmp_path / "cp.jsonl")],
            cwd=tmp_path,
        )
    )
    assert "TP 2 × CP 2 (p2p) × DP 1" in out.stdout
    serial = losses(tmp_path / "serial.jsonl")
    first = losses(tmp_path / "cp.jsonl")
    assert len(serial) == 8 and len(first) == 4
    for got, want in zip(first, serial):
        assert abs(got - want) <= 1e-5 * abs(want), (first, serial)
    ulysses = ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]
    check(
        torchrun(
            2,
            RUN + ulysses + ["--load", str(tmp_path / "ckpt"), "--log-jsonl", str(tmp_path / "r.jsonl")],
            cwd=tmp_path,
        )
    )
    tp4 = ["--tensor-model-parallel-size", "4", "--sequence-parallel"]
    check(
        torchrun(
            4, RUN + tp4 + ["--load", str(tmp_path / "ckpt"), "--log-jsonl", str(tmp_path / "r4.jsonl")], cwd=tmp_path
        )
    )
    for name in ("r.jsonl", "r4.jsonl"):
        resumed = losses(tmp_path / name)
        assert len(resumed) == 4
        for got, want in zip(resumed, serial[4:]):
            assert abs(got - want) <= 1e-5 * abs(want), (name, resumed, serial[4:])

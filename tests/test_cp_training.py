"""Context parallelism and GQA checkpoints in the real program (torchrun, gloo), with a Llama of 2
key/value heads, a sliding window of 8 tokens on every other layer, learnt attention sinks and
dropout on: a TP=2+SP × CP=2 run whose layers are ring attention and all-gather CP
(--cp-comm-type p2p allgather) logs the losses of a single-process run; its checkpoint (key/value
heads and sinks split over 2 TP ranks) resumes at TP=1 × CP=4 with a2a+p2p (2 × 2) and Ulysses
layers (another CP size, TP size and both remaining types) and at TP=4 + SP (each key/value head held
in copies by 2 ranks, the sinks over 4), both on the uninterrupted loss curve, optimizer state
included. So every CP type runs in the program, each on the serial losses, in the runs the resume
needs anyway (a program run takes one type per layer, not one per run)."""

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
    "--window-size",
    "8,0",
    "--window-attn-skip-freq",
    "2",
    "--softmax-type",
    "learnable",
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
        "allgather",
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
    assert "TP 2 × CP 2 (p2p allgather) × DP 1" in out.stdout
    serial = losses(tmp_path / "serial.jsonl")
    first = losses(tmp_path / "cp.jsonl")
    assert len(serial) == 8 and len(first) == 4
    for got, want in zip(first, serial):
        assert abs(got - want) <= 1e-5 * abs(want), (first, serial)
    levels = ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "a2a"]
    levels += ["--hierarchical-context-parallel-sizes", "2", "2"]
    check(
        torchrun(
            4,
            RUN + levels + ["--load", str(tmp_path / "ckpt"), "--log-jsonl", str(tmp_path / "r.jsonl")],
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

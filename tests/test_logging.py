"""What a run reports: Megatron-style lines, TensorBoard event files, the JSON-lines log, the PNG, and
evaluation on the validation split."""

import json

from launch_helpers import TINY

from megatron_sp.training import pretrain


def test_logs_tensorboard_jsonl_and_loss_curve(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, log, png = tmp_path / "tb", tmp_path / "log.jsonl", tmp_path / "curve.png"
    argv = TINY + [
        "--train-iters",
        "6",
        "--log-interval",
        "3",
        "--eval-interval",
        "3",
        "--eval-iters",
        "2",
        "--tensorboard-dir",
        str(tb),
        "--log-jsonl",
        str(log),
        "--loss-curve",
        str(png),
    ]
    assert pretrain.main(argv) == 0
    out = capsys.readouterr().out
    assert "iteration        3/       6" in out and "lm loss:" in out and "MFU:" in out
    assert "validation loss at iteration 6" in out and "lm loss PPL" in out
    rows = [json.loads(line) for line in open(log)]
    train = [r for r in rows if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [1, 3, 6]
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "tflops", "mfu"):
        assert all(key in r for r in train), key
    assert any("validation_lm_loss" in r for r in rows)
    acc = EventAccumulator(str(tb))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert "train/lm_loss" in scalars and "validation/lm_loss" in scalars
    assert {"lm loss", "learning-rate", "batch-size", "grad-norm", "lm loss validation"} <= set(scalars)  # Megatron's
    by_step = {e.step: e.value for e in acc.Scalars("train/lm_loss")}  # every --tensorboard-log-interval (1)
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    assert [by_step[r["iteration"]] for r in train] == [r["lm_loss"] for r in train]
    assert [e.value for e in acc.Scalars("lm loss")] == [by_step[i] for i in range(1, 7)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

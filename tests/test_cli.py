"""Bad input to pretrain_gpt_sp.py: one clear sentence on stderr, exit code 2, no traceback, before any
heavy work (these run in-process: main() returns before starting a process group)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from launch_helpers import PROGRAM, TINY

from megatron_sp.data import write_documents
from megatron_sp.training import pretrain


def _run(capsys, argv, monkeypatch=None, world=None):
    if world is not None:  # as torchrun would start rank 0
        for key, value in dict(
            WORLD_SIZE=world, RANK=0, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500
        ).items():
            monkeypatch.setenv(key, str(value))
    code = pretrain.main(TINY + ["--train-iters", "2"] + argv)
    err = capsys.readouterr().err.strip()
    return code, err


def _dataset(tmp_path, max_id=200, name="d"):
    prefix = str(tmp_path / name)
    docs = [np.arange(i, i + 50) % (max_id + 1) for i in range(20)]
    docs[0][0] = max_id
    write_documents(prefix, docs, vocab_size=max_id + 1)
    return prefix


@pytest.fixture
def data(tmp_path):
    return _dataset(tmp_path)


CASES = {
    "missing files": (lambda d, t: ["--data-path", str(t / "nope")], None, "nope"),
    "truncated idx": (
        lambda d, t: (
            _truncate(d + ".idx") or ["--data-path", d, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
        ),
        None,
        ".idx",
    ),
    "truncated bin": (
        lambda d, t: (
            _truncate(d + ".bin") or ["--data-path", d, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
        ),
        None,
        ".bin",
    ),
    "foreign idx": (lambda d, t: _clobber(d + ".idx") or ["--data-path", d], None, ".idx"),
    "data vocab larger": (
        lambda d, t: ["--data-path", d, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
        None,
        "vocab",
    ),
    "tokenizer missing": (
        lambda d, t: ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(t / "tok.json")],
        None,
        "tok.json",
    ),
    "batch not divisible": (
        lambda d, t: ["--tensor-model-parallel-size", "2", "--micro-batch-size", "3", "--global-batch-size", "8"],
        4,
        "global-batch-size",
    ),
    "world not divisible": (lambda d, t: ["--tensor-model-parallel-size", "2"], 3, "tensor-model-parallel-size"),
    "heads vs hidden": (lambda d, t: ["--hidden-size", "66"], None, "--hidden-size (66)"),
    "heads vs tp": (
        lambda d, t: ["--tensor-model-parallel-size", "8", "--global-batch-size", "2"],
        8,
        "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size",
    ),
    "seq vs tp under sp": (
        lambda d, t: [
            "--tensor-model-parallel-size",
            "4",
            "--sequence-parallel",
            "--seq-length",
            "34",
            "--global-batch-size",
            "2",
        ],
        4,
        "--seq-length (34)",
    ),
    "tp comm overlap without sp": (
        lambda d, t: ["--tensor-model-parallel-size", "2", "--tp-comm-overlap"],
        2,
        "--tp-comm-overlap needs --sequence-parallel",
    ),
    "dropout range": (lambda d, t: ["--hidden-dropout", "1.5"], None, "--hidden-dropout must be"),
    "unknown flag": (lambda d, t: ["--no-such-flag"], None, "--no-such-flag"),
    "compile without fused ops": (lambda d, t: ["--torch-compile", "--no-fused-kernels"], None, "--torch-compile"),
    "compile with tp comm overlap": (
        lambda d, t: [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--tp-comm-overlap",
            "--torch-compile",
        ],
        2,
        "--tp-comm-overlap",
    ),
}


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 16)


def _clobber(path):
    with open(path, "r+b") as f:
        f.write(b"NOTMEGA!")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_sentence(case, data, tmp_path, capsys, monkeypatch):
    make_argv, world, needle = CASES[case]
    code, err = _run(capsys, make_argv(data, tmp_path), monkeypatch, world)
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pretrain_gpt_sp.py: error:") and needle in err, err
    assert "Traceback" not in err


def test_cli_exit_code_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, PROGRAM, "--hidden-size", "66"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "--hidden-size" in proc.stderr


def test_non_finite_loss_stops_naming_iteration(capsys, monkeypatch, tmp_path):
    from megatron_sp.training import loop

    real = loop.forward_loss
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss = real(model, batch)
        return loss * float("nan") if calls["n"] > 8 else loss  # 4 micro-batches per step

    monkeypatch.setattr(loop, "forward_loss", poisoned)
    code = pretrain.main(TINY + ["--train-iters", "5", "--log-jsonl", str(tmp_path / "log.jsonl")])
    err = capsys.readouterr().err
    assert code == 1 and "iteration 3" in err, err


# What a bare GPU machine may lack (only torch there): a None entry in sys.modules makes `import x`
# raise ImportError and importlib.util.find_spec(x) return None, as for an absent package.
ABSENT = ("numpy", "megatron", "matplotlib", "tensorboard", "tqdm")


def _run_bare(tmp_path, argv):
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({ABSENT!r})); "
        "from megatron_sp.training import pretrain; sys.exit(pretrain.main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )


def test_mock_data_runs_with_torch_alone(tmp_path):
    """--mock-data (speed runs, bench/gpu_check.sh) trains with nothing but torch installed: no
    numpy, megatron-core, matplotlib, tensorboard or tqdm; the implicit loss-curve PNG is skipped
    with a notice, and flags that need a missing package are refused at start-up."""
    argv = TINY + ["--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]
    proc = _run_bare(tmp_path, argv + ["--log-jsonl", str(tmp_path / "log.jsonl")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "iteration        2/       2" in proc.stdout
    assert "no loss curve" in proc.stdout and "matplotlib is not installed" in proc.stdout
    assert (tmp_path / "log.jsonl").exists() and not (tmp_path / "log_loss.png").exists()
    for flag, package in (("--loss-curve", "matplotlib"), ("--tensorboard-dir", "tensorboard")):
        proc = _run_bare(tmp_path, argv + [flag, str(tmp_path / "out")])
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"{flag} needs the {package} package" in proc.stderr
        assert "Traceback" not in proc.stderr

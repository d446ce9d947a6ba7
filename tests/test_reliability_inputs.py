"""Issue 10, in one process: bad inputs end in one sentence and exit 2 before the model is built,
damaged or malicious checkpoint files are refused without running anything from them, a --save that
is read-only, too small or fills up mid-run is reported (2 at start-up, 1 while running), fp16 loss
scale underflow is caught, MFU needs a known peak, preprocess_data rejects non-text fields."""

import json
import math
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from launch_helpers import REPO

from megatron_sp import checkpointing
from megatron_sp.checkpointing import safe_dcp
from megatron_sp.training import pretrain

TINY = [
    "--device",
    "cpu",
    "--num-layers",
    "1",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "1",
    "--lr-warmup-iters",
    "1",
    "--no-progress-bar",
    "--mock-data",
]


def run(capsys, argv):
    """main() in this process: (exit code, stderr stripped, stdout)."""
    code = pretrain.main(TINY + argv)
    out = capsys.readouterr()
    return code, out.err.strip(), out.out


def assert_one_sentence(code, err, want_code, needle):
    assert code == want_code, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pretrain_gpt_sp.py: error:") and needle in err, err
    assert "Traceback" not in err


# ---- flags: refused by validate() before anything is built ----------------------------------------
FLAG_CASES = {
    "lr nan": (["--lr", "nan"], "--lr must be"),
    "lr inf": (["--lr", "inf"], "--lr must be"),
    "adam-beta1 1": (["--adam-beta1", "1.0"], "--adam-beta1 must be in [0, 1)"),
    "adam-beta2 >1": (["--adam-beta2", "1.5"], "--adam-beta2"),
    "loss scale 0": (["--fp16", "--initial-loss-scale", "0"], "--initial-loss-scale must be"),
    "loss scale <0": (["--fp16", "--initial-loss-scale", "-4"], "--initial-loss-scale must be"),
    "weight decay <0": (["--weight-decay", "-0.1"], "--weight-decay must be"),
    "eval-iters <0": (["--eval-iters", "-3"], "--eval-iters must be >= 0 (0: no evaluation)"),
    "timeout 0": (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes"),
    "peak tflops nan": (["--peak-tflops", "nan"], "--peak-tflops"),
    "bf16 and fp16": (["--bf16", "--fp16"], "--fp16: not allowed with argument --bf16"),
    "fp32 residual in fp32": (["--fp32-residual-connection"], "--fp32-residual-connection needs --bf16 or --fp16"),
    "loss scale in fp32": (["--loss-scale", "1024"], "--loss-scale needs --fp16 or --bf16"),
    "static loss scale 0": (["--fp16", "--loss-scale", "0"], "--loss-scale must be"),
    "bf16 grads with fp16": (["--fp16", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    "bf16 grads and fp32 grads": (
        ["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"],
        "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict",
    ),
    "hysteresis 0": (["--fp16", "--hysteresis", "0"], "--hysteresis must be"),
    "loss scale window 0.5": (["--fp16", "--loss-scale-window", "0.5"], "--loss-scale-window must be"),
    "fsdp2 and distributed optimizer": (
        ["--use-torch-fsdp2", "--use-distributed-optimizer"],
        "--use-torch-fsdp2 cannot be combined with --use-distributed-optimizer",
    ),
    "fsdp2 and bf16 grads": (
        ["--use-torch-fsdp2", "--bf16", "--grad-reduce-in-bf16"],
        "--use-torch-fsdp2 cannot be combined with --grad-reduce-in-bf16",
    ),
    "fsdp2 and torch compile": (["--use-torch-fsdp2", "--torch-compile"], "with --torch-compile"),
    "fsdp2 with one replica": (["--use-torch-fsdp2"], "--use-torch-fsdp2 shards over the data- and context-parallel"),
}


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_bad_flag_is_one_sentence(case, capsys):
    argv, needle = FLAG_CASES[case]
    code, err, _ = run(capsys, ["--train-iters", "2"] + argv)
    assert_one_sentence(code, err, 2, needle)


# ---- data: split, blend weights, empty train split (checked before the model is built) --------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from megatron_sp.data import write_documents

    prefix = str(tmp_path_factory.mktemp("data") / "d")
    write_documents(prefix, [list(range(i, i + 40)) for i in range(10)], vocab_size=257)
    return prefix


def _no_model(monkeypatch):
    """Fail loudly if a check came too late: building the model means the input was not checked first."""

    def refuse(*a, **k):
        raise AssertionError("the model was built before the input was checked")

    monkeypatch.setattr(pretrain.Trainer, "__init__", refuse)


DATA_CASES = {
    "split 0,1,0": (lambda d: ["--data-path", d, "--split", "0,1,0"], "gives the train split no share"),
    "split nan": (lambda d: ["--data-path", d, "--split", "nan,1,1"], "--split"),
    "embedded corpus split 0,1,0": (lambda d: ["--split", "0,1,0"], "gives the train split no share"),
    "blend weight nan": (lambda d: ["--data-path", "nan", d, "1", d], "positive finite"),
    "blend weight inf": (lambda d: ["--data-path", "inf", d, "1", d], "positive finite"),
    "empty train split": (lambda d: ["--data-path", d, "--split", "1,1000,0"], "train split"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data_input_before_model_build(case, dataset, capsys, monkeypatch):
    make_argv, needle = DATA_CASES[case]
    _no_model(monkeypatch)
    code = pretrain.main([a for a in TINY if a != "--mock-data"] + ["--train-iters", "2"] + make_argv(dataset))
    err = capsys.readouterr().err.strip()
    assert_one_sentence(code, err, 2, needle)


def test_index_cache_pickle_is_refused_not_run(dataset, tmp_path):
    """megatron-core loads its index cache with allow_pickle=True; a pickle planted there must not run."""
    from megatron_sp.data import DataError, build_gpt_datasets, build_tokenizer

    tok, cache = build_tokenizer("ByteLevelTokenizer"), tmp_path / "cache"
    build = dict(
        data_path=[dataset],
        split="1,0,0",
        seq_length=16,
        seed=1,
        tokenizer=tok,
        train_samples=8,
        valid_samples=0,
        test_samples=0,
        cache_dir=str(cache),
    )
    build_gpt_datasets(**build)  # fills the cache
    planted = sorted(cache.rglob("*document_index.npy"))[0]
    marker = tmp_path / "pwned"
    planted.write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(DataError, match="not a plain numpy array"):
        build_gpt_datasets(**build)
    assert not marker.exists()


class _Payload:
    """Unpickling this creates a directory: proof that a loader ran code from a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


# ---- checkpoints: damaged, misplaced, malicious ---------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint directory (iterations 2 and 4) and the JSON log of the run that wrote it."""
    root = tmp_path_factory.mktemp("saved")
    log = root / "log.jsonl"
    assert (
        pretrain.main(
            TINY + ["--train-iters", "4", "--save-interval", "2", "--save", str(root / "ckpt"), "--log-jsonl", str(log)]
        )
        == 0
    )
    return root


def _rewrite_record(ckpt, name):
    """An attacker who can write the directory can also rewrite the integrity record."""
    meta_path = ckpt / "iter_0000004" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["files"][name] = safe_dcp.file_digest(str(ckpt / "iter_0000004" / name))
    meta_path.write_text(json.dumps(meta))


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_meta(ckpt, **changes):
    meta_path = ckpt / "iter_0000004" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta.update(changes)
    meta_path.write_text(json.dumps(meta))


def _edit_config(ckpt, **changes):
    meta = json.loads((ckpt / "iter_0000004" / "metadata.json").read_text())
    _edit_meta(ckpt, config={**meta["config"], **changes})


def _plant_metadata(ckpt, marker):
    (ckpt / "iter_0000004" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rewrite_record(ckpt, ".metadata")


def _plant_rng(ckpt, marker):
    torch.save({"torch": _Payload(marker)}, str(ckpt / "iter_0000004" / "rng_rank0.pt"))
    _rewrite_record(ckpt, "rng_rank0.pt")


I4 = "iter_0000004"
# name: (damage(ckpt dir, marker path), extra flags, needle in the message, exit code)
CHECKPOINT_CASES = {
    "load is a file": (lambda c, m: None, ["--load", "{ckpt}/latest_checkpointed_iteration.txt"], "is a file", 2),
    "load is one iteration": (lambda c, m: None, ["--load", "{ckpt}/" + I4], "is one checkpoint", 2),
    "load does not exist": (lambda c, m: shutil.rmtree(c), ["--load", "{ckpt}"], "does not exist", 2),
    "load has no marker": (
        lambda c, m: os.remove(c / "latest_checkpointed_iteration.txt"),
        ["--load", "{ckpt}"],
        "write the iteration of iter_0000004",
        2,
    ),
    "marker not utf-8": (
        lambda c, m: (c / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe4"),
        ["--load", "{ckpt}"],
        "does not hold an iteration number",
        2,
    ),
    "marker names a missing iteration": (
        lambda c, m: (c / "latest_checkpointed_iteration.txt").write_text("6"),
        ["--load", "{ckpt}"],
        "missing or incomplete",
        2,
    ),
    "metadata.json truncated": (
        lambda c, m: _truncate(c / I4 / "metadata.json"),
        ["--load", "{ckpt}"],
        "not valid JSON",
        2,
    ),
    "metadata.json not ours": (
        lambda c, m: _edit_meta(c, train_state="x"),
        ["--load", "{ckpt}"],
        "lacks iteration/train_state",
        2,
    ),
    "distcp truncated": (lambda c, m: _truncate(c / I4 / "__0_0.distcp"), ["--load", "{ckpt}"], "truncated", 2),
    ".metadata truncated": (lambda c, m: _truncate(c / I4 / ".metadata"), ["--load", "{ckpt}"], "truncated", 2),
    "rng truncated": (lambda c, m: _truncate(c / I4 / "rng_rank0.pt"), ["--load", "{ckpt}"], "truncated", 2),
    "distcp corrupted in place": (
        lambda c, m: _flip(c / I4 / "__0_0.distcp"),
        ["--load", "{ckpt}"],
        "does not match the sha256",
        2,
    ),
    # without the record (older checkpoints) a flipped byte loads silently; a truncated file still fails
    "distcp truncated, no record": (
        lambda c, m: (_truncate(c / I4 / "__0_0.distcp"), _edit_meta(c, files=None)),
        ["--load", "{ckpt}"],
        "which holds",
        2,
    ),
    ".metadata garbage, no record": (
        lambda c, m: ((c / I4 / ".metadata").write_bytes(b"\x80\x05garbage"), _edit_meta(c, files=None)),
        ["--load", "{ckpt}"],
        "not a readable DCP index",
        2,
    ),
    ".metadata runs code": (lambda c, m: _plant_metadata(c, m), ["--load", "{ckpt}"], "refusing to unpickle", 2),
    "rng runs code": (lambda c, m: _plant_rng(c, m), ["--load", "{ckpt}"], "not a readable RNG state", 2),
    "other model flags": (lambda c, m: None, ["--load", "{ckpt}", "--hidden-size", "64"], "hidden_size", 2),
    # issue 21: hostile files; nothing outside --load is read, nothing blocks
    "marker is a FIFO": (
        lambda c, m: (
            os.remove(c / "latest_checkpointed_iteration.txt"),
            os.mkfifo(c / "latest_checkpointed_iteration.txt"),
        ),
        ["--load", "{ckpt}"],
        "regular file",
        2,
    ),
    "metadata.json nested 10^5 deep": (
        lambda c, m: (c / I4 / "metadata.json").write_text("[" * 100_000 + "]" * 100_000),
        ["--load", "{ckpt}"],
        "nested too deeply",
        2,
    ),
    "record names a file outside": (
        lambda c, m: _edit_meta(c, files={"../../x": {"size": 1, "sha256": "0" * 64}}),
        ["--load", "{ckpt}"],
        "outside its directory",
        2,
    ),
    "shard linked outside": (
        lambda c, m: _link_out(c / I4 / "__0_0.distcp", m),
        ["--load", "{ckpt}"],
        "leads outside",
        2,
    ),
    "checkpoint linked outside": (lambda c, m: _link_out(c / I4, m), ["--load", "{ckpt}"], "leads outside", 2),
    # issue 39: each value read from metadata.json is checked for type and range (was: a TypeError on rank 0)
    "pp size a string": (
        lambda c, m: _edit_meta(c, pipeline_model_parallel_size="2"),
        ["--load", "{ckpt}"],
        "metadata.json has pipeline_model_parallel_size = '2', which must be a positive integer",
        2,
    ),
    "dp size null": (
        lambda c, m: _edit_meta(c, data_parallel_size=None),
        ["--load", "{ckpt}"],
        "has data_parallel_size = None, which must be a positive integer",
        2,
    ),
    "loss scale nan": (
        lambda c, m: _edit_meta(c, loss_scale={"scale": float("nan")}),
        ["--load", "{ckpt}"],
        "has loss_scale.scale = nan, which must be a finite positive number",
        2,
    ),
    "config field a string": (
        lambda c, m: _edit_config(c, hidden_size="32"),
        ["--load", "{ckpt}"],
        "has config.hidden_size = '32', which must be an integer",
        2,
    ),
}


def _link_out(path, marker):
    """`path` moved beside the marker (outside the checkpoint) and replaced by a link to it."""
    outside = os.path.join(os.path.dirname(marker), "outside_" + path.name)
    shutil.move(str(path), outside)
    os.symlink(outside, str(path))


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_bad_checkpoint_is_one_sentence(case, saved, tmp_path, capsys):
    damage, flags, needle, want = CHECKPOINT_CASES[case]
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    shutil.copytree(saved / "ckpt", ckpt)
    damage(ckpt, str(marker))
    code, err, _ = run(capsys, ["--train-iters", "6"] + [f.format(ckpt=ckpt) for f in flags])
    assert_one_sentence(code, err, want, needle)
    assert not marker.exists(), "a checkpoint file ran code"


def test_load_equal_to_save_may_be_missing_or_leftovers(saved, tmp_path, capsys):
    """Megatron's `--save X --load X` first submission: missing, empty or a killed save's leftovers."""
    fresh = tmp_path / "fresh"
    code, err, out = run(capsys, ["--train-iters", "1", "--save", str(fresh), "--load", str(fresh)])
    assert code == 0 and "starting from scratch" in out, err
    leftovers = tmp_path / "leftovers"
    (leftovers / "iter_0000002.tmp").mkdir(parents=True)
    code, err, out = run(capsys, ["--train-iters", "1", "--save", str(leftovers), "--load", str(leftovers)])
    assert code == 0 and "starting from scratch" in out, err


def test_every_file_of_a_save_has_one_mode(saved):
    """The marker, metadata.json, DCP's shards and index, the RNG files: all 0o666 less the umask (was: the
    marker 0600 while the rest were 0644, so a group that reads the checkpoint could not tell it is a run's)."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {}
    for directory, _, names in os.walk(saved / "ckpt"):
        modes.update({os.path.join(directory, n): os.stat(os.path.join(directory, n)).st_mode & 0o777 for n in names})
    assert any(p.endswith("latest_checkpointed_iteration.txt") for p in modes) and len(modes) > 4
    assert {oct(m) for m in modes.values()} == {oct(0o666 & ~umask)}, {p: oct(m) for p, m in modes.items()}


# ---- one run per --save (issue 39) -------------------------------------------------------------------
HOLD_LOCK = """
import fcntl, json, os, socket, sys, time
fd = os.open(os.path.join(sys.argv[1], ".megatron_sp.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as checkpointing/locks.py's RunLock, without importing torch
os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode())
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_run_on_the_same_save_is_refused_naming_the_holder(tmp_path, capsys):
    """Was: both runs trained and exited 0, each iter_N of one silently replacing the other's."""
    save = tmp_path / "save"
    save.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(save)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err, _ = run(capsys, ["--train-iters", "1", "--save", str(save)])
        assert_one_sentence(code, err, 2, f"--save {save} is in use by another run (pid {holder.pid} on host")
        assert not [n for n in os.listdir(save) if n.startswith("iter_")]
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its lock died with it; its note is said to be stale, and the run trains
    code, err, out = run(capsys, ["--train-iters", "1", "--save", str(save)])
    assert code == 0, err
    assert f"took over the stale lock of a run that ended without releasing it (pid {holder.pid}" in out
    assert (save / ".megatron_sp.lock").read_text() == ""  # a clean exit leaves no note


def test_retention_keeps_the_checkpoint_being_read(tmp_path):
    """Was: a reader of iter_N while its run retired N failed with DCP's tracebacks and "damaged"."""
    from megatron_sp.checkpointing import locks, paths

    for it in (2, 3, 4):
        (tmp_path / f"iter_000000{it}").mkdir()
        (tmp_path / f"iter_000000{it}" / "metadata.json").write_text("{}")
    reading = locks.Reading(str(tmp_path / "iter_0000003"))
    assert reading.acquire()
    assert paths.drop_unretained(str(tmp_path), latest=4, interval=100) == [3]  # 2 retired, 3 being read
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004"]
    reading.release()
    assert paths.drop_unretained(str(tmp_path), latest=4, interval=100) == []
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004"]  # the latest always stays
    assert not locks.Reading(str(tmp_path / "iter_0000003")).acquire()  # retired: the reader re-reads the marker


def test_mfu_only_against_a_known_peak(saved):
    """On CPU without --peak-tflops there is no MFU (it read 244% against a peak measured under load)."""
    rows = [json.loads(line) for line in open(saved / "log.jsonl")]
    assert rows and all(r["mfu"] is None and r["peak_tflops"] is None and r["tflops"] > 0 for r in rows)
    from megatron_sp.training.logger import _megatron_line

    assert "MFU: n/a (no known peak; set --peak-tflops)" in _megatron_line(rows[0], 4)


# ---- --save: read-only, too small, fills up during the run ----------------------------------------
@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, read_only) -> a small tmpfs directory (skips where mounting is not allowed)."""
    mounted = []

    def mount(size_kb, read_only=False):
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        opts = f"size={size_kb}k" + (",ro" if read_only else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): needs root")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_save_is_refused_at_start(tmpfs, capsys, monkeypatch):
    _no_model(monkeypatch)
    code, err, _ = run(capsys, ["--train-iters", "2", "--save", str(tmpfs(64, read_only=True) / "ckpt")])
    assert_one_sentence(code, err, 2, "is not writable (Read-only file system)")


def test_save_without_room_for_a_checkpoint_is_refused_at_start(tmpfs, capsys, monkeypatch):
    _no_model(monkeypatch)
    code, err, _ = run(capsys, ["--train-iters", "2", "--save", str(tmpfs(64))])
    assert_one_sentence(code, err, 2, "MB free but one checkpoint needs about")


def test_disk_full_during_save_stops_with_previous_checkpoint_intact(tmpfs, capsys):
    """Room for one checkpoint and a half: the first save succeeds, the second runs out of space."""
    save = tmpfs(600)
    code, err, _ = run(capsys, ["--train-iters", "4", "--save-interval", "1", "--save", str(save)])
    assert_one_sentence(code, err, 1, "No space left on device")
    assert "the previous checkpoint and latest_checkpointed_iteration.txt are intact" in err
    assert checkpointing.read_latest(str(save)) == 1
    assert sorted(set(os.listdir(save)) - {".megatron_sp.lock"}) == [
        "iter_0000001",
        "latest_checkpointed_iteration.txt",
    ]
    code, err, out = run(capsys, ["--train-iters", "1", "--load", str(save)])  # and it still loads
    assert code == 0 and "training already finished" in out, err


# ---- fp16 underflow -------------------------------------------------------------------------------
# ---- out of memory: one sentence with the sizes (issue 21) ----------------------------------------
def test_model_too_large_for_memory_is_refused_before_it_is_built(capsys, monkeypatch):
    from megatron_sp.training import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 10)
    code, err, _ = run(capsys, ["--train-iters", "1"])
    assert_one_sentence(code, err, 2, "per rank for weights, gradients and AdamW state but cpu has 0.00 GiB free")


@pytest.mark.parametrize(
    "error, asked",
    [
        (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.00 GiB free."),
            "2.00 GiB",
        ),
        (
            RuntimeError(
                "[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes."
            ),
            "4096 bytes",
        ),
        (MemoryError(), None),
    ],
)
def test_out_of_memory_while_running_is_one_sentence(error, asked, capsys, monkeypatch):
    from megatron_sp.models import gpt

    def allocate(*args, **kwargs):
        raise error

    monkeypatch.setattr(gpt, "GPTModel", allocate)
    code, err, _ = run(capsys, ["--train-iters", "1"])
    assert_one_sentence(code, err, 1, "out of memory on cpu")
    assert "M parameters, at least" in err and (asked is None or f"allocating {asked}" in err), err


def test_fp16_underflow_grows_the_scale_instead_of_training_on_zeros(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    code, err, out = run(
        capsys,
        [
            "--train-iters",
            "12",
            "--fp16",
            "--initial-loss-scale",
            "1e-20",
            "--peak-tflops",
            "2",
            "--log-jsonl",
            str(log),
        ],
    )
    assert code == 0, err
    rows = [json.loads(line) for line in open(log)]
    skipped = [r for r in rows if r["skipped"]]
    assert skipped and all(r["grad_norm"] == 0.0 for r in skipped)
    assert "fp16 gradients underflowed to zero" in out
    assert rows[0]["loss_scale"] == pytest.approx(1e-20 * 256)  # x256 per step below 1 ...
    assert rows[-1]["loss_scale"] == 1.0  # ... up to 1 (Megatron's minimum)
    assert not rows[-1]["skipped"] and rows[-1]["grad_norm"] > 0  # and then it trains
    assert rows[-1]["mfu"] == pytest.approx(rows[-1]["tflops"] / 2)  # MFU against the stated peak


def test_loss_scale_starvation_is_said(tmp_path, capsys):
    """fp16 whose gradients overflow every step (a static scale of 1e30): Megatron's meaning kept (skip,
    go on, exit 0), but a warning each --loss-scale-window skipped steps in a row, the skipped count in
    the iteration line, and a last word that nothing trained (was: exit 0 and no word)."""
    log = tmp_path / "log.jsonl"
    argv = ["--train-iters", "4", "--fp16", "--loss-scale", "1e30", "--loss-scale-window", "2", "--log-interval", "2"]
    code, err, out = run(capsys, argv + ["--log-jsonl", str(log)])
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("pretrain_gpt_sp.py: warning:")]
    assert len(warnings) == 3 and "the last 2 steps (to iteration 2) were all skipped" in warnings[0], err
    assert "the last 4 steps (to iteration 4)" in warnings[1] and "nothing trained" in warnings[2], err
    assert "Traceback" not in err
    rows = [json.loads(line) for line in open(log)]
    assert [r["skipped_iterations"] for r in rows] == [1, 1, 2]  # iterations 1, 2 (since 1), 4 (since 2)
    assert "number of skipped iterations:   2 |" in out


def test_fp16_underflow_at_the_largest_scale_stops():
    from megatron_sp.distributed.loss_scale import DynamicLossScaler

    scaler = DynamicLossScaler(1e-20)
    verdicts = []
    while not verdicts or verdicts[-1] == "underflow":
        verdicts.append(scaler.update(grad_norm=0.0))
    # the largest scale is Megatron's initial one, 2^32
    assert verdicts[-1] == "no_gradient" and scaler.scale == scaler.max_scale == 2.0**32
    assert len(verdicts) - 1 == math.ceil((32 - math.log2(1e-20)) / 8)  # x256 per zero-gradient step
    with pytest.raises(ValueError, match="initial loss scale"):
        DynamicLossScaler(0.0)


# ---- preprocess_data ------------------------------------------------------------------------------
def test_preprocess_non_string_text_is_one_sentence(tmp_path):
    src, workers = tmp_path / "in.jsonl", "2"  # the error crosses the worker pool
    src.write_text('{"text": "fine"}\n{"text": 12}\n')
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "preprocess_data.py"),
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "out"),
            "--workers",
            workers,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert proc.returncode == 2, proc.stderr
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert error == [
        f"preprocess_data.py: error: {src} line 2: field 'text' is of type int, not text (a string "
        "or a list of strings); fix that line or pass the right --json-keys."
    ], proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.glob("out*"))

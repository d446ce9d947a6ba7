"""Checkpoints: exact resume (bit for bit), resharding TP=2+SP -> TP=1 (-> TP=4: tests/test_cp_training.py),
to and from the distributed optimizer, pipeline stages (PP=2) and FSDP2, atomic save under kill -9,
--finetune / --no-load-optim, the safetensors conversion tool, and save/load restoring the states they
are given in place."""

import json
import os
import subprocess
import sys

import pytest
import torch
from launch_helpers import TINY, check, losses, torchrun

from megatron_sp import checkpointing
from megatron_sp.training import pretrain

TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
RUN = TINY + ["--train-iters", "20", "--global-batch-size", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted TP=2+SP run of 20 iterations, and one stopped after 10 with a checkpoint."""
    root = tmp_path_factory.mktemp("ckpt")
    check(torchrun(2, RUN + TP2_SP + ["--log-jsonl", str(root / "straight.jsonl")], cwd=root))
    check(
        torchrun(
            2,
            RUN
            + TP2_SP
            + ["--save", str(root / "ckpt"), "--exit-interval", "10", "--log-jsonl", str(root / "first.jsonl")],
            cwd=root,
        )
    )
    return root


@pytest.mark.slow
def test_exact_resume_is_bit_identical(runs, tmp_path):
    straight = losses(runs / "straight.jsonl")
    assert losses(runs / "first.jsonl") == straight[:10]
    check(
        torchrun(
            2,
            RUN + TP2_SP + ["--load", str(runs / "ckpt"), "--log-jsonl", str(tmp_path / "resumed.jsonl")],
            cwd=tmp_path,
        )
    )
    assert losses(tmp_path / "resumed.jsonl") == straight[10:]  # bit for bit
    # the tools read the TP=2+SP checkpoint whole, with the trainer's checks and its shapes against its config
    from megatron_sp.checkpointing.full_state import checkpoint_path, read_full_state
    from megatron_sp.config import config_from_dict
    from megatron_sp.models.reference import ReferenceGPT

    state, meta = read_full_state(checkpoint_path(str(runs / "ckpt")))
    assert meta["tensor_model_parallel_size"] == 2
    ReferenceGPT(config_from_dict(meta["config"]), initialise=False).load_state_dict(state)  # strict: every key, shape


RESHARDED = {  # layout resumed at: (ranks, flags); both save at 15, resumed as BACK says
    # (TP=4+SP resuming a TP=2 checkpoint, key/value heads in copies: tests/test_cp_training.py)
    "zero": (2, ["--use-distributed-optimizer"]),
    "pp2": (4, ["--pipeline-model-parallel-size", "2"] + TP2_SP),
}
BACK = {"zero": (2, TP2_SP), "pp2": (1, [])}  # PP2 × TP2+SP's checkpoint at PP1 × TP1


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(RESHARDED))
def test_resharded_resume_matches(runs, tmp_path, layout):
    """TP=2+SP -> TP=1 × DP=2 with the distributed optimizer (the AdamW state of a replicated run
    sharded over the replicas); -> PP=2 × TP=2+SP (1F1B: one layer per stage, the tied embedding on
    both): each saves a checkpoint at iteration 15 that then resumes with the replicated optimizer, at
    TP=2+SP and at PP=1 × TP=1 (PP=4 and other PP resharding: tests/test_pipeline.py). Every loss on
    the uninterrupted run's curve (a lost or misplaced moment would move it); the tools (generate,
    Hugging Face export) read the pipeline checkpoint whole."""
    ranks, flags = RESHARDED[layout]
    flags = flags + ["--save", str(tmp_path / "zero"), "--save-interval", "5"]
    check(
        torchrun(
            ranks,
            RUN + flags + ["--load", str(runs / "ckpt"), "--log-jsonl", str(tmp_path / "r.jsonl")],
            cwd=tmp_path,
        )
    )
    got, want = losses(tmp_path / "r.jsonl"), losses(runs / "straight.jsonl")[10:]
    (tmp_path / "zero" / checkpointing.LATEST).write_text("15\n")  # resume from iteration 15
    back_ranks, back_flags = BACK[layout]
    check(
        torchrun(
            back_ranks,
            RUN + back_flags + ["--load", str(tmp_path / "zero"), "--log-jsonl", str(tmp_path / "b.jsonl")],
            cwd=tmp_path,
        )
    )
    got += losses(tmp_path / "b.jsonl")
    want += want[5:]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (layout, got, want)
    if layout == "pp2":  # the tools read a pipeline checkpoint whole (every stage's entries, strictly)
        from megatron_sp.models.hf import to_hf
        from tools import convert_hf
        from tools.generate import load_model

        model, cfg = load_model(str(tmp_path / "zero"), 15)
        assert cfg.num_layers == 2 and len(model.layers) == 2
        convert_hf.export(str(tmp_path / "zero"), 15, str(tmp_path / "hf"), "fp32")
        exported, _ = convert_hf.read_hf(str(tmp_path / "hf"))
        want_hf, _ = to_hf(model.state_dict(), cfg)
        assert set(exported) == set(want_hf) and all(torch.equal(exported[k], want_hf[k]) for k in want_hf)


@pytest.mark.slow
def test_fsdp2_resumes_a_replicated_checkpoint_on_the_curve(runs, tmp_path):
    """The replicated TP=2+SP checkpoint of iteration 10 resumes under --use-torch-fsdp2 at PP=2 × CP=2
    (each stage an FSDP2 root; weights and AdamW moments chunked over the CP replicas, the tied embedding
    on both ends): every loss on the uninterrupted run's curve. (FSDP2's own checkpoints resuming as
    replicated ones: tests/test_parity.py and tests/test_pipeline.py, in their worlds.)"""
    fsdp = ["--use-torch-fsdp2", "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    fsdp += ["--load", str(runs / "ckpt"), "--exit-interval", "14"]
    check(torchrun(4, RUN + fsdp + ["--log-jsonl", str(tmp_path / "f.jsonl")], cwd=tmp_path))
    got, want = losses(tmp_path / "f.jsonl"), losses(runs / "straight.jsonl")[10:14]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


SMALL = TINY + ["--global-batch-size", "4"]
EVERY2 = ["--save-interval", "2"]

KILLER = """
import os, signal, sys
from megatron_sp.checkpointing import checkpointer
from megatron_sp.training import pretrain
real = checkpointer._dcp()
class Dying:
    def save(self, state, checkpoint_id):          # the shards are written, then the process dies
        real.save(state, checkpoint_id=checkpoint_id)
        if checkpoint_id.endswith("iter_0000004.tmp"):
            os.kill(os.getpid(), signal.SIGKILL)
    def __getattr__(self, name):
        return getattr(real, name)
checkpointer._dcp = lambda: Dying()
sys.exit(pretrain.main(sys.argv[1:]))
"""


def test_save_killed_midway_keeps_previous_checkpoint(tmp_path, capsys):
    save = tmp_path / "ckpt"
    driver = tmp_path / "driver.py"
    driver.write_text(KILLER)
    proc = subprocess.run(
        [sys.executable, str(driver), *SMALL, *EVERY2, "--train-iters", "6", "--save", str(save)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert checkpointing.read_latest(str(save)) == 2  # marker still on the last good one
    assert (save / "iter_0000004.tmp").is_dir() and not (save / "iter_0000004").exists()
    code = pretrain.main(
        SMALL
        + EVERY2
        + [
            "--train-iters",
            "6",
            "--load",
            str(save),
            "--save",
            str(save),
            "--log-jsonl",
            str(tmp_path / "resumed.jsonl"),
        ]
    )
    assert code == 0 and "loaded checkpoint" in capsys.readouterr().out
    assert [r["iteration"] for r in map(json.loads, open(tmp_path / "resumed.jsonl"))] == [3, 4, 5, 6]
    assert checkpointing.read_latest(str(save)) == 6
    assert not (save / "iter_0000004.tmp").exists()  # leftovers cleaned by the next save


def test_finetune_and_no_load_optim(tmp_path):
    save = tmp_path / "ckpt"  # --load of a directory not made yet: from scratch
    assert (
        pretrain.main(
            SMALL
            + ["--train-iters", "4", "--save", str(save), "--load", str(save), "--log-jsonl", str(tmp_path / "a.jsonl")]
        )
        == 0
    )
    assert (
        pretrain.main(SMALL + ["--train-iters", "6", "--load", str(save), "--log-jsonl", str(tmp_path / "b.jsonl")])
        == 0
    )
    assert (
        pretrain.main(
            SMALL
            + ["--train-iters", "6", "--load", str(save), "--no-load-optim", "--log-jsonl", str(tmp_path / "c.jsonl")]
        )
        == 0
    )
    assert (
        pretrain.main(
            SMALL + ["--train-iters", "2", "--load", str(save), "--finetune", "--log-jsonl", str(tmp_path / "d.jsonl")]
        )
        == 0
    )
    first = losses(tmp_path / "a.jsonl")
    resumed, fresh_optim, finetuned = (losses(tmp_path / f"{n}.jsonl") for n in "bcd")
    assert len(resumed) == len(fresh_optim) == 2 and len(finetuned) == 2  # iterations 5-6, and 1-2
    assert resumed[0] == fresh_optim[0]  # same weights at iteration 5...
    assert resumed[1] != fresh_optim[1]  # ...but fresh Adam moments change the step
    assert finetuned[0] < first[0] - 0.05  # trained weights, data from the start


def test_checkpoints_are_precision_independent(tmp_path):
    """Checkpoints hold fp32 main weights whatever the run's precision: a --bf16 run resumes an fp32
    checkpoint and an fp32 run a --bf16 one (losses within bf16's rounding of the other precision's
    resumed curve), and within a precision the resume is bit for bit."""

    def run(name, iters, *flags):
        log = tmp_path / f"{name}.jsonl"
        argv = SMALL + ["--train-iters", str(iters), "--log-jsonl", str(log), *flags]
        assert pretrain.main(argv) == 0
        return losses(log)

    fp32 = run("fp32", 3, "--save", str(tmp_path / "fp32"), *EVERY2)
    bf16 = run("bf16", 3, "--bf16", "--save", str(tmp_path / "bf16"), *EVERY2)
    for ckpt in ("fp32", "bf16"):
        (tmp_path / ckpt / checkpointing.LATEST).write_text("2\n")  # resume from iteration 2
    assert run("bf16_again", 3, "--bf16", "--load", str(tmp_path / "bf16")) == bf16[2:]  # bit for bit
    bf16_from_fp32 = run("bf16_from_fp32", 3, "--bf16", "--load", str(tmp_path / "fp32"))
    fp32_from_bf16 = run("fp32_from_bf16", 3, "--load", str(tmp_path / "bf16"))
    for got, want in ((bf16_from_fp32, fp32[2:]), (fp32_from_bf16, bf16[2:])):
        assert len(got) == 1 and all(abs(a - b) <= 0.02 * b for a, b in zip(got, want)), (got, want)
    assert bf16_from_fp32 != bf16[2:]  # it did start from the fp32 weights, not bf16's own


def test_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file

    from megatron_sp.models.reference import ReferenceGPT
    from tools import convert_checkpoint

    save = tmp_path / "ckpt"
    assert pretrain.main(SMALL + ["--train-iters", "2", "--save", str(save)]) == 0
    convert_checkpoint.main(["to-safetensors", "--load", str(save), "--output", str(tmp_path / "m.safetensors")])
    full = load_file(str(tmp_path / "m.safetensors"))
    meta = json.load(open(save / "iter_0000002" / "metadata.json"))
    cfg_fields = {k: v for k, v in meta["config"].items()}
    ref = ReferenceGPT(pretrain.GPTConfig(**cfg_fields))
    ref.load_state_dict(full)  # ReferenceGPT's keys and shapes exactly
    convert_checkpoint.main(
        ["from-safetensors", "--input", str(tmp_path / "m.safetensors"), "--save", str(tmp_path / "back")]
    )
    again, _ = convert_checkpoint.read_full_state(checkpointing.checkpoint_dir(str(tmp_path / "back"), 0))
    converted = json.load(open(tmp_path / "back" / "iter_0000000" / "metadata.json"))
    assert {".metadata", "__0_0.distcp"} <= set(converted["files"])  # the tools' checkpoints carry the record too
    assert again.keys() == full.keys() and all(torch.equal(again[k], full[k]) for k in full)
    assert pretrain.main(SMALL + ["--train-iters", "1", "--load", str(tmp_path / "back"), "--finetune"]) == 0


def _run_states(cfg, seed, step: bool):
    """A serial GPTModel and AdamW (one step taken or not), as the states a run gives checkpointing."""
    from megatron_sp.distributed.loss_scale import DynamicLossScaler
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.parallel_state import ParallelState

    torch.manual_seed(seed)
    ps = ParallelState()
    model = GPTModel(cfg, ps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
        model(tokens, tokens).backward()
        opt.step()
    return (
        model,
        opt,
        {
            "model": checkpointing.ModelState(model, ps),
            "optim": checkpointing.OptimizerState(opt, model, ps),
            "train_state": checkpointing.TrainState(),
            "loss_scale": DynamicLossScaler(2.0**16),
            "rng": checkpointing.RNGState(),
        },
    )


def test_save_and_load_restore_the_given_states_in_place(tmp_path):
    """save/load take the states (not a trainer) and restore the caller's own objects; a tensor state
    the checkpoint lacks (no optimizer state) is left as it was."""
    from megatron_sp.config import GPTConfig
    from megatron_sp.parallel_state import ParallelState

    cfg = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=50,
        seq_length=8,
        model="llama",
        num_query_groups=2,
    )
    model, opt, states = _run_states(cfg, seed=0, step=True)
    states["train_state"].load_state_dict({"iteration": 3, "consumed_train_samples": 12, "consumed_valid_samples": 4})
    states["loss_scale"].scale = 1024.0
    rng = torch.get_rng_state()
    checkpointing.save(str(tmp_path / "a"), states, cfg, ParallelState(), log=lambda message: None)
    del states["optim"]
    checkpointing.save(str(tmp_path / "b"), states, cfg, ParallelState(), log=lambda message: None)

    model2, opt2, given = _run_states(cfg, seed=1, step=False)
    train_state, scaler = given["train_state"], given["loss_scale"]
    torch.manual_seed(99)
    meta = checkpointing.load(str(tmp_path / "a"), given, cfg, log=lambda message: None)
    assert meta["iteration"] == 3 and given["train_state"] is train_state and given["loss_scale"] is scaler
    assert (train_state.iteration, train_state.consumed_train_samples, scaler.scale) == (3, 12, 1024.0)
    assert torch.equal(torch.get_rng_state(), rng)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[p2][key]), (name, key)

    _, opt3, given = _run_states(cfg, seed=1, step=False)
    said = []
    checkpointing.load(str(tmp_path / "b"), given, cfg, log=said.append)
    assert any("holds no optimizer state" in line for line in said) and not opt3.state

"""Megatron-LM's training features beyond the model (issue 20), in this process: the per-token loss
against the serial computation, batch-size schedules, async saves that stay atomic with the retain
interval, the exit deadline, the profiler trace and the logged norms; NullTokenizer data of
megatron-core <= 0.16 refused naming the fix."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from launch_helpers import TINY, records

from megatron_sp.training import pretrain
from megatron_sp.training.batch_schedule import BatchSchedule

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]


def test_per_token_loss_is_the_global_token_mean():
    """Two micro-batches with 50 and 12 unmasked tokens: the step's loss and gradients are those of
    sum(token losses) / 62, not of the mean of the two means."""
    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.distributed.protocol import TrainingOptimizer
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.models.reference import ReferenceGPT
    from megatron_sp.training.loop import train_step

    cfg = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        vocab_size=50,
        seq_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    g = torch.Generator().manual_seed(0)
    batches = []
    for kept in (50, 12):
        mask = torch.zeros(2, 16)
        mask.view(-1)[torch.randperm(32, generator=g)[:kept]] = 1.0  # (kept <= 32)
        tokens, labels = torch.randint(0, 50, (2, 16), generator=g), torch.randint(0, 50, (2, 16), generator=g)
        batches.append({"tokens": tokens, "labels": labels, "loss_mask": mask.clamp(max=1)})
    ps = parallel_state.initialize_model_parallel(1, 1)
    try:
        model = GPTModel(cfg, ps)
        reference = ReferenceGPT(cfg)
        model.load_full_state_dict(reference.state_dict())
        hyper = SimpleNamespace(weight_decay=0.0, lr=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
        optimizer = build_optimizer(model, hyper, "cpu", ps)
        assert isinstance(optimizer, TrainingOptimizer)
        result = train_step(
            model, optimizer, iter(batches), 2, ps, device="cpu", clip_grad=0.0, iteration=1, per_token_loss=True
        )
        grads = model.full_grad_dict()
    finally:
        parallel_state.destroy_model_parallel()
    sums = [reference(b["tokens"], b["labels"], loss_mask=b["loss_mask"]) * b["loss_mask"].sum() for b in batches]
    want = sum(sums) / sum(b["loss_mask"].sum() for b in batches)
    want.backward()
    assert abs(result.loss - want.item()) < 1e-6 * abs(want.item())
    for name, p in reference.named_parameters():
        assert (grads[name] - p.grad).norm() <= 1e-5 * p.grad.norm(), name  # the parity tests' measure


def test_both_optimizers_implement_the_training_optimizer_protocol():
    """The loop, the logs and the checkpoints see one contract: every method the protocol declares is
    defined by both optimizers (none left as the protocol's stub)."""
    from megatron_sp.distributed.fsdp import FSDPOptimizer
    from megatron_sp.distributed.optimizer import MixedPrecisionOptimizer
    from megatron_sp.distributed.protocol import TrainingOptimizer

    declared = [n for n, v in vars(TrainingOptimizer).items() if callable(v) and not n.startswith("_")]
    assert {"finalize_grads", "prepare_grads", "step", "params_norm", "zero_grads_count"} <= set(declared)
    for cls in (MixedPrecisionOptimizer, FSDPOptimizer):
        assert TrainingOptimizer in cls.__mro__
        stubs = [n for n in declared if getattr(cls, n) is vars(TrainingOptimizer)[n]]
        assert not stubs, f"{cls.__name__} leaves {stubs} to the protocol"


def test_batch_schedules_follow_megatron():
    ramp = BatchSchedule.rampup(start=4, increment=4, samples=24, final=16)  # 3 increments, every 8 samples
    assert [ramp.at(n) for n in (0, 7, 8, 16, 24, 1000)] == [4, 4, 8, 12, 16, 16]
    assert ramp.iterations(4 + 4 + 8 + 12 + 16) == 5 and ramp.samples(5) == 44
    step = BatchSchedule.parse("0:16 2.4B:320 4.8B:624", seq_length=2048)
    assert step.steps == ((0, 16), (2_400_000_000 // 2048, 320), (4_800_000_000 // 2048, 624))
    with pytest.raises(ValueError, match="threshold 0"):
        BatchSchedule.parse("100:16", seq_length=1)


def test_rampup_changes_the_micro_batches_per_step(tmp_path):
    log = tmp_path / "log.jsonl"
    i = TINY.index("--lr-warmup-iters")
    argv = TINY[:i] + TINY[i + 2 :] + MOCK + ["--train-samples", "20", "--log-jsonl", str(log)]
    argv += ["--rampup-batch-size", "2", "2", "8"]
    assert pretrain.main(argv) == 0  # global batch 8: 2, then 4 from 3 samples, 6 from 6, 8 from 8
    steps = [r for r in records(log) if "lm_loss" in r]
    assert [r["global_batch_size"] for r in steps] == [2, 2, 4, 8, 8]  # (at 4 samples, then 8: 6 is skipped)
    assert [r["consumed_samples"] for r in steps] == [2, 4, 8, 16, 24]  # until --train-samples 20


def test_async_save_is_atomic_and_retains_the_interval(tmp_path):
    """--async-save: iter_N appears (renamed from iter_N.tmp, with its integrity record) only once
    written; --save-retain-interval 2 leaves iter_2 and the latest; the run resumes from it. Also
    --log-params-norm, --log-num-zeros-in-grad and a profiler trace of step 2."""
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    argv = TINY + MOCK + ["--save", str(save), "--save-interval", "1", "--async-save", "--save-retain-interval", "2"]
    argv += ["--log-params-norm", "--log-num-zeros-in-grad", "--log-jsonl", str(log), "--profile"]
    argv += ["--profile-step-start", "1", "--profile-step-end", "2", "--profile-dir", str(tmp_path / "prof")]
    assert pretrain.main(argv + ["--train-iters", "3"]) == 0
    assert sorted(set(os.listdir(save)) - {".megatron_sp.lock"}) == [
        "iter_0000002",
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]
    meta = json.load(open(save / "iter_0000003" / "metadata.json"))
    assert meta["iteration"] == 3 and any(name.endswith(".distcp") for name in meta["files"])
    steps = [r for r in records(log) if "lm_loss" in r]
    assert all(r["params_norm"] > 0 and r["num_zeros"] >= 0 for r in steps)
    assert os.listdir(tmp_path / "prof") == ["trace_rank0_steps1-2.json"]
    log.unlink()
    assert pretrain.main(argv[: argv.index("--profile")] + ["--load", str(save), "--train-iters", "4"]) == 0
    assert [r["iteration"] for r in records(log) if "lm_loss" in r] == [4]
    _strictness_of(save / "iter_0000004")


def _strictness_of(path):
    """--dist-ckpt-strictness: an entry the model lacks is logged (log_*) or refused (raise_*)."""
    from megatron_sp.checkpointing import CheckpointError, checkpointer, safe_dcp

    names = sorted(k for k in safe_dcp.read_metadata(str(path)).state_dict_metadata if k.startswith("model."))
    target = {"model": {name.split(".", 1)[1]: None for name in names[1:]}}  # the model lacks names[0]
    with pytest.raises(CheckpointError, match="1 entries this model does not have"):
        checkpointer._report_unexpected(str(path), target, "raise_unexpected", print)
    logged = []
    checkpointer._report_unexpected(str(path), target, "log_all", logged.append)
    assert names[0] in logged[0] and "not loaded" in logged[0]


def test_exit_duration_saves_and_stops_before_the_limit(tmp_path, capsys):
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    argv = TINY + MOCK + ["--train-iters", "50", "--save", str(save), "--log-jsonl", str(log)]
    assert pretrain.main(argv + ["--exit-duration-in-mins", "1e-6"]) == 0
    assert "--exit-duration-in-mins" in capsys.readouterr().out
    assert [r["iteration"] for r in records(log) if "lm_loss" in r] == [1]
    assert (save / "iter_0000001").is_dir()


def test_exit_on_missing_checkpoint_even_in_the_save_dir(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    argv = TINY + MOCK + ["--train-iters", "1", "--save", ckpt, "--load", ckpt, "--exit-on-missing-checkpoint"]
    assert pretrain.main(argv) == 2
    assert f"--load {ckpt} holds no latest_checkpointed_iteration.txt" in capsys.readouterr().err
    assert not [n for n in os.listdir(ckpt) if n.startswith("iter_")]  # nothing trained, nothing saved


def test_no_save_optim_and_rng_leave_them_out_and_a_resume_starts_them_fresh(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    ckpt = str(tmp_path / "ckpt")
    argv = TINY + MOCK + ["--save", ckpt, "--load", ckpt, "--no-save-optim", "--no-save-rng"]
    assert pretrain.main(argv + ["--train-iters", "1"]) == 0
    path = os.path.join(ckpt, "iter_0000001")
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert any(k.startswith("model") for k in stored) and not any(k.startswith("optim") for k in stored)
    assert not [n for n in os.listdir(path) if n.startswith("rng")]
    capsys.readouterr()
    assert pretrain.main(argv + ["--train-iters", "2"]) == 0
    assert "holds no optimizer" in capsys.readouterr().out
    assert os.path.isdir(os.path.join(ckpt, "iter_0000002"))


def test_null_tokenizer_data_of_megatron_core_016_names_the_fix(tmp_path):
    from megatron_sp.data import validate_indexed_prefix
    from megatron_sp.data.errors import DataError
    from megatron_sp.data.indexed import write_documents

    prefix = str(tmp_path / "old")
    write_documents(prefix, [[1, 2, 100], [3, 100]], vocab_size=101)  # EOD = --vocab-size 100, as 0.16 wrote
    with pytest.raises(DataError, match=r"pass --vocab-size 101"):
        validate_indexed_prefix(prefix, vocab_size=100)
    validate_indexed_prefix(prefix, vocab_size=101)  # read with the same EOD


def test_decoupled_lr_drives_the_embedding_and_output_layer():
    """--decoupled-lr: the word embedding and the output layer follow a schedule of their own."""
    from megatron_sp.config import GPTConfig
    from megatron_sp.distributed.optimizer import param_groups
    from megatron_sp.models.reference import ReferenceGPT
    from megatron_sp.training.schedules import LRSchedule, ParamScheduler, WDSchedule

    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=50, seq_length=8)
    model = ReferenceGPT(GPTConfig(**{**dataclass_fields(cfg), "untie_embeddings_and_output_weights": True}))
    optimizer = torch.optim.AdamW(param_groups(model.named_parameters(), 0.1, decoupled=True))
    scheduler = ParamScheduler(
        LRSchedule(1e-3, 0.0, 10, 100, "cosine", init=1e-4), WDSchedule(0.1, 0.1, 100), decoupled=(5e-3, 1e-4)
    )
    scheduler.step(5, optimizer)
    decoupled = [g for g in optimizer.param_groups if g.get("decoupled")]
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decoupled[0]["params"]) == [
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ]
    assert decoupled[0]["lr"] == 1e-4 + (5e-3 - 1e-4) * 5 / 10  # warmup from --lr-warmup-init
    assert all(g["lr"] == 1e-4 + (1e-3 - 1e-4) * 5 / 10 for g in optimizer.param_groups if not g.get("decoupled"))


def dataclass_fields(cfg) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}

"""The learning-rate and weight-decay schedules step for step against megatron-core's own
OptimizerParamScheduler (0.16.1, on CPU): every decay style, warmup by iterations, samples and
fraction, --lr-warmup-init, --decoupled-lr, WSD, rampup batch sizes, skipped updates, and resumes with
and without --use-checkpoint-opt_param-scheduler / --override-opt_param-scheduler. Megatron's side
is given the spans in samples written out by hand (iterations × global batch), as its training.py
computes them; ours comes from the parsed command line. The program's own updates are checked too:
the rates AdamW reads at each of its first steps (in-process, one rank)."""

import math
from types import SimpleNamespace

import pytest
import torch
from launch_helpers import records

from megatron_sp.training import pretrain
from megatron_sp.training.arguments import ArgumentError, parse_args

BASE = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-5"]
DLR = (5e-3, 2e-4)  # --decoupled-lr, --decoupled-min-lr


def megatron(warmup, decay, style="linear", init=0.0, wd=(0.01, 0.01, "constant"), incr=None, max_lr=1e-3, **kw):
    """megatron-core's scheduler over groups like ours: decay (wd_mult 1), no decay (0), decoupled;
    built as Megatron's training.py builds it (both resume flags default to False there)."""
    kw.setdefault("use_checkpoint_opt_param_scheduler", False)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}, {"wd_mult": 1.0, "max_lr": DLR[0], "min_lr": DLR[1]}]
    return OptimizerParamScheduler(
        SimpleNamespace(param_groups=groups),
        init_lr=init,
        max_lr=max_lr,
        min_lr=1e-5,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=wd[0],
        end_wd=wd[1],
        wd_incr_steps=incr if incr is not None else decay,
        wd_incr_style=wd[2],
        **kw,
    )


def ours(flags):
    args = parse_args(BASE + flags + ["--decoupled-lr", str(DLR[0]), "--decoupled-min-lr", str(DLR[1])])
    groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}, {"wd_mult": 1.0, "decoupled": True}]
    optimizer = SimpleNamespace(param_groups=groups)
    scheduler = pretrain.build_scheduler(args, log=lambda *a: None)
    scheduler.apply(optimizer)
    return args, scheduler, optimizer


def rates(optimizer):
    return [x for g in optimizer.param_groups for x in (g["lr"], g["weight_decay"])]


def follow(args, scheduler, optimizer, reference, steps, skipped=()):
    """Both schedules through `steps` updates (increment: the batch schedule's), `skipped` not stepped."""
    consumed = 0
    for it in range(steps):
        assert rates(optimizer) == pytest.approx(rates(reference.optimizer), rel=1e-12, abs=0), it
        batch = args.batch_schedule.at(consumed)
        if it not in skipped:
            scheduler.step(batch, optimizer)
            reference.step(batch)
        consumed += batch


CASES = {  # our flags -> Megatron's spans in samples (global batch 4)
    "linear, warmup iters": (["--train-iters", "10", "--lr-warmup-iters", "3"], dict(warmup=12, decay=40)),
    "cosine, decay iters, warmup init": (
        ["--train-iters", "12", "--lr-decay-style", "cosine", "--lr-decay-iters", "8", "--lr-warmup-iters", "2"]
        + ["--lr-warmup-init", "1e-4"],
        dict(warmup=8, decay=32, style="cosine", init=1e-4, incr=48),
    ),
    "constant": (
        ["--train-iters", "6", "--lr-decay-style", "constant", "--lr-warmup-iters", "2"],
        dict(warmup=8, decay=24, style="constant"),
    ),
    "inverse square root": (
        ["--train-iters", "10", "--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "2"],
        dict(warmup=8, decay=40, style="inverse-square-root"),
    ),
    "fractional warmup": (["--train-iters", "10", "--lr-warmup-fraction", "0.15"], dict(warmup=0.15 * 40, decay=40)),
    "samples": (
        ["--train-samples", "40", "--lr-warmup-samples", "6", "--lr-decay-samples", "30", "--lr-decay-style", "cosine"],
        dict(warmup=6, decay=30, style="cosine", incr=40),
    ),
    "samples, fraction": (
        ["--train-samples", "40", "--lr-warmup-fraction", "0.1"],
        dict(warmup=4.0, decay=40),
    ),
    "weight decay linear": (
        ["--train-iters", "10", "--weight-decay-incr-style", "linear"]
        + ["--start-weight-decay", "0.01", "--end-weight-decay", "0.1"],
        dict(warmup=0, decay=40, wd=(0.01, 0.1, "linear")),
    ),
    "weight decay cosine, samples": (
        ["--train-samples", "40", "--weight-decay-incr-style", "cosine"]
        + ["--start-weight-decay", "0.0", "--end-weight-decay", "0.2"],
        dict(warmup=0, decay=40, wd=(0.0, 0.2, "cosine")),
    ),
    "rampup": (
        ["--train-samples", "60", "--rampup-batch-size", "2", "2", "8", "--lr-warmup-samples", "10"],
        dict(warmup=10, decay=60, incr=60),
    ),
}
for _style in ("exponential", "linear", "cosine", "minus_sqrt"):
    CASES[f"WSD {_style}"] = (
        ["--train-iters", "12", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5", "--lr-warmup-iters", "2"]
        + ["--lr-wsd-decay-style", _style],
        dict(warmup=8, decay=48, style="WSD", wsd_decay_steps=20, lr_wsd_decay_style=_style),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_schedule_equals_megatron_step_for_step(case):
    """Every update's LR and weight decay of all three kinds of group, through and past the decay
    span; an update skipped (fp16 overflow) does not advance either schedule."""
    flags, spans = CASES[case]
    args, scheduler, optimizer = ours(flags)
    follow(args, scheduler, optimizer, megatron(**spans), args.train_iters + 3, skipped={1, 4})


def _resume_pair(ckpt_flags, resume_flags, **resume_kw):
    """Ours and Megatron's scheduler after 5 updates, saved, and loaded by a run with resume_flags."""
    args, scheduler, optimizer = ours(ckpt_flags)
    reference = megatron(warmup=12, decay=40)
    follow(args, scheduler, optimizer, reference, 5)
    saved, saved_ref = scheduler.state_dict(), reference.state_dict()
    assert saved == saved_ref  # the checkpoint entry is Megatron's, key for key
    args2, resumed, optimizer2 = ours(resume_flags)
    resumed.load_state_dict(saved)
    resumed.apply(optimizer2)
    ref2 = megatron(warmup=12, decay=40, **resume_kw)
    ref2.load_state_dict(saved_ref)
    return args2, resumed, optimizer2, ref2


RUN = ["--train-iters", "10", "--lr-warmup-iters", "3"]


def test_resume_continues_megatrons_schedule():
    """The same flags: the resumed schedule goes on where it stopped (Megatron's default rules)."""
    args, resumed, optimizer, reference = _resume_pair(RUN, RUN)
    assert resumed.num_steps == 20
    follow(args, resumed, optimizer, reference, 8)


def test_resume_with_a_changed_schedule():
    """--lr changed on resume: with --use-checkpoint-opt_param-scheduler the checkpoint's LR, with
    --override-opt_param-scheduler the command line's, each step for step as Megatron's. With neither,
    Megatron refuses (an assertion) and we keep the command line's, as with --override (README)."""
    with pytest.raises(AssertionError):  # Megatron's own refusal
        megatron(warmup=12, decay=40, max_lr=2e-3).load_state_dict(megatron(warmup=12, decay=40).state_dict())
    args, resumed, optimizer, reference = _resume_pair(
        RUN, RUN + ["--lr", "2e-3"], max_lr=2e-3, override_opt_param_scheduler=True
    )
    assert resumed.lr.lr == 2e-3
    follow(args, resumed, optimizer, reference, 8)
    args, resumed, optimizer, reference = _resume_pair(
        RUN,
        RUN + ["--lr", "2e-3", "--use-checkpoint-opt_param-scheduler"],
        max_lr=2e-3,
        use_checkpoint_opt_param_scheduler=True,
    )
    assert resumed.lr.lr == 1e-3
    follow(args, resumed, optimizer, reference, 8)
    args, resumed, optimizer, reference = _resume_pair(
        RUN, RUN + ["--lr", "2e-3", "--override-opt-param-scheduler"], max_lr=2e-3, override_opt_param_scheduler=True
    )
    assert resumed.lr.lr == 2e-3
    follow(args, resumed, optimizer, reference, 8)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr-warmup-samples", "8"], "--lr-warmup-samples needs --train-samples \\(with --train-iters use"),
        (["--train-samples", "8", "--lr-warmup-iters", "2"], "--lr-warmup-iters needs --train-iters"),
        (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        (["--start-weight-decay", "0.1"], "need --weight-decay-incr-style linear or cosine"),
        (["--weight-decay-incr-style", "linear"], "needs --start-weight-decay and --end-weight-decay"),
        (["--lr-warmup-init", "1"], "--lr-warmup-init must not exceed --lr"),
        (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "not both"),
        (
            ["--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"],
            "contradict each other",
        ),
    ],
)
def test_schedule_flags_refused_in_one_sentence(flags, message):
    with pytest.raises(ArgumentError, match=message) as err:
        parse_args(BASE + flags)
    assert len(str(err.value).splitlines()) == 1


def test_megatrons_explicit_zero_warmup_of_the_other_unit_is_accepted():
    """Megatron's defaults are --lr-warmup-iters 0 and --lr-warmup-samples 0: a script passing the
    other unit's 0 explicitly trains (it was refused)."""
    assert parse_args(BASE + ["--train-iters", "4", "--lr-warmup-samples", "0"]).lr_warmup_steps == 0
    assert parse_args(BASE + ["--train-samples", "8", "--lr-warmup-iters", "0"]).lr_warmup_steps == 0


# ---- the program's own updates ------------------------------------------------------------------

TINY = ["--device", "cpu", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"]
TINY += ["--seq-length", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--no-progress-bar"]
TINY += ["--log-interval", "1", "--untie-embeddings-and-output-weights"]


def _program(tmp_path, monkeypatch, flags):
    """pretrain.main in this process: each update's (lr, weight decay) per optimizer group as AdamW reads
    them, whether the first update left the weights unchanged, and the log's records."""
    seen, first = [], {}
    real = pretrain.train_step

    def spy(model, optimizer, *a, **k):
        seen.append([(bool(g.get("decoupled")), g["lr"], g["weight_decay"]) for g in optimizer.param_groups])
        before = [p.detach().clone() for p in model.parameters()]
        result = real(model, optimizer, *a, **k)
        if len(seen) == 1:
            first["unchanged"] = all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
        return result

    monkeypatch.setattr(pretrain, "train_step", spy)
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "log.jsonl"
    assert pretrain.main(BASE + TINY + flags + ["--log-jsonl", str(log)]) == 0
    return seen, first, [r for r in records(log) if "lm_loss" in r]


def _expected_updates(reference, steps, batch, decoupled):
    out = []
    for _ in range(steps):
        g = reference.optimizer.param_groups
        out.append((g[0]["lr"], g[0]["weight_decay"], g[2]["lr"] if decoupled else None))
        reference.step(batch)
    return out


def _check_updates(seen, expected):
    for it, (groups, (lr, wd, dlr)) in enumerate(zip(seen, expected)):
        for decoupled, got_lr, got_wd in groups:
            want = dlr if decoupled else lr
            assert got_lr == pytest.approx(want, rel=1e-12, abs=0), (it, decoupled)
            assert got_wd in (pytest.approx(wd, rel=1e-12, abs=0), 0.0), it


def test_the_programs_first_updates_follow_megatron(tmp_path, monkeypatch):
    """Warmup over 2 iterations from --lr-warmup-init 0: the first update runs at 0 (the weights stay
    as initialised) and each update k at Megatron's rate after k-1 updates; the log line shows the
    rate after the step (Megatron logs after stepping its scheduler)."""
    seen, first, steps = _program(tmp_path, monkeypatch, ["--train-iters", "4", "--lr-warmup-iters", "2"])
    ref = megatron(warmup=8, decay=16, incr=16)
    _check_updates(seen, _expected_updates(ref, 4, 4, decoupled=False))
    assert seen[0][0][1] == 0.0 and first["unchanged"]
    logged = megatron(warmup=8, decay=16, incr=16)
    for r in steps:
        logged.step(4)
        assert r["lr"] == pytest.approx(logged.optimizer.param_groups[0]["lr"], rel=1e-12, abs=0)


def test_the_programs_sample_based_fractional_warmup_and_decoupled_lr(tmp_path, monkeypatch):
    """--train-samples with a fractional warmup (1.2 iterations' worth of samples, kept fractional) and
    --decoupled-lr: the updates' rates are Megatron's, and the decoupled rate is in the log."""
    flags = ["--train-samples", "16", "--lr-warmup-fraction", "0.3", "--lr-decay-style", "cosine"]
    seen, _, steps = _program(tmp_path, monkeypatch, flags + ["--decoupled-lr", str(DLR[0])])
    assert len(seen) == 4
    ref = megatron(warmup=0.3 * 16, decay=16, style="cosine", incr=16)
    for g in ref.optimizer.param_groups[2:]:
        g["min_lr"] = 1e-5  # --decoupled-min-lr defaults to --min-lr
    ref.step(0)
    _check_updates(seen, _expected_updates(ref, 4, 4, decoupled=True))
    assert all(r["decoupled_lr"] is not None and math.isfinite(r["decoupled_lr"]) for r in steps)

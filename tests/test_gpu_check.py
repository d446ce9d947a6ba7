"""bench/gpu_check.sh (bench/gpu_check.py): stages run in order under one deadline, each cut at its
cap (its process group killed), skipped when the time left is below its minimum or a stage it needs
did not pass; the summary is rewritten after every stage and printed last; at most 7 files land in
$OUT. The runner with stand-in commands, then the real script as a CPU dry run on tiny shapes."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import gpu_check
from gpu_check import Stage, run_all

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _py(code):
    return [sys.executable, "-c", code]


def test_stages_are_capped_skipped_and_summarised(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir(), scratch.mkdir()
    stages = [
        Stage("ok", [_py("print('figure 42')")], log="ok.log", figures=gpu_check.last_line("figure")),
        Stage("fails", [_py("import sys; sys.exit(3)")]),
        Stage("hangs", [_py("import time; time.sleep(60)")]),
        Stage("after_failure", [_py("pass")], needs=("fails",)),
        Stage("too_big", [_py("pass")]),
        Stage("small", [_py("pass")]),
    ]
    budgets = {"ok": (10, 1), "fails": (10, 1), "hangs": (2, 1), "after_failure": (10, 1)}
    budgets.update(too_big=(10, 60), small=(10, 1))
    start = time.monotonic()
    results = run_all(stages, budgets, 20, str(out), str(scratch), "# test")
    assert time.monotonic() - start < 15, "the hanging stage was not cut at its cap"
    status = {r.name: r.status for r in results}
    assert status["ok"] == "passed" and results[0].figures == "figure 42"
    assert status["fails"] == "failed (exit 3)"
    assert status["hangs"].startswith("timed out after 2")
    assert status["after_failure"] == "skipped: needs fails"
    assert status["too_big"].startswith("skipped:") and "needs 60 s" in status["too_big"]
    assert status["small"] == "passed"  # a later stage that fits still runs
    summary = (out / "summary.md").read_text()
    for r in results:
        assert f"| {r.name} | {r.status} |" in summary
    assert sorted(os.listdir(out)) == ["ok.log", "summary.md"]  # the others log to scratch


def test_cpu_dry_run_within_a_small_deadline(tmp_path):
    """GPU_CHECK_DEVICE=cpu with a 20 s deadline, less than the stages' minima add up to: the first
    stages run on tiny shapes, the rest are skipped (for time, or because the build was); every stage
    is in the summary, in order, and the summary ends the output. Which stage is the first cut depends
    on the machine's load, so only what holds under any load is asserted."""
    out, deadline = tmp_path / "out", 20
    env = dict(os.environ, OUT=str(out), GPU_CHECK_DEVICE="cpu", GPU_CHECK_DEADLINE=str(deadline))
    env["PYTHON"] = sys.executable
    start = time.monotonic()
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert time.monotonic() - start < deadline + 20, "the deadline was overrun"
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip()), "the summary must be printed last"
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in summary.splitlines() if line[:2] == "| "}
    names = ["environment", "speed_reference", "build", "tests", "speed_fused_p0", "speed_fp8", "speed_fused_p01"]
    names += ["kernels"]
    assert [n for n in rows if n != "stage"] == names
    assert rows["environment"] == "passed", summary
    if rows["build"] == "passed":  # then some later stage must have been cut for time
        assert any(re.match(r"skipped: \d+ s left, needs \d+ s", s) for s in rows.values()), summary
    else:  # the build itself was cut (a loaded machine): what needs it says so, nothing ran without it
        assert rows["build"].startswith(("timed out", "skipped:")), summary
        assert all(rows[n] == "skipped: needs build" for n in names[3:]), summary
    assert rows["kernels"].startswith("skipped:"), summary
    assert not any(s.startswith("failed") for s in rows.values()), summary
    assert "summary.md" in os.listdir(out) and len(os.listdir(out)) <= gpu_check.MAX_OUT_FILES


def test_precondition_skips_saying_why_and_is_checked_after_the_time(tmp_path):
    """A stage whose precondition gives a reason is skipped with it; one that does not fit the time
    left is skipped for time without running its (possibly slow) precondition."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir(), scratch.mkdir()
    calls = []

    def missing():
        calls.append(1)
        return "torchao is not installed"

    stages = [
        Stage("needs_lib", [_py("pass")], precondition=missing),
        Stage("too_big", [_py("pass")], precondition=missing),
    ]
    results = run_all(stages, {"needs_lib": (10, 1), "too_big": (10, 60)}, 20, str(out), str(scratch), "# t")
    assert results[0].status == "skipped: torchao is not installed"
    assert results[1].status.startswith("skipped:") and "needs 60 s" in results[1].status
    assert len(calls) == 1


def test_fp8_stage_reports_its_speed_against_the_bf16_run(tmp_path):
    """speed_fp8's figures give its median step time over speed_fused_p0's (read back from
    $OUT/speed.jsonl, the first two iterations left out as warm-up)."""
    out = tmp_path
    lines = lambda ms: [  # noqa: E731
        {"iteration": i, "lm_loss": 5.0, "tokens_per_sec": 8192 / t * 1000, "elapsed_ms": t}
        for i, t in enumerate(ms, 1)
    ]
    for run, ms in (("speed_fused_p0", [900, 500, 100, 100, 102]), ("speed_fp8", [900, 500, 80, 80, 79])):
        path = tmp_path / f"{run}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in lines(ms)))
        words = gpu_check.speed_figures(str(path), run, str(out), "speed_fused_p0" if run == "speed_fp8" else None)("")
    assert "80 ms/step" in words and "1.25x speed_fused_p0's speed" in words, words
    runs = [json.loads(line)["run"] for line in (out / "speed.jsonl").read_text().splitlines()]
    assert runs == ["speed_fused_p0"] * 5 + ["speed_fp8"] * 5


def test_speed_stages_are_valid_command_lines():
    """Every speed stage's command line, on the GPU's shapes and the dry run's, is one the program
    accepts (the FP8 one included): a bad flag would cost a lent GPU session its stage."""
    from megatron_sp.training.arguments import parse_args

    for device in ("cuda", "cpu"):
        speed = [s for s in gpu_check.stages(device, "/nonexistent", "/nonexistent") if s.name.startswith("speed")]
        assert [s.name for s in speed] == ["speed_reference", "speed_fused_p0", "speed_fp8", "speed_fused_p01"]
        for stage in speed:
            (cmd,) = stage.commands
            assert cmd[1] == "pretrain_gpt_sp.py"
            args = parse_args(cmd[2:])
            assert args.device == device and args.train_iters > 2
        fp8 = parse_args(speed[2].commands[0][2:])
        assert (fp8.fp8, fp8.fp8_recipe, fp8.use_fused_kernels) == ("hybrid", "tensorwise", True)
        assert (fp8.bf16, fp8.hidden_size) == ((True, 2048) if device == "cuda" else (False, 64))


def test_ptxas_figures_name_the_kernels_that_spill():
    """The build stage's figures: kernel count, most registers, and each spilling kernel by a short
    name (c++filt's, where it is installed) with its spill stores; kernels without spills are left out."""
    mangled = (
        "_ZN3msp4cuda46_GLOBAL__N__a0485f2e_13_layer_norm_cu_904e686713ln_fwd_kernel"
        "I6__halffLi8ELi4EEEvPKT_PKT0_S9_PS4_PfSB_lf"
    )
    text = "\n".join(
        [
            f"ptxas info    : Compiling entry function '{mangled}' for 'sm_90'",
            "    16 bytes stack frame, 16 bytes spill stores, 40 bytes spill loads",
            "ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size",
            "ptxas info    : Compiling entry function '_ZN3msp4cuda7fwd_kernelIfEEvv' for 'sm_90'",
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
            "ptxas info    : Used 40 registers",
        ]
    )
    figures = gpu_check.ptxas_figures(text)
    name = "ln_fwd_kernel<__half, float, 8, 4>" if shutil.which("c++filt") else mangled[:40]
    assert figures == f"2 kernels, at most 255 registers, spills: {name} (16 B stores)", figures
    assert gpu_check.ptxas_figures("nothing") == "no ptxas report"

"""The GPU check as staged, budgeted stages (bench/gpu_check.sh runs it): what one lent GPU session
should learn, most important first, inside one deadline that cannot be overrun.

    bash bench/gpu_check.sh                                              # the GPU machine; $OUT
    GPU_CHECK_DEVICE=cpu GPU_CHECK_DEADLINE=60 bash bench/gpu_check.sh   # dry run on CPU, tiny shapes

    stage            what                                                          needs
    environment      GPU, driver, torch / CUDA / nvcc / compiler versions
    speed_reference  the speed-goal config, reference ops, dropout 0, 12 iterations   (no build)
    build            megatron_sp._C with its CUDA kernels; ptxas -v registers and spills kept
    tests            tests/test_cuda_ops.py, test_ops_attention_lse.py, test_cuda_tp_overlap.py,  build
                     test_model_init.py
    speed_fused_p0   the speed-goal config, fused ops, dropout 0, 12 iterations       build
    speed_fp8        the same with --fp8-format hybrid --fp8-recipe tensorwise        build, torchao
    speed_fused_p01  the same at dropout 0.1, 6 iterations                           build
    kernels          bench/op_speed.py --no-compile (per case, SDPA baseline, TFLOP/s) build

A stage starts only when the time left covers its minimum and runs at most min(its cap, time left);
past that its process group is killed. The summary ($OUT/summary.md) is rewritten after every stage
and printed last. Files under $OUT (at most 7): summary.md, build.log, tests.log, speed.log,
speed.jsonl (every iteration of every speed run, with its peak GPU memory), kernels.md. Loss curves
and per-run logs stay in a scratch directory (named in the summary). pip is never called (no package index is touched).
The speed-goal config: GPT 24 x 2048, 16 heads, seq 2048, micro batch 4, vocab 50304, bf16,
forward + backward + AdamW on one GPU with random tokens (--mock-data).
torchao (FP8) is not on the lent GPU machine and it has no package index: carry this machine's copy,
which is pure Python for what FP8 training uses (gpu_check.sh leaves its compiled kernels, built for
this machine's torch, unloaded), and name its parent directory in GPU_CHECK_SITE (prepended to PYTHONPATH):
    run(carry=[".venv/lib/python3.11/site-packages/torchao"],
        command="GPU_CHECK_SITE=.venv/lib/python3.11/site-packages bash bench/gpu_check.sh")
Without it (or where it does not import) speed_fp8 is skipped, saying why.
Exit status 1 when a stage failed or timed out, else 0 (stages skipped for time are reported).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
MAX_OUT_FILES = 7

# (cap, minimum) seconds per stage; the GPU figures leave ~10% of the 510 s deadline unplanned.
BUDGETS = {
    "cuda": {
        "environment": (20, 5),
        "speed_reference": (100, 40),
        "build": (200, 60),
        "tests": (90, 20),
        "speed_fused_p0": (70, 40),
        "speed_fp8": (60, 35),
        "speed_fused_p01": (60, 35),
        "kernels": (90, 20),
    },
    "cpu": {
        "environment": (20, 2),  # importing torch on a loaded CI machine
        "speed_reference": (60, 8),
        "build": (30, 2),
        "tests": (60, 8),
        "speed_fused_p0": (60, 8),
        "speed_fp8": (60, 8),
        "speed_fused_p01": (60, 8),
        "kernels": (60, 8),
    },
}
SPEED_SHAPE = {
    "cuda": "--device cuda --bf16 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
    "--micro-batch-size 4 --global-batch-size 4 --vocab-size 50303",
    "cpu": "--device cpu --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--micro-batch-size 2 --global-batch-size 2 --vocab-size 500",
}


@dataclass
class Stage:
    name: str
    commands: List[List[str]]  # run one after the other, all within the stage's time
    log: Optional[str] = None  # file under $OUT the output is appended to (None: scratch)
    needs: tuple = ()  # stages that must have passed
    env: dict = field(default_factory=dict)
    figures: Optional[Callable[[str], str]] = None  # from the stage's output: the summary's figures
    precondition: Optional[Callable[[], Optional[str]]] = None  # a reason to skip, or None


@dataclass
class Result:
    name: str
    status: str  # passed | failed (exit N) | timed out after N s | skipped: reason
    seconds: float = 0.0
    figures: str = ""


# ---- running ------------------------------------------------------------------------------------


def _run_command(cmd, log, timeout, env) -> tuple[int, bool]:
    """(exit status, timed out): cmd in its own process group, output appended to `log`."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 0.1)), False
        except subprocess.TimeoutExpired:
            _kill(proc)
            f.write(f"\n[gpu_check] killed after {timeout:.0f} s\n")
            return proc.returncode, True


def _kill(proc):
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_stage(stage: Stage, budget, left: float, passed: set, out: str, scratch: str) -> Result:
    cap, minimum = budget
    missing = [n for n in stage.needs if n not in passed]
    if missing:
        return Result(stage.name, f"skipped: needs {', '.join(missing)}")
    if left < minimum:
        return Result(stage.name, f"skipped: {max(left, 0):.0f} s left, needs {minimum} s")
    checked = time.monotonic()
    reason = stage.precondition() if stage.precondition else None
    if reason:
        return Result(stage.name, f"skipped: {reason}", time.monotonic() - checked)
    left -= time.monotonic() - checked  # the check's time counts against the deadline
    log = os.path.join(out if stage.log else scratch, stage.log or f"{stage.name}.log")
    stage_log = os.path.join(scratch, f"{stage.name}.stage.log")  # this stage's output alone (figures)
    env = dict(os.environ, **stage.env)
    start, limit = time.monotonic(), min(cap, left)
    status = "passed"
    for cmd in stage.commands:
        rc, timed_out = _run_command(cmd, stage_log, limit - (time.monotonic() - start), env)
        if timed_out:
            status = f"timed out after {limit:.0f} s"
            break
        if rc != 0:
            status = f"failed (exit {rc})"
            break
    with open(stage_log) as f:
        text = f.read()
    if stage.log:
        with open(log, "a") as f:
            f.write(text)
    figures = ""
    if stage.figures:
        try:
            figures = stage.figures(text)
        except Exception as err:  # a summary must not lose the stage over a parse error
            figures = f"(figures unreadable: {err})"
    return Result(stage.name, status, time.monotonic() - start, figures)


def run_all(stages, budgets, deadline_s: float, out: str, scratch: str, header: str) -> List[Result]:
    """Runs the stages in order within deadline_s; rewrites out/summary.md after each."""
    t0, results, passed = time.monotonic(), [], set()
    for stage in stages:
        left = deadline_s - (time.monotonic() - t0)
        result = run_stage(stage, budgets[stage.name], left, passed, out, scratch)
        if result.status == "passed":
            passed.add(stage.name)
        results.append(result)
        write_summary(out, header, results, [s.name for s in stages], time.monotonic() - t0, deadline_s, scratch)
        print(f"[gpu_check] {result.name}: {result.status} ({result.seconds:.0f} s) {result.figures}", flush=True)
    return results


def write_summary(out, header, results, names, elapsed, deadline_s, scratch):
    done = {r.name for r in results}
    rows = [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.figures.replace('|', '/')} |" for r in results]
    rows += [f"| {n} | not reached yet | | |" for n in names if n not in done]
    files = sorted(os.listdir(out)) if os.path.isdir(out) else []
    text = "\n".join(
        [
            header,
            "",
            "| stage | status | seconds | figures |",
            "|---|---|---|---|",
            *rows,
            "",
            f"elapsed {elapsed:.0f} s of the {deadline_s:.0f} s deadline; files in $OUT: {', '.join(files)}",
            "",
        ]
    )
    env_log = os.path.join(scratch, "environment.stage.log")
    if os.path.exists(env_log):
        with open(env_log) as f:
            text += "\n## environment\n\n```\n" + f.read() + "```\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)


# ---- figures --------------------------------------------------------------------------------------


def _steady(records):
    return [r for r in records if r["iteration"] > 2] or records  # the first steps warm up


def speed_figures(jsonl: str, run: str, out: str, baseline: Optional[str] = None) -> Callable[[str], str]:
    """Reads one speed run's JSONL: appends it to $OUT/speed.jsonl and returns its median figures
    (with its median step time over the `baseline` run's, when that run is in speed.jsonl)."""

    def figures(_text):
        with open(jsonl) as f:
            records = [json.loads(line) for line in f if '"lm_loss"' in line and '"iteration"' in line]
        speed_jsonl = os.path.join(out, "speed.jsonl")
        before = []
        if baseline and os.path.exists(speed_jsonl):
            with open(speed_jsonl) as f:
                before = [r for r in map(json.loads, f) if r.get("run") == baseline]
        with open(speed_jsonl, "a") as f:
            for r in records:
                f.write(json.dumps({"run": run, **r}) + "\n")
        steady = _steady(records)
        med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
        words = [f"{med('tokens_per_sec'):.0f} tokens/s", f"{med('elapsed_ms'):.0f} ms/step"]
        if before:
            base_ms = statistics.median(r["elapsed_ms"] for r in _steady(before))
            words.append(f"{base_ms / med('elapsed_ms'):.2f}x {baseline}'s speed")
        if steady[0].get("mfu") is not None:
            words.append(f"MFU {100 * med('mfu'):.1f}%")
        peaks = [r["peak_memory_gib"] for r in records if r.get("peak_memory_gib") is not None]
        if peaks:
            words.append(f"peak {max(peaks):.1f} GiB")
        words.append(f"loss {records[-1]['lm_loss']:.3f} after {records[-1]['iteration']} it")
        return ", ".join(words)

    return figures


def ptxas_figures(text: str) -> str:
    """Kernel count, the most registers, and every kernel that spills (ptxas -v lines)."""
    regs, spills, name = [], [], None
    for line in text.splitlines():
        entry = re.search(r"Compiling entry function '(\S+)'", line)
        if entry:
            name = entry.group(1)
        used = re.search(r"Used (\d+) registers", line)
        if used:
            regs.append(int(used.group(1)))
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spill and (int(spill.group(1)) or int(spill.group(2))):
            spills.append(f"{_kernel_name(name or '?')} ({spill.group(1)} B stores)")
    if not regs:
        return "no ptxas report"
    return f"{len(regs)} kernels, at most {max(regs)} registers, spills: {', '.join(spills) or 'none'}"


def _kernel_name(mangled: str) -> str:
    """A kernel's short name from its mangled one (c++filt, then `name<template args>`), e.g.
    ln_fwd_kernel<__half, float, 8, 4>; the mangled name's start where c++filt is missing."""
    try:
        text = subprocess.run(["c++filt", mangled], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return mangled[:40]
    short = re.search(r"(\w+)(<[^()]*>)?\(", text)
    return "".join(g for g in short.groups() if g) if short else mangled[:40]


def last_line(pattern: str) -> Callable[[str], str]:
    def figures(text):
        hits = [line.strip() for line in text.splitlines() if re.search(pattern, line)]
        return hits[-1] if hits else ""

    return figures


def kernels_figures(text: str) -> str:
    cases = len(re.findall(r"^\S.* \(\d", text, re.M))
    failed = len(re.findall(r"^\s*FAILED", text, re.M))
    return f"{cases} cases measured, {failed} failed"


# ---- the stages ---------------------------------------------------------------------------------


def _speed_stage(name, device, fused, dropout, iters, scratch, out, extra=(), precondition=None, baseline=None):
    jsonl = os.path.join(scratch, f"{name}.jsonl")
    flags = SPEED_SHAPE[device].split() + [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--train-iters",
        str(iters),
        "--log-interval",
        "1",
        "--eval-interval",
        "100000",
        "--lr-warmup-iters",
        "2",
        "--hidden-dropout",
        str(dropout),
        "--attention-dropout",
        str(dropout),
        "--no-progress-bar",
        "--log-jsonl",
        jsonl,
        "--loss-curve",
        os.path.join(scratch, f"{name}.png"),
    ]
    flags += ([] if fused else ["--no-fused-kernels"]) + list(extra)
    return Stage(
        name,
        [[PY, "pretrain_gpt_sp.py", *flags]],
        log="speed.log",
        needs=("build",) if fused else (),
        figures=speed_figures(jsonl, name, out, baseline),
        precondition=precondition,
    )


FP8_FLAGS = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")  # torchao's current scaling


def torchao_problem() -> Optional[str]:
    """Why the FP8 stage cannot run here, or None: torchao must import in a fresh interpreter (with
    the stages' PYTHONPATH), as the training run will import it."""
    code = "import torchao.float8, torchao; print(torchao.__version__)"
    try:
        proc = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "importing torchao took over 60 s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"torchao does not import ({last[:160]}); carry it and set GPU_CHECK_SITE (bench/gpu_check.py)"
    return None


def _environment(device):
    versions = (
        "import sys, torch; print('python', sys.version.split()[0], '· torch', torch.__version__, '· cuda', "
        "torch.version.cuda, '·', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    )
    commands = [[PY, "-c", versions]]
    if device == "cuda":
        query = "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem"
        commands = [["nvidia-smi", query, "--format=csv"], *commands, ["nvcc", "--version"]]
    return Stage("environment", commands, figures=last_line(r"^python "))


def _build(device):
    check = (
        "from megatron_sp.ops._extension import BUILT_DEVICES as d, _LOAD_ERROR as e\n"
        f"print('megatron_sp._C kernels for:', sorted(d), e or '')\nassert {device!r} in d, 'no {device} kernels'"
    )
    if device == "cpu":  # the dry run checks the developer's build; rebuilding would take minutes
        return Stage("build", [[PY, "-c", check]], log="build.log", figures=last_line("kernels for"))
    env = {
        "NVCC_APPEND_FLAGS": (os.environ.get("NVCC_APPEND_FLAGS", "") + " -Xptxas=-v").strip(),
        "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 8)),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
    }
    # never load an extension built elsewhere (CPU-only, another ABI)
    remove = (
        "import glob, os, shutil; shutil.rmtree('build', True); [os.remove(p) for p in glob.glob('megatron_sp/_C*.so')]"
    )
    clean = [PY, "-c", remove]
    commands = [clean, [PY, "setup.py", "build_ext", "--inplace"], [PY, "-c", check]]
    return Stage("build", commands, log="build.log", env=env, figures=ptxas_figures)


def _tests():
    import importlib.util

    def no_pytest():
        return None if importlib.util.find_spec("pytest") else "pytest is not installed"

    timeout = ["--timeout=60"] if importlib.util.find_spec("pytest_timeout") else []
    cmd = [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *timeout]
    # the CUDA op cases, the log-sum-exp vendor kernels of ring / Ulysses attention, and the
    # --tp-comm-overlap symmetric-memory ops in a one-rank NCCL group (seconds each; no nvcc run)
    cmd += ["tests/test_cuda_ops.py", "tests/test_ops_attention_lse.py", "tests/test_cuda_tp_overlap.py"]
    cmd += ["tests/test_model_init.py"]  # (the initial weights drawn on the GPU)
    figures = last_line(r"passed|failed|error")
    return Stage("tests", [cmd], log="tests.log", needs=("build",), figures=figures, precondition=no_pytest)


def _kernels(device, out):
    cmd = [PY, "bench/op_speed.py", "--device", device, "--no-compile", "--markdown", os.path.join(out, "kernels.md")]
    if device == "cpu":
        cmd += ["--scale", "16", "--repeats", "3"]
    return Stage("kernels", [cmd], needs=("build",), figures=kernels_figures)


def stages(device, out, scratch) -> List[Stage]:
    return [
        _environment(device),
        _speed_stage("speed_reference", device, False, 0.0, 12, scratch, out),
        _build(device),
        _tests(),
        _speed_stage("speed_fused_p0", device, True, 0.0, 12, scratch, out),
        _speed_stage("speed_fp8", device, True, 0.0, 12, scratch, out, FP8_FLAGS, torchao_problem, "speed_fused_p0"),
        _speed_stage("speed_fused_p01", device, True, 0.1, 6, scratch, out),
        _kernels(device, out),
    ]


def main() -> int:
    device = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    if device not in BUDGETS:
        print(f"GPU_CHECK_DEVICE must be cuda or cpu, not {device!r}.")
        return 2
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", "510" if device == "cuda" else "120"))
    out = os.environ.get("OUT") or "/tmp/megatron_sp_gpu_check"
    os.makedirs(out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="megatron_sp_gpu_check_")
    header = f"# bench/gpu_check.sh on {device} ({time.strftime('%Y-%m-%d %H:%M')}), scratch {scratch}"
    results = run_all(stages(device, out, scratch), BUDGETS[device], deadline, out, scratch, header)
    files = os.listdir(out)
    with open(os.path.join(out, "summary.md")) as f:
        print("\n" + f.read())
    if len(files) > MAX_OUT_FILES:
        print(f"[gpu_check] {len(files)} files under $OUT, more than {MAX_OUT_FILES}: {sorted(files)}")
    bad = [r for r in results if r.status.startswith(("failed", "timed out"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

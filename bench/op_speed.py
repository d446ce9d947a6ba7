"""Fused megatron_sp ops against PyTorch on the same inputs, in the same run.

    python bench/op_speed.py --device cpu     # C++ op vs its PyTorch reference: time, ratio
    python bench/op_speed.py --device cuda    # + bandwidth vs device copy, eager, torch.compile
    python bench/op_speed.py --device cuda --no-compile --dtype float32 --markdown out.md
    python bench/op_speed.py --device cpu --only rms_norm     # the cases whose name contains it
    python bench/op_speed.py --device cpu --only flash_attention --repeats 5

Every case is validated before it is timed (fused vs reference: masks bit-identical, values within
the dtype's tolerance); a case that fails (its check, or any error) is reported as FAILED and the
others still run; the exit status is then 1. Each case is printed (and appended to --markdown) as
soon as it is measured, so a run cut short keeps what it measured. CPU: wall-clock minimum over interleaved runs (the
minimum, not the median, because shared CI machines are noisy and the work is deterministic).
CUDA: CUDA-event median; bandwidth = compulsory bytes (each input read once, each output written
once) / time, and % of the measured device-to-device copy bandwidth (copy_ of a slab as large as the
largest case). Baselines: `reference` is the op's PyTorch reference in megatron_sp.ops (the same
numerics); `native` is what eager code usually calls (F.dropout with torch's RNG, F.layer_norm or
F.rms_norm in the input dtype); `compiled` is torch.compile of the native (or reference) code.
flash_attention: `explicit` is the s x s softmax of models/attention.causal_attention(explicit=True)
(its backward: autograd of that graph); the Python reference (block loops) runs up to s = 1024 only;
`sdpa p=0` is F.scaled_dot_product_attention without dropout (the speed our dropout kernel is held
to), `vendor lse` the log-sum-exp kernel ring attention uses at dropout 0 (ops/attention_lse.py).
Attention rows give TFLOP/s (causal: 2 b n s² d multiply-adds x 2 forward, 2.5x that backward)
instead of bandwidth: the kernels are compute-bound.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from megatron_sp import ops
from megatron_sp.models.attention import causal_attention
from megatron_sp.ops import layout
from megatron_sp.ops.attention_lse import attention_with_lse, attention_with_lse_backward
from megatron_sp.ops.flash_attention import (
    AttentionDropout,
    flash_attention_bwd_reference,
    flash_attention_fwd_reference,
)
from megatron_sp.ops.philox import DropoutIndex
from megatron_sp.testing import assert_close_dtype

MSP = torch.ops.megatron_sp
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Case:
    name: str  # op and shape
    nbytes: int  # compulsory bytes moved
    fused: Callable[[], object]
    baselines: Dict[str, Callable[[], object]]
    check: Callable[[], None]  # raises when the fused result is wrong
    compiled: Dict[str, Callable[[], object]] = field(default_factory=dict)
    flops: float = 0.0  # compute-bound cases (attention): floating-point operations per call


# ---- cases --------------------------------------------------------------------------------------


def _bda_cases(s, b, h, dtype, dev, compile_):
    x = torch.randn(s, b, h, device=dev, dtype=dtype)
    res = torch.randn(s, b, h, device=dev, dtype=dtype)
    bias = torch.randn(h, device=dev, dtype=dtype)
    index = DropoutIndex(torch.arange(s, device=dev), torch.arange(b, device=dev))
    pos, smp, p = index.token_positions, index.sample_ids, 0.1
    fused = lambda: MSP.dropout_add_fwd(x, bias, res, pos, smp, p, 1234, 3, 2, 0)
    ref = lambda: ops.dropout_add_reference(x, bias, res, p, 1234, 3, 2, index)
    native = lambda: res + F.dropout(x + bias, p, training=True)

    def check():
        assert_close_dtype(fused(), ref(), dtype)
        keep = MSP.dropout_add_fwd(torch.ones_like(x), None, torch.zeros_like(x), pos, smp, p, 1234, 3, 2, 0) != 0
        ones = ops.dropout_add_reference(torch.ones_like(x), None, torch.zeros_like(x), p, 1234, 3, 2, index) != 0
        assert torch.equal(keep, ones), "dropout mask differs from ops/philox.py"

    fwd = Case(
        f"dropout_add fwd [{s},{b},{h}]",
        3 * x.numel() * x.element_size(),
        fused,
        {"reference": ref, "native": native},
        check,
    )
    grad = torch.randn_like(x)
    fused_bwd = lambda: MSP.dropout_add_bwd(grad, pos, smp, p, 1234, 3, 2, 0, True)
    xr, br = x.clone().requires_grad_(), bias.clone().requires_grad_()
    out_ref = ops.dropout_add_reference(xr, br, res, p, 1234, 3, 2, index)
    ref_bwd = lambda: torch.autograd.grad(out_ref, (xr, br), grad, retain_graph=True)

    def check_bwd():
        gx, gb = fused_bwd()
        rx, rb = ref_bwd()
        assert_close_dtype(gx, rx, dtype)
        assert_close_dtype(gb, rb, dtype, scale=(s * b) ** 0.5)

    bwd = Case(
        f"dropout_add bwd [{s},{b},{h}]",
        2 * x.numel() * x.element_size(),
        fused_bwd,
        {"reference": ref_bwd},
        check_bwd,
    )
    if compile_:
        fwd.compiled = {
            "compiled native": torch.compile(lambda: res + F.dropout(x + bias, p)),
            "compiled reference": torch.compile(ref),
        }
    return [fwd, bwd]


def _ln_cases(rows, h, dtype, dev, compile_):
    x = torch.randn(rows, h, device=dev, dtype=dtype)
    w, b = torch.randn(h, device=dev, dtype=dtype), torch.randn(h, device=dev, dtype=dtype)
    fused = lambda: MSP.layer_norm_fwd(x, w, b, 1e-5)
    ref = lambda: ops.layer_norm_reference(x, w, b, 1e-5)
    native = lambda: F.layer_norm(x, (h,), w, b, 1e-5)
    fwd = Case(
        f"layer_norm fwd [{rows},{h}]",
        2 * x.numel() * x.element_size() + rows * 8,
        fused,
        {"reference": ref, "native": native},
        lambda: assert_close_dtype(fused()[0], ref(), dtype),
    )
    _, mean, rstd = fused()
    grad = torch.randn_like(x)
    fused_bwd = lambda: MSP.layer_norm_bwd(grad, x, w, mean, rstd)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    out_ref = ops.layer_norm_reference(*leaves, 1e-5)
    ref_bwd = lambda: torch.autograd.grad(out_ref, leaves, grad, retain_graph=True)

    def check_bwd():
        for i, (a, e) in enumerate(zip(fused_bwd(), ref_bwd())):
            assert_close_dtype(a, e, dtype, scale=4.0 if i == 0 else 4 * rows**0.5)

    bwd = Case(
        f"layer_norm bwd [{rows},{h}]",
        3 * x.numel() * x.element_size() + rows * 8,
        fused_bwd,
        {"reference": ref_bwd},
        check_bwd,
    )
    if compile_:
        fwd.compiled = {"compiled native": torch.compile(native)}
    return [fwd, bwd]


def _rms_cases(rows, h, dtype, dev, compile_):
    x = torch.randn(rows, h, device=dev, dtype=dtype)
    w = torch.randn(h, device=dev, dtype=dtype)
    fused = lambda: MSP.rms_norm_fwd(x, w, 1e-6)
    ref = lambda: ops.rms_norm_reference(x, w, 1e-6)
    native = lambda: F.rms_norm(x, (h,), w, 1e-6)
    fwd = Case(
        f"rms_norm fwd [{rows},{h}]",
        2 * x.numel() * x.element_size() + rows * 4,
        fused,
        {"reference": ref, "native": native},
        lambda: assert_close_dtype(fused()[0], ref(), dtype),
    )
    _, rstd = fused()
    grad = torch.randn_like(x)
    fused_bwd = lambda: MSP.rms_norm_bwd(grad, x, w, rstd)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    out_ref = ops.rms_norm_reference(*leaves, 1e-6)
    ref_bwd = lambda: torch.autograd.grad(out_ref, leaves, grad, retain_graph=True)

    def check_bwd():
        for i, (a, e) in enumerate(zip(fused_bwd(), ref_bwd())):
            assert_close_dtype(a, e, dtype, scale=4.0 if i == 0 else 4 * rows**0.5)

    bwd = Case(
        f"rms_norm bwd [{rows},{h}]",
        3 * x.numel() * x.element_size() + rows * 4,
        fused_bwd,
        {"reference": ref_bwd},
        check_bwd,
    )
    if compile_:
        fwd.compiled = {"compiled native": torch.compile(native)}
    return [fwd, bwd]


def _flash_cases(b, n, s, d, p, dtype, dev, with_reference):
    """Causal self-attention fwd and bwd: the fused op, the explicit s x s softmax, the reference, SDPA
    and the vendor log-sum-exp kernel (both without dropout). The forward outputs and the graphs the
    backwards need are made on first use (so that --only other cases do not pay for them)."""
    q, k, v = (torch.randn(b, n, s, d, device=dev, dtype=dtype) for _ in range(3))
    pos, samples = torch.arange(s, device=dev), torch.arange(b, device=dev)
    index, drop = DropoutIndex(pos, samples), AttentionDropout(p, 1234, 3, 0)
    args = (pos, pos, None, None, samples)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fused = lambda: MSP.flash_attention_fwd(q, k, v, *args, p, 1234, 3, 0)
    explicit = lambda: causal_attention(*leaves, dropout_p=p, seed=1234, layer=3, index=index, explicit=True)
    ref = lambda: flash_attention_fwd_reference(q, k, v, *args, drop)
    sdpa = lambda: F.scaled_dot_product_attention(*leaves, is_causal=True)
    vendor = lambda: attention_with_lse(q, k, v, causal=True)
    state = {}

    def saved():  # (out, lse) of the fused forward, dout, the explicit and SDPA graphs, the vendor (out, lse)
        if not state:
            state.update(fwd=fused(), dout=torch.randn_like(q), graph=explicit(), sdpa=sdpa(), vendor=vendor())
        return state

    fused_bwd = lambda: MSP.flash_attention_bwd(saved()["dout"], q, k, v, *saved()["fwd"], *args, p, 1234, 3, 0)
    ref_bwd = lambda: flash_attention_bwd_reference(saved()["dout"], q, k, v, *saved()["fwd"], *args, drop)
    explicit_bwd = lambda: torch.autograd.grad(saved()["graph"], leaves, saved()["dout"], retain_graph=True)
    sdpa_bwd = lambda: torch.autograd.grad(saved()["sdpa"], leaves, saved()["dout"], retain_graph=True)
    vendor_bwd = lambda: attention_with_lse_backward(saved()["dout"], q, k, v, *saved()["vendor"], causal=True)

    def check():  # against the reference where it runs, else the explicit softmax; the vendor vs SDPA
        want = ref()[0] if with_reference else saved()["graph"].detach()
        assert_close_dtype(saved()["fwd"][0], want, dtype, scale=2.0)
        assert_close_dtype(saved()["vendor"][0], saved()["sdpa"].detach(), dtype, scale=2.0)

    def check_bwd():
        want = ref_bwd() if with_reference else explicit_bwd()
        for a, e in zip(fused_bwd(), want):
            assert_close_dtype(a, e, dtype, scale=2 * (1 + e.float().abs().max().item()))
        for a, e in zip(vendor_bwd(), sdpa_bwd()):
            assert_close_dtype(a, e, dtype, scale=2 * (1 + e.float().abs().max().item()))

    name = f"[{b},{n},{s},{d}] p={p}"
    nbytes = 4 * q.numel() * q.element_size()
    flops = 2 * 2 * b * n * s * s * d / 2  # two [s, s] x d matmuls, causal half
    base_fwd = {"explicit": explicit, "sdpa p=0": sdpa, "vendor lse p=0": vendor}
    base_bwd = {"explicit": explicit_bwd, "sdpa p=0": sdpa_bwd, "vendor lse p=0": vendor_bwd}
    if with_reference:
        base_fwd["reference"], base_bwd["reference"] = ref, ref_bwd
    return [
        Case(f"flash_attention fwd {name}", nbytes, fused, base_fwd, check, flops=flops),
        Case(f"flash_attention bwd {name}", 2 * nbytes, fused_bwd, base_bwd, check_bwd, flops=2.5 * flops),
    ]


def _layout_case(name, x, k, compile_, args=()):
    fused = lambda: getattr(MSP, name)(x, k, *args)
    ref = lambda: getattr(layout, name + "_reference")(x, k, *args)

    def check():
        assert torch.equal(fused(), ref()), f"{name} differs from its reference"

    case = Case(f"{name} {list(x.shape)} k={k}", 2 * x.numel() * x.element_size(), fused, {"reference": ref}, check)
    if compile_:
        case.compiled = {"compiled reference": torch.compile(ref)}
    return case


def build_cases(device, dtype, compile_, scale):
    """scale 1: the GPU sizes (a [8192, 8192] bf16 slab); CPU runs smaller shapes."""
    if device == "cuda":  # 128 MiB bf16 slabs
        s, b, h, rows, p, n, d = 2048, 4, 8192, 8192, 8, 64, 128
    else:
        s, b, h, rows, p, n, d = 1024 // scale, 4, 1024, 4096 // scale, 4, 16, 64  # 16 MiB slabs
    dev = device
    cases = _bda_cases(s, b, h, dtype, dev, compile_) + _ln_cases(rows, h, dtype, dev, compile_)
    cases += _rms_cases(rows, h, dtype, dev, compile_)
    t = 4  # every layout case moves one [s, b, h]-sized slab
    cases += [
        _layout_case("ulysses_pack", torch.randn(s, b, n, d, device=dev, dtype=dtype), p, compile_),
        _layout_case("ulysses_unpack", torch.randn(p, s, b, n // p, d, device=dev, dtype=dtype), p, compile_),
        _layout_case("gather_to_last_dim", torch.randn(s, b, h, device=dev, dtype=dtype), t, compile_),
        _layout_case("last_dim_to_gather", torch.randn(s, b, h, device=dev, dtype=dtype), t, compile_),
        _layout_case("zigzag_reorder", torch.randn(s, b, h, device=dev, dtype=dtype), p, compile_, (0, False)),
    ]
    if device == "cuda":  # b, heads, s, d, dropout, with the Python reference
        attention = [(2, 16, 2048, 128, 0.1, False), (2, 16, 4096, 64, 0.0, False)]
    else:
        attention = [
            (1, 8, 256 // scale, 64, 0.0, True),
            (1, 8, 256 // scale, 64, 0.1, True),
            (1, 8, 1024 // scale, 64, 0.0, True),
            (1, 8, 2048 // scale, 64, 0.0, False),
        ]
    for shape in attention:
        cases += _flash_cases(*shape[:5], dtype, dev, shape[5])
    return cases


def saved_bytes_lines(s, b, h, dtype, dev) -> List[str]:
    """Bytes autograd keeps for the backward of one dropout_add site (a bias and a residual), reference vs fused."""
    index = DropoutIndex(torch.arange(s, device=dev), torch.arange(b, device=dev))

    def saved(fused):
        x = torch.randn(s, b, h, device=dev, dtype=dtype, requires_grad=True)
        bias = torch.randn(h, device=dev, dtype=dtype, requires_grad=True)
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            ops.dropout_add(x, bias, torch.randn_like(x), 0.1, 1, 0, 2, index, fused=fused)
        return sum(sizes)

    ref, fused = saved(False), saved(True)
    return [
        f"saved for backward by one dropout_add [{s},{b},{h}] {str(dtype)[6:]}: "
        f"reference {ref} B (its bool keep mask: {s * b * h} B at 1 byte), fused {fused} B "
        f"(positions + sample ids)",
        "",
    ]


# ---- timing -------------------------------------------------------------------------------------


def time_cpu(fns: Dict[str, Callable], repeats: int) -> Dict[str, float]:
    """Fastest call in seconds; the candidates are interleaved so drift hits all alike."""
    for fn in fns.values():
        fn(), fn()
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in samples.items()}


def time_cuda(fns: Dict[str, Callable], repeats: int) -> Dict[str, float]:
    out = {}
    for k, fn in fns.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[k] = statistics.median(times)
    return out


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Device-to-device copy_ bandwidth (read + write bytes / s) on a slab of nbytes."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = time_cuda({"copy": lambda: dst.copy_(src)}, repeats)["copy"]
    return 2 * src.numel() / t


# ---- report -------------------------------------------------------------------------------------


def header(args) -> List[str]:
    cpu = platform.processor() or platform.machine()
    lines = [
        f"date {datetime.date.today()} · torch {torch.__version__} · dtype {args.dtype} · "
        f"device {args.device} · threads {torch.get_num_threads()} · {cpu}",
        "command: " + " ".join(["python"] + sys.argv),
    ]
    if args.device == "cuda":
        lines.append(f"gpu {torch.cuda.get_device_name()} · CUDA {torch.version.cuda}")
    return lines


def run(args, emit) -> int:
    """Measures every case, passing each report's lines to `emit` as soon as they exist; returns the
    number of cases that failed."""
    dtype = DTYPES[args.dtype]
    cases = build_cases(args.device, dtype, args.compile and args.device == "cuda", args.scale)
    cases = [c for c in cases if args.only is None or args.only in c.name]
    if not cases:
        raise SystemExit(f"no case name contains --only {args.only!r}")
    emit(header(args))
    timer = time_cuda if args.device == "cuda" else time_cpu
    copy_bw = None
    if args.device == "cuda":
        copy_bw = copy_bandwidth(max(c.nbytes for c in cases), args.repeats)
        emit([f"device copy bandwidth: {copy_bw / 1e12:.3f} TB/s (read + write)"])
    emit([""] + saved_bytes_lines(256, 2, 1024, dtype, args.device))
    failed = 0
    for case in cases:
        try:
            case.check()
            times = timer({"fused": case.fused, **case.baselines, **case.compiled}, args.repeats)
            emit(format_case(case, times, copy_bw))
        except Exception as err:  # one case's failure must not lose the others' figures
            failed += 1
            emit([f"{case.name}", f"  FAILED: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"])
    return failed


def format_case(case: Case, times: Dict[str, float], copy_bw) -> List[str]:
    fused = times["fused"]
    out = [f"{case.name}  ({case.nbytes / 2**20:.1f} MiB compulsory)"]
    for k, t in times.items():
        row = f"  {k:<20} {t * 1e3:9.3f} ms"
        if k != "fused":
            row += f"   fused speed-up x{t / fused:6.2f}"
        if case.flops:
            row += f"   {case.flops / t / 1e12:8.3f} TFLOP/s"
        elif copy_bw:
            bw = case.nbytes / t
            row += f"   {bw / 1e12:6.3f} TB/s  {100 * bw / copy_bw:5.1f}% of copy"
        out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per candidate")
    parser.add_argument("--scale", type=int, default=1, help="cpu: divide the sequence by this")
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="cuda: skip the torch.compile baselines"
    )
    parser.add_argument("--markdown", help="also write the report to this file")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.repeats = args.repeats or (50 if args.device == "cuda" else 25)
    if not ops.extension_available():
        print("megatron_sp._C is not built: nothing to compare (pip install --no-build-isolation -e .)")
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda needs a GPU")
        return 1
    torch.manual_seed(0)
    markdown = open(args.markdown, "w") if args.markdown else None

    def emit(lines):
        print("\n".join(lines), flush=True)
        if markdown:
            markdown.write("\n".join(lines) + "\n")
            markdown.flush()

    if markdown:
        markdown.write("```\n")
    try:
        failed = run(args, emit)
    finally:
        if markdown:
            markdown.write("```\n")
            markdown.close()
    if failed:
        print(f"{failed} case(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

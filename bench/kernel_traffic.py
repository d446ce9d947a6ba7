"""Global-memory bytes each CUDA kernel moves, counted on the CPU emulator (no GPU needed).

    PYTHONPATH=tests python bench/kernel_traffic.py      # bf16, an H200's launch geometry (132 SMs)
    PYTHONPATH=tests python bench/kernel_traffic.py --sms 66 --dtype float32
    PYTHONPATH=tests python bench/kernel_traffic.py --csrc /path/to/other/checkout/csrc   # other kernels

The unmodified csrc/cuda/*.cu are built for tests/cuda_emulator/ with every load and store of the
kernel files routed to a counter (build mode "traffic"); each op then runs once on the shapes below
and every buffer it is given is watched. Per op the table gives the compulsory bytes (each input
read once, each output written once), the *distinct* bytes the kernels touched (each byte of a
buffer counted once per direction: the DRAM traffic if every re-read hit a cache) and the *requested*
bytes (every access counted: an upper bound, as if no re-read hit a cache; per-thread loads of the
row indices count once per thread although a GPU broadcasts them within a warp), and the buffers
that make the difference. These are byte counts, not speed: the share of the H200's copy bandwidth
an op reaches is measured only by bench/kernels.py --device cuda on a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time

import torch

from megatron_sp.testing import random_index

try:  # the emulator harness lives in tests/, outside the package
    from cuda_emulator import build as emulator_build
    from cuda_emulator.run_cases import DTYPE_CODE, load
except ModuleNotFoundError as err:
    raise SystemExit(f"{err}: run this bench as `PYTHONPATH=tests python bench/kernel_traffic.py`") from err


class Traffic:
    """Watches buffers of one op call and reports what the kernels moved in each."""

    def __init__(self, lib):
        self.lib = lib  # from run_cases.load(): the emu_traffic_* signatures are set there

    def measure(self, buffers, call):
        """buffers: {name: tensor}; call(): runs the op. Returns {name: (loaded, stored,
        distinct loaded, distinct stored)} in bytes."""
        self.lib.emu_traffic_clear()
        ids = {
            name: self.lib.emu_traffic_watch(t.data_ptr(), t.numel() * t.element_size())
            for name, t in buffers.items()
            if t is not None and t.numel() > 0
        }
        err = call()
        assert err == 0, f"launcher returned cudaError {err}"
        out = {}
        for name, region in ids.items():
            counts = (ctypes.c_uint64 * 4)()
            self.lib.emu_traffic_of(region, counts)
            out[name] = tuple(counts)
        self.lib.emu_traffic_clear()
        return out


def nbytes(t):
    return t.numel() * t.element_size()


def run_ops(lib, dtype, s, b, h, heads, head_dim, p):
    """[(op, compulsory, {buffer: counts}, buffers)] for every op at the given shapes."""
    traffic, code = Traffic(lib), DTYPE_CODE[dtype]
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    index = random_index(s, b)
    pos, samples = index.token_positions.contiguous(), index.sample_ids.contiguous()
    x, res, grad = (torch.randn(s, b, h).to(dtype) for _ in range(3))
    bias, w = torch.randn(h).to(dtype), torch.randn(h).to(dtype)
    drop = (0.1, 1234, 3, 1, 0)
    results = []

    out = torch.empty_like(x)
    bufs = {"x": x, "residual": res, "bias": bias, "out": out, "positions": pos, "sample ids": samples}
    counts = traffic.measure(
        bufs,
        lambda: lib.emu_bda_fwd(ptr(x), ptr(bias), ptr(res), ptr(out), ptr(pos), ptr(samples), s, b, h, code, *drop),
    )
    results.append(("bias_dropout_add fwd", nbytes(x) * 3 + nbytes(bias), counts))

    grad_x, grad_bias = torch.empty_like(grad), torch.empty(h)
    scratch = torch.empty(lib.emu_bda_bwd_scratch(s, b, h, code))
    bufs = {
        "grad": grad,
        "grad_x": grad_x,
        "grad_bias": grad_bias,
        "scratch (partial sums)": scratch,
        "positions": pos,
        "sample ids": samples,
    }
    counts = traffic.measure(
        bufs,
        lambda: lib.emu_bda_bwd(
            ptr(grad), ptr(grad_x), ptr(grad_bias), ptr(scratch), ptr(pos), ptr(samples), s, b, h, code, *drop
        ),
    )
    results.append(("bias_dropout_add bwd", nbytes(grad) * 2 + nbytes(grad_bias), counts))

    rows = s * b
    y, mean, rstd = torch.empty_like(x), torch.empty(rows), torch.empty(rows)
    bufs = {"x": x, "weight": w, "bias": bias, "y": y, "mean": mean, "rstd": rstd}
    counts = traffic.measure(
        bufs, lambda: lib.emu_ln_fwd(ptr(x), ptr(w), ptr(bias), ptr(y), ptr(mean), ptr(rstd), rows, h, 1e-5, code, code)
    )
    results.append(("layer_norm fwd", nbytes(x) * 2 + 2 * nbytes(w) + 2 * nbytes(mean), counts))

    dx, sums = torch.empty_like(x), torch.empty(2 * h)
    scratch = torch.empty(lib.emu_ln_bwd_scratch(rows, h, code))
    bufs = {
        "grad": grad,
        "x": x,
        "weight": w,
        "mean": mean,
        "rstd": rstd,
        "grad_x": dx,
        "grad_weight_bias": sums,
        "scratch (partial sums)": scratch,
    }
    counts = traffic.measure(
        bufs,
        lambda: lib.emu_ln_bwd(
            ptr(grad), ptr(x), ptr(w), ptr(mean), ptr(rstd), ptr(dx), ptr(sums), ptr(scratch), rows, h, code, code
        ),
    )
    results.append(("layer_norm bwd", nbytes(x) * 3 + nbytes(w) + 2 * nbytes(mean) + nbytes(sums), counts))

    rstd = torch.empty(rows)
    bufs = {"x": x, "weight": w, "y": y, "rstd": rstd}
    counts = traffic.measure(
        bufs, lambda: lib.emu_rms_fwd(ptr(x), ptr(w), ptr(y), ptr(rstd), rows, h, 1e-6, code, code)
    )
    results.append(("rms_norm fwd", nbytes(x) * 2 + nbytes(w) + nbytes(rstd), counts))

    grad_w = torch.empty(h)
    scratch = torch.empty(lib.emu_rms_bwd_scratch(rows, h, code))
    bufs = {
        "grad": grad,
        "x": x,
        "weight": w,
        "rstd": rstd,
        "grad_x": dx,
        "grad_weight": grad_w,
        "scratch (partial sums)": scratch,
    }
    counts = traffic.measure(
        bufs,
        lambda: lib.emu_rms_bwd(
            ptr(grad), ptr(x), ptr(w), ptr(rstd), ptr(dx), ptr(grad_w), ptr(scratch), rows, h, code, code
        ),
    )
    results.append(("rms_norm bwd", nbytes(x) * 3 + nbytes(w) + nbytes(rstd) + nbytes(grad_w), counts))

    # Ulysses pack [s, b, n, d] -> [p, s, b, n/p, d] (a = s*b, b = p, run = n/p*d) and the others.
    qkv = torch.randn(s, b, heads, head_dim).to(dtype)
    el = qkv.element_size()
    layouts = [
        ("ulysses_pack (p = 4)", s * b, 4, heads // 4 * head_dim),
        ("ulysses_unpack (p = 4)", 4, s * b, heads // 4 * head_dim),
        ("gather_to_last_dim (t = 4)", 4, s // 4 * b, heads * head_dim),
    ]
    for name, a, bb, run in layouts:
        dst = torch.empty_like(qkv)
        counts = traffic.measure(
            {"in": qkv, "out": dst}, lambda: lib.emu_block_transpose(ptr(qkv), ptr(dst), a, bb, run * el)
        )
        results.append((name, 2 * nbytes(qkv), counts))
    dst = torch.empty_like(qkv)
    counts = traffic.measure(
        {"in": qkv, "out": dst}, lambda: lib.emu_zigzag_reorder(ptr(qkv), ptr(dst), 1, 4, qkv.numel() // 8 * el, 0)
    )
    results.append(("zigzag_reorder (p = 4)", 2 * nbytes(qkv), counts))
    return results


def report(results):
    lines = [
        "op                           compulsory    distinct   requested  distinct/  requested/",
        "                                  (MiB)       (MiB)       (MiB)  compulsory compulsory",
        "---------------------------  ----------  ----------  ----------  ---------- ----------",
    ]
    notes = []
    for op, compulsory, counts in results:
        distinct = sum(c[2] + c[3] for c in counts.values())
        requested = sum(c[0] + c[1] for c in counts.values())
        lines.append(
            f"{op:27s}  {compulsory / 2**20:10.3f}  {distinct / 2**20:10.3f}  "
            f"{requested / 2**20:10.3f}  {distinct / compulsory:10.3f} "
            f"{requested / compulsory:10.3f}"
        )
        for name, (ld, st, dld, dst) in counts.items():
            if ld != dld or name.startswith("scratch"):
                notes.append(
                    f"  {op}: {name}: {dld / 2**20:.3f} MiB distinct read "
                    f"{ld / max(dld, 1):.2f}x, {dst / 2**20:.3f} MiB written"
                )
    return lines + ["", "buffers read more than once, and scratch:"] + notes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--sms", type=int, default=132, help="SM count the emulator reports")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument(
        "--csrc", default=emulator_build.CSRC, help="kernel sources to count (default: this tree's csrc/)"
    )
    args = parser.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        lib = load(emulator_build.build(tmp, "traffic", csrc=args.csrc))
        lib.emu_set_sm_count(args.sms)
        dtype = getattr(torch, args.dtype)
        results = run_ops(
            lib,
            dtype,
            args.seq_length,
            args.micro_batch_size,
            args.hidden_size,
            args.num_attention_heads,
            args.hidden_size // args.num_attention_heads,
            0.1,
        )
    print(
        f"global-memory bytes per op, counted on the CPU emulator — {args.dtype}, "
        f"[s, b, h] = [{args.seq_length}, {args.micro_batch_size}, {args.hidden_size}], "
        f"{args.num_attention_heads} heads, {args.sms} SMs (launch geometry), torch {torch.__version__}"
    )
    print("\n".join(report(results)))
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()

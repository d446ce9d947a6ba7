"""Global-memory bytes each CUDA kernel moves, counted on the CPU emulator (no GPU needed).

    PYTHONPATH=tests python bench/kernel_traffic.py      # bf16, an H200's launch geometry (132 SMs)
    PYTHONPATH=tests python bench/kernel_traffic.py --sms 66 --dtype float32
    PYTHONPATH=tests python bench/kernel_traffic.py --csrc /path/to/other/checkout/csrc   # other kernels

The unmodified csrc/cuda/*.cu are built for tests/cuda_emulator/ with every load and store of the
kernel files routed to a counter (build mode "traffic"); each op then runs once, through its CUDA
binding (torch.ops.megatron_sp_emulated), on the shapes below, and every buffer it is given or
allocates (outputs, scratch) is watched. Per op the table gives the compulsory bytes (each input
read once, each output written once), the *distinct* bytes the kernels touched (each byte of a
buffer counted once per direction: the DRAM traffic if every re-read hit a cache) and the *requested*
bytes (every access counted: an upper bound, as if no re-read hit a cache; per-thread loads of the
row indices count once per thread although a GPU broadcasts them within a warp), and the buffers
that make the difference. These are byte counts, not speed: the share of the H200's copy bandwidth
an op reaches is measured only by bench/op_speed.py --device cuda on a GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from megatron_sp.testing import random_index

try:  # the emulator harness lives in tests/, outside the package
    from cuda_emulator import build as emulator_build
    from cuda_emulator.run_cases import load
except ModuleNotFoundError as err:
    raise SystemExit(f"{err}: run this bench as `PYTHONPATH=tests python bench/kernel_traffic.py`") from err


def measure(E, call, inputs: dict, outputs: tuple) -> tuple:
    """Runs call() (one op of the emulated library E) with its inputs and its allocations watched.
    Returns (call's result, {buffer: (loaded, stored, distinct loaded, distinct stored) bytes}): inputs
    by their names, outputs by `outputs` (the names of the returned tensors, in order), and the other
    allocations as "scratch (partial sums)" when a kernel read them back, else "temporary"."""
    E.traffic_clear()
    names = {}
    for name, t in inputs.items():
        if t is not None and t.numel() > 0:
            E.traffic_watch(t)
            names[t.data_ptr()] = name
    E.traffic_watch_allocations(True)
    try:
        result = call()
    finally:
        E.traffic_watch_allocations(False)
    returned = result if isinstance(result, tuple) else (result,)
    names.update({t.data_ptr(): name for name, t in zip(outputs, returned) if t.numel() > 0})
    counts = {}
    for begin, _, *count in E.traffic_regions().tolist():
        name = names.get(begin) or ("scratch (partial sums)" if count[0] else "temporary")
        counts[name] = tuple(a + b for a, b in zip(counts.get(name, (0, 0, 0, 0)), count))
    return result, counts


def nbytes(t):
    return t.numel() * t.element_size()


def run_ops(E, dtype, s, b, h, heads, head_dim):
    """[(op, compulsory bytes, {buffer: counts})] for every op at the given shapes."""
    index = random_index(s, b)
    pos, samples = index.token_positions.contiguous(), index.sample_ids.contiguous()
    x, res, grad = (torch.randn(s, b, h).to(dtype) for _ in range(3))
    bias, w = torch.randn(h).to(dtype), torch.randn(h).to(dtype)
    drop = (0.1, 1234, 3, 1, 0)
    rows = s * b
    results = []

    def run(op, compulsory, call, inputs, outputs):
        result, counts = measure(E, call, inputs, outputs)
        results.append((op, compulsory, counts))
        return result

    index_in = {"positions": pos, "sample ids": samples}
    run(
        "dropout_add fwd",
        nbytes(x) * 3 + nbytes(bias),
        lambda: E.dropout_add_fwd(x, bias, res, pos, samples, *drop),
        {"x": x, "residual": res, "bias": bias, **index_in},
        ("out",),
    )
    run(
        "dropout_add fwd (embedding)",
        nbytes(x) * 3,
        lambda: E.dropout_add_fwd(x, res, None, pos, samples, *drop),
        {"x": x, "position embeddings": res, **index_in},
        ("out",),
    )
    run(
        "dropout_add bwd",
        nbytes(grad) * 2 + h * 4,
        lambda: E.dropout_add_bwd(grad, pos, samples, *drop, True),
        {"grad": grad, "positions": pos, "sample ids": samples},
        ("grad_x", "grad_bias"),
    )

    y, mean, rstd = run(
        "layer_norm fwd",
        nbytes(x) * 2 + 2 * nbytes(w) + 2 * rows * 4,
        lambda: E.layer_norm_fwd(x, w, bias, 1e-5),
        {"x": x, "weight": w, "bias": bias},
        ("y", "mean", "rstd"),
    )
    ln_in = {"grad": grad, "x": x, "weight": w, "mean": mean, "rstd": rstd}
    run(
        "layer_norm bwd",
        nbytes(x) * 3 + nbytes(w) + 2 * nbytes(mean) + 2 * h * 4,
        lambda: E.layer_norm_bwd(grad, x, w, mean, rstd),
        ln_in,
        ("grad_x", "grad_weight", "grad_bias"),
    )

    y, rstd = run(
        "rms_norm fwd",
        nbytes(x) * 2 + nbytes(w) + rows * 4,
        lambda: E.rms_norm_fwd(x, w, 1e-6),
        {"x": x, "weight": w},
        ("y", "rstd"),
    )
    run(
        "rms_norm bwd",
        nbytes(x) * 3 + nbytes(w) + nbytes(rstd) + h * 4,
        lambda: E.rms_norm_bwd(grad, x, w, rstd),
        {"grad": grad, "x": x, "weight": w, "rstd": rstd},
        ("grad_x", "grad_weight"),
    )

    qkv = torch.randn(s, b, heads, head_dim).to(dtype)  # [s, b, n, d]
    for name, call in [
        ("ulysses_pack (p = 4)", lambda: E.ulysses_pack(qkv, 4)),
        ("ulysses_unpack (p = 4)", lambda: E.ulysses_unpack(qkv.view(4, s, b, heads // 4, head_dim), 4)),
        ("gather_to_last_dim (t = 4)", lambda: E.gather_to_last_dim(qkv.view(s, b, -1), 4)),
        ("zigzag_reorder (p = 4)", lambda: E.zigzag_reorder(qkv, 4, 0, False)),
    ]:
        run(name, 2 * nbytes(qkv), call, {"in": qkv}, ("out",))
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
        target = load(emulator_build.build(tmp, "traffic", csrc=args.csrc))
        target.set_sm_count(args.sms)
        results = run_ops(
            target.ops,
            getattr(torch, args.dtype),
            args.seq_length,
            args.micro_batch_size,
            args.hidden_size,
            args.num_attention_heads,
            args.hidden_size // args.num_attention_heads,
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

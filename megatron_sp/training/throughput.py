"""Throughput figures: tokens/s, achieved TFLOP/s per device and MFU against a stated peak."""
from __future__ import annotations

import time

import torch

# Dense peak TFLOP/s per GPU by (name fragment, dtype). Sources: NVIDIA data sheets (SXM parts).
_GPU_PEAKS = [
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 183.0}),
]


def measured_cpu_peak(dtype=torch.float32, n: int = 512, seconds: float = 0.3) -> float:
    """Matmul throughput of this process on the CPU, in TFLOP/s (the CPU has no data-sheet peak)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.matmul(a, b)
        count += 1
    return 2 * n ** 3 * count / (time.perf_counter() - start) / 1e12


def peak_tflops(device: str, precision: str, override=None) -> tuple[float, str]:
    """(peak TFLOP/s per device, where the figure comes from)."""
    if override:
        return float(override), "--peak-tflops"
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for fragment, peaks in _GPU_PEAKS:
            if fragment in name:
                return peaks[precision], f"{name} {precision} data sheet"
        return 100.0, f"unknown GPU {name}: assumed 100 TFLOP/s (set --peak-tflops)"
    return measured_cpu_peak(), "measured fp32 matmul on this CPU process"


def throughput(flops_per_token: float, tokens: int, seconds: float, world_size: int, peak: float) -> dict:
    tokens_per_sec = tokens / max(seconds, 1e-9)
    tflops = flops_per_token * tokens_per_sec / world_size / 1e12
    return {"tokens_per_sec": tokens_per_sec, "tflops": tflops, "mfu": tflops / peak if peak else 0.0}

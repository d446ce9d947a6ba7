"""Throughput figures: tokens/s, achieved TFLOP/s per device and MFU against a stated peak.

MFU is reported only against a peak that is known (a data-sheet figure for a recognised GPU) or
stated (--peak-tflops). A CPU has no data-sheet peak, and measuring one at start-up is not a peak:
on a loaded machine the matmul probe ran slower than training later did and MFU read 244%. Without
a known peak MFU is None ("n/a" in the log line).
"""

from __future__ import annotations

from typing import Optional

import torch

# Dense peak TFLOP/s per GPU by (name fragment, dtype). Sources: NVIDIA data sheets (SXM parts).
_GPU_PEAKS = [
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 183.0}),
]


def peak_tflops(device: str, precision: str, override=None) -> tuple[Optional[float], str]:
    """(peak TFLOP/s per device or None when unknown, where the figure comes from)."""
    if override:
        return float(override), "--peak-tflops"
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for fragment, peaks in _GPU_PEAKS:
            if fragment in name:
                return peaks[precision], f"{name} {precision} data sheet"
        return None, f"unknown GPU {name}: no MFU without --peak-tflops"
    return None, "no data-sheet peak for a CPU: no MFU without --peak-tflops"


def throughput(flops_per_token: float, tokens: int, seconds: float, world_size: int, peak: Optional[float]) -> dict:
    tokens_per_sec = tokens / max(seconds, 1e-9)
    tflops = flops_per_token * tokens_per_sec / world_size / 1e12
    return {"tokens_per_sec": tokens_per_sec, "tflops": tflops, "mfu": tflops / peak if peak else None}

"""Shared by the op tests (tests/test_ops_*.py, tests/test_cuda_*.py) and bench/op_speed.py:
dtype-based tolerances and random inputs. Tolerances follow torch.testing's per-dtype defaults,
loosened where the fused op rounds once in fp32 and the reference rounds after every step.
"""

from __future__ import annotations

import torch

from megatron_sp.ops.philox import DropoutIndex

# (rtol, atol) for values of order one.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def assert_close_dtype(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """assert_close with dtype's tolerance; `scale` widens atol for sums of many terms."""
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol * scale)


def assert_same_error(call_a, call_b) -> None:
    """Both calls raise a RuntimeError with the same first line (e.g. the emulated CUDA binding and the
    CPU op refusing the same bad arguments)."""
    messages = []
    for call in (call_a, call_b):
        try:
            call()
        except RuntimeError as e:
            messages.append(str(e).split("\n")[0])
        else:
            messages.append(None)
    assert messages[0] is not None and messages[0] == messages[1], messages


def random_index(s: int, b: int, device="cpu", generator=None) -> DropoutIndex:
    """Global positions with an offset (a sequence shard) and sample ids beyond 2^32."""
    start = int(torch.randint(0, 1000, (1,), generator=generator))
    positions = torch.arange(start, start + s, device=device)
    samples = torch.randint(0, 1 << 40, (b,), generator=generator).to(device)
    return DropoutIndex(positions, samples)


def randn(shape, dtype, device="cpu", requires_grad=False, generator=None) -> torch.Tensor:
    x = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)

"""Cases of the layout ops' CUDA kernels (csrc/cuda/layout.cu) and binding: exact copies."""

from __future__ import annotations

import torch

from cuda_cases import DTYPE_NAME, Case, cpu, opcheck
from megatron_sp.ops import layout
from megatron_sp.testing import assert_same_error

CPU_OPS = torch.ops.megatron_sp


def results_case(target, name, shape, k, dtype, align=True):
    """One of ulysses_pack/unpack, gather_to_last_dim, last_dim_to_gather against its reference."""
    x = torch.randint(0, 100, shape).to(dtype)
    got = cpu(getattr(target.ops, name)(target.put(x, misaligned=not align), k))
    assert torch.equal(got, getattr(layout, name + "_reference")(x, k)), f"{name} differs"


def zigzag_case(target, shape, p, dim, inverse, dtype=torch.bfloat16, align=True):
    x = torch.randn(shape).to(dtype)
    got = cpu(target.ops.zigzag_reorder(target.put(x, misaligned=not align), p, dim, inverse))
    assert torch.equal(got, layout.zigzag_reorder_reference(x, p, dim, inverse)), "zigzag differs"


def binding_case(target, dtype):
    """Non-contiguous inputs, negative dims, output dtypes, opcheck, the same errors as the CPU ops."""
    x4 = torch.randint(0, 100, (6, 3, 8, 5)).to(dtype)
    x5 = torch.randint(0, 100, (4, 6, 3, 2, 5)).to(dtype)
    x3 = torch.randint(0, 100, (12, 3, 10)).to(dtype)
    calls = [
        ("ulysses_pack", x4, (4,)),
        ("ulysses_pack", x4.transpose(0, 1).contiguous().transpose(0, 1), (2,)),
        ("ulysses_unpack", x5, (4,)),
        ("gather_to_last_dim", x3, (3,)),
        ("gather_to_last_dim", x3[:, :, 1:9], (4,)),
        ("last_dim_to_gather", x3, (5,)),
        ("zigzag_reorder", x3, (3, 0, False)),
        ("zigzag_reorder", x3, (5, -1, True)),
        ("zigzag_reorder", x3[::2], (1, 0, True)),
    ]
    for name, x, args in calls:
        x_on = _same_view(target, x)
        got, expected = getattr(target.ops, name)(x_on, *args), getattr(CPU_OPS, name)(x, *args)
        assert got.dtype == expected.dtype and torch.equal(cpu(got), expected), (name, x.shape, args)
        opcheck(getattr(target.ops, name), (x_on, *args))
    x4_on, x3_on = target.put(x4), target.put(x3)
    assert_same_error(lambda: target.ops.ulysses_pack(x4_on, 3), lambda: CPU_OPS.ulysses_pack(x4, 3))
    assert_same_error(
        lambda: target.ops.zigzag_reorder(x3_on, 4, 0, False), lambda: CPU_OPS.zigzag_reorder(x3, 4, 0, False)
    )


def _same_view(target, x):
    """x's values on the target with x's strides and storage offset (a view of a copy of its base)."""
    base = x._base if x._base is not None else x
    return target.put(base).as_strided(x.shape, x.stride(), x.storage_offset())


def cases() -> list:
    out = []
    # emulated: small shapes with partial vectors (odd runs) and full 16-byte vectors; GPU only: the
    # model's sizes.
    for name, shape, k, emulate in [
        ("ulysses_pack", (16, 2, 8, 64), 4, True),
        ("ulysses_pack", (5, 3, 6, 7), 3, True),
        ("ulysses_unpack", (4, 8, 2, 2, 64), 4, True),
        ("ulysses_unpack", (3, 5, 2, 2, 7), 3, True),
        ("gather_to_last_dim", (64, 3, 32), 4, True),
        ("gather_to_last_dim", (6, 5, 9), 2, True),
        ("last_dim_to_gather", (16, 3, 128), 4, True),
        ("last_dim_to_gather", (3, 5, 10), 5, True),
        ("ulysses_pack", (64, 2, 32, 128), 4, False),
        ("ulysses_unpack", (4, 64, 2, 8, 128), 4, False),
        ("gather_to_last_dim", (512, 3, 256), 4, False),
        ("last_dim_to_gather", (128, 3, 1024), 4, False),
    ]:
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            case = f"{name}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}"
            race = case == "ulysses_pack-5x3x6x7-uint8"
            out.append(Case(case, results_case, (name, shape, k, dtype), 1, race, emulate))
    out.append(
        Case("ulysses_pack-misaligned-bf16", results_case, ("ulysses_pack", (4, 2, 4, 16), 2, torch.bfloat16, False))
    )
    for shape, p, dim, emulate in [
        ((512, 2, 64), 4, 0, True),
        ((2, 24, 3), 3, 1, True),
        ((3, 2, 10), 5, 2, True),
        ((8, 1), 2, 0, True),
        ((4096, 2, 64), 4, 0, False),
    ]:
        for inverse in (False, True):
            case = f"zigzag-{'x'.join(map(str, shape))}-p{p}-dim{dim}-{'inv' if inverse else 'fwd'}"
            out.append(
                Case(case, zigzag_case, (shape, p, dim, inverse), 132, case == "zigzag-2x24x3-p3-dim1-inv", emulate)
            )
    out.append(Case("zigzag-misaligned", zigzag_case, ((8, 3), 2, 0, False, torch.bfloat16, False)))
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        out.append(Case(f"binding-layout-{DTYPE_NAME[dtype]}", binding_case, (dtype,)))
    return out

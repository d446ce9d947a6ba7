"""Checks of the emulator's warp-matrix model (warp_matrix.cpp) against plain matrix products, with
the fragment layouts written again here from the PTX ISA (section "Matrix Fragments for
mma.m16n8k16 with floating point type", its figures for A, B and C/D; and "Warp-level matrix load
instruction: ldmatrix"), independently of the C++: g = lane // 4, t = lane % 4.

- A (16 x 16): elements a0..a7 of a lane, two per 32-bit register (a0 in the low half of register 0):
  a0, a1 at (g, 2t + 0/1); a2, a3 at (g + 8, 2t + 0/1); a4, a5 at (g, 2t + 8 + 0/1); a6, a7 at
  (g + 8, 2t + 8 + 0/1).
- B (16 x 8, k x n): b0, b1 at (k 2t + 0/1, n g); b2, b3 at (k 2t + 8 + 0/1, n g).
- C, D (16 x 8, fp32): c0, c1 at (g, 2t + 0/1); c2, c3 at (g + 8, 2t + 0/1).
- ldmatrix .x4: lanes 8j .. 8j + 7 give the row addresses of matrix j; register j of lane l holds
  elements (l // 4, 2 (l % 4) + 0/1) of matrix j, with .trans elements (2 (l % 4) + 0/1, l // 4).

Run by run_cases.py as the cases named in CHECKS (in the same sanitized process as the kernels)."""

from __future__ import annotations

import torch


def _a_position(lane: int, i: int) -> tuple:
    g, t = lane // 4, lane % 4
    return g + 8 * ((i // 2) % 2), 2 * t + (i % 2) + 8 * (i // 4)


def _b_position(lane: int, i: int) -> tuple:
    g, t = lane // 4, lane % 4
    return 2 * t + (i % 2) + 8 * (i // 2), g


def _c_position(lane: int, i: int) -> tuple:
    g, t = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * t + (i % 2)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """16-bit elements as their int32 bit patterns (0 .. 65535)."""
    return x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _registers(m: torch.Tensor, position, count: int) -> torch.Tensor:
    """[32, count // 2] int32 registers of matrix m (16-bit elements) in the fragment layout `position`."""
    bits = _bits(m)
    regs = torch.zeros(32, count // 2, dtype=torch.int64)
    for lane in range(32):
        for i in range(count):
            regs[lane, i // 2] |= int(bits[position(lane, i)]) << (16 * (i % 2))
    return regs.to(torch.int32)  # wraps the high bit as the register's sign, as int32 bits


def mma_check(ops, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7 if dtype == torch.bfloat16 else 8)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    b = torch.randn(16, 8, generator=gen).to(dtype)
    c = torch.randn(16, 8, generator=gen)
    c_regs = torch.tensor([[float(c[_c_position(lane, i)]) for i in range(4)] for lane in range(32)])
    kind = 0 if dtype == torch.bfloat16 else 1
    d_regs = ops.warp_mma(_registers(a, _a_position, 8), _registers(b, _b_position, 4), c_regs, kind)
    want = a.double() @ b.double() + c.double()
    got = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        for i in range(4):
            got[_c_position(lane, i)] = float(d_regs[lane, i])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp32 accumulation of exact products


def ldmatrix_check(ops, count: int, trans: bool) -> None:
    gen = torch.Generator().manual_seed(10 * count + trans)
    mats = torch.randint(-(1 << 15), 1 << 15, (count, 8, 8), generator=gen, dtype=torch.int32)
    # rows scattered in a shared buffer of 64 rows of 8 elements (16 bytes each, 16-byte aligned)
    slots = torch.randperm(64, generator=gen)[: 8 * count]
    shared = torch.zeros(64, 8, dtype=torch.int32)
    rows = torch.zeros(32, dtype=torch.int64)
    for j in range(count):
        for r in range(8):
            shared[slots[8 * j + r]] = mats[j, r]
            rows[8 * j + r] = 8 * int(slots[8 * j + r])
    regs = ops.warp_ldmatrix(shared.to(torch.int16), rows, count, trans)
    for lane in range(32):
        for j in range(count):
            pair = [(2 * (lane % 4) + h, lane // 4) if trans else (lane // 4, 2 * (lane % 4) + h) for h in (0, 1)]
            want = [int(mats[j][p]) & 0xFFFF for p in pair]
            got = int(regs[lane, j]) & 0xFFFFFFFF
            assert (got & 0xFFFF, got >> 16) == tuple(want), (lane, j, trans, hex(got), want)


CHECKS = {
    "emulator-mma-bf16": lambda ops: mma_check(ops, torch.bfloat16),
    "emulator-mma-fp16": lambda ops: mma_check(ops, torch.float16),
    "emulator-ldmatrix": lambda ops: [ldmatrix_check(ops, n, t) for n in (1, 2, 4) for t in (False, True)],
}

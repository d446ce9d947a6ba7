"""Layout kernels (C++ CPU ops) against their references, and the collectives they serve simulated
on one process with p virtual ranks."""

import pytest
import torch

from megatron_sp.ops import layout

pytestmark = pytest.mark.extension

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def _rand(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


def all_to_all_single(sends):
    """p virtual ranks: rank j receives chunk j (dim 0) of every rank's send buffer, in rank order."""
    p = len(sends)
    return [torch.stack([sends[i][j] for i in range(p)]) for j in range(p)]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("fused", [True, False])
def test_ulysses_round_trip_with_simulated_all_to_all(p, fused):
    s, b, n, d = 6 * p, 2, 2 * p, 5  # odd head dim
    x_full = torch.randn(s, b, n, d)
    x_seq = list(torch.chunk(x_full, p, dim=0))  # rank i: sequence shard i, all heads
    recv = all_to_all_single([layout.ulysses_pack(x, p, fused=fused) for x in x_seq])
    x_head = [layout.ulysses_recv_to_heads(r, p) for r in recv]
    for j in range(p):  # rank j: full sequence, heads of rank j
        assert torch.equal(x_head[j], x_full[:, :, j * n // p : (j + 1) * n // p])
    back = all_to_all_single([layout.ulysses_heads_to_send(x, p) for x in x_head])
    for i in range(p):
        assert torch.equal(layout.ulysses_unpack(back[i], p, fused=fused), x_seq[i])


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("shape", [(4, 7), (3, 2, 5), (2, 3, 2, 9)])
def test_gather_to_last_dim_is_concat_of_rank_outputs(t, shape):
    outs = [torch.randn(shape) for _ in range(t)]  # rank r's output [s, ..., l]
    gathered = torch.cat(outs, dim=0)  # dim-0 all-gather
    got = layout.gather_to_last_dim(gathered, t)
    assert torch.equal(got, torch.cat(outs, dim=-1))
    assert torch.equal(layout.last_dim_to_gather(got, t), gathered)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_zigzag_rank_slices_and_inverse(p, dim):
    x = torch.randn(4 * p, 4 * p, 3) if dim != -1 else torch.randn(3, 2, 4 * p)
    z = layout.zigzag_reorder(x, p, dim=dim)
    chunks = torch.chunk(x, 2 * p, dim=dim)
    for r, shard in enumerate(torch.chunk(z, p, dim=dim)):
        assert torch.equal(shard, torch.cat([chunks[r], chunks[2 * p - 1 - r]], dim=dim))
    assert torch.equal(layout.zigzag_reorder(z, p, dim=dim, inverse=True), x)


CASES = [
    ("ulysses_pack", (5, 3, 6, 7), 3),
    ("ulysses_unpack", (3, 5, 2, 2, 7), 3),
    ("gather_to_last_dim", (6, 5, 9), 2),
    ("last_dim_to_gather", (3, 5, 10), 5),
]


@pytest.mark.parametrize("name,shape,k", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_matches_reference_every_dtype(name, shape, k, dtype):
    x = _rand(shape, dtype)
    got = getattr(torch.ops.megatron_sp, name)(x, k)
    assert torch.equal(got, getattr(layout, name + "_reference")(x, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape,p,dim", [((4, 12, 5), 2, 0), ((4, 12, 5), 3, 1), ((3, 2, 10), 5, 2)])
def test_zigzag_fused_matches_reference(dtype, inverse, shape, p, dim):
    x = _rand(shape, dtype)
    got = torch.ops.megatron_sp.zigzag_reorder(x, p, dim, inverse)
    assert torch.equal(got, layout.zigzag_reorder_reference(x, p, dim, inverse))


def test_non_contiguous_input():
    x = torch.randn(6, 4, 8, 3).transpose(0, 1)  # [4, 6, 8, 3], strided
    assert torch.equal(layout.ulysses_pack(x, 2), layout.ulysses_pack_reference(x, 2))


@pytest.mark.parametrize("name,shape,k", CASES)
def test_backward_is_the_inverse_permutation(name, shape, k):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: getattr(torch.ops.megatron_sp, name)(t, k), (x,))


def test_opcheck():
    torch.library.opcheck(torch.ops.megatron_sp.ulysses_pack, (torch.randn(2, 3, 4, 5), 2))
    torch.library.opcheck(torch.ops.megatron_sp.ulysses_unpack, (torch.randn(2, 3, 1, 2, 5), 2))
    torch.library.opcheck(torch.ops.megatron_sp.gather_to_last_dim, (torch.randn(4, 3, 5), 2))
    torch.library.opcheck(torch.ops.megatron_sp.last_dim_to_gather, (torch.randn(4, 3, 6), 3))
    torch.library.opcheck(torch.ops.megatron_sp.zigzag_reorder, (torch.randn(3, 8, 2, requires_grad=True), 2, 1, False))


def test_user_errors_are_value_errors():
    with pytest.raises(ValueError, match="number of heads"):
        layout.ulysses_pack(torch.randn(2, 1, 3, 4), 2)
    with pytest.raises(ValueError, match="divisible by 4"):
        layout.zigzag_reorder(torch.randn(6, 2), 2)
    with pytest.raises(ValueError, match="dim 0"):
        layout.gather_to_last_dim(torch.randn(5, 2), 2)


def test_long_runs_and_streaming_outputs():
    """Runs of >= 16 KiB take the run copy (not ATen's strided copy); outputs >= 8 MiB stream."""
    cases = [
        ("gather_to_last_dim", torch.randn(4, 3, 4096), 2),  # 16 KiB runs
        ("last_dim_to_gather", torch.randn(2, 3, 8192), 2),
        ("gather_to_last_dim", torch.randn(8, 64, 4096), 2),
    ]  # 8 MiB: streaming
    for name, x, k in cases:
        assert torch.equal(getattr(torch.ops.megatron_sp, name)(x, k), getattr(layout, name + "_reference")(x, k))
    z = torch.randn(64, 8, 4096)  # 8 MiB zigzag
    assert torch.equal(layout.zigzag_reorder(z, 2), layout.zigzag_reorder_reference(z, 2))

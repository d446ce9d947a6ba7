"""--tp-comm-overlap's CUDA side on one GPU: torch's symmetric-memory fused ops, called as
tensor_parallel/symm_mem.py calls them, against the plain GEMMs, in a one-rank NCCL group (what one
GPU can check: the dispatch, the ops' layouts, dtypes and argument order, and the autograd around
them). The speed, and the ring on NCCL streams, need >= 2 GPUs (bench/comm_overlap.py).
Marked `cuda`: skipped without a GPU (tests/conftest.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_sp.testing import assert_close_dtype

pytestmark = pytest.mark.cuda


@pytest.fixture
def nccl_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def _fused_ops():
    from megatron_sp.tensor_parallel import symm_mem

    if not symm_mem._have_fused_ops():
        pytest.skip(f"torch {torch.__version__} has no symmetric-memory fused all-gather/reduce-scatter GEMMs")
    return symm_mem


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_symm_mem_ops_compute_the_plain_gemms(nccl_group, dtype):
    symm_mem = _fused_ops()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 2, 64, device="cuda", generator=g).to(dtype)  # [s, b, k]
    w = torch.randn(48, 64, device="cuda", generator=g).to(dtype)  # [n, k]
    grad = torch.randn(16, 2, 48, device="cuda", generator=g).to(dtype)  # [s, b, n]
    assert symm_mem.usable(x, nccl_group)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    assert_close_dtype(symm_mem.all_gather_matmul(x, w, nccl_group), x @ w.t(), dtype, scale=8)
    assert_close_dtype(symm_mem.matmul_reduce_scatter(x, w, nccl_group), x @ w.t(), dtype, scale=8)
    for grad_x, grad_w in (
        symm_mem.column_backward(grad, x, w, nccl_group),
        symm_mem.row_backward(grad, x, w, nccl_group),
    ):
        assert_close_dtype(grad_x, grad @ w, dtype, scale=8)
        assert_close_dtype(grad_w, flat(grad).t() @ flat(x), dtype, scale=8)


def test_overlapped_layers_dispatch_to_symm_mem_and_backpropagate(nccl_group, monkeypatch):
    """The autograd Functions of tensor_parallel/overlap.py on CUDA: they take the fused ops (each
    call counted) and give F.linear's output and gradients."""
    symm_mem = _fused_ops()
    from megatron_sp.tensor_parallel import overlap

    calls = []
    fused = overlap.SYMM_MEM
    counted = overlap.Ops(*(lambda *a, f=f: calls.append(f.__name__) or f(*a) for f in fused))
    monkeypatch.setattr(overlap, "SYMM_MEM", counted)
    assert symm_mem.usable(torch.zeros(1, device="cuda"), nccl_group)
    x = torch.randn(8, 2, 32, device="cuda", requires_grad=True)
    w1 = torch.randn(64, 32, device="cuda", requires_grad=True)
    b1 = torch.randn(64, device="cuda", requires_grad=True)
    w2 = torch.randn(32, 64, device="cuda", requires_grad=True)
    out = overlap.row_linear(overlap.column_linear(x, w1, b1, nccl_group), w2, nccl_group)
    grad = torch.randn_like(out)
    got = [t.detach().clone() for t in (out, *torch.autograd.grad(out, (x, w1, b1, w2), grad))]
    ref = F.linear(F.linear(x, w1, b1), w2)
    want = [t.detach() for t in (ref, *torch.autograd.grad(ref, (x, w1, b1, w2), grad))]
    for a, b in zip(got, want):
        assert_close_dtype(a, b, torch.float32, scale=8)
    assert sorted(calls) == sorted(f.__name__ for f in fused)

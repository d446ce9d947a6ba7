"""The bench measuring machinery counts right: bench/activation_memory.py's saved-tensor counter
(storages once, parameters and their views excluded, masks at their dtype's size, custom Functions'
save_for_backward included) and bench/comm_volume.py's collective counter (ring costs, no double count
of the deprecated aliases that forward to the *_single collectives)."""

import pytest
import torch
from activation_memory import SavedTensorCounter
from torch import nn


def test_views_of_one_storage_count_once():
    x = torch.randn(6, 4, requires_grad=True)
    with SavedTensorCounter() as c:
        y = x * 2.0  # scalar multiply saves no tensor
        q, k = y.chunk(2)
        (q * k).sum()  # saves q and k: two views of y's storage
    assert c.total() == 6 * 4 * 4
    assert len(c.records) == 1


def test_parameters_and_their_views_are_excluded():
    lin = nn.Linear(4, 3, bias=False)
    x = torch.randn(5, 4, requires_grad=True)
    with SavedTensorCounter(lin) as c:
        out = x @ lin.weight.t()  # saves x and weight.t() (a view of the parameter)
        out.sum()
    assert c.total() == 5 * 4 * 4
    assert len(c.excluded) == 1


def test_masks_count_at_their_dtype_size_and_labels():
    x = torch.randn(8, 8, requires_grad=True)
    mask = torch.rand(8, 8) > 0.5
    with SavedTensorCounter() as c:
        y = x.masked_fill(mask, 0.0)  # saves the bool mask: 64 bytes
        z = torch.relu(y)  # saves its fp32 result: 256 bytes
        z.sum()
    assert sorted(r["nbytes"] for r in c.records.values()) == [64, 256]
    assert {r["op"] for r in c.records.values()} == {"masked_fill", "relu"}


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_custom_function_save_for_backward_counts():
    x = torch.randn(10, requires_grad=True)
    with SavedTensorCounter() as c:
        _Square.apply(x).sum()
    assert c.total() == 40
    assert next(iter(c.records.values()))["op"] == "autograd.Function"


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layer_difference_equals_direct_count_serial(dropout):
    """One layer = bytes(L=2) - bytes(L=1) = storages first saved inside layers.1 (serial GPTModel)."""
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.gpt import GPTModel

    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    totals, direct = {}, None
    for layers in (1, 2):
        cfg = GPTConfig(
            num_layers=layers,
            hidden_size=32,
            num_attention_heads=4,
            vocab_size=97,
            seq_length=16,
            hidden_dropout=dropout,
            attention_dropout=dropout,
            use_fused_kernels=False,
        )
        model = GPTModel(cfg).train()
        with SavedTensorCounter(model) as c:
            loss = model(tokens, tokens)
        totals[layers] = c.total()
        if layers == 2:
            direct = c.total("layers.1")
        del loss
    assert totals[2] - totals[1] == direct > 0


def _comm_worker():
    import torch.distributed as dist
    from comm_volume import CollectiveCounter

    t = dist.get_world_size()
    x = torch.ones(8, 4)  # 128 bytes
    with CollectiveCounter() as c:
        dist.all_reduce(x.clone())
        out = torch.empty(8 * t, 4)
        dist.all_gather_into_tensor(out, x)  # deprecated alias of all_gather_single
        rs = torch.empty(8 // t, 4)
        dist.reduce_scatter_tensor(rs, x.clone())
    return [(k["kind"], k["raw"], k["sent"]) for k in c.calls]


def test_collective_counter_ring_costs():
    from megatron_sp.testing import LocalWorld

    with LocalWorld(2) as world:
        calls = world.run(_comm_worker)
    for per_rank in calls:
        assert per_rank == [("all_reduce", 128, 128.0), ("all_gather", 256, 128.0), ("reduce_scatter", 128, 64.0)]

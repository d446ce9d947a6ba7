"""Mappings, layers and vocab-parallel cross entropy at TP 1, 2 and 4 (gloo, 4 processes), forward and
backward, against the plain math on the full tensor."""

import pytest
import torch
import torch.nn.functional as F

from megatron_sp.testing import LocalWorld

S, B, H = 8, 2, 12


@pytest.fixture(scope="module")
def pool():
    p = LocalWorld(4)
    yield p
    p.close()


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _chunk(x, t, r, dim):
    return x.chunk(t, dim=dim)[r]


# Each case: (mapping name, input of rank r, upstream grad of rank r, expected output, expected input grad)
# X is the full input, Xs[r] / Gs[r] per-rank full-shaped tensors, G the full upstream gradient.
def _case(name, t, r):
    X, G = _full(1, S, B, H), _full(2, S, B, H)
    Xs = [_full(10 + i, S, B, H) for i in range(t)]
    Gs = [_full(20 + i, S, B, H) for i in range(t)]
    c = _chunk
    cases = {
        "copy_to_tensor_parallel_region": (X, Gs[r], X, sum(Gs)),
        "reduce_from_tensor_parallel_region": (Xs[r], G, sum(Xs), G),
        "scatter_to_tensor_parallel_region": (
            X,
            c(Gs[r], t, r, -1),
            c(X, t, r, -1),
            torch.cat([c(Gs[i], t, i, -1) for i in range(t)], -1),
        ),
        "gather_from_tensor_parallel_region": (c(X, t, r, -1), G, X, c(G, t, r, -1)),
        "scatter_to_sequence_parallel_region": (
            X,
            c(Gs[r], t, r, 0),
            c(X, t, r, 0),
            torch.cat([c(Gs[i], t, i, 0) for i in range(t)], 0),
        ),
        "gather_from_sequence_parallel_region": (c(X, t, r, 0), Gs[r], X, c(sum(Gs), t, r, 0)),
        "reduce_scatter_to_sequence_parallel_region": (
            Xs[r],
            c(Gs[r], t, r, 0),
            c(sum(Xs), t, r, 0),
            torch.cat([c(Gs[i], t, i, 0) for i in range(t)], 0),
        ),
        "all_gather_last_dim_from_tensor_parallel_region": (c(X, t, r, -1), Gs[r], X, c(sum(Gs), t, r, -1)),
        "reduce_scatter_last_dim_to_tensor_parallel_region": (
            Xs[r],
            c(Gs[r], t, r, -1),
            c(sum(Xs), t, r, -1),
            torch.cat([c(Gs[i], t, i, -1) for i in range(t)], -1),
        ),
    }
    return cases[name]


MAPPINGS = [
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
]


def _mapping_worker(tp, name):
    from megatron_sp import parallel_state
    from megatron_sp.tensor_parallel import mappings

    ps = parallel_state.initialize_model_parallel(tp)
    x, upstream, want_out, want_grad = _case(name, tp, ps.tp_rank)
    x = x.clone().requires_grad_()
    out = getattr(mappings, name)(x, ps.tp_group)
    out.backward(upstream)
    return (out - want_out).abs().max().item(), (x.grad - want_grad).abs().max().item()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mappings_forward_backward(pool, tp):
    for name in MAPPINGS:
        for rank, (err_out, err_grad) in enumerate(pool.run(_mapping_worker, tp, name)):
            assert err_out < 1e-12 and err_grad < 1e-12, (name, tp, rank, err_out, err_grad)


def _all_to_all_worker(tp):
    from megatron_sp import parallel_state
    from megatron_sp.tensor_parallel import mappings

    ps = parallel_state.initialize_model_parallel(tp)
    r = ps.tp_rank
    X, G = _full(3, S, B, 4, 3), _full(4, S, B, 4, 3)  # [s, b, n, d]
    x = _chunk(X, tp, r, 0).clone().requires_grad_()  # sequence-sharded
    out = mappings.all_to_all(x, ps.tp_group, scatter_dim=2, gather_dim=0)  # head-sharded
    out.backward(_chunk(G, tp, r, 2))
    return ((out - _chunk(X, tp, r, 2)).abs().max().item(), (x.grad - _chunk(G, tp, r, 0)).abs().max().item())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_all_to_all(pool, tp):
    for err_out, err_grad in pool.run(_all_to_all_worker, tp):
        assert err_out == 0.0 and err_grad == 0.0


def _linear_worker(tp, sp, overlap=False):
    """Column then row parallel linear (an MLP without activation) against nn.Linear on the full tensor
    (overlap: --tp-comm-overlap's ring steps); no collective warns (torch 2.13's deprecated names)."""
    import warnings

    from megatron_sp import parallel_state
    from megatron_sp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_sp.tensor_parallel.sharding import gather_full, shard_full

    ps = parallel_state.initialize_model_parallel(tp)
    t, r, g = ps.tp_size, ps.tp_rank, ps.tp_group
    X, G = _full(5, S, B, H).float(), _full(6, S, B, H).float()
    W1, b1, W2, b2 = (
        _full(7, 2 * H, H).float(),
        _full(8, 2 * H).float(),
        _full(9, H, 2 * H).float(),
        _full(11, H).float(),
    )
    col = ColumnParallelLinear(H, 2 * H, init="normal", group=g, sequence_parallel=sp, tp_comm_overlap=overlap)
    row = RowParallelLinear(2 * H, H, init="normal", group=g, sequence_parallel=sp, tp_comm_overlap=overlap)
    with torch.no_grad():
        for p, full in ((col.weight, W1), (col.bias, b1), (row.weight, W2), (row.bias, b2)):
            p.copy_(shard_full(full, p.shard_spec, tuple(p.shape), r, t))
    x = (_chunk(X, t, r, 0) if sp else X).clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = row(col(x))
        out.backward(_chunk(G, t, r, 0) if sp else G)
    bias_grad = row.bias.grad.clone()
    if sp:
        torch.distributed.all_reduce(bias_grad, group=g)  # SP-region parameter: sum over TP
    grads = [gather_full(p.grad, p.shard_spec, g) for p in (col.weight, col.bias, row.weight)]
    return out.detach(), x.grad, grads + [bias_grad]


@pytest.mark.parametrize(
    "tp,sp,overlap",
    [(1, False, False), (2, False, False), (2, True, False), (4, False, False), (4, True, False)]
    + [(2, True, True), (4, True, True)],
)
def test_column_row_parallel_linear(pool, tp, sp, overlap):
    X, G = _full(5, S, B, H).float(), _full(6, S, B, H).float()
    W1, b1, W2, b2 = [
        _full(s, *shape).float().requires_grad_()
        for s, shape in ((7, (2 * H, H)), (8, (2 * H,)), (9, (H, 2 * H)), (11, (H,)))
    ]
    x = X.clone().requires_grad_()
    ref = F.linear(F.linear(x, W1, b1), W2, b2)
    ref.backward(G)
    for rank, (out, x_grad, grads) in enumerate(pool.run(_linear_worker, tp, sp, overlap)):
        r = rank % tp  # TP rank (ranks are TP-fastest)
        want_out, want_xg = (_chunk(ref, tp, r, 0), _chunk(x.grad, tp, r, 0)) if sp else (ref, x.grad)
        torch.testing.assert_close(out, want_out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x_grad, want_xg, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, (W1.grad, b1.grad, W2.grad, b2.grad)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _overlap_traffic_worker(tp):
    """The collectives of a column + row forward and backward with and without --tp-comm-overlap
    (bench/comm_volume.py's counter), and a row input the ring cannot cut into tp chunks."""
    from comm_volume import CollectiveCounter

    from megatron_sp import parallel_state
    from megatron_sp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    ps = parallel_state.initialize_model_parallel(tp)
    g, calls = ps.tp_group, {}
    for overlap in (False, True):
        torch.manual_seed(0)
        col = ColumnParallelLinear(H, 2 * H, init="normal", group=g, sequence_parallel=True, tp_comm_overlap=overlap)
        row = RowParallelLinear(2 * H, H, init="normal", group=g, sequence_parallel=True, tp_comm_overlap=overlap)
        x = torch.randn(S // tp, B, H, requires_grad=True)
        with CollectiveCounter() as counter:
            row(col(x)).sum().backward()
        calls[overlap] = [(c["kind"], c["sent"]) for c in counter.calls]
    try:
        row(torch.randn(S + 1, B, 2 * H // tp))
    except ValueError as err:
        return calls, str(err)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_comm_overlap_moves_the_same_bytes_in_ring_steps(pool, tp):
    """Without the flag: an all-gather and a reduce-scatter each way; with it only send/receive ring
    steps (t - 1 per collective), sending exactly as many bytes. A sequence the ring cannot cut is
    refused in one sentence."""
    for calls, refusal in pool.run(_overlap_traffic_worker, tp):
        plain, ring = calls[False], calls[True]
        assert sorted({kind for kind, _ in plain}) == ["all_gather", "reduce_scatter"]
        assert {kind for kind, _ in ring} == {"p2p"} and len(ring) == 5 * (tp - 1)  # 2 forward, 3 backward
        assert sum(sent for _, sent in ring) == pytest.approx(sum(sent for _, sent in plain), rel=1e-12)
        assert f"cannot cut the sequence dimension ({S + 1}) into {tp} equal chunks" in refusal


def test_tp_comm_overlap_needs_sequence_parallel():
    from megatron_sp.tensor_parallel.layers import ColumnParallelLinear

    with pytest.raises(ValueError, match="tp_comm_overlap needs sequence_parallel"):
        ColumnParallelLinear(H, H, init="normal", tp_comm_overlap=True)


def _embedding_ce_worker(tp, sp, vocab, padded):
    """VocabParallelEmbedding forward/backward and vocab-parallel cross entropy on padded vocab."""
    from megatron_sp import parallel_state
    from megatron_sp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron_sp.tensor_parallel.layers import VocabParallelEmbedding
    from megatron_sp.tensor_parallel.sharding import gather_full, shard_full

    ps = parallel_state.initialize_model_parallel(tp)
    t, r, g = ps.tp_size, ps.tp_rank, ps.tp_group
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(1))
    emb = VocabParallelEmbedding(vocab, padded, H, group=g, sequence_parallel=sp)
    with torch.no_grad():
        emb.weight.copy_(shard_full(_full(12, vocab, H).float(), emb.weight.shard_spec, tuple(emb.weight.shape), r, t))
    out = emb(ids)  # [s(/t), b, h]
    out.backward(_chunk(_full(13, S, B, H).float(), t, r, 0) if sp else _full(13, S, B, H).float())
    logits = _full(14, S, B, padded).float()
    logits_shard = _chunk(logits, t, r, -1).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits_shard, ids.t(), vocab_start=r * padded // t, vocab_size=vocab, group=g)
    loss.backward(_full(15, S, B).float())
    logits_grad = gather_full(logits_shard.grad, emb.weight.shard_spec.__class__(dim=-1), g)
    return out.detach(), gather_full(emb.weight.grad, emb.weight.shard_spec, g), loss.detach(), logits_grad


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True), (4, False), (4, True)])
def test_vocab_parallel_embedding_and_cross_entropy(pool, tp, sp):
    vocab, padded = 13, 16  # 13 is divisible by no TP size
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(1))
    W = _full(12, vocab, H).float().requires_grad_()
    ref = F.embedding(ids.t(), W)
    ref.backward(_full(13, S, B, H).float())
    logits = _full(14, S, B, padded).float().requires_grad_()
    ref_loss = F.cross_entropy(logits[..., :vocab].flatten(0, 1), ids.t().flatten(), reduction="none").view(S, B)
    ref_loss.backward(_full(15, S, B).float())
    for rank, (out, w_grad, loss, logits_grad) in enumerate(pool.run(_embedding_ce_worker, tp, sp, vocab, padded)):
        r = rank % tp
        torch.testing.assert_close(out, _chunk(ref, tp, r, 0).detach() if sp else ref.detach())
        torch.testing.assert_close(w_grad, W.grad)
        torch.testing.assert_close(loss, ref_loss.detach())
        torch.testing.assert_close(logits_grad, logits.grad)
        assert logits_grad[..., vocab:].abs().max() == 0  # padded logits never count


def _grad_sync_worker(overlap):
    """Two micro-batches at TP=2 × DP=2 with different data per DP rank; DP-averaged gradients."""
    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.distributed.grad_buffers import GradBuffers
    from megatron_sp.distributed.grad_sync import OverlappedGradSync, finalize_model_grads
    from megatron_sp.models.gpt import GPTModel

    ps = parallel_state.initialize_model_parallel(2)
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=50,
        seq_length=16,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(cfg)
    buffers = GradBuffers(model, bucket_bytes=4096)  # several buckets
    sync = OverlappedGradSync(buffers, ps) if overlap else None
    gen = torch.Generator().manual_seed(ps.dp_rank)
    for micro in range(2):
        if sync is not None and micro == 1:
            sync.arm()
        tokens = torch.randint(0, 50, (2, 16), generator=gen)
        (model(tokens, tokens.roll(-1, 1)) / 2).backward()
    finalize_model_grads(model, ps, buffers, sync)
    return model.full_grad_dict()  # (the main_grads: the buffers hold the gradients)


def test_overlapped_data_parallel_grad_sync_matches_plain(pool):
    plain, overlapped = pool.run(_grad_sync_worker, False), pool.run(_grad_sync_worker, True)
    for rank in range(4):
        for k in plain[rank]:
            torch.testing.assert_close(overlapped[rank][k], plain[rank][k], rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(plain[rank][k], plain[0][k], rtol=0, atol=0)  # replicas agree
    assert any(not torch.equal(plain[0][k], torch.zeros_like(plain[0][k])) for k in plain[0])


def _design_example_worker():
    """DESIGN.md's example: the config is given the TP size parallel_state was initialised with."""
    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.models.reference import ReferenceGPT

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=1)
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=97,
        seq_length=32,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(cfg)
    model.load_full_state_dict(ReferenceGPT(cfg).state_dict())
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, tokens.roll(-1, 1))
    loss.backward()
    return cfg.tensor_model_parallel_size, cfg.sequence_parallel, loss.item(), len(model.full_grad_dict())


def test_design_example_runs_as_written(pool):
    for tp, sp, loss, n_grads in pool.run(_design_example_worker):
        assert (tp, sp, n_grads) == (2, True, 2 + 12 * 2 + 2) and loss > 0

"""Long sequences: communication and activation memory per rank under context parallelism, and the
longest sequence that trains within a fixed activation budget, at CP = 1, 2, 4.

    python bench/long_sequence.py                        # s=256 b=1 h=64 a=4, cp = 1,2,4; budget 16 MiB
    python bench/long_sequence.py --budget-mib 64 --cp-sizes 1,2,4

1. Bytes each rank sends per transformer layer per step (forward + backward; dropout off, fp32),
   counted by wrapping torch.distributed (bench/comm_volume.py's CollectiveCounter, which also counts
   the isend bytes of ring attention's batch_isend_irecv), one layer = L2 - L1, next to the theory
   with N = 4sbh (the layer's [s, b, h] activation in fp32, whole sequence), c = CP size:
       TP+SP at t = c       10 (c-1)/c N        (4 AG + 4 RS of N, and 2 backward re-gathers)
       Ulysses (a2a)         8 (c-1)/c² N       (q, k, v, out all-to-all forward, again backward;
                                                 each rank's input is N/c, keeps 1/c of it)
       ring (p2p)           4 (c-1)/c N + 2 N   (K and V, 2N/c, passed c-1 times forward and again
                                                 backward; fp32 dK, dV, 2N/c, passed c times home)
   plus, once per step, the gradient all-reduce over DP × CP (the CP sum rides on the DP average),
   listed apart ("grad sync", per layer; the world's other ranks are DP replicas).
2. Activation bytes saved for the backward per layer per rank (bench/activation_memory.py's
   SavedTensorCounter, dropout on, blockwise attention), against (bytes at CP=1) / c.
3. The longest sequence whose forward saves at most --budget-mib of activations on each rank
   (whole model: layers, embedding, head; parameters excluded), searched in steps of 2c × 64 tokens,
   then one full training step (forward, backward, AdamW) at that length to show it trains.
Ranks are gloo processes on this machine; the world has max(cp) ranks (smaller CP sizes leave DP
replicas). Exit 0 when the measured volumes equal the theory and activations scale as 1/c (5%).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _cli import table

from megatron_sp.testing import LocalWorld


def _config(a, layers, cp, comm, s, dropout, tp=1):
    from megatron_sp.config import GPTConfig

    return GPTConfig(
        num_layers=layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        vocab_size=a.vocab_size,
        seq_length=s,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        context_parallel_size=cp,
        cp_comm_type=comm,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        use_fused_kernels=not a.no_fused_kernels,
    )


def _batch(a, s):
    import torch

    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, a.vocab_size, (a.micro_batch_size, s), generator=g),
        torch.randint(0, a.vocab_size, (a.micro_batch_size, s), generator=g),
    )


def comm_worker(a, tp, cp, comm):
    """Per-layer (L2 - L1) bytes sent by this rank, by kind, and the CP gradient sum."""
    from comm_volume import CollectiveCounter

    from megatron_sp import parallel_state
    from megatron_sp.distributed.grad_buffers import GradBuffers
    from megatron_sp.distributed.grad_sync import finalize_model_grads
    from megatron_sp.models.gpt import GPTModel

    ps = parallel_state.initialize_model_parallel(tp, cp)
    tokens, labels = _batch(a, a.seq_length)
    sent = {}
    for layers in (1, 2):
        model = GPTModel(_config(a, layers, cp, comm, a.seq_length, 0.0, tp), ps)
        buffers = GradBuffers(model)
        with CollectiveCounter() as counter:
            counter.phase = "step"
            model(tokens, labels).backward()
            counter.phase = "grad-sync"
            finalize_model_grads(model, ps, buffers)
        sent[layers] = {}
        for c in counter.calls:
            key = c["kind"] if c["phase"] == "step" else "grad-sync"
            sent[layers][key] = sent[layers].get(key, 0.0) + c["sent"]
    return {k: sent[2].get(k, 0.0) - sent[1].get(k, 0.0) for k in set(sent[1]) | set(sent[2])}


def _saved(model, tokens, labels):
    from activation_memory import SavedTensorCounter

    with SavedTensorCounter(model) as counter:
        loss = model(tokens, labels)
    return counter.total(), loss


def activation_worker(a, cp, comm):
    from megatron_sp import parallel_state
    from megatron_sp.models.gpt import GPTModel

    ps = parallel_state.initialize_model_parallel(1, cp)
    tokens, labels = _batch(a, a.seq_length)
    totals = [
        _saved(GPTModel(_config(a, layers, cp, comm, a.seq_length, 0.1), ps).train(), tokens, labels)[0]
        for layers in (1, 2)
    ]
    return totals[1] - totals[0]


def budget_worker(a, cp, comm, s, train):
    """Saved activation bytes of the whole model at length s on this rank; one step when train."""
    import torch

    from megatron_sp import parallel_state
    from megatron_sp.distributed.grad_buffers import GradBuffers
    from megatron_sp.distributed.grad_sync import finalize_model_grads
    from megatron_sp.models.gpt import GPTModel

    ps = parallel_state.initialize_model_parallel(1, cp)
    model = GPTModel(_config(a, a.num_layers, cp, comm, s, 0.1), ps).train()
    buffers = GradBuffers(model)
    tokens, labels = _batch(a, s)
    saved, loss = _saved(model, tokens, labels)
    if not train:
        return saved, None, None
    start = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss.backward()
    finalize_model_grads(model, ps, buffers)
    for p in model.parameters():
        p.grad = p.main_grad
    opt.step()
    return saved, loss.item(), time.perf_counter() - start


def theory(a, c, comm):
    s, b, h = a.seq_length, a.micro_batch_size, a.hidden_size
    n = 4 * s * b * h
    if comm == "tp+sp":
        return 10 * (c - 1) / c * n
    if comm == "a2a":
        return 8 * (c - 1) / c**2 * n
    return 4 * (c - 1) / c * n + 2 * n


def section_comm(a, world, cps):
    rows, ok = [], True
    n = 4 * a.seq_length * a.micro_batch_size * a.hidden_size
    for c in cps:
        if c == 1:
            continue
        for comm in ("tp+sp", "a2a", "p2p"):
            res = world.run(
                comm_worker,
                a,
                c if comm == "tp+sp" else 1,
                1 if comm == "tp+sp" else c,
                "p2p" if comm == "tp+sp" else comm,
            )[0]
            layer = sum(v for k, v in res.items() if k != "grad-sync")
            want = theory(a, c, comm)
            ok &= abs(layer - want) <= 1e-6 * want
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(res.items()) if k != "grad-sync" and v)
            rows.append(
                [
                    c,
                    comm,
                    kinds,
                    f"{layer:.0f}",
                    f"{want:.0f}",
                    f"{layer / n:.3f}",
                    "OK" if abs(layer - want) <= 1e-6 * want else "DIFF",
                    f"{res.get('grad-sync', 0):.0f}",
                ]
            )
    print(table(["c", "scheme", "sent per kind (B)", "sent/layer", "theory", "/N", "check", "grad sync/layer"], rows))
    return ok


def section_activations(a, world, cps):
    """Ring: exactly (c=1)/c. Ulysses: the core's output is needed twice, in head layout (the core's
    backward) and in sequence layout (the projection's input), one extra 4sbh/c, so it is ∝ 1/c from
    c=2 on (checked against (first c>1) × c'/c) and (c=1)/c + 4sbh/c against c=1."""
    rows, ok, first = [], True, {}
    sbh = a.seq_length * a.micro_batch_size * a.hidden_size
    for comm in ("p2p", "a2a"):
        for c in cps:
            saved = world.run(activation_worker, a, c, comm)[0]
            first.setdefault((comm, c > 1), (c, saved))
            c0, s0 = first[(comm, False)] if c == 1 or comm == "p2p" else first[(comm, True)]
            want = s0 * c0 / c if comm == "p2p" or c > 1 else s0
            close = abs(saved / want - 1) <= 0.05
            ok &= close
            extra = (saved - first[(comm, False)][1] / c) / (sbh / c) if c > 1 else 0.0
            rows.append(
                [
                    comm,
                    c,
                    saved,
                    f"{first[(comm, False)][1] / c:.0f}",
                    f"{saved * c / first[(comm, False)][1]:.4f}",
                    f"{extra:+.2f}",
                    f"{want:.0f}",
                    "OK" if close else "DIFF",
                ]
            )
    print(
        table(
            [
                "scheme",
                "c",
                "saved B/layer/rank",
                "(c=1)/c",
                "ratio to (c=1)/c",
                "extra /(sbh/c)",
                "expected",
                "5% check",
            ],
            rows,
        )
    )
    return ok


def section_budget(a, world, cps):
    budget = int(a.budget_mib * 2**20)
    rows = []
    for c in cps:
        step = 2 * c * 64
        fits = lambda s: max(r[0] for r in world.run(budget_worker, a, c, "p2p", s, False)) <= budget
        lo, hi = 0, step
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        saved, loss, secs = world.run(budget_worker, a, c, "p2p", lo, True)[0]
        rows.append([c, lo, f"{saved / 2**20:.2f}", f"{loss:.4f}", f"{secs:.1f}"])
    print(table(["c", f"longest s (budget {a.budget_mib:g} MiB/rank)", "saved MiB/rank", "loss", "step s"], rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=2, help="model of the budget search")
    p.add_argument("--vocab-size", type=int, default=97)
    p.add_argument("--cp-sizes", default="1,2,4")
    p.add_argument("--budget-mib", type=float, default=16.0)
    p.add_argument("--no-fused-kernels", action="store_true")
    p.add_argument("--skip-budget", action="store_true")
    a = p.parse_args(argv)
    cps = sorted({int(c) for c in a.cp_sizes.split(",")})
    import torch

    start = time.time()
    print(
        f"long sequences — torch {torch.__version__}, gloo, {os.cpu_count()} CPU cores, world of {max(cps)}; "
        f"s={a.seq_length} b={a.micro_batch_size} h={a.hidden_size} a={a.num_attention_heads}, fp32"
    )
    with LocalWorld(max(cps)) as world:
        print("\n1. bytes sent per rank per layer per step (forward + backward), dropout off")
        ok = section_comm(a, world, cps)
        print("\n2. activation bytes saved per layer per rank, dropout 0.1 (TP=1)")
        ok &= section_activations(a, world, cps)
        if not a.skip_budget:
            print(
                f"\n3. longest sequence within {a.budget_mib:g} MiB of saved activations per rank "
                f"(L={a.num_layers}, ring attention, dropout 0.1)"
            )
            section_budget(a, world, cps)
    print(f"\n{'ALL CHECKS PASS' if ok else 'SOME CHECK FAILED'} ({time.time() - start:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

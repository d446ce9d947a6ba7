"""Megatron's context-parallel types: bytes each rank sends per layer and step, measured against the
planner's formula (megatron_sp/planning/cost.py, cp_traffic: the one statement of it), and the same
formula at Llama 3 sizes.

    python bench/cp_comm_types.py                       # s=256 b=1 h=128, 8 heads, 2 key/value heads; world of 4
    python bench/cp_comm_types.py --skip-measured       # the computed table only (no processes)

1. Measured at CPU size: one training step (forward + backward, dropout off, fp32) of a 1-layer and a
   2-layer Llama at TP=1, every collective and isend counted (bench/comm_volume.py's CollectiveCounter);
   L2 - L1 is one layer (the embedding, the loss and the CP loss mean cancel). Types: p2p, a2a and
   allgather at c = 2 and 4, a2a+p2p at 2 × 2, and a per-layer mix. The formulas, e = 4 bytes,
   KV = 2 (s/c) b g d the rank's keys and values, g' the key/value heads after Ulysses' split:
       p2p        (2(c-1) e + 4c) KV                  K, V c-1 times each way; dK, dV (fp32) c times home
       a2a        2 (c-1)/c (s/c) b (2n + 2g') d e    q, k, v, out and their gradients
       allgather  (c-1)(2e + 4) KV                    K, V gathered forward and again backward; dK, dV RS
       a2a+p2p    a2a over A, then p2p over P on A times the tokens and 1/A of the heads
2. Computed (the same formula, bf16, micro batch 1): GB per rank per step for Llama-3-8B and 70B at
   s = 8192 and 131072, per type, and the seconds they take over NVLink (360 GB/s) within a node and
   InfiniBand (45 GB/s per GPU) across (tools/plan.py's defaults; p2p's hide under the attention).
Exit 0 when every measured figure equals the formula.
"""

from __future__ import annotations

import argparse
import sys
import time

from _cli import table

from megatron_sp.testing import LocalWorld

MEASURED = [  # (cp, --cp-comm-type, hierarchical sizes)
    (2, "p2p", None),
    (4, "p2p", None),
    (2, "a2a", None),
    (4, "a2a", None),
    (2, "allgather", None),
    (4, "allgather", None),
    (4, "a2a+p2p", (2, 2)),
    (4, ("a2a", "allgather"), None),  # per layer: the mean of the two
]


def _config(a, layers, cp, comm, levels):
    from megatron_sp.config import GPTConfig

    per_layer = comm if isinstance(comm, str) else comm[:layers]
    return GPTConfig(
        num_layers=layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups,
        model="llama",
        vocab_size=97,
        seq_length=a.seq_length,
        context_parallel_size=cp,
        cp_comm_type=per_layer if layers > 1 or isinstance(comm, str) else comm[0],
        hierarchical_context_parallel_sizes=levels,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def measure_worker(a, cp, comm, levels):
    """Bytes this rank sends for the second layer (L2 - L1), and the formula's figure for it."""
    import torch
    from comm_volume import CollectiveCounter

    from megatron_sp import parallel_state
    from megatron_sp.models.gpt import GPTModel
    from megatron_sp.planning import cost

    ps = parallel_state.initialize_model_parallel(1, cp, hierarchical_context_parallel_sizes=levels)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 97, (a.micro_batch_size, a.seq_length), generator=g) for _ in range(2))
    sent = []
    for layers in (1, 2):
        model = GPTModel(_config(a, layers, cp, comm, levels), ps)
        with CollectiveCounter() as counter:
            model(tokens, labels).backward()
        sent.append(sum(c["sent"] for c in counter.calls))
    cfg = _config(a, 2, cp, comm, levels)
    second = comm if isinstance(comm, str) else comm[1]
    return sent[1] - sent[0], cost.cp_bytes_per_layer(cfg, a.micro_batch_size, 4, second)


def section_measured(a, world) -> bool:
    rows, ok = [], True
    for cp, comm, levels in MEASURED:
        got, want = world.run(measure_worker, a, cp, comm, levels)[0]
        name = comm if isinstance(comm, str) else " ".join(comm) + " (layer 2)"
        same = abs(got - want) <= 1e-9 * want
        ok &= same
        rows.append([name + (f" {levels[0]}x{levels[1]}" if levels else ""), cp, f"{got:.0f}", f"{want:.0f}",
                     "OK" if same else "DIFF"])  # fmt: skip
    print(table(["type", "c", "measured B/layer/rank", "formula", "check"], rows))
    return ok


LLAMAS = {"Llama-3-8B": (32, 4096, 32, 8, 14336), "Llama-3-70B": (80, 8192, 64, 8, 28672)}


def section_computed() -> None:
    from megatron_sp.config import GPTConfig
    from megatron_sp.planning import cost

    rows = []
    for name, (layers, h, n, g, f) in LLAMAS.items():
        for s in (8192, 131072):
            for tp, cp in ((1, 8), (1, 16), (8, 8)):
                for comm in ("p2p", "a2a", "allgather", "a2a+p2p"):
                    inner = max(a for a in (1, 2, 4, 8) if a * tp <= 8 and cp % a == 0)
                    if comm == "a2a+p2p" and not 1 < inner < cp:
                        continue
                    levels = (inner, cp // inner) if comm == "a2a+p2p" else None
                    try:
                        cfg = GPTConfig(num_layers=layers, hidden_size=h, num_attention_heads=n, num_query_groups=g,
                                        ffn_hidden_size=f, vocab_size=128256, seq_length=s, model="llama",
                                        tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type=comm,
                                        hierarchical_context_parallel_sizes=levels)  # fmt: skip
                    except ValueError:  # heads per TP rank do not split over c (a2a)
                        continue
                    parts = cost.cp_traffic(cfg, comm, 1, 2)
                    total = layers * sum(x.nbytes for x in parts)
                    secs = layers * sum(x.nbytes / (360e9 if x.span <= 8 else 45e9) for x in parts)
                    label = comm + (f" {levels[0]}x{levels[1]}" if levels else "")
                    rows.append([name, s, f"tp{tp} cp{cp}", label, f"{total / 1e9:.2f}", f"{secs:.2f}"])
    print(table(["model", "s", "layout", "type", "GB/rank/step", "s on its links"], rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--skip-measured", action="store_true")
    a = p.parse_args(argv)
    start, ok = time.time(), True
    if not a.skip_measured:
        print(f"1. measured, s={a.seq_length} b={a.micro_batch_size} h={a.hidden_size} n={a.num_attention_heads} "
              f"g={a.num_query_groups}, fp32, TP=1 (bytes per rank for one layer, forward + backward)")  # fmt: skip
        with LocalWorld(4) as world:
            ok = section_measured(a, world)
    print("\n2. computed: bf16, micro batch 1, per rank per step (all layers)")
    section_computed()
    print(f"\n{'ALL CHECKS PASS' if ok else 'SOME CHECK FAILED'} ({time.time() - start:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

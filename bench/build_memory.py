"""Resident memory while building a model, measured as a user would (issue 30, item 6): peak growth of
each rank while `GPTModel(cfg)` runs, in a fresh process (no warm-up build), against its shard's bytes.

    python bench/build_memory.py                            # TP 1 and 4: 4 layers, hidden 1536, vocab 32000
    python bench/build_memory.py --tp-sizes 4 --hidden-size 512   # a quick look
    git archive main megatron_sp | tar -x -C /tmp/main && PYTHONPATH=/tmp/main python bench/build_memory.py
                                                            # the same figures for another tree

Each TP size t gets its own gloo world of t processes (peak resident memory is a process's whole life).
Each rank initialises its groups, resets its peak resident set (`/proc/self/clear_refs` "5": VmHWM
becomes VmRSS), builds GPTModel(cfg) and reports VmHWM - VmRSS before (the peak growth), what it kept
(VmRSS, anonymous and file-backed pages), its parameters' bytes, the seconds the build took, and whether
the build imported sympy (a first normal_ on the meta device does: ~70 MiB of modules). The table shows
rank 0 (the issue's figure) and the worst rank.
"""

from __future__ import annotations

import argparse

from _cli import table

from megatron_sp.testing import LocalWorld


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def build_worker(tp: int, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> dict:
    """This rank's peak and kept growth (bytes) while GPTModel(cfg) runs, beside its shard's bytes."""
    import sys
    import time

    import torch

    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.gpt import GPTModel

    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(tp)
    cfg = GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=vocab,
        seq_length=seq,
        tensor_model_parallel_size=tp,
    )
    had_sympy = "sympy" in sys.modules
    before = _status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    model = GPTModel(cfg)
    seconds = time.perf_counter() - start
    after = _status()
    return dict(
        shard=sum(p.numel() * p.element_size() for p in model.parameters()),
        peak=after["VmHWM"] - before["VmRSS"],
        kept=after["VmRSS"] - before["VmRSS"],
        anon=after["RssAnon"] - before["RssAnon"],
        file=after["RssFile"] - before["RssFile"],
        seconds=seconds,
        sympy=not had_sympy and "sympy" in sys.modules,
    )


def _row(tp: int, which: str, r: dict) -> list:
    mib = 2**20
    return [
        tp,
        which,
        f"{r['shard'] / mib:.1f}",
        f"{r['peak'] / mib:.1f}",
        f"{r['peak'] / r['shard']:.3f}",
        f"{(r['peak'] - r['shard']) / mib:.1f}",
        f"{r['kept'] / mib:.1f}",
        f"{r['anon'] / mib:.1f}",
        f"{r['file'] / mib:.1f}",
        f"{r['seconds']:.1f}",
        "yes" if r["sympy"] else "no",
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 4])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=1536)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-length", type=int, default=1024)
    args = p.parse_args(argv)
    shape = (args.num_layers, args.hidden_size, args.num_attention_heads, args.vocab_size, args.seq_length)
    rows = []
    for tp in args.tp_sizes:
        with LocalWorld(tp) as world:
            ranks = world.run(build_worker, tp, *shape, timeout=3600)
        rows.append(_row(tp, "0", ranks[0]))
        if tp > 1:
            worst = max(range(tp), key=lambda r: ranks[r]["peak"])
            rows.append(_row(tp, f"{worst} (worst)", ranks[worst]))
    print(
        f"resident growth while GPTModel(cfg) runs, fresh processes: {args.num_layers} layers, hidden "
        f"{args.hidden_size}, {args.num_attention_heads} heads, vocab {args.vocab_size}, seq {args.seq_length}, fp32"
    )
    headers = ["TP", "rank", "shard MiB", "peak MiB", "peak/shard", "peak-shard", "kept MiB", "anon", "file", "s"]
    print(table(headers + ["sympy"], rows))


if __name__ == "__main__":
    main()

"""Pipeline schedules on CPU (gloo): bubble fraction, in-flight micro-batches and activation memory
per stage, point-to-point bytes per step, for each torch.distributed.pipelining schedule PipelineGPT runs.

    .venv/bin/python bench/pipeline.py [--pp 2] [--micro-batches 2,4,8] [--hidden-size 128] [--layers 8]

Method (per rank, from timelines): every PipelineStage compute call (forward_one_chunk,
backward_one_chunk, backward_weight_one_chunk) is timed; a step's bubble fraction on a rank is
1 − (its compute time) / (the step's wall time), averaged over the ranks and over --steps steps after a
warm-up step. The ideal: (p − 1) / (m + p − 1) for GPipe and 1F1B, (p − 1) / (v m + p − 1) for the
interleaved schedule (v chunks per rank), and ~0 for the zero-bubble ones (whose weight passes fill
the bubble; the figure quoted is the 1F1B one for reference). In-flight micro-batches: the most forwards
a stage has run whose backward it has not (peak activation memory = that × the bytes one micro-batch's
forward of the stage saves for backward, measured with saved_tensors_hooks, storages counted once).
P2P bytes: the tensors of the send ops the stages post (forward activations and backward gradients).

CPU caveat: the ranks share the machine's cores (and on a loaded machine, other processes'), so the
absolute times are noisy; the comparison between schedules at the same m is the figure.
"""

from __future__ import annotations

import argparse
import sys
import time

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("interleaved-zb", 2), ("zbv", 2)]
RECORD = {"events": [], "bytes": 0}  # this rank's, filled by the wrapped stage methods


def _instrument(record):
    """Wraps PipelineStage's compute and send methods to record (kind, start, end) and bytes sent."""
    from torch.distributed.pipelining import stage as stage_mod

    base = stage_mod._PipelineStageBase
    if getattr(base, "_bench_wrapped", False):
        return
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        original = getattr(base, name)

        def timed(self, *a, _original=original, _name=name, **k):
            start = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                record["events"].append((self.stage_index, _name, start, time.perf_counter()))

        setattr(base, name, timed)
    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        original = getattr(base, name)

        def counted(self, *a, _original=original, **k):
            ops = _original(self, *a, **k)
            record["bytes"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

        setattr(base, name, counted)
    base._bench_wrapped = True


def _saved_bytes(chunk, x, batch):
    """Bytes one forward of `chunk` saves for backward (storages once, parameters excluded)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk(x, **batch)
    return sum(seen.values())


def _in_flight(events, stage):
    """The most forwards of `stage` without their backward yet, over the step's timeline."""
    live = peak = 0
    for s, kind, _, _ in sorted(events, key=lambda e: e[2]):
        if s != stage:
            continue
        if kind == "forward_one_chunk":
            live += 1
            peak = max(peak, live)
        elif kind == "backward_one_chunk":
            live -= 1
    return peak


def run_case(schedule, vp, m, args):
    import torch

    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.pipeline_parallel.layout import PipelineLayout
    from megatron_sp.pipeline_parallel.model import PipelineGPT

    record = RECORD
    _instrument(record)
    ps = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=args.pp)
    cfg = GPTConfig(
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        num_attention_heads=4,
        vocab_size=512,
        seq_length=args.seq_length,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    pipe = PipelineGPT(cfg, PipelineLayout(args.pp, vp, schedule=schedule), ps).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (m * args.micro_batch_size, args.seq_length), generator=g)
    labels = torch.randint(0, 512, tokens.shape, generator=g)
    bubbles, walls, sent = [], [], []
    for step in range(args.steps + 1):
        record["events"].clear()
        record["bytes"] = 0
        torch.distributed.barrier(group=ps.pp_group)
        start = time.perf_counter()
        pipe.step(tokens, labels, num_microbatches=m)
        wall = time.perf_counter() - start
        busy = sum(end - begin for _, _, begin, end in record["events"])
        if step:  # the first step builds the schedule and warms up
            bubbles.append(1 - busy / wall)
            walls.append(wall)
            sent.append(record["bytes"])
    in_flight = {s: _in_flight(record["events"], s) for s in pipe.stage_ids}
    micro = {k: v[: args.micro_batch_size] for k, v in dict(tokens=tokens, labels=labels).items()}
    per_mb = {}
    for s, chunk in zip(pipe.stage_ids, pipe._chunks):
        shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
        x = micro["tokens"] if s == 0 else torch.zeros(shape, requires_grad=True)
        per_mb[s] = _saved_bytes(chunk, x, micro)
    return {
        "bubble": sum(bubbles) / len(bubbles),
        "wall": sum(walls) / len(walls),
        "bytes": sum(sent) / len(sent),
        "in_flight": in_flight,
        "per_mb": per_mb,
    }


def ideal(schedule, vp, p, m):
    if schedule in ("gpipe", "1f1b") and vp == 1:
        return (p - 1) / (m + p - 1)
    return (p - 1) / (vp * m + p - 1)  # interleaved (and the loop placement of interleaved-zb)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro-batches", default="2,4,8")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    from megatron_sp.testing import LocalWorld

    rows = []
    with LocalWorld(args.pp) as world:
        for m in [int(x) for x in args.micro_batches.split(",")]:
            for schedule, vp in SCHEDULES:
                per_rank = world.run(run_case, schedule, vp, m, args)
                bubble = sum(r["bubble"] for r in per_rank) / len(per_rank)
                flights = {s: f for r in per_rank for s, f in r["in_flight"].items()}
                per_mb = {s: b for r in per_rank for s, b in r["per_mb"].items()}
                peak = {s: flights[s] * per_mb[s] for s in flights}
                name = f"{schedule}{f' v={vp}' if vp > 1 else ''}"
                rows.append(
                    (
                        m,
                        name,
                        bubble,
                        ideal(schedule, vp, args.pp, m),
                        per_rank[0]["wall"],
                        flights,
                        peak,
                        sum(r["bytes"] for r in per_rank),
                    )
                )
    print(
        f"pipeline schedules: pp {args.pp}, {args.layers} layers, h {args.hidden_size}, s {args.seq_length}, "
        f"micro-batch {args.micro_batch_size}, fp32, gloo on CPU"
    )
    print(
        f"{'m':>3}  {'schedule':<18} {'bubble':>7} {'(p-1)/(vm+p-1)':>15} {'step s':>7}  "
        f"{'in-flight per stage':<24} {'peak act. MiB per stage':<30} {'p2p MB/step':>11}"
    )
    for m, name, bubble, want, wall, flights, peak, sent in rows:
        f = " ".join(f"{s}:{flights[s]}" for s in sorted(flights))
        a = " ".join(f"{s}:{peak[s] / 2**20:.1f}" for s in sorted(peak))
        print(f"{m:>3}  {name:<18} {bubble:>7.3f} {want:>15.3f} {wall:>7.3f}  {f:<24} {a:<30} {sent / 1e6:>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""--tp-comm-overlap on CPU/gloo: how long the GEMMs wait on communication, the bytes moved, step time.

    python bench/comm_overlap.py                               # s=512 b=2 h=256, t = 2, 4
    python bench/comm_overlap.py --tp-sizes 2 --seq-length 1024 --repeats 20

What is measured
----------------
1. Per linear layer of a GPT-2 transformer layer under TP+SP (qkv h->3h and fc1 h->4h column-parallel,
   proj h->h and fc2 4h->h row-parallel), one forward + backward on every rank of a TP group of
   size t (a world of t gloo processes), alternating plain and overlapped runs --repeats times:
     wall   the layer's forward + backward;
     wait   the time the rank was blocked on communication, so that no GEMM could run: inside a
            blocking collective call, or in wait() on an asynchronous collective or a ring step
            (every torch.distributed call the library makes is wrapped, as in bench/comm_volume.py);
     gemm   the same GEMMs on this rank's shapes with no communication at all (t = 1, local shards).
   Figures are the median (--stat min: the minimum) over repeats, averaged over the ranks.
2. Bytes each rank sends per layer, plain vs overlapped (bench/comm_volume.py's counter: ring cost of
   each collective, the isend bytes of each ring step): must be equal (exit 1 otherwise).
3. The bench model's training step (bench/model_step.py's model: forward, backward, gradient sync,
   AdamW), median (or min) ms/step at TP=t+SP with and without the flag (the two alternating step by step),
   and the bytes one forward + backward + SP gradient sum sends per rank through every collective
   and ring step (must be equal too).

On a machine with fewer free cores than ranks (gloo's transfers need CPU too) overlap can only hide
what the idle cores can carry; the figures say what this machine does, not what NCCL on GPUs does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

from _cli import add_shape_args, table
from comm_volume import WRAPPED, CollectiveCounter

from megatron_sp.testing import LocalWorld


class _TimedWork:
    """An async collective's handle whose wait() is timed (all the library calls on it)."""

    def __init__(self, work, timer):
        self._work, self._timer = work, timer

    def wait(self, *args):
        start = time.perf_counter()
        try:
            return self._work.wait(*args)
        finally:
            self._timer.seconds += time.perf_counter() - start


class WaitTimer:
    """Context manager: the seconds spent inside torch.distributed calls and in wait() on their handles."""

    def __init__(self):
        import torch.distributed as dist

        self._dist, self._saved, self.seconds = dist, {}, 0.0

    def _wrap(self, orig):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                out = orig(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
            if isinstance(out, list):  # batch_isend_irecv
                return [_TimedWork(w, self) for w in out]
            return out if out is None else _TimedWork(out, self)

        return wrapper

    def __enter__(self):
        for name in WRAPPED:
            orig = getattr(self._dist, name, None)
            if orig is not None:
                self._saved[name] = orig
                setattr(self._dist, name, self._wrap(orig))
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(self._dist, name, orig)


# On a shared machine the minimum is the least disturbed sample; the median is the usual figure.
_STATS = {"median": statistics.median, "min": min}

# ---- per-rank work -----------------------------------------------------------------------------------

LAYERS = {  # name: (column or row, in features / h, out features / h)
    "qkv": ("column", 1, 3),
    "proj": ("row", 1, 1),
    "fc1": ("column", 1, 4),
    "fc2": ("row", 4, 1),
}


def _layer(kind, fin, fout, group, overlap):
    from megatron_sp.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls(fin, fout, init="normal", group=group, sequence_parallel=group is not None, tp_comm_overlap=overlap)
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    return layer


def _inputs(kind, fin, a, t):
    """The layer's input on a rank: [s/t, b, in] (column, SP shard) or [s, b, in/t] (row)."""
    import torch

    s, b = a.seq_length, a.micro_batch_size
    shape = (s // t, b, fin) if kind == "column" else (s, b, fin // t)
    return torch.randn(*shape, requires_grad=True)


def _fwd_bwd(layer, x):
    start = time.perf_counter()
    layer(x).sum().backward()
    return time.perf_counter() - start


def _time_layer(kind, fin, fout, a, ps):
    """{mode: [wall s], [wait s]} over the repeats, plus the GEMM-only time on this rank's shapes."""
    t, g = ps.tp_size, ps.tp_group
    layers = {mode: _layer(kind, fin, fout, g, mode == "overlap") for mode in ("plain", "overlap")}
    local = _layer(kind, fin // t if kind == "row" else fin, fout // t if kind == "column" else fout, None, False)
    x = _inputs(kind, fin, a, t)
    x_local = _inputs(kind, fin, a, 1).detach()[..., : local.weight.shape[1]].clone().requires_grad_()
    out = {"plain": ([], []), "overlap": ([], []), "gemm": []}
    for rep in range(a.warmup + a.repeats):
        for mode, layer in layers.items():
            with WaitTimer() as timer:
                wall = _fwd_bwd(layer, x)
            if rep >= a.warmup:
                out[mode][0].append(wall)
                out[mode][1].append(timer.seconds)
        gemm = _fwd_bwd(local, x_local)
        if rep >= a.warmup:
            out["gemm"].append(gemm)
    return {
        "plain": [_STATS[a.stat](v) for v in out["plain"]],
        "overlap": [_STATS[a.stat](v) for v in out["overlap"]],
        "gemm": _STATS[a.stat](out["gemm"]),
    }


def _bytes_layer(kind, fin, fout, a, ps):
    sent = {}
    for mode in ("plain", "overlap"):
        layer = _layer(kind, fin, fout, ps.tp_group, mode == "overlap")
        with CollectiveCounter() as counter:
            _fwd_bwd(layer, _inputs(kind, fin, a, ps.tp_size))
        sent[mode] = sum(c["sent"] for c in counter.calls)
    return sent


def layers_worker(a, t):
    import torch

    from megatron_sp import parallel_state

    ps = parallel_state.initialize_model_parallel(t)
    torch.manual_seed(ps.tp_rank)
    h, out = a.hidden_size, {}
    for name, (kind, fin, fout) in LAYERS.items():
        out[name] = _time_layer(kind, fin * h, fout * h, a, ps)
        out[name]["sent"] = _bytes_layer(kind, fin * h, fout * h, a, ps)
    return out


def _step_models(a, t):
    """The bench model (bench/model_step.py's config) without and with the flag, same seed, and AdamW each."""
    import torch
    from model_step import _config

    from megatron_sp import parallel_state
    from megatron_sp.distributed.optimizer import build_optimizer
    from megatron_sp.models.gpt import GPTModel

    ps = parallel_state.get()
    models = {}
    for mode in ("plain", "overlap"):
        torch.manual_seed(0)
        model = GPTModel(_config(SimpleNamespace(**vars(a), tp_comm_overlap=mode == "overlap"), t), ps)
        hyper = SimpleNamespace(weight_decay=0.0, lr=1e-4, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
        models[mode] = (model, build_optimizer(model, hyper, "cpu", ps))  # AdamW on the gradient buffers
    return models


def _train_step(model, opt, tokens):
    from megatron_sp import parallel_state
    from megatron_sp.distributed.grad_sync import finalize_model_grads

    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(tokens, tokens.roll(-1, 1)).backward()
    finalize_model_grads(model, parallel_state.get(), opt.grad_buffers)
    opt.prepare_grads()
    opt.step()
    return time.perf_counter() - start


def step_worker(a, t):
    """Median step time (forward, backward, gradient sync, AdamW) of each model, the two alternating
    step by step, and the bytes one forward + backward + SP gradient sum sends."""
    import torch

    from megatron_sp import parallel_state

    parallel_state.initialize_model_parallel(t)
    models = _step_models(a, t)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length), generator=g)
    times = {mode: [] for mode in models}
    for step in range(a.warmup + a.steps):
        for mode, (model, opt) in models.items():
            seconds = _train_step(model, opt, tokens)
            if step >= a.warmup:
                times[mode].append(seconds)
    out = {}
    for mode, (model, _) in models.items():
        with CollectiveCounter() as counter:
            model(tokens, tokens.roll(-1, 1)).backward()
            model.partial_grads.reduce(model.parameters())
        out[mode] = {
            "ms": 1e3 * _STATS[a.stat](times[mode]),
            "sent": sum(c["sent"] for c in counter.calls),
            "ring_steps": sum(c["kind"] == "p2p" for c in counter.calls),
        }
    return out


# ---- report ------------------------------------------------------------------------------------------


def _mean(values):
    return sum(values) / len(values)


def layer_rows(t, per_rank):
    """Table rows per layer (ms, rank means) and whether the bytes agree."""
    rows, ok = [], True
    for name in LAYERS:
        res = [r[name] for r in per_rank]
        pw, pwait = _mean([r["plain"][0] for r in res]), _mean([r["plain"][1] for r in res])
        ow, owait = _mean([r["overlap"][0] for r in res]), _mean([r["overlap"][1] for r in res])
        gemm = _mean([r["gemm"] for r in res])
        sent = res[0]["sent"]
        same = abs(sent["plain"] - sent["overlap"]) <= 1e-9 * sent["plain"]
        ok &= same and all(r["sent"] == sent for r in res)
        rows.append(
            [t, name]
            + [f"{1e3 * v:.2f}" for v in (gemm, pw, pwait, ow, owait)]
            + [f"{pwait / max(owait, 1e-9):.2f}x", f"{pw / ow:.3f}", f"{sent['plain']:.0f}", f"{sent['overlap']:.0f}"]
            + ["SAME" if same else "DIFFERENT"]
        )
    return rows, ok


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_shape_args(p)
    p.set_defaults(seq_length=512, micro_batch_size=2, hidden_size=256, num_attention_heads=8, vocab_size=8192)
    p.add_argument("--tp-sizes", default="2,4")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2, help="layers of the step-time model")
    p.add_argument("--steps", type=int, default=10, help="timed steps of the step-time model")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--skip-step", action="store_true", help="per-layer figures only")
    p.add_argument("--stat", choices=sorted(_STATS), default="median", help="of the timed repeats")
    a = p.parse_args(argv)
    a.ffn_hidden_size = a.ffn_hidden_size or 4 * a.hidden_size
    a.device, a.bf16, a.no_fused_kernels = "cpu", False, False
    import torch

    start = time.time()
    print(
        f"--tp-comm-overlap — torch {torch.__version__}, gloo, {os.cpu_count()} CPU cores, 1 thread per rank; "
        f"s={a.seq_length} b={a.micro_batch_size} h={a.hidden_size} f={a.ffn_hidden_size}, fp32; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    rows, steps, ok = [], [], True
    for t in sorted({int(x) for x in a.tp_sizes.split(",")}):
        with LocalWorld(t) as world:
            layer_table, same = layer_rows(t, world.run(layers_worker, a, t))
            rows += layer_table
            ok &= same
            if not a.skip_step:
                res = world.run(step_worker, a, t)[0]
                plain, overlapped = res["plain"], res["overlap"]
                same = abs(plain["sent"] - overlapped["sent"]) <= 1e-9 * plain["sent"]
                ok &= same
                steps.append(
                    [t, f"{plain['ms']:.1f}", f"{overlapped['ms']:.1f}", f"{plain['ms'] / overlapped['ms']:.3f}"]
                    + [f"{plain['sent']:.0f}", f"{overlapped['sent']:.0f}", overlapped["ring_steps"]]
                    + ["SAME" if same else "DIFFERENT"]
                )
    print(f"\n1-2. per layer, forward + backward, ms ({a.stat} of {a.repeats}, mean over ranks); bytes sent per rank")
    heads = ["t", "layer", "gemm only", "plain wall", "plain wait", "overlap wall", "overlap wait"]
    heads += ["wait plain/overlap", "wall plain/overlap", "bytes plain", "bytes overlap", "bytes"]
    print(table(heads, rows))
    if steps:
        print(
            f"\n3. training step of the bench model ({a.model}, L={a.num_layers}, V={a.vocab_size}, "
            f"dropout {a.dropout}), {a.stat} ms over {a.steps} steps (rank 0), bytes sent per rank"
        )
        heads = ["t", "plain ms/step", "overlap ms/step", "plain/overlap", "bytes plain", "bytes overlap"]
        print(table(heads + ["ring steps", "bytes"], steps))
    print(
        f"\n{'ALL CHECKS PASS' if ok else 'SOME CHECK FAILED'}: bytes equal with and without the flag "
        f"({time.time() - start:.1f} s, load average {os.getloadavg()[0]:.1f})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

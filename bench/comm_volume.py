"""Bytes each rank sends through collectives, per transformer layer per training step, TP vs TP+SP.

    python bench/comm_volume.py                  # s=64 b=2 h=64 a=4, t = 2, 4
    python bench/comm_volume.py --seq-length 128 --tp-sizes 2,4,8   (needs 8 processes)

What is measured
----------------
The torch.distributed collectives the library calls are wrapped for the duration of one training
step (forward, backward, and model.partial_grads.reduce, the SP gradient sum): the
library calls them as attributes of the `torch.distributed` module (`dist.all_reduce(...)` with
`import torch.distributed as dist`), so replacing those attributes intercepts every call. Wrapped:
all_reduce, all_gather_into_tensor / all_gather_single / _all_gather_base, reduce_scatter_tensor /
reduce_scatter_single / _reduce_scatter_base, all_gather (list), reduce_scatter (list),
all_to_all_single, all_to_all (list), batch_isend_irecv (ring attention: the isend bytes), and the
functional collectives tensor_parallel/mappings.py and layers.py call (what torch.compile can trace:
all_reduce, all_gather_tensor, reduce_scatter_tensor, all_to_all_single of
torch.distributed._functional_collectives, called as attributes of that module). A call made
from inside another wrapped call is not counted twice. Each call records its op, phase (forward /
backward / sp-grad-sync), the library function that issued it, the group size t and the tensor bytes,
and is charged the standard ring-algorithm cost per rank:
    all-reduce      2 (t-1)/t · N         N = bytes of the tensor
    all-gather        (t-1)/t · N_out     N_out = bytes of the gathered output
    reduce-scatter    (t-1)/t · N_in      N_in = bytes of the full input
    all-to-all        (t-1)/t · N_in      (every rank keeps 1/t of its input)
"raw" bytes are the N of each call (what the call's tensor holds), before the ring factor.

Per-layer isolation: one step of a 1-layer and of a 2-layer model (same shapes and settings);
L2 - L1 is one transformer layer (embedding, head, cross entropy and their collectives cancel).
Dropout is off (it changes no collective). fp32: N = 4 bytes · s · b · h (--bf16: 2 bytes) for every activation
collective inside a layer.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time
import traceback
from collections import OrderedDict

from _cli import add_shape_args
from _cli import table as _table

from megatron_sp.testing import LocalWorld

# torch.distributed attribute -> (kind, how to size it)
WRAPPED = OrderedDict(
    [
        ("all_reduce", "all_reduce"),
        ("all_gather_into_tensor", "all_gather"),
        ("all_gather_single", "all_gather"),
        ("_all_gather_base", "all_gather"),
        ("all_gather", "all_gather"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("reduce_scatter_single", "reduce_scatter"),
        ("_reduce_scatter_base", "reduce_scatter"),
        ("reduce_scatter", "reduce_scatter"),
        ("all_to_all_single", "all_to_all"),
        ("all_to_all", "all_to_all"),
        ("batch_isend_irecv", "p2p"),
    ]
)
# torch.distributed._functional_collectives attribute -> kind; each takes its tensor as `self` and
# returns a new one (all_gather_tensor's output: t times its input)
FUNCTIONAL = OrderedDict(
    [
        ("all_reduce", "all_reduce"),
        ("all_gather_tensor", "all_gather"),
        ("all_gather_single", "all_gather"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("reduce_scatter_single", "reduce_scatter"),
        ("all_to_all_single", "all_to_all"),
    ]
)
# mappings' raw helpers are skipped when naming the call site (the caller of interest is above them)
_HELPERS = {
    "all_gather_into",
    "reduce_scatter_into",
    "all_gather_start",
    "reduce_scatter_start",
    "_all_reduce",
    "_all_gather_dim0",
    "_reduce_scatter_dim0",
    "_all_gather_last",
    "_reduce_scatter_last",
    "_all_to_all",
    "<lambda>",
}


def _nbytes(x):
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return x.numel() * x.element_size()


class CollectiveCounter:
    """Context manager: wraps torch.distributed collectives and records every call.

    calls: list of dict(kind, name, phase, site, t, raw, sent); set `.phase` to label what follows.
    """

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self._dist, self._funcol = dist, funcol
        self.calls = []
        self.phase = "forward"
        self._saved = {}
        self._depth = 0

    def _site(self):
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if "megatron_sp" in code.co_filename and code.co_name not in _HELPERS:
                return getattr(code, "co_qualname", code.co_name)
            frame = frame.f_back
        return "<outside megatron_sp>"

    def _wrap(self, name, kind, orig):
        counter = self
        params = list(inspect.signature(orig).parameters)

        def wrapper(*args, **kwargs):
            if counter._depth:  # nested inside another wrapped collective
                return orig(*args, **kwargs)
            bound = dict(zip(params, args), **kwargs)
            t = counter._world_size(bound.get("group"))
            if "self" in bound:  # a functional collective
                raw = _nbytes(bound["self"]) * (t if kind == "all_gather" else 1)
                sent = (2 if kind == "all_reduce" else 1) * (t - 1) / t * raw
            elif kind == "all_reduce":
                raw = _nbytes(bound["tensor"])
                sent = 2 * (t - 1) / t * raw
            elif kind == "all_gather":
                out = bound.get("output_tensor", bound.get("tensor_list"))
                raw = _nbytes(out)
                sent = (t - 1) / t * raw
            elif kind == "reduce_scatter":
                inp = bound.get("input", bound.get("input_list"))
                raw = _nbytes(inp)
                sent = (t - 1) / t * raw
            elif kind == "p2p":  # ring attention: what this rank sends
                ops = bound["p2p_op_list"]
                raw = sent = sum(_nbytes(op.tensor) for op in ops if op.op is counter._dist.isend)
                t = counter._world_size(ops[0].group) if ops else 1
            else:  # all_to_all
                inp = bound.get("input", bound.get("input_tensor_list"))
                raw = _nbytes(inp)
                sent = (t - 1) / t * raw
            counter.calls.append(
                dict(kind=kind, name=name, phase=counter.phase, site=counter._site(), t=t, raw=raw, sent=sent)
            )
            counter._depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                counter._depth -= 1

        wrapper.__wrapped__ = orig
        return wrapper

    def _world_size(self, group):
        return self._saved.get("get_world_size", self._dist.get_world_size)(group)

    def __enter__(self):
        dist = self._dist
        self._saved["get_world_size"] = dist.get_world_size
        for name, kind in WRAPPED.items():
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._saved[name] = orig
            setattr(dist, name, self._wrap(name, kind, orig))
        for name, kind in FUNCTIONAL.items():
            orig = getattr(self._funcol, name, None)
            if orig is None:
                continue
            self._saved["funcol." + name] = orig
            setattr(self._funcol, name, self._wrap("funcol." + name, kind, orig))
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            if name.startswith("funcol."):
                setattr(self._funcol, name[len("funcol.") :], orig)
            elif name != "get_world_size":
                setattr(self._dist, name, orig)
        self._saved.clear()


# ---- the per-rank work ----------------------------------------------------------------------------


def _step_worker(args, tp, sp):
    import warnings

    import torch

    from megatron_sp import parallel_state
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.gpt import GPTModel

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    ps = parallel_state.initialize_model_parallel(tp)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=g)
    labels = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length), generator=g)
    out = {"tp_rank": ps.tp_rank}
    for layers in (1, 2):
        cfg = GPTConfig(
            num_layers=layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            vocab_size=args.vocab_size,
            seq_length=args.seq_length,
            ffn_hidden_size=args.ffn_hidden_size,
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_fused_kernels=args.fused,
            params_dtype="bf16" if getattr(args, "bf16", False) else "fp32",
        )
        model = GPTModel(cfg).train()
        with CollectiveCounter() as counter:
            counter.phase = "forward"
            loss = model(tokens, labels)
            counter.phase = "backward"
            loss.backward()
            counter.phase = "sp-grad-sync"
            model.partial_grads.reduce(model.parameters())
        out[f"L{layers}"] = counter.calls
    return out


# ---- aggregation and printing -----------------------------------------------------------------------


def _aggregate(calls, key):
    agg = OrderedDict()
    for c in calls:
        k = key(c)
        a = agg.setdefault(k, {"calls": 0, "raw": 0, "sent": 0.0})
        a["calls"] += 1
        a["raw"] += c["raw"]
        a["sent"] += c["sent"]
    return agg


def per_layer(res, key):
    """L2 - L1 of the aggregated calls (keys present in either)."""
    a2, a1 = _aggregate(res["L2"], key), _aggregate(res["L1"], key)
    out = OrderedDict()
    for k in list(a2) + [k for k in a1 if k not in a2]:
        x, y = a2.get(k, {"calls": 0, "raw": 0, "sent": 0.0}), a1.get(k, {"calls": 0, "raw": 0, "sent": 0.0})
        d = {f: x[f] - y[f] for f in ("calls", "raw", "sent")}
        if d["calls"] or d["raw"]:
            out[k] = d
    return out


def _is_regather(kind, phase, site):
    """The backward all-gather of a ColumnParallelLinear's saved input shard (for the weight grad)."""
    return kind == "all_gather" and phase == "backward" and site.startswith("_ParallelLinear")


def report(args, results):
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    size, dtype = (2, "bf16") if getattr(args, "bf16", False) else (4, "fp32")  # collectives move the activations
    N = size * s * b * h
    title = (
        f"collective bytes per layer per rank per training step (forward + backward) — "
        f"s={s} b={b} h={h} a={args.num_attention_heads}, {dtype}, N = {size}sbh = {N} B"
    )
    print("\n" + "=" * len(title) + f"\n{title}\n" + "=" * len(title))
    ok = True
    rows, detail = [], {}
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    for (t, sp), res in results.items():
        by_kind = per_layer(res, lambda c: (c["kind"], c["phase"] == "sp-grad-sync"))
        by_phase = per_layer(res, lambda c: c["phase"])
        act = {k: by_kind.get((k, False), {"calls": 0, "raw": 0, "sent": 0.0}) for k in kinds}
        act_sent = sum(v["sent"] for v in act.values())
        regather = sum(
            v["sent"] for k, v in per_layer(res, lambda c: _is_regather(c["kind"], c["phase"], c["site"])).items() if k
        )
        sync = by_phase.get("sp-grad-sync", {"calls": 0, "raw": 0, "sent": 0.0})
        expected = (10 if sp else 8) * (t - 1) / t * N  # see the explanation printed below
        ok &= abs(act_sent - expected) < 1e-6 * expected
        calls = " ".join(f"{act[k]['calls']}{ab}" for k, ab in zip(kinds, ("AR", "AG", "RS", "A2A")))
        rows.append(
            [
                t,
                "TP+SP" if sp else "TP",
                calls,
                act["all_reduce"]["raw"],
                act["all_gather"]["raw"],
                act["reduce_scatter"]["raw"],
                act["all_to_all"]["raw"],
                f"{by_phase.get('forward', {'sent': 0})['sent']:.0f}",
                f"{by_phase.get('backward', {'sent': 0})['sent']:.0f}",
                f"{act_sent:.0f}",
                f"{act_sent / N:.3f}",
                f"{act_sent - regather:.0f}",
                f"{sync['sent']:.0f}",
            ]
        )
        detail[(t, sp)] = per_layer(res, lambda c: (c["phase"], c["kind"], c["site"]))
    print(
        _table(
            [
                "t",
                "mode",
                "calls",
                "raw AR B",
                "raw AG B",
                "raw RS B",
                "raw A2A B",
                "sent fwd",
                "sent bwd",
                "sent total",
                "/N",
                "w/o bwd re-gather",
                "SP grad sync",
            ],
            rows,
        )
    )

    print("\nTP vs TP+SP, ring bytes sent per rank per layer (activation collectives):")
    crow = []
    for t in sorted({t for t, _ in results}):
        if (t, False) not in results or (t, True) not in results:
            continue

        def sent(sp, drop_regather=False):
            d = per_layer(
                results[(t, sp)],
                lambda c: (c["phase"] != "sp-grad-sync", _is_regather(c["kind"], c["phase"], c["site"])),
            )
            return sum(v["sent"] for (inside, rg), v in d.items() if inside and not (drop_regather and rg))

        tp_b, sp_b, sp_nr = sent(False), sent(True), sent(True, True)
        equal = abs(sp_nr - tp_b) < 1e-6 * tp_b
        ok &= equal
        crow.append(
            [
                t,
                f"{tp_b:.0f}",
                f"{sp_b:.0f}",
                f"{sp_b / tp_b:.3f}",
                f"{sp_nr:.0f}",
                f"{sp_nr / tp_b:.3f}",
                "EQUAL" if equal else "DIFFERENT",
            ]
        )
    print(
        _table(
            ["t", "TP (4 AR)", "TP+SP (all)", "SP/TP", "TP+SP w/o re-gather (4 AG + 4 RS)", "ratio", "AG+RS = AR?"],
            crow,
        )
    )

    bt = args.detail_tp
    for sp in (False, True):
        if (bt, sp) not in detail:
            continue
        print(f"\nPer call site, t={bt} {'TP+SP' if sp else 'TP'} (one layer, L2 - L1):")
        drows = [
            [ph, kind, site, v["calls"], v["raw"], f"{v['sent']:.0f}"]
            for (ph, kind, site), v in detail[(bt, sp)].items()
        ]
        print(
            _table(
                ["phase", "collective", "issued by", "calls", "raw B", "sent B"], drows, ["<", "<", "<", ">", ">", ">"]
            )
        )
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_shape_args(p)
    p.add_argument("--tp-sizes", type=str, default="2,4")
    p.add_argument("--detail-tp", type=int, default=2, help="print per-call-site detail at this t (0: none)")
    p.add_argument("--fused", action="store_true", help="use_fused_kernels=True")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters and activations (Megatron's --bf16)")
    args = p.parse_args(argv)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    tps = sorted({int(x) for x in args.tp_sizes.split(",")})

    world_size = math.lcm(*tps)  # every TP size divides the world (dp = world / t)
    import torch

    start = time.time()
    print(
        f"communication volume — torch {torch.__version__}, gloo, {os.cpu_count()} CPU cores, "
        f"world of {world_size} processes"
    )
    results = OrderedDict()
    with LocalWorld(world_size) as world:
        for t in tps:
            for sp in (False, True):
                per_rank = world.run(_step_worker, args, t, sp)
                results[(t, sp)] = per_rank[0]
                for r in per_rank[1:]:
                    if [c["sent"] for c in r["L2"]] != [c["sent"] for c in per_rank[0]["L2"]]:
                        raise RuntimeError(f"t={t} sp={sp}: ranks send different volumes")
    ok = report(args, results)
    print(
        "\nexpected per layer: TP 4 all-reduces of N (2 fwd: f-bar after proj and FC2; 2 bwd: f before "
        "QKV and FC1) = 8(t-1)/t N;\nTP+SP 2 AG + 2 RS fwd (g, g-bar) and 2 AG + 2 RS bwd (their "
        "transposes) = 8(t-1)/t N, plus 2 AG bwd that re-gather the\nsaved input shard of the QKV and "
        "FC1 GEMMs for the weight gradient (+2(t-1)/t N) = 10(t-1)/t N.\nSP grad sync: one flattened "
        "all-reduce of every SP-region parameter gradient per step (0 extra calls per layer); each layer "
        "adds\nits 2 LayerNorms' weight and bias and the proj and FC2 biases: 6h floats."
    )
    print(f"\n{'ALL CHECKS PASS' if ok else 'SOME CHECK FAILED'} ({time.time() - start:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # any failure: the traceback, then exit 2
        traceback.print_exc()
        sys.exit(2)

"""Activation memory saved for backward, per transformer layer per rank, TP vs TP+SP, measured.

    python bench/activation_memory.py                      # s=64 b=2 h=64 a=4, t = 1, 2, 4, dropout 0 and 0.1
    python bench/activation_memory.py --seq-length 128 --tp-sizes 2,4 --dropout 0.1

What is measured
----------------
A forward pass of GPTModel (train mode) runs under `torch.autograd.graph.saved_tensors_hooks`. Every
tensor autograd saves for the backward (inputs/outputs saved by aten ops, and `ctx.save_for_backward`
of the library's autograd Functions) passes through the pack hook, which records the tensor's
*storage* (`untyped_storage()`): each storage is counted once, by `data_ptr`, with its full
`nbytes()` (what the saved view keeps alive). Excluded, and listed separately:
  * parameters: saved tensors that are `nn.Parameter`s or share a storage with one (views such as
    `weight.t()` saved by a matmul, LayerNorm gamma/beta);
  * empty storages (nbytes == 0).
Nothing else is excluded: masks (bool or float), LayerNorm statistics, SDPA's logsumexp, 0-dim
tensors all count. Tensors that a custom autograd Function stashes as plain `ctx` attributes (not via
save_for_backward) would be invisible to the hook; the library saves none (checked by reading
tensor_parallel/ and models/).

Per-layer isolation: the same measurement on a 1-layer and a 2-layer model (same shapes, dropout,
TP/SP); bytes(L=2) - bytes(L=1) is exactly one transformer layer (embedding, final LayerNorm, head and
loss are common to both). Cross-check: in the 2-layer model, the storages first saved while
`layers.1` runs (module forward hooks track the current module) -- a layer counts its own input (saved
by its first LayerNorm), not its output (saved by the next layer's / the final LayerNorm). Both
numbers are printed; they agree.

Reported per rank (rank 0 of the TP group; every TP rank is checked to save the same bytes).

Formulas (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
16-bit activations, 1-byte dropout masks, a = heads, per layer):
    TP       sbh (10 + 24/t + 5as/(ht))
    TP + SP  sbh/t (34 + 5as/h)
Our layers differ from that accounting; the "adjusted formula" below sums the named terms (see
`adjusted_terms` in megatron_sp/planning/activations.py, which tools/plan.py uses), each derived
from the code, not fitted to the measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections import OrderedDict

from _cli import add_shape_args
from _cli import table as _table

from megatron_sp.planning.activations import adjusted_formula_text, adjusted_terms, paper_bytes
from megatron_sp.testing import LocalWorld

# ---- the measurement machinery (importable; tests/test_bench_memory.py checks it) --------------


class SavedTensorCounter:
    """Context manager recording every storage saved for backward while it is active.

    records: OrderedDict data_ptr -> dict(nbytes, shape, dtype, module, op), in first-save order.
    excluded: list of (module, op, shape) for saves skipped because they are parameters.
    `model` (optional): its parameters are excluded and its module names label the records.
    """

    def __init__(self, model=None, exclude=()):
        import torch

        self._torch = torch
        self.model = model
        params = list(model.parameters()) if model is not None else []
        params += list(exclude)
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.records: "OrderedDict[int, dict]" = OrderedDict()
        self.excluded = []
        self._module_stack = ["<outside>"]
        self._op_stack = []
        self._handles = []
        self._in_hook = False

    # current module / op labels ----------------------------------------------------------------
    def _push_module(self, name):
        def pre(_mod, _inp):
            self._module_stack.append(name)

        return pre

    def _pop_module(self, _mod, _inp, _out):
        self._module_stack.pop()

    def _mode(self):
        from torch.overrides import TorchFunctionMode

        counter = self

        class _OpLabel(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if counter._in_hook:
                    return func(*args, **(kwargs or {}))
                counter._op_stack.append(getattr(func, "__name__", str(func)))
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    counter._op_stack.pop()

        return _OpLabel()

    # hooks ------------------------------------------------------------------------------------------
    def _pack(self, t):
        self._in_hook = True
        try:
            torch = self._torch
            module = self._module_stack[-1]
            op = self._op_stack[0] if self._op_stack else "autograd.Function"
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if isinstance(t, torch.nn.Parameter) or ptr in self._param_ptrs:
                self.excluded.append((module, op, tuple(t.shape)))
            elif nbytes > 0 and ptr not in self.records:
                self.records[ptr] = dict(
                    nbytes=nbytes, shape=tuple(t.shape), dtype=str(t.dtype)[6:], module=module, op=op
                )
        finally:
            self._in_hook = False
        return t

    def __enter__(self):
        torch = self._torch
        if self.model is not None:
            for name, mod in self.model.named_modules():
                if name:
                    self._handles.append(mod.register_forward_pre_hook(self._push_module(name)))
                    self._handles.append(mod.register_forward_hook(self._pop_module))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._fmode = self._mode()
        self._fmode.__enter__()
        return self

    def __exit__(self, *exc):
        self._fmode.__exit__(*exc)
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def total(self, module_prefix=None) -> int:
        return sum(
            r["nbytes"]
            for r in self.records.values()
            if module_prefix is None or r["module"] == module_prefix or r["module"].startswith(module_prefix + ".")
        )


# ---- formulas: megatron_sp/planning/activations.py (tools/plan.py uses the same terms) ----------

# ---- the per-rank work ----------------------------------------------------------------------------


def _layer_bytes_worker(args, tp, sp, dropout):
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
    out = {"tp_rank": ps.tp_rank, "dp_rank": ps.dp_rank}
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
            hidden_dropout=dropout,
            attention_dropout=dropout,
            use_fused_kernels=args.fused,
            params_dtype="bf16" if getattr(args, "bf16", False) else "fp32",
        )
        model = GPTModel(cfg).train()
        with SavedTensorCounter(model) as counter:
            loss = model(tokens, labels)
        out[f"total_L{layers}"] = counter.total()
        if layers == 2:
            out["direct"] = counter.total("layers.1")
            out["records"] = [
                dict(r, module=r["module"].replace("layers.1.", "").replace("layers.1", "block"))
                for r in counter.records.values()
                if r["module"] == "layers.1" or r["module"].startswith("layers.1.")
            ]
            out["excluded"] = [e for e in counter.excluded if e[0].startswith("layers.1")]
            out["attention_nodes"] = sorted(_node_names(loss.grad_fn, "Attention"))
        del loss, model
    out["per_layer"] = out["total_L2"] - out["total_L1"]
    return out


def _node_names(root, needle):
    """Names of the autograd nodes reachable from `root` whose name contains `needle`."""
    seen, stack, names = set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if needle in node.name():
            names.add(node.name())
        stack.extend(n for n, _ in node.next_functions)
    return names


# ---- printing -------------------------------------------------------------------------------------


def _breakdown(res_tp, res_sp, t):
    """Rows (module, op, TP shape/bytes, SP shape/bytes), matched by (module, op, occurrence)."""

    def keyed(records):
        seen, out = {}, OrderedDict()
        for r in records:
            k = (r["module"], r["op"])
            seen[k] = seen.get(k, 0) + 1
            out[k + (seen[k],)] = r
        return out

    a, b = keyed(res_tp["records"]), keyed(res_sp["records"]) if res_sp else OrderedDict()
    rows = []
    for k in list(a) + [k for k in b if k not in a]:
        ra, rb = a.get(k), b.get(k)
        fmt = lambda r: (f"{list(r['shape'])} {r['dtype']}", r["nbytes"]) if r else ("-", 0)
        sa, ba = fmt(ra)
        sb_, bb = fmt(rb)
        row = [k[0], k[1], sa, ba]
        if res_sp:
            row += [sb_, bb]
        rows.append(row)
    headers = ["module", "op (outermost torch call)", f"TP t={t}: saved tensor", "bytes"]
    if res_sp:
        headers += [f"TP+SP t={t}: saved tensor", "bytes"]
    rows.append(["total", "", "", sum(r[3] for r in rows)] + (["", sum(r[5] for r in rows)] if res_sp else []))
    return _table(headers, rows, ["<", "<", "<", ">", "<", ">"][: len(headers)])


def report(args, dropout, results):
    s, b, h, a, f = (
        args.seq_length,
        args.micro_batch_size,
        args.hidden_size,
        args.num_attention_heads,
        args.ffn_hidden_size,
    )
    sbh = s * b * h
    title = (
        f"dropout {'on (hidden = attention = %g)' % dropout if dropout else 'off (hidden = attention = 0)'}"
        f" — s={s} b={b} h={h} a={a} f={f}, fp32, bytes per layer per rank"
    )
    print("\n" + "=" * len(title) + f"\n{title}\n" + "=" * len(title))
    rows, ok = [], True
    for (t, sp), res in results.items():
        adj = sum(x[1] for x in adjusted_terms(s, b, h, a, f, t, sp, dropout))
        pap = paper_bytes(s, b, h, a, t, sp)
        m = res["per_layer"]
        rows.append(
            [
                t,
                "TP+SP" if sp else "TP",
                m,
                res["direct"],
                f"{m / sbh:.3f}",
                f"{pap:.0f}",
                f"{pap / sbh:.3f}",
                f"{adj:.0f}",
                f"{adj / sbh:.3f}",
                f"{m / adj:.4f}",
            ]
        )
    print(
        _table(
            [
                "t",
                "mode",
                "measured L2-L1",
                "direct layers.1",
                "meas/sbh",
                "paper (16-bit)",
                "paper/sbh",
                "adjusted",
                "adj/sbh",
                "meas/adj",
            ],
            rows,
        )
    )
    print("paper (16-bit):   TP: sbh(10 + 24/t + 5as/(ht))    TP+SP: sbh/t(34 + 5as/h)    (f = 4h assumed)")
    print(f"adjusted (fp32):  {adjusted_formula_text(h, f, dropout)}")
    nodes = sorted({n for r in results.values() for n in r["attention_nodes"]})
    print(f"attention autograd nodes: {', '.join(nodes) or 'none with Attention in the name (explicit softmax)'}")

    print(f"\nSP / non-SP ratio per rank (criterion: measured within {args.tolerance:.0%} of adjusted)")
    rrows = []
    for t in sorted({t for t, _ in results}):
        if (t, True) not in results:
            continue
        meas = results[(t, True)]["per_layer"] / results[(t, False)]["per_layer"]
        pap = paper_bytes(s, b, h, a, t, True) / paper_bytes(s, b, h, a, t, False)
        adj = sum(x[1] for x in adjusted_terms(s, b, h, a, f, t, True, dropout)) / sum(
            x[1] for x in adjusted_terms(s, b, h, a, f, t, False, dropout)
        )
        dev = abs(meas / adj - 1)
        passed = dev <= args.tolerance
        ok &= passed
        rrows.append(
            [
                t,
                f"{meas:.4f}",
                f"{pap:.4f}",
                f"{adj:.4f}",
                f"{meas / pap - 1:+.1%}",
                f"{dev:.2%}",
                "PASS" if passed else "FAIL",
            ]
        )
    print(_table(["t", "measured", "paper", "adjusted", "meas vs paper", "|meas/adj-1|", "5% check"], rrows))

    bt = args.breakdown_tp
    if bt in {t for t, _ in results}:
        print(f"\nWhat one layer saves at t={bt} (rank 0; storages counted once, parameters excluded):")
        print(_breakdown(results[(bt, False)], results.get((bt, True)), bt))
        excl = sorted({f"{m}:{op}" for m, op, _ in results[(bt, False)]["excluded"]})
        print(f"excluded as parameters ({len(results[(bt, False)]['excluded'])} saves at TP): " + ", ".join(excl))
        print(f"\nAdjusted formula terms at t={bt} (bytes per layer per rank):")
        trows = []
        tp_terms = adjusted_terms(s, b, h, a, f, bt, False, dropout)
        sp_terms = adjusted_terms(s, b, h, a, f, bt, True, dropout) if bt > 1 else None
        for i, (name, nbytes, why) in enumerate(tp_terms):
            trows.append([name, f"{nbytes:.0f}"] + ([f"{sp_terms[i][1]:.0f}"] if sp_terms else []) + [why])
        trows.append(
            ["total", f"{sum(x[1] for x in tp_terms):.0f}"]
            + ([f"{sum(x[1] for x in sp_terms):.0f}"] if sp_terms else [])
            + [""]
        )
        print(
            _table(
                ["term", "TP"] + (["TP+SP"] if sp_terms else []) + ["vs paper"],
                trows,
                ["<", ">"] + ([">"] if sp_terms else []) + ["<"],
            )
        )
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_shape_args(p)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters and activations (the formulas stay fp32)")
    p.add_argument("--tp-sizes", type=str, default="1,2,4")
    p.add_argument(
        "--dropout", type=float, default=0.1, help="the 'dropout on' table uses this for hidden and attention dropout"
    )
    p.add_argument("--no-dropout-off", action="store_true", help="skip the dropout-off table")
    p.add_argument("--no-dropout-on", action="store_true", help="skip the dropout-on table")
    p.add_argument("--breakdown-tp", type=int, default=2, help="print the per-tensor breakdown at this t (0: none)")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument(
        "--fused", action="store_true", help="use_fused_kernels=True (the adjusted formula describes the reference ops)"
    )
    args = p.parse_args(argv)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    tps = sorted({int(x) for x in args.tp_sizes.split(",")})
    dropouts = ([] if args.no_dropout_off else [0.0]) + ([] if args.no_dropout_on else [args.dropout])

    world_size = math.lcm(*tps)  # every TP size divides the world (dp = world / t)
    import torch

    start = time.time()
    print(
        f"activation memory per layer per rank — torch {torch.__version__}, gloo, "
        f"{os.cpu_count()} CPU cores, world of {world_size} processes, fused ops: {args.fused}"
    )
    ok = True
    with LocalWorld(world_size) as world:
        for dropout in dropouts:
            results = OrderedDict()
            for t in tps:
                for sp in (False, True) if t > 1 else (False,):
                    per_rank = world.run(_layer_bytes_worker, args, t, sp, dropout)
                    distinct = {r["per_layer"] for r in per_rank}
                    if len(distinct) != 1:
                        raise RuntimeError(f"t={t} sp={sp}: ranks save different bytes: {sorted(distinct)}")
                    results[(t, sp)] = per_rank[0]
            ok &= report(args, dropout, results)
    print(f"\n{'ALL PASS' if ok else 'SOME FAIL'} ({time.time() - start:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # any failure: the traceback, then exit 2
        traceback.print_exc()
        sys.exit(2)

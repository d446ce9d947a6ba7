#!/usr/bin/env python
"""Check that a model computes the same function at every parallel layout, on this machine's CPUs.

    python tools/check_parity.py <pretrain_gpt_sp.py's model flags> [--layouts tp2+sp,cp2,pp2,dp2]
    python tools/check_parity.py --model my_block.py:SPEC --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32

It takes the program's own flags (its parser; the layout, batch and precision flags are ignored:
the check sets its own), builds the serial oracle (ReferenceGPT) and, in local gloo ranks, the
parallel model at each layout asked (default: every dimension at 2 that the model allows: tp2+sp,
cp2, cp2:a2a, pp2, dp2; names in megatron_sp/testing/layouts.py), all from the same seed; runs the
same batches through each (forward, backward and an AdamW step per batch, --steps of them, 2 by
default; dropout as the flags say, Megatron's 0.1 / 0.1 by default) and prints one row per layout:
the loss difference, the first batch's worst gradient difference and its parameter, the gradient
norm's, and the worst parameter after the steps.
Exits 1 when any exceeds its tolerance (fp32, relative: megatron_sp/testing/parity.py's TOLERANCES),
2 for flags it cannot run. A model is a registered family (`--model qwen3`), a spec
(`--model package.module:SPEC`) or a spec file (`--model path/to/block.py:SPEC`; docs/models.md).
The harness is the test suite's (tests/test_parity.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from megatron_sp import failures

LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "context_parallel_size",
    "cp_comm_type",
    "hierarchical_context_parallel_sizes",
    "sequence_parallel",
)


def _tool_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/check_parity.py",
        description=__doc__.splitlines()[1],
        epilog="Every other flag is pretrain_gpt_sp.py's (python pretrain_gpt_sp.py --help).",
        allow_abbrev=False,
    )
    p.add_argument("--layouts", default=None, help="comma-separated layouts (default: every dimension at 2 allowed)")
    p.add_argument("--steps", type=int, default=2, help="AdamW steps, one per batch (default 2)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per global batch (default 4)")
    p.add_argument("--documents", action="store_true", help="pack three documents per sample (reset positions, mask)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    return p


def _importable(argv: list) -> list:
    """argv with `--model dir/file.py:ATTR` as `file:ATTR`, its directory put on sys.path (the
    spawned ranks inherit it)."""
    out = list(argv)
    for i, flag in enumerate(out[:-1]):
        target = out[i + 1]
        if flag == "--model" and ":" in target and target.partition(":")[0].endswith(".py"):
            path, _, attr = target.partition(":")
            if not os.path.isfile(path):
                raise ValueError(f"--model {target}: there is no file {path}.")
            sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
            out[i + 1] = f"{os.path.splitext(os.path.basename(path))[0]}:{attr}"
    return out


def model_fields(argv: list) -> dict:
    """The GPTConfig fields (serial, fp32) that the program's flags describe; ArgumentError or
    ValueError (one sentence) for flags it refuses."""
    from megatron_sp.training.arguments import build_parser, parse_args
    from megatron_sp.training.pretrain import build_config

    sizes, _ = build_parser().parse_known_args(argv)  # the world its layout flags need, to validate
    world = sizes.tensor_model_parallel_size * sizes.context_parallel_size * sizes.pipeline_model_parallel_size
    args = parse_args(argv, world_size=world)
    args.params_dtype = "fp32"  # the contract's precision (bf16 drifts by summation order)
    cfg = build_config(args, args.vocab_size or 97)  # 97: no TP size divides it, so padding is checked
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in LAYOUT_FIELDS}
    return dict(fields, tp_comm_overlap=False)


def _layouts(text, fields: dict, batch: int) -> tuple[list, dict]:
    from megatron_sp.testing.layouts import allowed_layouts, parse_layouts

    if text is None:
        return allowed_layouts(fields, batch)
    asked = parse_layouts(text)
    allowed, refused = allowed_layouts(fields, batch, [str(layout) for layout in asked])
    if refused:
        name, why = next(iter(refused.items()))
        raise ValueError(f"layout {name} cannot run this model: {why}")
    return allowed, {}


def check(fields: dict, layouts: list, *, steps: int, batch: int, documents: bool, lr: float) -> list:
    """[Row] of every layout against the serial oracle (megatron_sp/testing/parity.py): the worst of
    its TP ranks' (each gathers the full model; a replicated parameter may differ between them). An MoE
    model's oracle under a pipeline layout accumulates its pp micro-batches (a balancing loss is the
    micro-batch's)."""
    from megatron_sp.testing import LocalWorld
    from megatron_sp.testing.parity import compare, make_batches, run_layout, run_serial

    batches = make_batches(fields["vocab_size"], fields["seq_length"], batch, steps, documents=documents)
    oracles, rows = {}, []
    with LocalWorld(max(layout.size for layout in layouts)) as world:
        for layout in layouts:
            micro = layout.pp if fields.get("num_experts") else 1
            if micro not in oracles:
                oracles[micro] = run_serial(fields, batches, lr=lr, micro_batches=micro)
            runs = world.run(run_layout, fields, layout, batches, state=None, lr=lr)
            per_tp_rank = [compare(oracles[micro], run, layout) for run in runs if run is not None]
            rows.append(max(per_tp_rank, key=lambda row: (len(row.failures()), row.grad, row.params)))
    return rows


def print_table(rows: list, fields: dict, steps: int, tolerances: dict) -> None:
    print(
        f"parity of --model {fields['model']} against its serial model: {steps} AdamW steps (gradients: "
        f"the first batch's), dropout {fields['hidden_dropout']:g}/{fields['attention_dropout']:g}, fp32; tolerances "
        f"(relative): loss {tolerances['loss']:.0e}, gradients {tolerances['grad']:.0e}, gradient norm "
        f"{tolerances['grad_norm']:.0e}, parameters after the steps {tolerances['params']:.0e}"
    )
    header = ("layout", "loss", "worst gradient", "(parameter)", "grad norm", f"after {steps} steps", "(parameter)")
    lines = [header] + [
        (
            r.layout,
            f"{r.loss:.1e}",
            f"{r.grad:.1e}",
            r.worst_grad,
            f"{r.grad_norm:.1e}",
            f"{r.params:.1e}",
            r.worst_params,
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line, row in zip(lines, [None] + rows):
        verdict = (
            ""
            if row is None
            else "  ok"
            if not row.failures(tolerances)
            else "  FAIL: " + "; ".join(row.failures(tolerances))
        )
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() + verdict)


def main(argv=None) -> int:
    from megatron_sp.testing.parity import TOLERANCES
    from megatron_sp.training.arguments import ArgumentError

    tool, rest = _tool_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if tool.steps < 1 or tool.batch_size < 1:
            raise ValueError("--steps and --batch-size must be at least 1.")
        fields = model_fields(_importable(rest))
        layouts, skipped = _layouts(tool.layouts, fields, tool.batch_size)
        if not layouts:
            raise ValueError(f"no layout at 2 can run this model ({'; '.join(skipped.values())}).")
    except (ArgumentError, ValueError) as err:
        print(f"check_parity.py: error: {failures.one_sentence(err)}", file=sys.stderr)
        return 2
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    rows = check(fields, layouts, steps=tool.steps, batch=tool.batch_size, documents=tool.documents, lr=tool.lr)
    print_table(rows, fields, tool.steps, TOLERANCES)
    return 1 if any(row.failures(TOLERANCES) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

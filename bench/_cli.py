"""The bench scripts' shared command line: the model-shape flags and plain-text tables.

The scripts import this file as `_cli` (a script's own directory, bench/, is on sys.path when it
runs; the tests put bench/ there through pytest's `pythonpath`). Their gloo world is
megatron_sp.testing.LocalWorld: a script starts one (the largest size it needs) and runs every
configuration in it; a TP group of size t < world size simply leaves the world with dp = world / t
data-parallel replicas (each computes the same thing).
"""

from __future__ import annotations


def table(headers, rows, align=None) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned (or `align`)."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    align = align or ["<"] + [">"] * (len(headers) - 1)
    fmt = "  ".join(f"{{:{al}{w}}}" for al, w in zip(align, widths))
    lines = [fmt.format(*headers), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*[str(x) for x in r]) for r in rows]
    return "\n".join(lines)


def add_shape_args(parser) -> None:
    """The model-shape flags both layer benches take (Megatron names, tiny defaults)."""
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    parser.add_argument("--vocab-size", type=int, default=97)

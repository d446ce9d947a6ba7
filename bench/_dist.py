"""Shared helpers for the bench scripts: a world of gloo CPU processes that runs module-level functions,
and plain-text tables.

    with World(4) as world:
        per_rank = world.run(fn, *args)      # fn(*args) on every rank; list of results by rank

Starting a process and importing torch costs seconds on a small machine, so a script starts one
world (the largest size it needs) and runs every configuration in it; a TP group of size t < world
size simply leaves the world with dp = world / t data-parallel replicas (each computes the same
thing). `fn` must be a module-level function (it is pickled by reference); an exception on any rank is
re-raised in the parent with that rank's traceback.

The scripts import this file as `_dist` (bench/ is on sys.path when a script runs) and put the repo
root on sys.path so that `megatron_sp` imports without installation.
"""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


from megatron_sp.local_world import LocalWorld as World  # noqa: E402,F401  (spawned ranks inherit sys.path)


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

"""Parallel layouts by name, as the parity check takes them (`--layouts tp2+sp,cp2,pp2,dp2`).

    tp2        tensor parallelism over 2 ranks          tp2+sp   with sequence parallelism
    cp2        context parallelism, ring (p2p)           cp2:a2a  Ulysses (any --cp-comm-type after ':')
    cp4:a2a+p2p=2x2   a2a+p2p with its hierarchical sizes (a2a over the first, the ring over the second)
    pp2        pipeline parallelism, 2 stages (1F1B)     dp2      data parallelism, the batch split in 2
    tp2+sp/cp2 dimensions combined with '/'

A layout runs on tp·cp·pp·dp ranks. In a larger world the remaining ranks are further data-parallel
replicas that repeat the asked parts of the batch (testing/parity.py), so the function is the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

_DIMENSION = re.compile(r"^(tp|cp|pp|dp)(\d+)(\+sp|:[\w+]+(?:=\d+x\d+)?)?$")


@dataclass(frozen=True)
class Layout:
    """One parallel layout: the sizes of its dimensions (1: not split)."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_comm: str = "p2p"
    cp_levels: Optional[tuple] = None  # a2a+p2p's hierarchical sizes (inner a2a, outer ring)
    pp: int = 1
    dp: int = 1

    @property
    def size(self) -> int:
        """The ranks it runs on."""
        return self.tp * self.cp * self.pp * self.dp

    def __str__(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else "")] if self.tp > 1 else []
        if self.cp > 1:
            levels = "" if self.cp_levels is None else "=" + "x".join(map(str, self.cp_levels))
            parts.append(f"cp{self.cp}" + ("" if self.cp_comm == "p2p" else f":{self.cp_comm}") + levels)
        parts += [f"{name}{n}" for name, n in (("pp", self.pp), ("dp", self.dp)) if n > 1]
        return "/".join(parts) or "serial"

    def config_fields(self) -> dict:
        """The GPTConfig fields of its TP and CP (PP and DP are not the model's)."""
        return dict(
            tensor_model_parallel_size=self.tp,
            sequence_parallel=self.sp,
            context_parallel_size=self.cp,
            cp_comm_type=self.cp_comm,
            hierarchical_context_parallel_sizes=self.cp_levels,
        )


def parse_layout(text: str) -> Layout:
    """The Layout a name spells (module docstring); ValueError (one sentence) otherwise."""
    layout, seen = Layout(), set()
    for part in text.strip().split("/"):
        match = _DIMENSION.match(part)
        if not match or match.group(1) in seen or int(match.group(2)) < 1:
            raise ValueError(
                f"layout {text!r}: {part!r} is not a dimension (tp2, tp2+sp, cp2, cp2:a2a, pp2, dp2; "
                f"each at most once, joined by '/')."
            )
        name, size, suffix = match.group(1), int(match.group(2)), match.group(3) or ""
        seen.add(name)
        if suffix == "+sp" and name != "tp" or suffix.startswith(":") and name != "cp":
            raise ValueError(f"layout {text!r}: {suffix!r} belongs to {'tp' if suffix == '+sp' else 'cp'}, not {name}.")
        layout = replace(layout, **{name: size})
        if suffix == "+sp":
            layout = replace(layout, sp=True)
        elif suffix:
            comm, _, levels = suffix[1:].partition("=")
            cp_levels = tuple(int(n) for n in levels.split("x")) if levels else None
            layout = replace(layout, cp_comm=comm, cp_levels=cp_levels)
    return layout


def parse_layouts(text: str) -> list:
    """Comma-separated layout names -> [Layout]."""
    return [parse_layout(part) for part in text.split(",") if part.strip()]


CANDIDATES = ("tp2+sp", "cp2", "cp2:a2a", "pp2", "dp2")  # every dimension at 2 (Ulysses too)


def allowed_layouts(fields: dict, batch: int, candidates=CANDIDATES) -> tuple[list, dict]:
    """([Layout] of `candidates` that the model of GPTConfig `fields` allows with `batch` samples,
    {name: why not} of the others)."""
    from megatron_sp.config import GPTConfig
    from megatron_sp.pipeline_parallel.layout import PipelineLayout

    allowed, refused = [], {}
    for name in candidates:
        layout = parse_layout(name)
        try:
            cfg = GPTConfig(**{**fields, **layout.config_fields()})
            if layout.pp > 1:
                PipelineLayout(layout.pp).check(cfg.num_layers)
            if batch % (layout.dp * layout.pp):
                raise ValueError(f"the batch of {batch} samples does not split into {layout.dp * layout.pp} parts.")
        except ValueError as err:
            refused[name] = str(err)
            continue
        allowed.append(layout)
    return allowed, refused

"""Parallel layouts by name, as the parity check takes them (`--layouts tp2+sp,cp2,pp2,dp2`).

    tp2        tensor parallelism over 2 ranks          tp2+sp   with sequence parallelism
    cp2        context parallelism, ring (p2p)           cp2:a2a  Ulysses (any --cp-comm-type after ':')
    cp4:a2a+p2p=2x2   a2a+p2p with its hierarchical sizes (a2a over the first, the ring over the second)
    pp2        pipeline parallelism, 2 stages (1F1B)     dp2      data parallelism, the batch split in 2
    pp2:zbv    another schedule: gpipe, interleaved (1F1B, 2 chunks per rank), zbv, interleaved-zb
               (2 chunks per rank each); pp micro-batches per step
    ep2        expert parallelism over 2 of a stage's ranks (MoE models)   etp2  expert-TP 2 (default: tp)
    tp2+sp/cp2 dimensions combined with '/'

A layout runs on tp·cp·pp·dp ranks (EP and expert-TP lie over a stage's tp·cp·dp ranks, Megatron's
expert grid: replicas are added where they do not divide them). In a larger world the remaining ranks
are further data-parallel replicas that repeat the asked parts of the batch (testing/parity.py), so
the function is the same.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Optional

_DIMENSION = re.compile(r"^(tp|cp|pp|dp|ep|etp)(\d+)(\+sp|:[\w+-]+(?:=\d+x\d+)?)?$")
# a pp suffix -> (--pipeline-schedule, chunks per rank)
PIPELINE_SCHEDULES = {"1f1b": ("1f1b", 1), "gpipe": ("gpipe", 1), "interleaved": ("1f1b", 2)}
PIPELINE_SCHEDULES.update({"zbv": ("zbv", 2), "interleaved-zb": ("interleaved-zb", 2)})


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
    pp_schedule: str = "1f1b"  # a PIPELINE_SCHEDULES key
    ep: int = 1
    etp: Optional[int] = None  # None: the TP size (Megatron's default)

    @property
    def size(self) -> int:
        """The ranks it runs on: with experts, enough data-parallel replicas for EP × expert-TP to divide
        a stage's ranks."""
        experts = self.ep * (self.etp if self.etp is not None else self.tp)
        return self.pp * math.lcm(self.tp * self.cp * self.dp, experts)

    def __str__(self) -> str:
        parts = [f"tp{self.tp}" + ("+sp" if self.sp else "")] if self.tp > 1 else []
        if self.cp > 1:
            levels = "" if self.cp_levels is None else "=" + "x".join(map(str, self.cp_levels))
            parts.append(f"cp{self.cp}" + ("" if self.cp_comm == "p2p" else f":{self.cp_comm}") + levels)
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + ("" if self.pp_schedule == "1f1b" else f":{self.pp_schedule}"))
        parts += [f"{name}{n}" for name, n in (("dp", self.dp), ("ep", self.ep)) if n > 1]
        parts += [f"etp{self.etp}"] if self.etp is not None else []
        return "/".join(parts) or "serial"

    def pipeline_layout(self):
        """The PipelineLayout of its pp dimension (even stages)."""
        from megatron_sp.pipeline_parallel.layout import PipelineLayout

        schedule, chunks = PIPELINE_SCHEDULES[self.pp_schedule]
        return PipelineLayout(self.pp, chunks, schedule=schedule)

    def config_fields(self) -> dict:
        """The GPTConfig fields of its TP and CP (PP and DP are not the model's); the hierarchical CP
        sizes only where the name gives them (else the model's fields keep theirs)."""
        fields = dict(
            tensor_model_parallel_size=self.tp,
            sequence_parallel=self.sp,
            context_parallel_size=self.cp,
            cp_comm_type=self.cp_comm,
        )
        if self.cp_levels is not None:
            fields["hierarchical_context_parallel_sizes"] = self.cp_levels
        if self.ep > 1 or self.etp is not None:  # (only where given: a dense model has none)
            fields.update(expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp)
        return fields


def parse_layout(text: str) -> Layout:
    """The Layout a name spells (module docstring); ValueError (one sentence) otherwise."""
    layout, seen = Layout(), set()
    for part in text.strip().split("/"):
        match = _DIMENSION.match(part)
        if not match or match.group(1) in seen or int(match.group(2)) < 1:
            raise ValueError(
                f"layout {text!r}: {part!r} is not a dimension (tp2, tp2+sp, cp2, cp2:a2a, pp2, pp2:zbv, dp2, ep2, "
                f"etp2; each at most once, joined by '/')."
            )
        name, size, suffix = match.group(1), int(match.group(2)), match.group(3) or ""
        seen.add(name)
        if suffix == "+sp" and name != "tp" or suffix.startswith(":") and name not in ("cp", "pp"):
            raise ValueError(
                f"layout {text!r}: {suffix!r} belongs to {'tp' if suffix == '+sp' else 'cp or pp'}, not {name}."
            )
        layout = replace(layout, **{name: size})
        if suffix == "+sp":
            layout = replace(layout, sp=True)
        elif suffix and name == "pp":
            if suffix[1:] not in PIPELINE_SCHEDULES:
                raise ValueError(f"layout {text!r}: pp's schedule is one of {', '.join(PIPELINE_SCHEDULES)}.")
            layout = replace(layout, pp_schedule=suffix[1:])
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

    allowed, refused = [], {}
    for name in candidates:
        layout = parse_layout(name)
        try:
            cfg = GPTConfig(**{**fields, **layout.config_fields()})
            if layout.pp > 1:
                layout.pipeline_layout().check(cfg.num_layers)
            if batch % (layout.dp * layout.pp):
                raise ValueError(f"the batch of {batch} samples does not split into {layout.dp * layout.pp} parts.")
        except ValueError as err:
            refused[name] = str(err)
            continue
        allowed.append(layout)
    return allowed, refused

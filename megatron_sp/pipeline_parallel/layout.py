"""Which transformer layers each pipeline stage holds, and which rank holds each stage.

A pipeline of p ranks with v virtual stages per rank has p·v stages (model chunks), each a run of
whole consecutive layers. As Megatron assigns them:

    layers per rank    even (L / p), or the first rank `first` layers and the last rank `last`
                       (--decoder-first/last-pipeline-num-layers), the rest even over the others
    chunks of a rank   its layers split evenly over its v chunks
    stage order        loop (1F1B, interleaved, interleaved-zb): stage s = chunk·p + rank, i.e. the
                       chunks go round-robin over the ranks;  V (zbv, v = 2): rank r holds stages r
                       and 2p − 1 − r, so rank 0 holds both the first and the last stage

and the layers are dealt to the stages in stage order, each stage its chunk's count. Stage 0 holds
the embedding, the last stage the final norm, the output layer and the loss. A layer keeps its global
index i (its parameter names `layers.{i}.…` and its dropout layer id i + 1), whatever the stage.

`PipelineLayout.check(num_layers)` states the one sentence a layout that cannot serve says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SCHEDULES = ("1f1b", "gpipe", "interleaved-zb", "zbv")


@dataclass(frozen=True)
class PipelineLayout:
    """pp_size ranks × vp_size chunks each; first/last: the first/last rank's layer counts (None: even)."""

    pp_size: int
    vp_size: int = 1
    first: Optional[int] = None
    last: Optional[int] = None
    schedule: str = "1f1b"

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.vp_size

    @property
    def v_shape(self) -> bool:
        return self.schedule == "zbv"

    def check(self, num_layers: int) -> None:
        """Raises ValueError (one sentence) when the layout cannot split num_layers into stages."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--pipeline-schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}.")
        if self.v_shape and self.vp_size != 2:
            raise ValueError(
                f"--pipeline-schedule zbv needs 2 virtual stages per rank (V shape), not "
                f"--virtual-pipeline-model-parallel-size {self.vp_size}."
            )
        if self.schedule == "gpipe" and self.vp_size != 1:
            raise ValueError(
                "--pipeline-schedule gpipe runs one stage per rank; drop --virtual-pipeline-model-parallel-size."
            )
        rank_layers(num_layers, self)  # raises on counts that do not divide

    def check_microbatches(self, num_microbatches: int) -> None:
        """Raises ValueError (one sentence) when the schedule cannot run this many micro-batches."""
        p, m = self.pp_size, num_microbatches
        if self.v_shape and m < p:
            raise ValueError(
                f"--pipeline-schedule zbv needs at least --pipeline-model-parallel-size {p} micro-batches "
                f"per step, not {m}."
            )
        interleaved = self.vp_size > 1 or self.schedule == "interleaved-zb"
        if interleaved and not self.v_shape and m % p != 0:
            raise ValueError(
                f"an interleaved pipeline schedule needs a micro-batch count that is a multiple of "
                f"--pipeline-model-parallel-size {p}, not {m} (global batch / (micro-batch × DP))."
            )
        if self.schedule == "1f1b" and m < p:
            raise ValueError(
                f"the 1F1B pipeline schedule needs at least --pipeline-model-parallel-size {p} micro-batches "
                f"per step, not {m}; raise --global-batch-size or lower --micro-batch-size."
            )

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank holding `stage`."""
        p = self.pp_size
        if self.v_shape:
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def rank_stages(self, rank: int) -> list[int]:
        """The stages `rank` holds, in chunk order."""
        return [s for s in range(self.num_stages) if self.stage_rank(s) == rank]


def rank_layers(num_layers: int, layout: PipelineLayout) -> list[int]:
    """Layers per pipeline rank (see the module docstring); ValueError when they do not divide."""
    p, v, first, last = layout.pp_size, layout.vp_size, layout.first, layout.last
    if p == 1 and (first is not None or last is not None):
        raise ValueError(
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
            "--pipeline-model-parallel-size > 1."
        )
    fixed = {0: first, p - 1: last} if p > 1 else {}
    fixed = {r: n for r, n in fixed.items() if n is not None}
    if any(n < 1 for n in fixed.values()):
        raise ValueError("--decoder-first/last-pipeline-num-layers must be at least 1.")
    rest, others = num_layers - sum(fixed.values()), p - len(fixed)
    if rest < 0 or (others == 0 and rest != 0) or (others > 0 and (rest % others != 0 or rest < others)):
        where = f"the {others} middle ranks, after the first/last ranks' layers," if fixed else f"{p} ranks"
        raise ValueError(
            f"--num-layers {num_layers} does not split evenly over {where} of --pipeline-model-parallel-size "
            f"{p}; choose a multiple, or set --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers."
        )
    counts = [fixed.get(r, rest // others if others else 0) for r in range(p)]
    if any(n % v for n in counts):
        raise ValueError(
            f"the pipeline ranks' layer counts {counts} do not split into "
            f"--virtual-pipeline-model-parallel-size {v} chunks each; choose --num-layers "
            f"(or --num-layers-per-virtual-pipeline-stage) so that every rank's count is a multiple of {v}."
        )
    return counts


def stage_layers(num_layers: int, layout: PipelineLayout) -> list[range]:
    """The global layer indices of every stage, by stage index."""
    per_rank = rank_layers(num_layers, layout)
    sizes = [per_rank[layout.stage_rank(s)] // layout.vp_size for s in range(layout.num_stages)]
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def layout_from_args(
    pp_size, vp_size=None, layers_per_virtual_stage=None, num_layers=None, first=None, last=None, schedule="1f1b"
) -> PipelineLayout:
    """Megatron's flags as a layout: --num-layers-per-virtual-pipeline-stage n means v = L / (p n)."""
    if layers_per_virtual_stage is not None:
        if vp_size is not None:
            raise ValueError(
                "give --virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage, not both."
            )
        if num_layers % (pp_size * layers_per_virtual_stage) != 0:
            raise ValueError(
                f"--num-layers {num_layers} is not a multiple of --pipeline-model-parallel-size {pp_size} × "
                f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}."
            )
        vp_size = num_layers // (pp_size * layers_per_virtual_stage)
    if schedule == "zbv" and vp_size is None:
        vp_size = 2
    return PipelineLayout(pp_size, vp_size or 1, first, last, schedule)

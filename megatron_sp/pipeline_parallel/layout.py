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

Megatron-LM's --pipeline-model-parallel-layout spells the stages out instead (`layout_from_string`,
read from megatron/core/transformer/pipeline_parallel_layer_layout.py): the stages in stage order,
separated by `|`, each a string of symbols

    E  the embedding (once, first)     t  a transformer layer      L  the loss: final norm, output layer
    m  an MTP layer (refused here)     (…)*N  the group N times    x*N  the symbol (or `|`) N times

commas are cosmetic and dropped; groups do not nest. The counts are read from the parse and checked
(against --num-layers and p, and fixed caps) before the repeats are written out.
The stage count is p·v, so v follows from it, and
stage s sits on rank s mod p, as above; the layout keeps each stage's count of `t` (`stage_sizes`).
"Et*3|(tt|)*2,tL" at p = 2 is four stages of 3, 2, 2, 1 layers, stages 0 and 2 on rank 0. Megatron
allows a stage that holds nothing; here each stage holds a layer, E or L (its stage runs a schedule's
forward and backward, and a rank of empty stages would have no parameter to optimise).

`PipelineLayout.check(num_layers)` states the one sentence a layout that cannot serve says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

SCHEDULES = ("1f1b", "gpipe", "interleaved-zb", "zbv")
ZERO_BUBBLE = ("zbv", "interleaved-zb")  # split backward: input and weight passes
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
VP_FLAGS = "--virtual-pipeline-model-parallel-size (or --num-virtual-stages-per-pipeline-rank)"
SYMBOLS = "EtmL"


@dataclass(frozen=True)
class PipelineLayout:
    """pp_size ranks × vp_size chunks each; first/last: the first/last rank's layer counts (None: even);
    stage_sizes: every stage's layer count in stage order, from a layout string (None: from the above)."""

    pp_size: int
    vp_size: int = 1
    first: Optional[int] = None
    last: Optional[int] = None
    schedule: str = "1f1b"
    stage_sizes: Optional[tuple] = None

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
        if self.stage_sizes is not None:
            return self._check_stage_sizes(num_layers)
        if self.v_shape and self.vp_size != 2:
            raise ValueError(
                f"--pipeline-schedule zbv needs 2 virtual stages per rank (V shape), not {VP_FLAGS} {self.vp_size}."
            )
        if self.schedule == "gpipe" and self.vp_size != 1:
            raise ValueError(f"--pipeline-schedule gpipe runs one stage per rank; drop {VP_FLAGS}.")
        rank_layers(num_layers, self)  # raises on counts that do not divide

    def _check_stage_sizes(self, num_layers: int) -> None:
        """check() for a layout string's stages (Megatron-LM's rules, and ours on empty stages)."""
        sizes, p = self.stage_sizes, self.pp_size
        if self.v_shape:
            raise ValueError(
                f"{LAYOUT_FLAG} puts stage s on rank s mod {p} (Megatron-LM's round-robin), which the V shape of "
                f"--pipeline-schedule zbv does not; choose another --pipeline-schedule or drop the layout."
            )
        if self.first is not None or self.last is not None:
            raise ValueError(f"give {LAYOUT_FLAG} or --decoder-first/last-pipeline-num-layers, not both.")
        if len(sizes) != self.num_stages:
            raise ValueError(f"{LAYOUT_FLAG} has {len(sizes)} stages, not {p} ranks × {self.vp_size} chunks.")
        if self.schedule == "gpipe" and self.vp_size != 1:
            raise ValueError(f"--pipeline-schedule gpipe runs one stage per rank; give {LAYOUT_FLAG} {p} stages.")
        for s, n in enumerate(sizes):
            if n < 0 or (n == 0 and 0 < s < len(sizes) - 1):
                raise ValueError(
                    f"stage {s} of {LAYOUT_FLAG} holds nothing; give every stage between the first (E) and the "
                    f"last (L) at least one transformer layer t, or use fewer stages."
                )
        if sum(sizes) != num_layers:
            raise ValueError(
                f"{LAYOUT_FLAG} holds {sum(sizes)} transformer layers (t) but --num-layers is {num_layers}; "
                f"make them agree."
            )

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
                f"--pipeline-model-parallel-size {p}, not {m} (global batch / (micro-batch × DP)): ours run "
                f"rounds of {p} micro-batches (Megatron-LM's default group size; its larger "
                f"--microbatch-group-size-per-virtual-pipeline-stage, which allows other counts, is not implemented)."
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
    if layout.stage_sizes is not None:
        return [sum(layout.stage_sizes[s] for s in layout.rank_stages(r)) for r in range(layout.pp_size)]
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
            f"{VP_FLAGS} {v} chunks each; choose --num-layers "
            f"(or --num-layers-per-virtual-pipeline-stage) so that every rank's count is a multiple of {v}."
        )
    return counts


def stage_layers(num_layers: int, layout: PipelineLayout) -> list[range]:
    """The global layer indices of every stage, by stage index."""
    sizes = layout.stage_sizes
    if sizes is None:
        per_rank = rank_layers(num_layers, layout)
        sizes = [per_rank[layout.stage_rank(s)] // layout.vp_size for s in range(layout.num_stages)]
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def layout_from_args(
    pp_size,
    vp_size=None,
    layers_per_virtual_stage=None,
    num_layers=None,
    first=None,
    last=None,
    schedule="1f1b",
    *,
    virtual_stages=None,
    text=None,
) -> PipelineLayout:
    """Megatron's flags as a layout: --num-layers-per-virtual-pipeline-stage n means v = L / (p n),
    --num-virtual-stages-per-pipeline-rank (virtual_stages) is v by its newer name, and a layout string
    (text) sets everything; at most one of those three, as in Megatron-LM."""
    _check_chunk_flags(vp_size, layers_per_virtual_stage, virtual_stages, text)
    if text is not None:
        return _layout_from_text(text, pp_size, vp_size, first, last, schedule, num_layers)
    if virtual_stages is not None:
        if vp_size not in (None, virtual_stages):
            raise ValueError(
                f"--num-virtual-stages-per-pipeline-rank {virtual_stages} contradicts "
                f"--virtual-pipeline-model-parallel-size {vp_size} (two names for one number); give one of them."
            )
        vp_size = virtual_stages
    if layers_per_virtual_stage is not None:
        vp_size = _vp_from_layers_per_stage(pp_size, vp_size, layers_per_virtual_stage, num_layers, first, last)
    if schedule == "zbv" and vp_size is None:
        vp_size = 2
    return PipelineLayout(pp_size, vp_size or 1, first, last, schedule)


def _check_chunk_flags(vp_size, layers_per_virtual_stage, virtual_stages, text) -> None:
    """The chunk-count flags' values are positive, and at most one of Megatron-LM's three is given."""
    numbers = (
        ("--virtual-pipeline-model-parallel-size", vp_size),
        ("--num-layers-per-virtual-pipeline-stage", layers_per_virtual_stage),
        ("--num-virtual-stages-per-pipeline-rank", virtual_stages),
    )
    for name, value in numbers:
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}.")
    given = [name for name, value in numbers[1:] + ((LAYOUT_FLAG, text),) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of {given[0]} and {given[1]}, not both (as in Megatron-LM).")


def _vp_from_layers_per_stage(pp_size, vp_size, layers_per_virtual_stage, num_layers, first, last) -> int:
    if vp_size is not None:
        raise ValueError(
            "give --virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage, not both."
        )
    if first is not None or last is not None:  # Megatron-LM's rule: a chunk size is ambiguous when uneven
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage does not combine with --decoder-first/last-pipeline-num-layers; "
            "give the chunks per rank with --num-virtual-stages-per-pipeline-rank instead."
        )
    if num_layers % (pp_size * layers_per_virtual_stage) != 0:
        raise ValueError(
            f"--num-layers {num_layers} is not a multiple of --pipeline-model-parallel-size {pp_size} × "
            f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}."
        )
    return num_layers // (pp_size * layers_per_virtual_stage)


def accounted_layout(num_layers: int, pp_size: int, vp_size: int, embedding: bool, loss: bool) -> str:
    """Megatron's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split as a
    layout string: the embedding and the loss count as one layer each when the layers are divided over
    the p·v stages, so the first stage holds one transformer layer fewer (and the last, with the loss)."""
    stages, total = pp_size * vp_size, num_layers + int(embedding) + int(loss)
    if total % stages != 0:
        raise ValueError(
            f"--num-layers {num_layers} plus the embedding/loss layers accounted for ({total}) must be divisible "
            f"by the {stages} pipeline stages (--pipeline-model-parallel-size × virtual stages)."
        )
    per = total // stages
    counts = [per - int(embedding) * (s == 0) - int(loss) * (s == stages - 1) for s in range(stages)]
    parts = ["t" * n for n in counts]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return "|".join(parts)


def _layout_from_text(text, pp_size, vp_size, first, last, schedule, num_layers=None) -> PipelineLayout:
    """A layout string with the flags it may meet: an equal --virtual-pipeline-model-parallel-size only."""
    if first is not None or last is not None:
        raise ValueError(f"give {LAYOUT_FLAG} or --decoder-first/last-pipeline-num-layers, not both.")
    layout = layout_from_string(text, pp_size, schedule, num_layers)
    if vp_size not in (None, layout.vp_size):
        raise ValueError(
            f"{LAYOUT_FLAG} {text!r} has {layout.num_stages} stages, {layout.vp_size} per rank, but "
            f"--virtual-pipeline-model-parallel-size is {vp_size}; drop --virtual-pipeline-model-parallel-size."
        )
    return layout


# ---- Megatron-LM's layout string ---------------------------------------------------------------
# At each position: a (group)*N without nested parentheses, a symbol (or `|`) times N, or one character.
# The counts are read from this parse before anything is written out, so a repeat of 10^12 is refused
# in one sentence instead of being expanded (MemoryError), and a count of thousands of digits never
# reaches int() (Python's own digit limit).
_PIECE = re.compile(r"\(([^()]+)\)\*(\d+)|([^()*])\*(\d+)|([^()*])")
MAX_LAYOUT_CHARS = 10_000  # the string as given
MAX_REPEAT_DIGITS = 6  # a count up to 999,999
MAX_EXPANDED = 1 << 20  # symbols and separators once the repeats are written out


def _pieces(text: str, flag_value: str):
    """(piece, times) for each piece: a group's text, a symbol or `|`; ValueError naming what cannot be read."""
    pos = 0
    while pos < len(text):
        piece = _PIECE.match(text, pos)
        if piece is None:
            raise ValueError(
                f"{LAYOUT_FLAG} {flag_value!r}: cannot read {text[pos:][:40]!r}; a repeat is a symbol or a (group) "
                f"followed by *N, and groups do not nest."
            )
        group, group_times, symbol, times, single = piece.groups()
        count = group_times or times or "1"
        if len(count) > MAX_REPEAT_DIGITS:
            raise ValueError(
                f"{LAYOUT_FLAG}: a repeat count of {len(count)} digits is too large; counts go up to "
                f"{10**MAX_REPEAT_DIGITS - 1:,}."
            )
        yield (group if group is not None else single if single is not None else symbol), int(count), group is not None
        pos = piece.end()


def _counts(text: str, flag_value: str) -> dict:
    """How many of each character the string holds once unrolled, from the parse alone (nothing expanded)."""
    counts = {}
    for piece, times, is_group in _pieces(text, flag_value):
        inner = _counts(piece, flag_value) if is_group else {piece: 1}
        for char, n in inner.items():
            counts[char] = counts.get(char, 0) + n * times
    return counts


def _unroll(text: str, flag_value: str) -> str:
    """The string with its repeats written out (its size bounded by _check_size first)."""
    out = []
    for piece, times, is_group in _pieces(text, flag_value):
        out.append((_unroll(piece, flag_value) if is_group else piece) * times)
    return "".join(out)


def _check_size(text: str, flag_value: str, num_layers: Optional[int], pp_size: Optional[int]) -> None:
    """The stage and layer counts from the parse, checked against --num-layers and the pipeline's ranks
    before expanding."""
    if len(flag_value) > MAX_LAYOUT_CHARS:
        raise ValueError(f"{LAYOUT_FLAG} is {len(flag_value):,} characters long; at most {MAX_LAYOUT_CHARS:,}.")
    counts = _counts(text, flag_value)
    layers, stages = counts.get("t", 0), counts.get("|", 0) + 1
    if num_layers is not None and layers != num_layers:
        raise ValueError(
            f"{LAYOUT_FLAG} holds {layers:,} transformer layers (t) but --num-layers is {num_layers}; make them agree."
        )
    if num_layers is not None and stages > num_layers + 2:
        raise ValueError(
            f"{LAYOUT_FLAG} has {stages:,} stages for {num_layers} layers; each stage holds a layer, E or L, "
            f"so at most {num_layers + 2}."
        )
    if sum(counts.values()) > MAX_EXPANDED:
        raise ValueError(
            f"{LAYOUT_FLAG} unrolls to {sum(counts.values()):,} symbols, more than {MAX_EXPANDED:,}; "
            "give fewer layers or stages."
        )
    if pp_size is not None and stages % pp_size != 0:
        raise ValueError(
            f"{LAYOUT_FLAG} {flag_value[:40]!r} has {stages:,} stages, not a multiple of "
            f"--pipeline-model-parallel-size {pp_size}; give p × (chunks per rank) stages."
        )


def parse_layout(text: str, num_layers: Optional[int] = None, pp_size: Optional[int] = None) -> list:
    """Megatron-LM's layout string as one string of symbols per stage, in stage order, repeats unrolled:
    "E(t|)*2tL" -> ["Et", "t", "tL"]. ValueError (one sentence) on a character that is no symbol, or a
    string whose counts (against num_layers and pp_size when given) are too large to write out."""
    _check_size(text.replace(",", ""), text, num_layers, pp_size)
    stages = _unroll(text.replace(",", ""), text).split("|")
    for symbol in "".join(stages):
        if symbol not in SYMBOLS:
            raise ValueError(
                f"{LAYOUT_FLAG} {text!r}: {symbol!r} is not a layer symbol (E embedding, t transformer layer, "
                f"L loss, | between stages, (...)*N and x*N repeats, commas ignored)."
            )
    return stages


def layout_from_string(
    text: str, pp_size: int, schedule: str = "1f1b", num_layers: Optional[int] = None
) -> PipelineLayout:
    """The PipelineLayout a layout string describes at pp_size ranks (v = stages / p); the layer count
    is checked here when given, else by PipelineLayout.check. ValueError (one sentence) on what cannot
    serve here."""
    stages = parse_layout(text, num_layers, pp_size)
    symbols = "".join(stages)
    if "m" in symbols:
        raise ValueError(
            f"{LAYOUT_FLAG} {text!r} has multi-token prediction layers (m), which megatron_sp does not implement; "
            f"remove them."
        )
    if symbols.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError(f"{LAYOUT_FLAG} {text!r} must hold E (the embedding) once, at the start of the first stage.")
    if symbols.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError(f"{LAYOUT_FLAG} {text!r} must hold L (the loss) once, at the end of the last stage.")
    sizes = tuple(stage.count("t") for stage in stages)
    return PipelineLayout(pp_size, len(stages) // pp_size, schedule=schedule, stage_sizes=sizes)

"""Megatron-LM's newer pipeline-layout spellings, without a world: the layout string
(--pipeline-model-parallel-layout, its grammar as megatron/core/transformer/pipeline_parallel_layer_layout.py
reads it) and --num-virtual-stages-per-pipeline-rank. The parser, every refusal's one sentence, the
equivalence with the older flags (the same stages, layer for layer) and the command line. That the
stages a string describes train like the serial model: tests/test_pipeline.py ("layout-string-uneven")."""

import pytest
from launch_helpers import bounded

from megatron_sp.pipeline_parallel.layout import (
    PipelineLayout,
    layout_from_args,
    layout_from_string,
    parse_layout,
    rank_layers,
    stage_layers,
)
from megatron_sp.training import megatron_flags
from megatron_sp.training.arguments import ArgumentError, parse_args


# ---- the grammar -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, stages",
    [
        ("Et|tL", ["Et", "tL"]),
        ("Et*3|t*2|ttL", ["Ettt", "tt", "ttL"]),  # x*N: the symbol N times
        ("E(t|)*2tL", ["Et", "t", "tL"]),  # (group)*N, the group may hold `|`
        ("Ettt|(tt|)*2,tL", ["Ettt", "tt", "tt", "tL"]),  # commas are cosmetic
        ("E|(t*2|)*2L", ["E", "tt", "tt", "L"]),  # repeats inside a group
        ("Et|*2tL", ["Et", "", "tL"]),  # `|` repeats too (Megatron-LM's x*N takes any character)
        ("Et*12|t*10L", ["E" + "t" * 12, "t" * 10 + "L"]),  # N of several digits
        ("Et*0|tL", ["E", "tL"]),
    ],
)
def test_layout_strings_unroll_as_megatron_reads_them(text, stages):
    assert parse_layout(text) == stages


@pytest.mark.parametrize(
    "text, pp, vp, sizes",
    [
        ("Et|tL", 2, 1, (1, 1)),
        ("Ettt|(tt|)*2,tL", 2, 2, (3, 2, 2, 1)),  # v = stages / p
        ("E|ttt|t|L", 2, 2, (0, 3, 1, 0)),  # E and L stages without a transformer layer
        ("Et|(t|)*4tL", 3, 2, (1, 1, 1, 1, 1, 1)),
        ("Ett|tt|tt|ttL", 4, 1, (2, 2, 2, 2)),
    ],
)
def test_a_layout_string_gives_each_stage_its_layers(text, pp, vp, sizes):
    layout = layout_from_string(text, pp)
    assert (layout.pp_size, layout.vp_size, layout.stage_sizes) == (pp, vp, sizes)
    layout.check(sum(sizes))
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    assert stage_layers(sum(sizes), layout) == [range(a, a + n) for a, n in zip(starts, sizes)]
    assert [layout.stage_rank(s) for s in range(len(sizes))] == [s % pp for s in range(len(sizes))]  # round-robin


def test_rank_layers_sum_a_ranks_stages():
    assert rank_layers(6, layout_from_string("Ettt|(tt|)*2,tL", 2)) == [3 + 2, 2 + 1]


# ---- equivalence with the older flags ----------------------------------------------------------
def _spelled(sizes) -> str:
    """The layout string of these per-stage layer counts."""
    stages = ["t" * n for n in sizes]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return "|".join(stages)


@pytest.mark.parametrize(
    "flags, layers",
    [
        (dict(pp_size=2), 4),
        (dict(pp_size=4), 8),
        (dict(pp_size=2, vp_size=2), 8),
        (dict(pp_size=4, vp_size=2), 16),
        (dict(pp_size=3, first=1, last=1), 6),  # --decoder-first/last-pipeline-num-layers
        (dict(pp_size=2, vp_size=2, first=2, last=4), 6),  # uneven, split over each rank's chunks
        (dict(pp_size=4, vp_size=2, first=2), 14),
    ],
)
def test_a_string_spelling_the_flags_layout_gives_the_same_stages(flags, layers):
    by_flags = PipelineLayout(**flags)
    sizes = [len(r) for r in stage_layers(layers, by_flags)]
    by_string = layout_from_string(_spelled(sizes), flags["pp_size"])
    by_string.check(layers)
    assert stage_layers(layers, by_string) == stage_layers(layers, by_flags)
    assert by_string.vp_size == by_flags.vp_size
    assert rank_layers(layers, by_string) == rank_layers(layers, by_flags)
    assert [by_string.rank_stages(r) for r in range(by_flags.pp_size)] == [
        by_flags.rank_stages(r) for r in range(by_flags.pp_size)
    ]


def test_num_virtual_stages_is_the_virtual_pipeline_size():
    newer = layout_from_args(2, num_layers=8, virtual_stages=2)
    assert newer == layout_from_args(2, 2, num_layers=8) == PipelineLayout(2, 2)
    assert layout_from_args(2, 2, num_layers=8, virtual_stages=2) == newer  # both names, one number
    uneven = layout_from_args(2, num_layers=6, first=2, last=4, virtual_stages=2)  # Megatron's uneven + VPP
    assert stage_layers(6, uneven) == [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    assert layout_from_args(2, 2, num_layers=4, text="Et|t|t|tL") == layout_from_string("Et|t|t|tL", 2)


# ---- refusals, one sentence each ---------------------------------------------------------------
def _refused(make) -> str:
    with pytest.raises(ValueError) as err:
        make()
    message = str(err.value)
    assert len(message.splitlines()) == 1 and message.endswith("."), message
    return message


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: parse_layout("Et|tX"), "'X' is not a layer symbol"),
        (lambda: parse_layout("Et |tL"), "' ' is not a layer symbol"),
        (lambda: parse_layout("E((t|)*2)*2L"), "groups do not nest"),
        (lambda: parse_layout("E(t|)L"), "followed by *N"),  # a group needs its count
        (lambda: parse_layout("*2Et|tL"), "cannot read '*2Et|tL'"),
        (lambda: layout_from_string("Ettt|(tt|)*29,m|L", 2), "multi-token prediction layers (m)"),
        (lambda: layout_from_string("tE|tL", 2), "E (the embedding) once, at the start of the first stage"),
        (lambda: layout_from_string("Et|tL|E", 3), "E (the embedding) once"),
        (lambda: layout_from_string("t|tL", 2), "E (the embedding) once"),
        (lambda: layout_from_string("Et|Lt", 2), "L (the loss) once, at the end of the last stage"),
        (lambda: layout_from_string("EtL|tL", 2), "L (the loss) once"),
        (lambda: layout_from_string("Et|t|tL", 2), "3 stages, not a multiple of --pipeline-model-parallel-size 2"),
        (lambda: layout_from_string("Et|tL", 2).check(3), "holds 2 transformer layers (t) but --num-layers is 3"),
        (
            lambda: layout_from_string("Et||t|tL", 2).check(3),
            "stage 1 of --pipeline-model-parallel-layout holds nothing",
        ),
        (lambda: layout_from_string("Et|t|t|tL", 2, "zbv").check(4), "which the V shape of --pipeline-schedule zbv"),
        (
            lambda: layout_from_string("Et|t|t|tL", 2, "gpipe").check(4),
            "give --pipeline-model-parallel-layout 2 stages",
        ),
        (lambda: PipelineLayout(2, 2, stage_sizes=(2, 2)).check(4), "has 2 stages, not 2 ranks × 2 chunks"),
        (lambda: PipelineLayout(2, first=1, stage_sizes=(1, 3)).check(4), "or --decoder-first/last"),
        (lambda: layout_from_args(2, num_layers=4, text="Et|tL", virtual_stages=1), "not both"),
        (lambda: layout_from_args(2, None, 1, 4, text="Et|tL"), "--num-layers-per-virtual-pipeline-stage and"),
        (lambda: layout_from_args(2, None, 1, 4, virtual_stages=2), "not both (as in Megatron-LM)"),
        (lambda: layout_from_args(2, num_layers=4, first=1, text="Et|tttL"), "or --decoder-first/last"),
        (lambda: layout_from_args(2, 2, num_layers=4, text="Et|tttL"), "has 2 stages, 1 per rank, but --virtual-pipe"),
        (lambda: layout_from_args(2, 3, num_layers=12, virtual_stages=2), "two names for one number"),
        (lambda: layout_from_args(2, num_layers=8, virtual_stages=0), "must be at least 1, not 0"),
        (lambda: layout_from_args(2, None, 2, 8, first=2), "give the chunks per rank with --num-virtual-stages"),
        (lambda: layout_from_args(2, num_layers=6, virtual_stages=2).check(6), "or --num-virtual-stages-per-pip"),
    ],
)
def test_each_refusal_is_one_sentence(make, words):
    assert words in _refused(make)


def test_an_interleaved_layout_string_needs_its_micro_batch_multiple():
    assert "multiple of --pipeline-model-parallel-size 2" in _refused(
        lambda: layout_from_string("Et|t|t|tL", 2).check_microbatches(3)
    )
    layout_from_string("Et|tttL", 2).check_microbatches(3)  # one stage per rank: 1F1B's rule only


# ---- the command line --------------------------------------------------------------------------
BASE = ["--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4", "--num-layers", "4"]
PP2 = BASE + ["--pipeline-model-parallel-size", "2"]


def test_the_flags_are_no_longer_refused():
    assert (
        megatron_flags.refusal(["--pipeline-model-parallel-layout", "--num-virtual-stages-per-pipeline-rank"]) is None
    )


@pytest.mark.parametrize(
    "flags, layout",
    [
        (["--pipeline-model-parallel-layout", "E|ttt|t|L"], PipelineLayout(2, 2, stage_sizes=(0, 3, 1, 0))),
        (["--pipeline-model-parallel-layout", "Ett|ttL"], PipelineLayout(2, 1, stage_sizes=(2, 2))),
        (
            ["--pipeline-model-parallel-layout", "Et|(t|)*2tL", "--virtual-pipeline-model-parallel-size", "2"],
            PipelineLayout(2, 2, stage_sizes=(1, 1, 1, 1)),
        ),
        (
            ["--pipeline-model-parallel-layout", "Et|t|t|tL", "--pipeline-schedule", "interleaved-zb"],
            PipelineLayout(2, 2, schedule="interleaved-zb", stage_sizes=(1, 1, 1, 1)),
        ),
        (["--num-virtual-stages-per-pipeline-rank", "2"], PipelineLayout(2, 2)),
        (
            ["--num-virtual-stages-per-pipeline-rank", "2", "--virtual-pipeline-model-parallel-size", "2"],
            PipelineLayout(2, 2),
        ),
        (
            ["--num-virtual-stages-per-pipeline-rank", "2", "--decoder-first-pipeline-num-layers", "2"],
            PipelineLayout(2, 2, first=2),
        ),
    ],
)
def test_the_command_line_builds_the_layout(flags, layout):
    args = parse_args(PP2 + flags, world_size=2)
    assert args.pipeline_layout == layout


@pytest.mark.parametrize(
    "flags, words",
    [
        (BASE + ["--pipeline-model-parallel-layout", "EttttL"], "need --pipeline-model-parallel-size > 1"),
        (BASE + ["--num-virtual-stages-per-pipeline-rank", "2"], "need --pipeline-model-parallel-size > 1"),
        (PP2 + ["--pipeline-model-parallel-layout", "Et|tttmL"], "multi-token prediction layers (m)"),
        (PP2 + ["--pipeline-model-parallel-layout", "Et|tttL", "--decoder-last-pipeline-num-layers", "3"], "not both"),
        (PP2 + ["--pipeline-model-parallel-layout", "Et|tL"], "but --num-layers is 4"),
        (PP2 + ["--pipeline-model-parallel-layout", "Et|t|t|tL", "--global-batch-size", "3"], "multiple of"),
        (
            PP2 + ["--pipeline-model-parallel-layout", "Et|tttL", "--num-virtual-stages-per-pipeline-rank", "1"],
            "give one of --num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout, not both",
        ),
        (
            PP2 + ["--num-virtual-stages-per-pipeline-rank", "2", "--virtual-pipeline-model-parallel-size", "1"],
            "two names for one number",
        ),
    ],
)
def test_the_command_line_refuses_in_one_sentence(flags, words):
    with pytest.raises(ArgumentError) as err:
        parse_args(flags, world_size=2)
    assert words in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


# ---- hostile strings: refused from the parse's counts, before anything is written out ----------
HUGE = [
    ("E(t)*999999tL", 4, "holds 1,000,000 transformer layers (t) but --num-layers is 4"),
    ("E(|)*999999ttL", 2, "has 1,000,000 stages for 2 layers"),
    ("E(t*999999|)*999999tL", 4, "holds 999,998,000,002 transformer layers"),
    ("Et*99999999999999999999L", 4, "a repeat count of 20 digits is too large"),
    ("Et*" + "9" * 5000 + "L", 4, "a repeat count of 5000 digits is too large"),
    ("E(t*999999)*999999L", None, "unrolls to 999,998,000,003 symbols, more than 1,048,576"),
    ("E" + "t" * 20_000 + "L", 20_000, "is 20,002 characters long; at most 10,000"),
    ("E(t|)*999tL", 1000, "has 1,000 stages, not a multiple of --pipeline-model-parallel-size 3"),
]


@pytest.mark.parametrize(
    "text, num_layers, words", HUGE, ids=[w.split(" ")[0] + str(i) for i, (_, _, w) in enumerate(HUGE)]
)
def test_huge_layout_strings_are_refused_before_expanding(text, num_layers, words):
    """Was: MemoryError, OverflowError, Python's int-digit limit, or a hang past 30 s."""
    with bounded(5):
        message = _refused(lambda: layout_from_args(3, num_layers=num_layers, text=text))
    assert words in message and len(message) < 400, message

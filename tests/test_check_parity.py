"""tools/check_parity.py, the parity check users run on their own model: one run on a block with a
planted layout bug (tests/example_layout_bug.py, given as a spec file) in 2 local ranks catches it
at TP2+SP, names the parameter and exits 1, while the layouts it does not break pass; flags it
cannot run exit 2 with one sentence and start no rank."""

import os

import pytest

from tools import check_parity

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
BUGGY = os.path.join(os.path.dirname(__file__), "example_layout_bug.py") + ":SPEC"


def test_a_planted_layout_bug_is_caught_and_named(capsys):
    code = check_parity.main(["--model", BUGGY, *TINY, "--layouts", "tp2+sp,tp2,cp2,pp2,dp2", "--documents"])
    out = capsys.readouterr().out
    assert code == 1, out
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert set(rows) == {"tp2+sp", "tp2", "cp2", "pp2", "dp2"}, out
    assert "FAIL" in rows["tp2+sp"] and ".mlp.gain" in rows["tp2+sp"], out  # the worst gradient's name
    assert all(rows[name].endswith("ok") for name in ("tp2", "cp2", "pp2", "dp2")), out


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--model", "qwen3", "--layouts", "tp3"], "tp3 cannot run this model"),
        (["--model", "qwen3", "--layouts", "xx2"], "not a dimension"),
        (["--model", "nope.py:SPEC"], "there is no file nope.py"),
        (["--model", "llama", "--num-query-groups", "3"], "--num-query-groups (3) must divide"),
    ],
)
def test_flags_it_cannot_run_exit_2(flags, needle, capsys):
    assert check_parity.main([*TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_layout_names_carry_the_hierarchical_cp_sizes():
    """`cp4:a2a+p2p=2x2` names a2a+p2p with its sizes, which reach the config (the serial oracle keeps
    none) and print back the same way; a2a+p2p without them is refused as the model refuses it."""
    from megatron_sp.testing.layouts import allowed_layouts, parse_layout

    layout = parse_layout("tp2+sp/cp4:a2a+p2p=2x2")
    assert (layout.size, layout.cp_levels, str(layout)) == (8, (2, 2), "tp2+sp/cp4:a2a+p2p=2x2")
    assert layout.config_fields()["hierarchical_context_parallel_sizes"] == (2, 2)
    fields = check_parity.model_fields(TINY)
    assert "hierarchical_context_parallel_sizes" not in fields
    allowed, refused = allowed_layouts(fields, 4, ["cp4:a2a+p2p=2x2", "cp4:a2a+p2p", "cp4:a2a+p2p=2x4"])
    assert [str(a) for a in allowed] == ["cp4:a2a+p2p=2x2"]
    assert set(refused) == {"cp4:a2a+p2p", "cp4:a2a+p2p=2x4"}, refused


def test_layout_names_carry_the_pipeline_schedule_and_the_expert_grid():
    """`pp2:zbv` names the schedule (2 chunks per rank: a V), `ep2`/`etp1` the expert grid, which reaches
    the config; a layout adds the replicas its expert grid needs (pp2/ep2: a stage of 2 ranks)."""
    from megatron_sp.testing.layouts import parse_layout

    layout = parse_layout("tp2+sp/pp2:zbv/ep2/etp1")
    assert (layout.size, str(layout)) == (4, "tp2+sp/pp2:zbv/ep2/etp1")
    pipeline = layout.pipeline_layout()
    assert (pipeline.pp_size, pipeline.vp_size, pipeline.schedule) == (2, 2, "zbv")
    fields = layout.config_fields()
    assert (fields["expert_model_parallel_size"], fields["expert_tensor_parallel_size"]) == (2, 1)
    assert parse_layout("pp2/ep2").size == 4 and "expert_model_parallel_size" not in parse_layout("pp2").config_fields()
    with pytest.raises(ValueError, match="pp's schedule is one of"):
        parse_layout("pp2:zb")

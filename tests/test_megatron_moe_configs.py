"""Megatron-LM's MoE functional tests run as they are: the training configs of
tests/functional_tests/test_cases/moe/ (tests/assets/megatron_moe_flag_sets.json, written from the
Megatron-LM snapshot by tools/megatron_functional_configs.py), shrunk to CPU size as the GPT flag sets
are (tests/megatron_flag_sets_helpers.py), each train 2 iterations or are refused in one sentence
naming the missing feature (`expect`).

Configs whose shrunk command lines are the same (a `_frozen_resume` and its `_resume` twin, an EP 8
config and its EP 4 `_1node` one, both at EP 2 here) are checked once: each test is one group, its id
the group's names joined by "=", and the group's other configs are asserted to shrink to the first's
command line.
"""

import json
import os

import pytest
from launch_helpers import REPO
from megatron_flag_sets_helpers import WORLD, check, shrink

from megatron_sp.testing import LocalWorld

FIXTURE = json.load(open(os.path.join(REPO, "tests", "assets", "megatron_moe_flag_sets.json")))
SETS = {s["name"]: s for s in FIXTURE["sets"]}


def _groups() -> dict:
    """first config's name -> the names of the configs whose shrunk argv is its own, in fixture order."""
    from pathlib import Path

    groups, first = {}, {}
    for name, spec in SETS.items():
        argv = tuple(shrink(spec["argv"], Path("TMP"))[0])
        groups.setdefault(first.setdefault(argv, name), []).append(name)
    return groups


GROUPS = _groups()


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(WORLD)
    yield w
    w.close()


@pytest.mark.parametrize("name", list(GROUPS), ids=lambda name: "=".join(GROUPS[name]))
def test_megatron_moe_config(name, world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, model_parallel = shrink(SETS[name]["argv"], tmp_path)
    for other in GROUPS[name][1:]:  # (the same run: checked once)
        assert shrink(SETS[other]["argv"], tmp_path) == (argv, model_parallel), other
        assert SETS[other]["expect"] == SETS[name]["expect"], other
    check(argv, SETS[name]["expect"], model_parallel, world, tmp_path)


def test_the_fixture_is_the_snapshots_training_configs():
    """48 of the 65 MoE configs: the 14 inference / RL ones and 3 `_1node` copies left out; each with its
    source and commit; after shrinking, fewer distinct runs."""
    assert len(SETS) == 48
    assert not [n for n in SETS if n.startswith(("gpt_dynamic_inference", "gpt_static_inference", "gpt_grpo"))]
    assert all(s["source"].endswith(f"/moe/{n}/model_config.yaml") and len(s["commit"]) == 40 for n, s in SETS.items())
    assert sum(map(len, GROUPS.values())) == len(SETS) and len(GROUPS) < len(SETS)
    refused = [s["expect"] for s in SETS.values() if s["expect"] != "train"]
    assert all(e.startswith("--") and ": " in e for e in refused), refused  # the flag, then the feature

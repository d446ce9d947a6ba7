"""A Megatron-LM user's script runs as it is: the 19 flag sets of tests/assets/megatron_flag_sets.json
(Megatron-LM's examples and GPT functional tests, as their scripts expand them), shrunk to CPU size,
each train 2 iterations or are refused in one sentence naming the missing feature.

Shrinking (tests/megatron_flag_sets_helpers.py, shared with the MoE functional tests of
test_megatron_moe_configs.py) changes sizes, never meanings: 2 layers × 64 wide, 32 tokens, 2
iterations, TP 8 becomes 4, PP 2, EP 2, mock data, gloo. Sets whose TP × CP × EP is 1 train in this
process; the others in one 4-rank gloo world shared by the module.

Precision flags of the scale issue (W2-17) that this tree does not know yet are dropped after checking
that the refusal names them; once they exist they stay in and the sets train with them.
"""

import json
import os

import pytest
from launch_helpers import REPO, records
from megatron_flag_sets_helpers import (
    WORLD,
    check,
    drop,
    has_wandb,
    known,
    refusal,
    replace,
    shrink,
    train_in_world,
)

from megatron_sp.testing import LocalWorld
from megatron_sp.training import pretrain
from megatron_sp.training.arguments import build_parser, parse_args
from tools.megatron_flag_table import PENDING as PENDING_PRECISION  # issue 17's flags: unknown until it lands

FIXTURE = json.load(open(os.path.join(REPO, "tests", "assets", "megatron_flag_sets.json")))
SETS = {s["name"]: s for s in FIXTURE["sets"]}


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(WORLD)
    yield w
    w.close()


@pytest.mark.parametrize("name", list(SETS))
def test_megatron_flag_set(name, world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    spec = SETS[name]
    argv, model_parallel = shrink(spec["argv"], tmp_path)
    pending = [f for f in PENDING_PRECISION if f in argv and not known(f)]
    if pending:  # (a refused feature is named first)
        if spec["expect"] in ("train", "pipeline parallelism"):
            assert f"unrecognized arguments: {pending[0]}" in refusal(argv)
        argv = drop(argv, pending)
    if "--wandb-project" in argv and not has_wandb():
        assert "needs the wandb package" in refusal(argv)
        argv = drop(argv, [f for f in argv if f.startswith("--wandb-")])
    check(argv, spec["expect"], model_parallel, world, tmp_path)
    if spec["expect"] == "train" and "--wandb-project" in argv:  # offline: the run is on disk, to sync later
        assert list((tmp_path / "wandb").rglob("offline-run-*")), list((tmp_path / "wandb").rglob("*"))
    for variant in spec["variants"]:
        changed = replace(drop(argv, variant.get("drop", ())), variant.get("set", {}))
        check(changed, variant["expect"], model_parallel, world, tmp_path)


def test_wandb_without_the_package_is_one_sentence(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    message = refusal(["--mock-data", "--wandb-project", "p"])
    assert "--wandb-project needs the wandb package" in message and len(message.splitlines()) == 1


def test_the_fixture_is_what_the_issue_lists():
    """19 sets, each with its source file and commit; every one trains as it is (gpt-oss with its
    experts and FP8 flags, the Llama-3 FP8 scripts with theirs, --fp8-param-gather included)."""
    assert len(SETS) == 19
    assert all(s["source"] and len(s["commit"]) == 40 for s in SETS.values())
    assert {n for n, s in SETS.items() if s["expect"] != "train"} == set()


@pytest.mark.parametrize(
    "flags,position",
    [
        (["--position-embedding-type", "rope", "--no-position-embedding"], "rope"),  # Mixtral's script
        (["--no-position-embedding", "--position-embedding-type", "rope"], "rope"),
        (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"], "rope"),
        (["--position-embedding-type", "learned_absolute", "--use-rotary-position-embeddings"], "rope"),
        (["--no-position-embedding"], "none"),
        ([], None),
    ],
)
def test_legacy_position_flags_read_as_megatron_lm(flags, position):
    assert parse_args(["--mock-data"] + flags).position_embedding_type == position


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--lr-decay"], "unrecognized arguments: --lr-decay"),  # no abbreviations (--lr-decay-style)
        (["--moe-use-upcycling", "--bogus"], "mixture-of-experts option is not implemented"),  # the feature first
        (["--pipeline-model-parallel-size", "3"], "× --pipeline-model-parallel-size 3."),
        (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], "does not split evenly over 2 ranks"),
        (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--torch-compile"], "zero-bubble"),
        (["--pipeline-schedule", "zbv"], "need --pipeline-model-parallel-size > 1"),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "4",
                "--global-batch-size",
                "6",
            ],
            "multiple of --pipeline-model-parallel-size 2",
        ),
        (["--ckpt-format", "torch"], "--ckpt-format torch_dist"),
        (["--rope-type", "yarn"], "--rope-type yarn: multi-latent attention's switch"),  # gpt-oss's is rope
        (["--optimizer", "sgd"], "--optimizer sgd: AdamW (Megatron-LM's adam"),
        (["--overlap-param-gather"], "needs --use-distributed-optimizer"),
        (["--tokenizer-type", "GPTSentencePieceTokenizer"], "HuggingFaceTokenizer"),
        (["--no-position-embedding", "--position-embedding-type", "learned_absolute"], "contradicts"),
        (["--step-batch-size-schedule", "0:8", "1280:16", "--global-batch-size", "8"], "make them agree"),
    ],
)
def test_refusals_are_one_sentence(flags, needle):
    message = refusal(["--mock-data", "--micro-batch-size", "1"] + flags)
    assert needle in message and len(message.splitlines()) == 1, message


def test_quoted_split_and_unquoted_schedule_read_as_megatron():
    argv = ["--split", "'99,1,0'", "--step-batch-size-schedule", "0:2", "64:4", "--micro-batch-size", "1"]
    args = parse_args(argv + ["--seq-length", "32"])  # (the words of an unquoted "0:2 64:4")
    assert args.split == "99,1,0" and args.global_batch_size == 4
    assert [args.batch_schedule.at(n) for n in (0, 1, 2, 100)] == [2, 2, 4, 4]  # 64 tokens: 2 samples of 32


def test_readme_flag_table_is_the_generated_one():
    """Every flag of the 19 sets is handled (implemented, no effect, refused, or issue 17's) and the
    docs/megatron_flags.md's table says so: `python tools/megatron_flag_table.py --write` regenerates it."""
    from tools import megatron_flag_table

    assert megatron_flag_table.readme_table() == megatron_flag_table.table()


def test_flag_table_refuses_a_flag_nothing_handles(tmp_path):
    from tools import megatron_flag_table

    fixture = tmp_path / "sets.json"
    fixture.write_text(json.dumps({"sets": [{"argv": ["--lr", "1", "--no-such-flag"], "variants": []}]}))
    with pytest.raises(ValueError, match="--no-such-flag: no handling"):
        megatron_flag_table.table(str(fixture))


def test_defaults_a_script_relies_on_are_megatron_lms():
    args = parse_args(["--mock-data"])
    defaults = (args.min_lr, args.lr_decay_style, args.adam_beta2, args.eval_iters, args.log_interval)
    assert defaults == (0.0, "linear", 0.999, 100, 100)
    assert args.lr_warmup_iters == 0 and args.lr_warmup_fraction is None and args.lr_warmup_samples == 0
    evaluates = [pretrain.evaluates(parse_args(["--mock-data"] + f)) for f in ([], ["--eval-interval", "5"])]
    assert evaluates == [False, True]  # evaluation only with --eval-interval ...
    assert not pretrain.evaluates(parse_args(["--mock-data", "--eval-interval", "5", "--eval-iters", "0"]))  # ... > 0


def test_fsdp2_saves_right_after_an_evaluation(world, tmp_path):
    """--use-torch-fsdp2 with an evaluation and a save at the same iteration (TP2 × FSDP2 over DP2): the
    root's weights, left gathered by the forward-only evaluation, are sharded again before the save (it
    crashed on `full_tensor`), and the checkpoint resumes."""
    ckpt = tmp_path / "ckpt"
    argv = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--device", "cpu"]
    argv += ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    argv += ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "4"]
    argv += ["--use-torch-fsdp2", "--eval-interval", "2", "--eval-iters", "1", "--save", str(ckpt)]
    argv += ["--save-interval", "2", "--log-jsonl", str(tmp_path / "log.jsonl"), "--no-progress-bar"]
    assert world.run(train_in_world, argv + ["--train-iters", "2"], str(tmp_path)) == [0] * WORLD
    assert (ckpt / "iter_0000002").is_dir()
    assert world.run(train_in_world, argv + ["--train-iters", "3", "--load", str(ckpt)], str(tmp_path)) == [0] * WORLD
    assert [r["iteration"] for r in records(tmp_path / "log.jsonl") if "lm_loss" in r] == [1, 2, 3]


def test_query_key_layer_scaling_turns_the_fp32_softmax_on():
    """Megatron-LM's TransformerConfig: --apply-query-key-layer-scaling sets attention_softmax_in_fp32
    (else layer 1, whose scale is 1, ran its softmax in bf16)."""
    cfg = pretrain.build_config(parse_args(["--mock-data", "--apply-query-key-layer-scaling", "--bf16"]), 512)
    assert cfg.apply_query_key_layer_scaling and cfg.attention_softmax_in_fp32


def test_model_refusals_name_the_flags():
    """A GPTConfig error reached from the command line names the flags, not the config's fields."""
    args = parse_args(["--mock-data", "--num-attention-heads", "4", "--num-query-groups", "3"])
    with pytest.raises(ValueError) as err:
        pretrain.build_config(args, 512)
    message = str(err.value)
    assert "--num-query-groups (3)" in message and "--num-attention-heads (4)" in message, message
    assert "GPTConfig" not in message and "num_query_groups" not in message


@pytest.mark.parametrize(
    "strategy, fsdp2, reshard, distributed",
    [
        ("optim_grads_params", True, True, False),  # ZeRO-3
        ("optim_grads", True, False, False),  # ZeRO-2: weights kept gathered from forward to backward
        ("optim", False, True, True),  # ZeRO-1
        ("no_shard", False, True, False),
    ],
)
def test_megatron_fsdp_runs_on_fsdp2_or_the_distributed_optimizer(strategy, fsdp2, reshard, distributed):
    """--use-megatron-fsdp's sharding strategies on our implementations (Llama-3 8B's Megatron-FSDP
    set trains with optim_grads_params in test_megatron_flag_set; its --use-distributed-optimizer, which
    Megatron-FSDP v1 requires, gives way to FSDP2's own sharding)."""
    argv = ["--mock-data", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    args = parse_args(argv + ["--use-distributed-optimizer"] * (strategy != "no_shard"), world_size=2)
    assert (args.use_torch_fsdp2, args.torch_fsdp2_reshard_after_forward) == (fsdp2, reshard)
    assert args.use_distributed_optimizer == distributed
    assert parse_args(argv + ["--ckpt-format", "fsdp_dtensor"], world_size=2).ckpt_format == "fsdp_dtensor"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp"),
        (["--use-megatron-fsdp", "--use-torch-fsdp2"], "two FSDP implementations; give one"),
        (["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"], "(HSDP) is not implemented"),
        (["--megatron-fsdp-main-params-dtype", "bf16"], "the main weights are fp32"),
    ],
)
def test_megatron_fsdp_refusals_are_one_sentence(flags, message):
    assert message in refusal(["--mock-data"] + flags)


# Implemented options whose default differs from Megatron-LM's on purpose (README, docs/megatron_flags.md):
# a value where Megatron-LM requires one, the model family's default (gpt2's are Megatron's), a default
# resolved at run time to Megatron's, or the same value spelled another way.
OUR_DEFAULTS = {
    "--num-layers": "required by Megatron-LM",
    "--hidden-size": "required by Megatron-LM",
    "--num-attention-heads": "required by Megatron-LM",
    "--seq-length": "required by Megatron-LM",
    "--micro-batch-size": "required by Megatron-LM",
    "--lr": "required by Megatron-LM",
    "--tokenizer-type": "required by Megatron-LM (ours: the byte-level tokenizer of the embedded corpus)",
    "--num-query-groups": "the family's: the head count (Megatron's 1 applies only with --group-query-attention)",
    "--normalization": "the family's (gpt2: LayerNorm)",
    "--position-embedding-type": "the family's (gpt2: learned_absolute)",
    "--yarn-original-max-position-embeddings": "YaRN's values, read only with --position-embedding-type yarn",
    "--yarn-beta-fast": "YaRN's values, read only with --position-embedding-type yarn",
    "--yarn-beta-slow": "YaRN's values, read only with --position-embedding-type yarn",
    "--distributed-backend": "nccl on CUDA (Megatron's), gloo on CPU",
    "--split": "Megatron's 969,30,1, which it fills in when --split is left out",
    "--attention-backend": "auto, Megatron's AttnBackend.auto",
    "--cp-comm-type": "p2p, Megatron's ['p2p'] (one value for every layer)",
}


def _megatron_value(option):
    """A value Megatron accepts for a value option: the accepted one, its first choice, its default, or 1."""
    from megatron_sp.training.megatron_flags import NO_EFFECT
    from megatron_sp.training.megatron_rules import rule_for

    only = getattr(rule_for(option), "only", None)
    only = only or next((e.only for e in NO_EFFECT if option["flags"][0] in e.flags), None)
    only = only[0] if isinstance(only, tuple) else only
    value = only or (option["choices"] or [None])[0] or option["default"] or 1
    value = value[0] if isinstance(value, list) else value
    count = option["nargs"] if isinstance(option["nargs"], int) else 1
    return [str(value)] * count


def test_every_megatron_option_is_implemented_accepted_or_refused():
    """Every option of Megatron-LM's parser (megatron_arguments.json, extracted from the real parser at
    the commit it names): implemented (all its spellings parse), accepted without effect (parses, and
    a value other than the accepted one is refused), or refused in one sentence naming the flag."""
    from megatron_sp.training import megatron_flags
    from megatron_sp.training.megatron_rules import megatron_options
    from tools import megatron_flag_table

    parser = build_parser()
    known = parser._option_string_actions
    assert len(megatron_options()["options"]) > 800
    for option in megatron_options()["options"]:
        flags = option["flags"]
        text = megatron_flag_table.describe(next((f for f in flags if f in known), flags[0]), parser)
        if text.startswith("refused"):
            sentence = megatron_flags.refusal([flags[0]])
            assert sentence.startswith(f"{flags[0]}: ") and len(sentence.splitlines()) == 1, flags
            continue
        assert all(f in known for f in flags), flags  # every spelling
        if text.startswith("implemented"):
            continue
        argv = [flags[0]] + ([] if option["kind"] == "switch" else _megatron_value(option))
        args, unknown = parser.parse_known_args(argv)
        assert not unknown and megatron_flags.refused_value(args) is None, argv


def test_implemented_options_have_megatrons_defaults():
    from megatron_sp.training.megatron_rules import megatron_options

    known, differ = build_parser()._option_string_actions, {}
    for option in megatron_options()["options"]:
        action = next((known[f] for f in option["flags"] if f in known), None)
        if action is None or option["kind"] == "switch" or "accepted, no effect" in (action.help or ""):
            continue
        ours, theirs = action.default, option["default"]
        if ours != theirs and not (isinstance(ours, (int, float)) and isinstance(theirs, (int, float))):
            differ[option["flags"][0]] = (theirs, ours)
    assert set(differ) == set(OUR_DEFAULTS), differ


def test_pipeline_split_accounting_is_megatrons_layout():
    """--account-for-embedding/loss-in-pipeline-split: the embedding and the loss count as layers when
    the layers are divided, so the first (last) stage holds one transformer layer fewer."""
    base = ["--mock-data", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--micro-batch-size", "1"]
    args = parse_args(base + ["--num-layers", "3", "--account-for-embedding-in-pipeline-split"], world_size=2)
    assert args.pipeline_model_parallel_layout == "Et|ttL" and args.pipeline_layout.stage_sizes == (1, 2)
    both = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    args = parse_args(base + ["--num-layers", "6", "--virtual-pipeline-model-parallel-size", "2"] + both, world_size=2)
    assert args.pipeline_model_parallel_layout == "Et|tt|tt|tL"
    assert "must be divisible by the 2 pipeline stages" in refusal(
        base + ["--num-layers", "4", "--account-for-embedding-in-pipeline-split"]
    )
    group = "--microbatch-group-size-per-virtual-pipeline-stage"
    assert parse_args(base + ["--num-layers", "4", group, "2"], world_size=2).pipeline_layout is not None
    assert "rounds of --pipeline-model-parallel-size (2)" in refusal(base + ["--num-layers", "4", group, "4"])

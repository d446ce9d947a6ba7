"""What the tests of Megatron-LM's own flag sets share (tests/test_megatron_flag_sets.py: examples and
GPT functional tests; tests/test_megatron_moe_configs.py: the MoE functional tests): `shrink`, which
turns a set into its CPU-size run, and the checks that it trains 2 iterations or is refused in one
sentence.

Shrinking changes sizes, never meanings: 2 layers × 64 wide, 4 heads (2 key/value groups where the
set has GQA), 32 tokens, 128-wide MLPs (experts' and shared experts' too), 2 iterations, micro batch 1
and 2 micro-batches per step (a batch schedule becomes 0:DP then 2·DP, times PP); TP 8 becomes 4; PP
becomes 2 (one layer per stage, TP shrunk to fit; experts too: Mixtral's EP 8 × PP 4 trains at EP 2 ×
PP 2); EP becomes 2, and the expert TP shrinks to fit a stage's ranks as TP does; a per-layer
--moe-layer-freq pattern keeps its first and last layer (DeepSeek's dense-then-MoE ([0]*3+[1]*5)
becomes ([0]*1+[1]*1)); data and tokenizer files (none exist here) become mock data with NullTokenizer
--vocab-size 512; paths go to a temporary directory; nccl becomes gloo. Sets whose TP × CP × EP is 1
train in the test's process; the others in one 4-rank gloo world shared by the module.
"""

import importlib.util
import math
import os
import shutil

import pytest
from launch_helpers import records

from megatron_sp.layer_options import moe_layer_freq_type
from megatron_sp.training import pretrain
from megatron_sp.training.arguments import ArgumentError, build_parser, parse_args

WORLD = 4
DATA_FLAGS = ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-model", "--tokenizer-type", "--vocab-size")


def _values(argv, i):
    """Index past flag argv[i] and its values."""
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return j


def drop(argv, flags):
    out, i = [], 0
    while i < len(argv):
        j = _values(argv, i) if argv[i].startswith("--") else i + 1
        if argv[i] not in flags:
            out += argv[i:j]
        i = j
    return out


def replace(argv, values: dict):
    """Each flag of `values` set to its value (None: dropped), in place where the set has it."""
    out, i = [], 0
    while i < len(argv):
        j = _values(argv, i)
        flag = argv[i]
        if flag in values:
            if values[flag] is not None:
                out += [flag, *([values[flag]] if values[flag] != "" else [])]
        else:
            out += argv[i:j]
        i = j
    return out


def _get(argv, flag, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def moe_pattern(pattern: str) -> str:
    """A per-layer --moe-layer-freq pattern (Megatron-LM's list expression of 0s and 1s) for the 2
    shrunk layers: its first and its last layer."""
    layers = moe_layer_freq_type(pattern)
    return f"([{layers[0]}]*1+[{layers[-1]}]*1)"


def shrink(argv, tmp):
    """The set at CPU size (see the module docstring)."""
    pp = min(int(_get(argv, "--pipeline-model-parallel-size", 1)), 2)
    cp = int(_get(argv, "--context-parallel-size", 1))
    tp = min(int(_get(argv, "--tensor-model-parallel-size", 1)), WORLD // (pp * cp))
    ep = min(int(_get(argv, "--expert-model-parallel-size", 1)), 2)
    sharded = "--use-megatron-fsdp" in argv or "--use-torch-fsdp2" in argv  # (needs replicas: the world)
    dp = WORLD // (tp * cp * pp) if tp * cp * pp * ep > 1 or sharded else 1
    sizes = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32"}
    sizes.update({f: v for f, v in (("--ffn-hidden-size", "128"), ("--kv-channels", "16")) if f in argv})
    sizes.update({f: v for f, v in (("--num-query-groups", "2"), ("--max-position-embeddings", "32")) if f in argv})
    sizes.update({"--tensor-model-parallel-size": str(tp), "--micro-batch-size": "1"})
    if "--pipeline-model-parallel-size" in argv:
        sizes["--pipeline-model-parallel-size"] = str(pp)
    if "--expert-model-parallel-size" in argv:  # EP 8 becomes 2
        sizes["--expert-model-parallel-size"] = str(ep)
    etp = int(_get(argv, "--expert-tensor-parallel-size", tp))  # (Megatron's default: the TP size)
    etp_shrunk = ep * etp > WORLD // pp  # EP × ETP divides a stage's ranks: ETP shrunk to fit, as TP
    if etp_shrunk or "--expert-tensor-parallel-size" in argv:
        sizes["--expert-tensor-parallel-size"] = str(min(etp, WORLD // (pp * ep)))
    sizes.update({f: "128" for f in ("--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size") if f in argv})
    if "--moe-layer-freq" in argv and _get(argv, "--moe-layer-freq").startswith(("(", "[")):
        sizes["--moe-layer-freq"] = moe_pattern(_get(argv, "--moe-layer-freq"))
    schedule = "--step-batch-size-schedule" in argv
    if schedule:  # tokens: batch pp·dp (1F1B: at least pp micro-batches), then 2 pp·dp
        sizes["--step-batch-size-schedule"] = f"0:{pp * dp} {32 * pp * dp}:{2 * pp * dp}"
    if "--global-batch-size" in argv or not schedule:
        sizes["--global-batch-size"] = str(2 * (pp if schedule else 1) * dp)
    if "--train-samples" in argv:
        sizes["--train-samples"] = str(3 * dp if schedule else 4 * dp)
    else:
        sizes["--train-iters"] = "2"
    if "--eval-interval" in argv and _get(argv, "--eval-iters") != "0":
        sizes.update({"--eval-interval": "2", "--eval-iters": "1"})
    if "--profile" in argv:
        sizes.update({"--profile-step-start": "1", "--profile-step-end": "2"})
    sizes.update({"--distributed-backend": "gloo", "--split": _get(argv, "--split")})
    if "--tensorboard-dir" in argv:  # (a relative one would land in the world's working directory)
        sizes["--tensorboard-dir"] = str(tmp / "tb")
    argv = replace(drop(argv, DATA_FLAGS + ("--mock-data",)), sizes)
    if etp_shrunk and "--expert-tensor-parallel-size" not in argv:  # (it followed the TP size)
        argv += ["--expert-tensor-parallel-size", sizes["--expert-tensor-parallel-size"]]
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--device", "cpu"]
    argv += ["--log-jsonl", str(tmp / "log.jsonl"), "--no-progress-bar"]
    paths = {"$CKPT": tmp / "ckpt", "$TB": tmp / "tb", "$CACHE": tmp / "cache", "$WANDB": tmp / "wandb"}
    for key, path in paths.items():
        argv = [a.replace(key, str(path)) for a in argv]
    return argv, WORLD if sharded else max(tp * cp * pp, ep)


def known(flag) -> bool:
    return flag in build_parser()._option_string_actions


def refusal(argv) -> str:
    with pytest.raises(ArgumentError) as err:
        parse_args(argv, world_size=WORLD)
    return str(err.value)


def train_in_world(argv, cwd):
    """One rank of a set's run in the shared world (pretrain_gpt_sp.py less its process-group start),
    in the test's directory (a set's relative paths, such as Mixtral's CKPT/tensorboard, land there)."""
    import torch.distributed as dist

    os.chdir(cwd)
    args = parse_args(argv, world_size=dist.get_world_size())
    args.distributed_backend, args.data_cache_path = "gloo", args.data_cache_path or "data_cache"
    return pretrain.Trainer(pretrain.check_inputs(args)).run()


def train(argv, model_parallel, world, tmp):
    """Trains the shrunk set: its two iterations' losses (finite) from rank 0's log."""
    shutil.rmtree(tmp / "ckpt", ignore_errors=True)  # a fresh run, not a resume of the last one
    (tmp / "log.jsonl").unlink(missing_ok=True)
    if model_parallel == 1:
        assert pretrain.main(argv) == 0
    else:
        assert world.run(train_in_world, argv, str(tmp)) == [0] * WORLD
    steps = [r for r in records(tmp / "log.jsonl") if "lm_loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["lm_loss"]) for r in steps), steps
    return steps


def check(argv, expect, model_parallel, world, tmp):
    if expect == "train" and "--fp8-format" in argv and not has_torchao():  # (a venv set up before it)
        with pytest.raises(ArgumentError, match="needs the torchao package"):
            parse_args(argv, world_size=1 if model_parallel == 1 else WORLD)
        return None
    if expect != "train":
        message = refusal(argv)
        assert expect in message and len(message.splitlines()) == 1, message
        return None
    return train(argv, model_parallel, world, tmp)


def has_torchao() -> bool:
    return importlib.util.find_spec("torchao") is not None


def has_wandb() -> bool:
    return importlib.util.find_spec("wandb") is not None

#!/usr/bin/env python
"""Megatron-LM's MoE functional-test configs as command lines: tests/assets/megatron_moe_flag_sets.json.

Reads tests/functional_tests/test_cases/moe/*/model_config.yaml of a Megatron-LM snapshot (a git
repository, read with `git show COMMIT:PATH`, no work tree needed) and turns each MODEL_ARGS mapping
into the argv that tests/functional_tests/shell_test_utils/_run_training.sh hands to the training
script on a first run (RUN_NUMBER 1: MODEL_ARGS, no SLURM time limit):

- the launcher's variables are substituted first (its envsubst): ${CHECKPOINT_SAVE_PATH} and
  ${CHECKPOINT_LOAD_PATH} become $CKPT, ${TENSORBOARD_PATH} $TB, ${DATA_PATH} $DATA_PATH,
  ${DATA_CACHE_PATH} $CACHE (the placeholders of tests/assets/megatron_flag_sets.json); any other
  variable is an error;
- each entry as yq prints it: `true` becomes the bare flag, an empty value drops the entry, any other
  value is its YAML text (quotes of a quoted scalar removed, comments gone);
- the value trimmed as `xargs` trims it (its quotes removed, runs of blanks made one);
- a value in parentheses, such as `([0]*3+[1]*5)`, stays one word; one in brackets, such as
  `[attn mlp]`, loses its brackets and is split into words; one with a blank, `|`, `(` or `)` stays one
  word; any other value is split at blanks (the script's `eval` of the joined line).

Training configs only: the inference and RL ones (gpt_dynamic_inference*, gpt_static_inference*,
gpt_grpo*) are left out, and a `_1node` config whose MODEL_ARGS equal its sibling's (the one without
the suffix) is left out as the same command line. `expect` is kept from the fixture being replaced
(a new config: "train"); tests/test_megatron_moe_configs.py checks it.

    python tools/megatron_functional_configs.py [--repo /work/.mirror/NVIDIA+Megatron-LM/repo] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "assets", "megatron_moe_flag_sets.json")
MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # tests/assets/megatron_flag_sets.json's
CASES = "tests/functional_tests/test_cases/moe"
SCRIPT = "tests/functional_tests/shell_test_utils/_run_training.sh"
NOT_TRAINING = ("gpt_dynamic_inference", "gpt_static_inference", "gpt_grpo")
PLACEHOLDERS = {
    "CHECKPOINT_SAVE_PATH": "$CKPT",
    "CHECKPOINT_LOAD_PATH": "$CKPT",
    "TENSORBOARD_PATH": "$TB",
    "DATA_PATH": "$DATA_PATH",
    "DATA_CACHE_PATH": "$CACHE",
}
ABOUT = (
    "Megatron-LM's MoE functional-test configs (tests/functional_tests/test_cases/moe/*/model_config.yaml at "
    "NVIDIA/Megatron-LM commit `commit`), each MODEL_ARGS resolved into the command line that "
    f"{SCRIPT} gives the training script on a first run (tools/megatron_functional_configs.py, which "
    "writes this file). Training configs only: the inference and RL ones (gpt_dynamic_inference*, "
    "gpt_static_inference*, gpt_grpo*) are left out, and so is a `_1node` config whose MODEL_ARGS equal its "
    "sibling's ({same}). Paths are the placeholders of megatron_flag_sets.json ($CKPT, $TB, $DATA_PATH, "
    "$CACHE). tests/test_megatron_moe_configs.py shrinks each to CPU size as test_megatron_flag_sets.py "
    "does and checks `expect`: 'train', or the missing feature its one-sentence refusal names."
)


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def envsubst(text: str) -> str:
    def sub(match):
        name = match.group(1) or match.group(2)
        if name not in PLACEHOLDERS:
            raise ValueError(f"${{{name}}}: a variable the launcher does not set for training")
        return "zzvar" + name + "zz"  # a path (no shell meaning) until the argv is built

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, text)


def entries(text: str, key: str = "MODEL_ARGS") -> list:
    """(flag, value text or True) of the YAML mapping `key`, in order, as yq prints them."""
    import yaml

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    node = next(v for k, v in root.value if k.value == key)
    out = []
    for k, v in node.value:
        if not isinstance(v, yaml.ScalarNode):
            raise ValueError(f"{k.value}: a {type(v).__name__} value; the launcher's configs hold scalars")
        is_true = v.style is None and v.value in ("true", "True", "TRUE")  # (YAML 1.2's booleans, as yq's)
        if v.value != "" or v.style is not None:
            out.append((k.value, True if is_true else v.value))
    return out


def command_line(pairs) -> list:
    """The argv of _run_training.sh's loop over the entries and its `eval` of the joined words."""
    words = []
    for key, value in pairs:
        if value is True:
            words.append(shlex.quote(key))
            continue
        value = " ".join(shlex.split(value))  # `echo "$value" | xargs`
        if value == "true":
            words.append(key)
        elif re.fullmatch(r"\([^)]+\)", value):
            words += [key, '"' + value + '"']
        elif re.fullmatch(r"\[[^]]+\]", value):
            words += [key, value[1:-1]]
        elif any(c in value for c in " |()"):
            words += [key, '"' + value + '"']
        else:
            words += [key, value]
    argv = shlex.split(" ".join(words))
    return [re.sub("zzvar([A-Z_]+)zz", lambda m: PLACEHOLDERS[m.group(1)], a) for a in argv]


def configs(repo: str = MIRROR, commit: str = COMMIT) -> tuple:
    """(sets, left-out _1node names), each set {name, source, argv}, sorted by name."""
    names = sorted(os.path.basename(p) for p in git(repo, "ls-tree", "--name-only", commit, CASES + "/").split())
    argvs = {}
    for name in names:
        if name.startswith(NOT_TRAINING):
            continue
        text = git(repo, "show", f"{commit}:{CASES}/{name}/model_config.yaml")
        argvs[name] = command_line(entries(envsubst(text)))
    same = [n for n in argvs if n.endswith("_1node") and argvs.get(n[: -len("_1node")]) == argvs[n]]
    kept = [n for n in argvs if n not in same]
    sets = [{"name": n, "source": f"{CASES}/{n}/model_config.yaml", "argv": argvs[n]} for n in kept]
    return sets, same


def fixture(repo: str = MIRROR, commit: str = COMMIT, old: dict | None = None) -> dict:
    sets, same = configs(repo, commit)
    expect = {s["name"]: s["expect"] for s in (old or {}).get("sets", [])}
    out = []
    for s in sets:
        out.append(
            {
                "name": s["name"],
                "source": s["source"],
                "commit": commit,
                "resolved": f"MODEL_ARGS as {SCRIPT.split('/', 2)[2]} expands them (RUN_NUMBER 1)",
                "expect": expect.get(s["name"], "train"),
                "variants": [],
                "argv": s["argv"],
            }
        )
    return {"about": ABOUT.format(same=", ".join(same) or "none"), "sets": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default=MIRROR, help="the Megatron-LM git repository (default %(default)s)")
    p.add_argument("--commit", default=COMMIT, help="default: the GPT flag-set fixture's commit")
    p.add_argument("--check", action="store_true", help="exit 1 if the committed fixture differs, write nothing")
    args = p.parse_args(argv)
    old = json.load(open(FIXTURE)) if os.path.exists(FIXTURE) else None
    new = fixture(args.repo, args.commit, old)
    if args.check:
        return 0 if new == old else 1
    with open(FIXTURE, "w") as f:
        json.dump(new, f, indent=1)
        f.write("\n")
    print(f"{FIXTURE}: {len(new['sets'])} configs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

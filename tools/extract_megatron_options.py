#!/usr/bin/env python
"""Writes megatron_sp/training/megatron_arguments.json: every option of Megatron-LM's training parser
(`megatron.training.arguments.add_megatron_arguments`) with its option strings, default, type,
choices, nargs, kind (switch or value) and --help group, at one Megatron-LM commit.

    python tools/extract_megatron_options.py --repo /path/to/Megatron-LM [--commit SHA]

Why the real parser and not `ast` over arguments.py: most of its groups are built by
`ArgumentGroupFactory` from config dataclasses (TransformerConfig, TrainingConfig, CheckpointConfig, ...),
so the flags exist only once the parser runs. The tool exports the commit's `megatron/` with
`git archive` into a temporary directory and imports it here, at extraction time only, with the
GPU-only packages it imports (Transformer Engine, apex, triton kernels, ...) stubbed; nothing of
Megatron-LM is copied into megatron_sp, and the project reads only the JSON list this writes
(tools/megatron_flag_table.py, tests/test_megatron_flag_sets.py).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "megatron_sp", "training", "megatron_arguments.json")
# Modules that need a GPU stack or are absent on a CPU machine; the parser never calls into them.
STUBBED = (
    "transformer_engine",
    "apex",
    "flash_attn",
    "nvidia_resiliency_ext",
    "tensorstore",
    "zarr",
    "modelopt",
    "one_logger_utils",
    "wandb",
    "einops",
    "nvtx",
    "mamba_ssm",
    "causal_conv1d",
    "flashinfer",
    "deep_ep",
    "emerging_optimizers",
    "multistorageclient",
    "torch_memory_saver",
    "grouped_gemm",
    "cupy",
    "nv_grouped_gemm",
    "kitchen",
    "tiktoken",
    "sentencepiece",
    # Megatron's own triton kernels (stubbing triton itself would break torch's import)
    "megatron.core.transformer.moe.ops",
    "megatron.core.ssm.ops",
    "megatron.core.ssm.gated_delta_product",
)


def _stub_body() -> dict:
    def attr(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), _stub_body())()

    return {
        "__init__": lambda self, *a, **k: None,
        "__call__": lambda self, *a, **k: _StubType("result", (), _stub_body())(),
        "__iter__": lambda self: iter(()),
        "__getattr__": attr,
        "__bool__": lambda self: False,
    }


class _StubType(type):
    """Any attribute of a stub is a stub class; used as a decorator it returns what it decorates."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), _stub_body())

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return type.__call__(cls)


class _StubModule(types.ModuleType):
    __path__ = []

    def __getattr__(self, name):
        if name == "__version__":
            return "99.0.0"
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), _stub_body())


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == s or name.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _type_name(action) -> str | None:
    t = action.type
    return None if t is None else getattr(t, "__name__", repr(t))


def options(parser) -> list:
    """One record per option (positional arguments and --help left out), in the parser's order."""
    groups = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    out = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        switch = action.nargs == 0
        out.append(
            {
                "flags": list(action.option_strings),
                "dest": action.dest,
                "default": _jsonable(action.default),
                "type": _type_name(action),
                "choices": _jsonable(list(action.choices)) if action.choices is not None else None,
                "nargs": _jsonable(action.nargs),
                "kind": "switch" if switch else "value",
                "group": groups.get(id(action)),
            }
        )
    return out


def build_parser(megatron_root: str):
    """Megatron-LM's training parser, imported from megatron_root with the stubs installed."""
    import typing

    import typing_extensions

    if not hasattr(typing, "override"):  # Python 3.12's; the parser's modules import it
        typing.override = typing_extensions.override
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, megatron_root)
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _commit(repo: str, commit: str) -> str:
    return subprocess.check_output(["git", "-C", repo, "rev-parse", commit], text=True).strip()


def export(repo: str, commit: str, into: str) -> None:
    archive = subprocess.run(["git", "-C", repo, "archive", commit, "megatron"], check=True, capture_output=True)
    subprocess.run(["tar", "x", "-C", into], input=archive.stdout, check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True, help="a Megatron-LM git repository (a bare mirror works)")
    p.add_argument("--commit", default="HEAD", help="the commit to read (default HEAD)")
    p.add_argument("--out", default=OUT, help="the JSON list to write")
    args = p.parse_args(argv)
    sha = _commit(args.repo, args.commit)
    with tempfile.TemporaryDirectory() as tmp:
        export(args.repo, sha, tmp)
        records = options(build_parser(tmp))
    with open(args.out, "w") as f:
        json.dump({"megatron_lm_commit": sha, "options": records}, f, indent=1)
        f.write("\n")
    print(f"{len(records)} options of Megatron-LM {sha[:12]} -> {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

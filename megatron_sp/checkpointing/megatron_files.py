"""Reading the checkpoints Megatron-LM's `save_checkpoint` writes, without running code from them.

    read_megatron(root, iteration=None) -> MegatronCheckpoint
        .format       "torch" (legacy) or "torch_dist"
        .common       args (argparse.Namespace), iteration, checkpoint_version, opt_param_scheduler, ...
        .tensors      {mcore name: whole tensor}; layers numbered globally ("decoder.layers.3.mlp..."),
                      under the local spec's names; TP shards not yet merged for the legacy format:
                      see .shards
        .shards       legacy only: {mcore name: [tensor of TP rank 0, 1, ...]}
        .objects      the names of the non-tensor entries (`_extra_state`), accounted for but unread

Layouts on disk (megatron/training/checkpointing.py, megatron/core/dist_checkpointing/):
    torch       latest_checkpointed_iteration.txt, iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt,
                one torch.save per rank; each pipeline stage numbers its layers from 0
    torch_dist  iter_NNNNNNN/{.metadata, __R_I.distcp, metadata.json}, with common.pt (megatron-core
                0.16) or the common state as the "common_state" object inside the .distcp files
                (newer Megatron-LM); whole tensors, layers stacked on a leading axis, Transformer
                Engine's fused norm names ("linear_qkv.layer_norm_weight")

Trust: the pickles (model_optim_rng.pt, common.pt, the common_state object) are read by torch's
weights_only unpickler admitting, besides tensors and builtins, only argparse.Namespace and
megatron-core's objects (the enums Megatron-LM puts in `args`), which are rebuilt as inert
MegatronObjects; a file naming any other class is refused, naming it, before anything is called.
DCP's `.metadata` goes through safe_dcp's unpickler.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from dataclasses import dataclass, field

import torch

from megatron_sp.checkpointing import files, safe_dcp
from megatron_sp.checkpointing.paths import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
PICKLE_LIMIT = 64 << 30  # bytes of one rank file read at most
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
# torch_dist's fused-norm names (Transformer Engine's, kept even for the local spec) -> the local names
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_LAYERS = "decoder.layers."


@dataclass
class MegatronCheckpoint:
    format: str
    path: str
    common: dict
    tensors: dict = field(default_factory=dict)
    shards: dict = field(default_factory=dict)
    objects: set = field(default_factory=set)

    @property
    def args(self):
        return self.common.get("args")


def iteration_dir(root: str, iteration=None) -> str:
    """iter_NNNNNNN (or release) of a Megatron-LM --save directory: the given or the tracked one."""
    if not os.path.isdir(root):
        raise CheckpointError(f"{root} is not a Megatron-LM checkpoint directory (the one holding {TRACKER}).")
    if iteration is None:
        try:
            text = files.read_bytes(os.path.join(root, TRACKER), root, 1024).decode().strip()
        except (files.UnreadableFile, UnicodeDecodeError) as err:
            raise CheckpointError(f"{root} holds no readable {TRACKER} ({err}); pass --iteration.") from None
        name = "release" if text == "release" else (f"iter_{int(text):07d}" if text.isdigit() else None)
        if name is None:
            raise CheckpointError(f"{root}/{TRACKER} holds {text[:40]!r}, not an iteration number.")
    else:
        name = f"iter_{iteration:07d}"
    path = os.path.join(root, name)
    if not os.path.isdir(path) or not files.inside(root, path):
        raise CheckpointError(f"{root} holds no checkpoint {name} (a directory inside it).")
    return path


def read_megatron(root: str, iteration=None) -> MegatronCheckpoint:
    path = iteration_dir(root, iteration)
    if os.path.lexists(os.path.join(path, safe_dcp.METADATA_FILE)):
        return read_torch_dist(path)
    if any(_RANK_DIR.match(name) for name in os.listdir(path)):
        return read_legacy(path)
    raise CheckpointError(
        f"{path} is neither a torch_dist checkpoint (.metadata) nor a torch one (mp_rank_*/{RANK_FILE})."
    )


def read_common(root: str, iteration=None) -> tuple[dict, str]:
    """(args, iteration, ... of a checkpoint, its iteration directory): no tensors of torch_dist read;
    the legacy format keeps them in the same pickle, so its first rank file is read whole."""
    path = iteration_dir(root, iteration)
    if os.path.lexists(os.path.join(path, safe_dcp.METADATA_FILE)):
        return _dist_common(path, _dist_metadata(path)), path
    ranks = _rank_files(path)
    if not ranks:
        raise CheckpointError(f"{path} holds neither .metadata nor mp_rank_*/{RANK_FILE}.")
    data = load_pickle(ranks[min(ranks)], ranks[min(ranks)])
    return {k: v for k, v in data.items() if not k.startswith("model")}, path


# ---- the restricted unpickler ------------------------------------------------------------------


class MegatronObject:
    """An inert stand-in for a megatron-core object a pickle names (the enums in `args`, such as
    AttnBackend): it keeps the arguments it was rebuilt with, and runs none of megatron's code."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}{self.args}"


def _admitted(name: str):
    """What a Megatron-LM pickle may name: argparse.Namespace, or a megatron.core object (an inert
    MegatronObject under that name, so megatron-core need not be installed, nor match the writer's)."""
    import argparse

    if name == "argparse.Namespace":
        return argparse.Namespace
    if name.startswith("megatron.core.") and all(part.isidentifier() for part in name.split(".")):
        return (type(name.rpartition(".")[2], (MegatronObject,), {"__qualname__": name}), name)
    return None


def load_pickle(source, what: str) -> dict:
    """torch.load of a Megatron-LM pickle (a path or bytes) admitting only the named classes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(
                source if isinstance(source, str) else io.BytesIO(source)
            )
        except Exception as err:  # noqa: BLE001 - a truncated zip or pickle: any error class
            raise CheckpointError(f"{what} is not a readable torch file ({_first_line(err)}); it is damaged.") from None
        admitted = []
        for name in names:
            cls = _admitted(name)
            if cls is None:
                raise CheckpointError(f"{what} refers to {name}, which a Megatron-LM checkpoint never needs: refused.")
            admitted.append(cls)
        try:
            with torch.serialization.safe_globals(admitted):
                data = torch.load(source if isinstance(source, str) else io.BytesIO(source), weights_only=True)
        except Exception as err:  # noqa: BLE001 - UnpicklingError, a truncated storage, ...
            raise CheckpointError(f"{what} cannot be read ({_first_line(err)}); it is damaged.") from None
    return data


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


# ---- --ckpt-format torch ------------------------------------------------------------------------


def _rank_files(path: str) -> dict:
    """{(tp, pp): file} of a legacy iteration directory."""
    found = {}
    for name in sorted(os.listdir(path)):
        match = _RANK_DIR.match(name)
        if not match:
            continue
        if match.group(3) is not None:
            raise CheckpointError(f"{path} holds {name}: expert-parallel (MoE) checkpoints are not supported yet.")
        tp, pp = int(match.group(1)), int(match.group(2) or 0)
        file = os.path.join(path, name, RANK_FILE)
        problem = files.regular_file_problem(file, path)
        if problem:
            raise CheckpointError(f"{problem}; every mp_rank_* directory holds its rank's {RANK_FILE}.")
        found[(tp, pp)] = file
    return found


def _check_grid(path: str, ranks: dict, args) -> tuple[int, int]:
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in ranks]
    want = (getattr(args, "tensor_model_parallel_size", tp), getattr(args, "pipeline_model_parallel_size", pp))
    if missing or (tp, pp) != want:
        gap = f" (TP rank {missing[0][0]}, PP rank {missing[0][1]} missing)" if missing else ""
        raise CheckpointError(
            f"{path} holds the files of TP {tp} x PP {pp} ranks{gap} but its args say TP {want[0]} x "
            f"PP {want[1]}: a rank's file is missing."
        )
    return tp, pp


def read_legacy(path: str) -> MegatronCheckpoint:
    """Every rank file of a --ckpt-format torch iteration directory."""
    ranks = _rank_files(path)
    first = load_pickle(ranks[min(ranks)], ranks[min(ranks)])
    tp, pp = _check_grid(path, ranks, first.get("args"))
    ckpt = MegatronCheckpoint("torch", path, {k: v for k, v in first.items() if not k.startswith("model")})
    layers_per_stage = _layers_per_stage(ckpt.args, pp, path)
    for (t, p), file in sorted(ranks.items(), key=lambda item: (item[0][1], item[0][0])):
        data = first if (t, p) == min(ranks) else load_pickle(file, file)
        if "model" not in data:
            chunks = sorted(k for k in data if k.startswith("model"))
            raise CheckpointError(
                f"{file} holds {', '.join(chunks) or 'no model'}: virtual pipeline stages are not supported yet."
                if chunks
                else f"{file} holds no model state dict."
            )
        for name, value in data["model"].items():
            name = _global_layer(name, p * layers_per_stage)
            if name.endswith("_extra_state"):
                ckpt.objects.add(name)
            elif not torch.is_tensor(value):
                raise CheckpointError(f"{file} holds {name} as a {type(value).__name__}, not a tensor.")
            else:
                ckpt.shards.setdefault(name, {})
                ckpt.shards[name].setdefault(p, [None] * tp)[t] = value
    ckpt.shards = {name: _one_stage(name, by_stage, path) for name, by_stage in ckpt.shards.items()}
    return ckpt


def _one_stage(name: str, by_stage: dict, path: str) -> list:
    """The TP shards of one tensor: the output layer's tied copy on the last stage aside, a tensor
    lives on one stage."""
    if len(by_stage) > 1 and name != "embedding.word_embeddings.weight":
        raise CheckpointError(f"{path} holds {name} on several pipeline stages.")
    shards = by_stage[min(by_stage)]
    if any(s is None for s in shards):
        raise CheckpointError(f"{path} lacks {name} on some tensor-parallel ranks.")
    return shards


def _layers_per_stage(args, pp: int, path: str) -> int:
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(args, name, None):
            raise CheckpointError(f"{path} was saved with uneven pipeline stages (--{name.replace('_', '-')}).")
    if getattr(args, "pipeline_model_parallel_layout", None):
        raise CheckpointError(f"{path} was saved with --pipeline-model-parallel-layout: not supported yet.")
    layers = getattr(args, "num_layers", None)
    if not isinstance(layers, int) or layers % pp:
        raise CheckpointError(f"{path} has {layers} layers in its args, not a multiple of its {pp} pipeline stages.")
    return layers // pp


def _global_layer(name: str, offset: int) -> str:
    if not name.startswith(_LAYERS):
        return name
    index, _, rest = name[len(_LAYERS) :].partition(".")
    return f"{_LAYERS}{int(index) + offset}.{rest}" if index.isdigit() else name


# ---- --ckpt-format torch_dist -------------------------------------------------------------------


def read_torch_dist(path: str) -> MegatronCheckpoint:
    """The tensors of a torch_dist directory (plain torch.distributed.checkpoint, one process)."""
    metadata = _dist_metadata(path)
    entries = metadata.state_dict_metadata
    common = _dist_common(path, metadata)
    ckpt = MegatronCheckpoint("torch_dist", path, common)
    tensors = {}
    for key, entry in entries.items():
        if not hasattr(entry, "size"):  # BytesStorageMetadata: a pickled object
            if key.split("/")[0] != "common_state":
                ckpt.objects.add(key.split("/")[0])
            continue
        if key.startswith("optimizer.") or key.startswith("rng_state") or key.startswith("rerun_state"):
            continue  # optimizer state: read by load_optimizer where the format allows
        tensors[key] = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            safe_dcp.load(tensors, path, allow_objects=True, no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP wraps any reader error
        raise CheckpointError(f"checkpoint {path} cannot be read ({_first_line(err)}); it is damaged.") from None
    for key, value in tensors.items():
        _unstack(ckpt.tensors, key, value)
    return ckpt


def _dist_metadata(path: str):
    """DCP's Metadata through safe_dcp's unpickler, pickled-object entries listed (never unpickled,
    but the common_state one through load_pickle)."""
    try:
        return safe_dcp.read_metadata(path, allow_objects=True)
    except safe_dcp.UnsafeCheckpointError as err:
        raise CheckpointError(f"{err}.") from None


def _dist_common(path: str, metadata) -> dict:
    """args, iteration, ...: common.pt, or the "common_state" object of newer Megatron-LM."""
    common_pt = os.path.join(path, "common.pt")
    if os.path.lexists(common_pt):
        problem = files.regular_file_problem(common_pt, path)
        if problem:
            raise CheckpointError(f"{problem}; common.pt must be a file of the checkpoint.")
        return load_pickle(common_pt, common_pt)
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn.split("/")[0] == "common_state":
            file = os.path.join(path, str(info.relative_path))
            with open(file, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            loaded = load_pickle(data, f"{file} (common_state)")
            if not (isinstance(loaded, list) and loaded and isinstance(loaded[0], dict)):
                raise CheckpointError(f"{file} holds a common_state that is not a state dict.")
            return loaded[0]
    raise CheckpointError(f"{path} holds neither common.pt nor a common_state entry: its args are missing.")


def _unstack(out: dict, key: str, value: torch.Tensor) -> None:
    """torch_dist's stacked layers [L, ...] -> one entry per global layer, under the local names."""
    if key.startswith(_LAYERS) and "." in key[len(_LAYERS) :]:
        rest = key[len(_LAYERS) :]
        rest = _TE_NORMS.get(rest, rest)
        for i in range(value.shape[0]):
            out[f"{_LAYERS}{i}.{rest}"] = value[i]
    else:
        out[key] = value

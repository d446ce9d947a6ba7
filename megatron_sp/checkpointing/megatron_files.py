"""Reading the checkpoints Megatron-LM's `save_checkpoint` writes, without running code from them.

    read_megatron(root, iteration=None) -> MegatronCheckpoint
        .format       "torch" (legacy) or "torch_dist"
        .common       args (argparse.Namespace), iteration, checkpoint_version, opt_param_scheduler, ...
        .tensors      {mcore name: whole tensor}; layers numbered globally ("decoder.layers.3.mlp..."),
                      under the local spec's names; TP shards not yet merged for the legacy format:
                      see .shards
        .shards       legacy only: {mcore name: [tensor of TP rank 0, 1, ...]}
        .objects      the names of the non-tensor entries (`_extra_state`), accounted for but unread
    read_torch_dist(path, state="optimizer.state.exp_avg.") -> the entries "<state><model key>" of an
        optimizer's model-space state, unstacked as the model's (megatron_optim.py)

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
import math
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
    first = next(iter(ranks.values()))[1]
    data = load_pickle(first, first)
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
    """{directory name: (its rank numbers, file)} of a legacy iteration directory, sorted by name (the
    first: TP, PP and EP rank 0)."""
    found = {}
    for name in sorted(os.listdir(path)):
        match = _RANK_DIR.match(name)
        if not match:
            continue
        file = os.path.join(path, name, RANK_FILE)
        problem = files.regular_file_problem(file, path)
        if problem:
            raise CheckpointError(f"{problem}; every mp_rank_* directory holds its rank's {RANK_FILE}.")
        found[name] = (tuple(int(g) for g in match.groups() if g is not None), file)
    return found


def _grid(path: str, dirs: dict, args) -> dict:
    """{(tp, pp, ep): file}: Megatron-LM names a rank mp_rank_TT, then _PPP when PP > 1, then _EEE
    when EP > 1 (mp_rank_00_001 is PP rank 1 or EP rank 1: the args say which)."""
    get = lambda name: getattr(args, name, None) or 1  # noqa: E731
    tp, pp, ep = (
        get("tensor_model_parallel_size"),
        get("pipeline_model_parallel_size"),
        get("expert_model_parallel_size"),
    )
    ranks = {}
    for name, (numbers, file) in dirs.items():
        if len(numbers) != 1 + (pp > 1) + (ep > 1):
            raise CheckpointError(f"{path} holds {name}, which is not a rank of its args' TP {tp} x PP {pp} x EP {ep}.")
        ranks[(numbers[0], numbers[1] if pp > 1 else 0, numbers[-1] if ep > 1 else 0)] = file
    missing = [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep) if (t, p, e) not in ranks]
    if missing or len(ranks) != tp * pp * ep:
        gap = f" (TP rank {missing[0][0]}, PP rank {missing[0][1]}, EP rank {missing[0][2]} missing)" if missing else ""
        raise CheckpointError(
            f"{path} holds the files of {len(ranks)} ranks{gap} but its args say TP {tp} x PP {pp} x EP {ep}: "
            f"a rank's file is missing or extra."
        )
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if getattr(args, "num_experts", None) and etp not in (None, tp):
        raise CheckpointError(
            f"{path} was saved with --expert-tensor-parallel-size {etp} other than its TP size {tp}: its legacy "
            f"expert files are not supported (save it as torch_dist)."
        )
    return ranks


def read_legacy(path: str) -> MegatronCheckpoint:
    """Every rank file of a --ckpt-format torch iteration directory: one model state dict per rank
    (`model`), or one per virtual pipeline stage (`model0`, `model1`, ...); each chunk numbers its
    layers from 0 and each EP rank its experts from 0."""
    dirs = _rank_files(path)
    if not dirs:
        raise CheckpointError(f"{path} holds no mp_rank_*/{RANK_FILE}.")
    first_file = next(iter(dirs.values()))[1]
    first = load_pickle(first_file, first_file)
    ranks = _grid(path, dirs, first.get("args"))
    ckpt = MegatronCheckpoint("torch", path, {k: v for k, v in first.items() if not k.startswith("model")})
    args = ckpt.args
    pp, vp = max(p for _, p, _ in ranks) + 1, getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    ep = max(e for _, _, e in ranks) + 1
    experts = (getattr(args, "num_experts", None) or 0) // ep
    chunk_layers = _chunk_layers(args, pp, vp, path)
    offsets = _offsets(chunk_layers, pp, vp)
    tp = max(t for t, _, _ in ranks) + 1
    for (t, p, e), file in sorted(ranks.items(), key=lambda item: (item[0][1], item[0][2], item[0][0])):
        data = first if file == first_file else load_pickle(file, file)
        for c, model in enumerate(_chunks(data, vp, file)):
            layers = (offsets[(p, c)], chunk_layers[(p, c)])
            for name, value in model.items():
                name = _legacy_name(name, layers, (e * experts, experts), file)
                if name.endswith("_extra_state"):
                    ckpt.objects.add(name)
                elif not torch.is_tensor(value):
                    raise CheckpointError(f"{file} holds {name} as a {type(value).__name__}, not a tensor.")
                else:
                    ckpt.shards.setdefault(name, {}).setdefault((p, c, e), [None] * tp)[t] = value
    ckpt.shards = {name: _one_place(name, by_place, path) for name, by_place in ckpt.shards.items()}
    return ckpt


def _chunks(data: dict, vp: int, file: str) -> list:
    if vp == 1 and "model" in data:
        return [data["model"]]
    names = [f"model{c}" for c in range(vp)]
    if vp == 1 or "model" in data or any(name not in data for name in names):
        held = ", ".join(sorted(k for k in data if k.startswith("model"))) or "no model"
        raise CheckpointError(
            f"{file} holds {held} but its args' --virtual-pipeline-model-parallel-size {vp if vp > 1 else None} "
            f"needs {', '.join(names) if vp > 1 else 'model'}."
        )
    return [data[name] for name in names]


def _one_place(name: str, by_place: dict, path: str) -> list:
    """The TP shards of one tensor. It lives on one pipeline stage and virtual stage (the output
    layer's tied copy of the embedding on the last stage aside); a dense tensor is on every EP rank
    (all equal), an expert on its own."""
    places = sorted({(p, c) for p, c, _ in by_place})
    if len(places) > 1 and name != "embedding.word_embeddings.weight":
        raise CheckpointError(f"{path} holds {name} on several pipeline stages.")
    copies = [shards for (p, c, _), shards in sorted(by_place.items()) if (p, c) == places[0]]
    if any(s is None for shards in copies for s in shards):
        raise CheckpointError(f"{path} lacks {name} on some tensor-parallel ranks.")
    if any(not torch.equal(a, b) for other in copies[1:] for a, b in zip(copies[0], other)):
        raise CheckpointError(f"{path} holds {name} differently on its expert-parallel ranks.")
    return copies[0]


def _chunk_layers(args, pp: int, vp: int, path: str) -> dict:
    """{(pp rank, virtual stage): layers} as megatron-core's get_transformer_layer_offset lays them
    out: --decoder-first/last-pipeline-num-layers on the first / last stage, the rest evenly over the
    others, each stage's split evenly over its virtual stages."""
    if getattr(args, "pipeline_model_parallel_layout", None):
        raise CheckpointError(f"{path} was saved with --pipeline-model-parallel-layout: not supported yet.")
    layers = getattr(args, "num_layers", None)
    if not isinstance(layers, int):
        raise CheckpointError(f"{path} has no num_layers in its args: not a GPT checkpoint of Megatron-LM.")
    first = getattr(args, "decoder_first_pipeline_num_layers", None) if pp > 1 else None
    last = getattr(args, "decoder_last_pipeline_num_layers", None) if pp > 1 else None
    middle = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise CheckpointError(f"{path}'s args cannot split {layers} layers over {pp} pipeline stages.")
    stage = [rest // middle if middle else 0] * pp
    if first is not None:
        stage[0] = first
    if last is not None:
        stage[-1] = last
    if any(n % vp for n in stage):
        raise CheckpointError(f"{path}'s args give stages of {stage} layers, not multiples of {vp} virtual stages.")
    return {(p, c): stage[p] // vp for p in range(pp) for c in range(vp)}


def _offsets(chunk_layers: dict, pp: int, vp: int) -> dict:
    """The first global layer of each (pp rank, virtual stage): layers go virtual stage by virtual
    stage, each over the pipeline ranks in order."""
    out, n = {}, 0
    for c in range(vp):
        for p in range(pp):
            out[(p, c)], n = n, n + chunk_layers[(p, c)]
    return out


_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")  # TEGroupedMLP's


def _legacy_name(name: str, layers: tuple, experts: tuple, file: str) -> str:
    """A chunk's entry under global layer and expert numbers and the local spec's names."""
    if not name.startswith(_LAYERS):
        return name
    index, _, rest = name[len(_LAYERS) :].partition(".")
    if not index.isdigit():
        return name
    offset, count = layers
    if int(index) >= count:
        raise CheckpointError(f"{file} holds layer {index} of a pipeline stage its args give {count} layers.")
    rest = _TE_NORMS.get(rest, rest)
    local = _LOCAL_EXPERT.match(rest) or _TE_GROUPED.match(rest)
    if local:
        j = int(local[1] if local.re is _LOCAL_EXPERT else local[3])
        if j >= experts[1]:
            raise CheckpointError(f"{file} holds expert {j} of an expert-parallel rank its args give {experts[1]}.")
        tail = local[2] if local.re is _LOCAL_EXPERT else f"{local[1]}.{local[2]}"
        rest = f"mlp.experts.local_experts.{experts[0] + j}.{tail}"
    elif rest.startswith(("mlp.experts.weight1", "mlp.experts.weight2")):
        raise CheckpointError(
            f"{file} holds megatron-core's legacy GroupedMLP weights (--moe-use-legacy-grouped-gemm): not supported."
        )
    return f"{_LAYERS}{int(index) + offset}.{rest}"


# ---- --ckpt-format torch_dist -------------------------------------------------------------------


_NOT_MODEL = ("optimizer.", "chained_", "rng_state", "rerun_state")  # (chained_<i>.optimizer.*: a prefixed one)


def read_torch_dist(path: str, state: str | None = None) -> MegatronCheckpoint:
    """The tensors of a torch_dist directory (plain torch.distributed.checkpoint, one process): the
    model's, or with `state` the entries "<state><model key>" (an optimizer's model-space state,
    "optimizer.state.exp_avg."), under the model's keys and unstacked as the model's."""
    metadata = _dist_metadata(path)
    entries = metadata.state_dict_metadata
    common = _dist_common(path, metadata)
    ckpt = MegatronCheckpoint("torch_dist", path, common)
    tensors, present = {}, {}
    for key, entry in entries.items():
        if not hasattr(entry, "size"):  # BytesStorageMetadata: a pickled object
            if key.split("/")[0] != "common_state" and state is None and not key.startswith(_NOT_MODEL):
                ckpt.objects.add(key.split("/")[0])  # (the optimizer's, RNG and rerun state objects: not the model's)
            continue
        if key.startswith(_NOT_MODEL) if state is None else not key.startswith(state):
            continue  # optimizer state: megatron_optim.py reads it where the layout allows
        name = key if state is None else key[len(state) :]
        tensors[key] = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
        present[key] = (name, _layers_present(name, entry, path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            safe_dcp.load(tensors, path, allow_objects=True, no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP wraps any reader error
        raise CheckpointError(f"checkpoint {path} cannot be read ({_first_line(err)}); it is damaged.") from None
    for key, value in tensors.items():
        name, layers = present[key]
        _unstack(ckpt.tensors, name, value, layers, path)
    return ckpt


def _layers_present(key: str, entry, path: str):
    """The layers a stacked entry [L, ...] holds, each whole (None for an entry that is not stacked,
    which must be whole): DCP would leave a region no chunk covers as zeros."""
    size = tuple(entry.size)
    stacked = key.startswith(_LAYERS) and not key[len(_LAYERS) :].partition(".")[0].isdigit() and size
    per_layer = math.prod(size[1:]) if stacked else math.prod(size)
    covered = [0] * (size[0] if stacked else 1)
    for chunk in entry.chunks:
        first, count = (chunk.offsets[0], chunk.sizes[0]) if stacked else (0, 1)
        volume = math.prod(chunk.sizes[1:]) if stacked else math.prod(chunk.sizes)
        for i in range(first, min(first + count, len(covered))):
            covered[i] += volume
    if any(n != per_layer for n in covered):
        where = f" for layer {next(i for i, n in enumerate(covered) if n != per_layer)}" if stacked else ""
        raise CheckpointError(f"{path} holds only part of {key}{where}: a shard is missing.")
    return list(range(size[0])) if stacked else None


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


_DIST_EXPERTS = "mlp.experts.experts."  # SequentialMLP's and (TE)GroupedMLP's [(L,) E, ...] entries


def _unstack(out: dict, key: str, value: torch.Tensor, layers, path: str) -> None:
    """torch_dist's layer entries -> one per global layer (and expert), under the local names. Layers
    are stacked on a leading [L] axis (decoder.layers.<name>), or keyed one by one
    (decoder.layers.<i>.<name>: megatron-core's non-homogeneous layers, such as dense and MoE ones
    mixed); experts on the next axis. A norm under both Transformer Engine's fused name and its own
    (an MoE layer of an export, for either spec) must hold the same values."""
    head = key[len(_LAYERS) :] if key.startswith(_LAYERS) else None
    if head is None or "." not in head:
        out[key] = value
        return
    index, _, rest = head.partition(".")
    slabs = {int(index): value} if index.isdigit() else {i: value[i] for i in layers}
    rest = rest if index.isdigit() else head
    rest = _TE_NORMS.get(rest, rest)
    for i, slab in slabs.items():
        if rest.startswith(_DIST_EXPERTS):
            tail = rest[len(_DIST_EXPERTS) :]
            items = {f"mlp.experts.local_experts.{e}.{tail}": slab[e] for e in range(slab.shape[0])}
        else:
            items = {rest: slab}
        for name, t in items.items():
            name = f"{_LAYERS}{i}.{name}"
            if name in out and not torch.equal(out[name], t):
                raise CheckpointError(f"{path} holds {name} twice, with different values.")
            out[name] = t

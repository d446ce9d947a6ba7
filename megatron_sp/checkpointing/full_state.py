"""Whole (unsharded) model state <-> checkpoint directories, in one process (the conversion tools).

read_full_state(path)                          -> (ReferenceGPT state dict, metadata.json dict), read
                                               with the trainer's checks (paths.verified_metadata:
                                               schema, sizes, sha256) and the tensors' shapes checked
                                               against the saved config before anything is built
write_full_checkpoint(state, cfg, save, source)   iteration 0 of `save`, the model only (no optimizer
                                               state), written by checkpointer.save as a training run
                                               writes one: pretrain_gpt_sp.py --load (--finetune)
                                               reads it at any TP
"""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings

import torch

from megatron_sp.checkpointing import checkpointer, files, locks, safe_dcp
from megatron_sp.checkpointing.canonical import canonical_to_full, full_to_canonical
from megatron_sp.checkpointing.paths import (
    LATEST,
    CheckpointError,
    checkpoint_dir,
    read_latest,
    verified_metadata,
)
from megatron_sp.checkpointing.states import TrainState, kept_buffers
from megatron_sp.config import GPTConfig, config_from_dict


def _meta_model(cfg: GPTConfig):
    """A shape-only serial ReferenceGPT of a config (the meta device: nothing allocated)."""
    from megatron_sp.models.reference import ReferenceGPT

    with torch.device("meta"):
        return ReferenceGPT(config_from_dict(dataclasses.asdict(cfg)), initialise=False)


def model_specs(cfg: GPTConfig, model=None) -> dict:
    """Each parameter's ShardSpec for a config."""
    model = model if model is not None else _meta_model(cfg)
    return {name: p.shard_spec for name, p in model.named_parameters()}


def checkpoint_path(root: str, iteration=None) -> str:
    """iter_N of a --save directory: the given iteration or the latest (inside root, not a link out)."""
    if not os.path.isdir(root):
        raise CheckpointError(f"{root} is not a checkpoint directory (the one holding {LATEST}).")
    it = iteration if iteration is not None else read_latest(root)
    if it is None:
        raise CheckpointError(f"{root} holds no checkpoint ({LATEST} missing).")
    path = checkpoint_dir(root, it)
    if not os.path.isdir(path):
        raise CheckpointError(f"{root} holds no checkpoint of iteration {it} ({path} missing).")
    if not files.inside(root, path):
        raise CheckpointError(f"checkpoint {path} is a link that leads outside {root}; copy it in instead.")
    return path


def read_full_state(path: str) -> tuple[dict, dict]:
    """All model tensors of one checkpoint directory in ReferenceGPT layout, and its metadata; the
    checkpoint checked as the trainer checks it, its tensors against its config before allocation.
    Read under a shared lock (locks.py), so its run's --save-retain-interval does not remove it meanwhile."""
    reading = locks.Reading(path)
    reading.acquire()  # not held (a damaged or missing metadata.json): the checks below say what is wrong
    try:
        return _read_full_state(path)
    finally:
        reading.release()


def _read_full_state(path: str) -> tuple[dict, dict]:
    metadata = verified_metadata(path)
    cfg = saved_config(metadata, path)
    try:
        stored = safe_dcp.read_metadata(path).state_dict_metadata
    except safe_dcp.UnsafeCheckpointError as err:
        raise CheckpointError(f"{err}; megatron_sp loads only the checkpoints it writes.") from None
    shapes = {k[len("model.") :]: tuple(md.size) for k, md in stored.items() if k.startswith("model.")}
    specs = check_shapes(shapes, cfg, path)
    state = {
        "model": {k: torch.zeros(shape, dtype=stored[f"model.{k}"].properties.dtype) for k, shape in shapes.items()}
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            safe_dcp.load(state, path, no_dist=True)
    except (Exception, checkpointer._checkpoint_exception()) as err:  # noqa: BLE001 - DCP wraps any reader error
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({checkpointer._root_cause(err)}); it is damaged: "
            f"load an earlier iteration."
        ) from None
    return canonical_to_full(state["model"], specs), metadata


def saved_config(metadata: dict, path: str) -> GPTConfig:
    """The serial GPTConfig a checkpoint's metadata.json holds (CheckpointError if it builds none)."""
    try:
        return config_from_dict(metadata["config"])
    except (TypeError, ValueError, OverflowError) as err:
        raise CheckpointError(f"checkpoint {path} holds a model config this version cannot build ({err}).") from None


def check_layers(names, cfg: GPTConfig, source: str) -> GPTConfig:
    """The layers.<i> of a whole state's names are those of cfg: checked before anything is built,
    so that a config claiming 10^5 layers costs nothing."""
    layers = {int(k.split(".")[1]) for k in names if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if len(layers) != cfg.num_layers or not all(0 <= i < cfg.num_layers for i in layers):  # = range(L)
        raise CheckpointError(
            f"{source} has a config of {cfg.num_layers} layers but tensors of {len(layers)}; "
            f"its config does not describe its tensors."
        )
    return cfg


def _describe(t) -> str:
    return "nothing" if t is None else f"{list(t.shape)} {t.dtype}"


def _check_new_run(save: str) -> None:
    """A converted model starts a new run: a --save holding one is refused (its marker would be reset)."""
    if os.path.lexists(save) and not os.path.isdir(save):
        raise CheckpointError(f"--save {save} is a file; pass a directory for the checkpoint.")
    runs = [p for p in glob.glob(os.path.join(glob.escape(save), "iter_*")) if not p.endswith(".tmp")]
    if os.path.lexists(os.path.join(save, LATEST)) or runs:
        raise CheckpointError(
            f"--save {save} already holds a run ({LATEST} or iter_N); converting into it would reset "
            f"it: choose a new directory."
        )


def check_shapes(shapes: dict, cfg: GPTConfig, path: str) -> dict:
    """The canonical entries' shapes (name -> shape) against those of model `cfg`; returns its specs.
    The layer count is compared first, so that a config claiming 10^5 layers builds nothing."""
    model = _meta_model(check_layers(shapes, cfg, f"checkpoint {path}"))
    specs = model_specs(cfg, model)
    expected = _flat(full_to_canonical(dict(model.named_parameters()), specs))
    expected.update({name: tuple(b.shape) for name, b in kept_buffers(model)})  # the expert biases
    for name in sorted(set(expected) | set(shapes)):
        want, got = expected.get(name), shapes.get(name)
        if want != got:
            raise CheckpointError(
                f"checkpoint {path} holds model.{name} of shape {list(got) if got else 'none'} but its config "
                f"needs {list(want) if want else 'none'}; its metadata.json does not describe its tensors."
            )
    return specs


def _flat(entries: dict) -> dict:
    """Canonical entries (segments nested) -> {"name" or "name.segment<i>": shape}."""
    out = {}
    for name, value in entries.items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": tuple(v.shape) for k, v in value.items()})
        else:
            out[name] = tuple(value.shape)
    return out


class _CanonicalEntries:
    """A tensor state (states.py) that already is canonical entries: a whole model at TP=1."""

    label = "model"

    def __init__(self, entries: dict):
        self.entries = entries

    def state_dict(self) -> dict:
        return self.entries

    def load_target(self) -> dict:
        return self.entries

    def load_state_dict(self, loaded: dict) -> None:
        self.entries = loaded


def write_full_checkpoint(state: dict, cfg: GPTConfig, save: str, source: str) -> str:
    """Writes `state` (ReferenceGPT keys) of model `cfg` as iteration 0 of `save`; returns the
    checkpoint directory. The metadata holds every GPTConfig field resolved (family defaults filled
    in), as a training run's checkpoint does, so that a resume compares like with like."""
    from megatron_sp.parallel_state import ParallelState

    cfg = config_from_dict(dataclasses.asdict(cfg))  # serial: TP = CP = 1
    _check_new_run(save)
    model = _meta_model(check_layers(state, cfg, source))
    for name, p in model.named_parameters():
        if name not in state or tuple(state[name].shape) != tuple(p.shape) or not state[name].is_floating_point():
            got = state.get(name)
            raise CheckpointError(
                f"{source} holds {name} as {_describe(got)} but the model needs {list(p.shape)} floating point."
            )
    params = {name for name, _ in model.named_parameters()}
    buffers = dict(kept_buffers(model))  # the routers' expert biases: kept as they are, as a run saves them
    extra = sorted(set(state) - params - set(buffers))
    if extra:
        raise CheckpointError(f"{source} holds {extra[0]}, which the model has no place for.")
    entries = full_to_canonical({k: state[k].float() for k in params}, model_specs(cfg, model))
    entries.update({name: state[name].float() if name in state else b.clone() for name, b in buffers.items()})
    states = {"model": _CanonicalEntries(entries), "train_state": TrainState(), "loss_scale": None}
    extra = {"converted_from": os.path.abspath(source)}
    return checkpointer.save(save, states, cfg, ParallelState(), log=lambda message: None, extra=extra)

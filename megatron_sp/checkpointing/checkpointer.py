"""Checkpoints in torch.distributed.checkpoint (DCP) format that load at any TP size.

Layout of --save DIR:
    DIR/iter_0000010/            one checkpoint: DCP shards (*.distcp, .metadata), rng_rank*.pt,
                                 metadata.json (config, TP/DP sizes, iteration, tokens seen)
    DIR/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint

Atomicity: a checkpoint is written into `iter_N.tmp` and renamed to `iter_N` only after every rank
has finished; the `latest` marker is replaced (os.replace) last. A process killed during a save
leaves the previous checkpoint and marker untouched; a save that fails (disk full) removes its
`iter_N.tmp` and stops the run with CheckpointSaveError.

Loading is safe (safe_dcp.py: nothing in a checkpoint is unpickled beyond DCP's own metadata
classes) and agreed: rank 0 reads the marker and broadcasts the iteration, every rank checks that
it sees the same metadata.json (which records the size and sha256 of every file) before reading
tensors, and that all ranks restored the same training state afterwards. Path checks that need
no process group are in paths.py.

Resharding: each TP-sharded tensor is stored as its slice of one canonical global tensor (see
canonical.py), declared to DCP with its global offsets (a ShardedTensor), so DCP reads back any
other slicing: save at TP=2, load at TP=1 or TP=4. Replicated tensors are plain tensors (DCP
writes one copy). Data-parallel replicas declare the same slices; DCP de-duplicates them.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_sp.checkpointing import safe_dcp
from megatron_sp.checkpointing.canonical import empty_dcp_target, from_canonical_local, to_dcp_tensor
from megatron_sp.checkpointing.paths import (  # noqa: F401 - re-exported: tools and tests use them
    LATEST,
    METADATA_JSON,
    CheckpointError,
    check_files_present,
    check_save_dir,
    checkpoint_dir,
    locate,
    read_latest,
    read_metadata_json,
    same_path,
)
from megatron_sp.config import config_from_dict
from megatron_sp.fields import mismatch
from megatron_sp.training import failures
from megatron_sp.training.optimizer import local_optimizer, owned_parameters


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, directory gone): a runtime fault, one sentence."""


def _dcp():
    """torch.distributed.checkpoint, its reading made safe (safe_dcp.py): use it for every load."""
    return safe_dcp.safe_module()


def _checkpoint_exception():
    """DCP's CheckpointException (a BaseException: `except Exception` does not catch it)."""
    _dcp()
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


# ---- state dicts -------------------------------------------------------------------------------


def _model_items(trainer):
    ps = trainer.ps
    for name, p in trainer.model.named_parameters():
        yield name, p, ps


def build_state(trainer, with_optim: bool):
    """The DCP state dict of this rank: model (and optimizer) tensors in canonical layout. With the
    distributed optimizer a rank writes the AdamW state of the parameters it owns; the entries are
    the same as the replicated optimizer's, so either kind of run, at any layout, reads them."""
    state = {"model": {}, "optim": {}}
    owned = owned_parameters(trainer.optimizer) if with_optim else set()
    for name, p, ps in _model_items(trainer):
        state["model"][name] = to_dcp_tensor(p.detach(), p, ps)
        if id(p) in owned:
            st = local_optimizer(trainer.optimizer).state.get(p, {})
            state["optim"][name] = {
                "exp_avg": to_dcp_tensor(st.get("exp_avg", torch.zeros_like(p)), p, ps),
                "exp_avg_sq": to_dcp_tensor(st.get("exp_avg_sq", torch.zeros_like(p)), p, ps),
                "step": torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).cpu().clone(),
            }
    if not with_optim:
        del state["optim"]
    return state


def _target_state(trainer, with_optim: bool):
    """Empty tensors shaped like this rank's slices, for DCP to fill."""
    state = {"model": {n: empty_dcp_target(p, ps) for n, p, ps in _model_items(trainer)}}
    if with_optim:
        owned = owned_parameters(trainer.optimizer)
        state["optim"] = {
            n: {
                "exp_avg": empty_dcp_target(p, ps),
                "exp_avg_sq": empty_dcp_target(p, ps),
                "step": torch.zeros((), dtype=torch.float32),
            }
            for n, p, ps in _model_items(trainer)
            if id(p) in owned
        }
    return state


# ---- start-up checks ---------------------------------------------------------------------------


def check_inputs(args, cfg) -> None:
    """What --load and --save need, checked on every rank before the model is built (no collectives):
    the checkpoint to resume from (path, marker, metadata.json, model flags, file sizes) and a
    writable --save with room for one more checkpoint."""
    if args.load:
        iteration = locate(args.load, is_save_dir=same_path(args.load, args.save))
        if iteration is not None:
            path = checkpoint_dir(args.load, iteration)
            meta = read_metadata_json(path)
            _check_compatible(meta, cfg, path)
            check_files_present(path, meta)
    if args.save:
        check_save_dir(args.save, checkpoint_bytes(cfg))


def checkpoint_bytes(cfg) -> int:
    """About one checkpoint's size: fp32 weights and two AdamW moments per parameter."""
    return 3 * 4 * cfg.num_parameters()


# ---- save --------------------------------------------------------------------------------------


def save(args, trainer) -> str:
    """Collective. Writes iter_N atomically and then moves the latest marker to it."""
    root, it = args.save, trainer.state.iteration
    final, tmp = checkpoint_dir(root, it), checkpoint_dir(root, it) + ".tmp"
    try:
        _write(args, trainer, tmp)
        if _rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_text_atomic(os.path.join(root, LATEST), str(it))
    except (OSError, _checkpoint_exception()) as err:
        reason = _save_failure(err, root, checkpoint_bytes(trainer.cfg))
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back
        raise CheckpointSaveError(
            f"saving iteration {it} to {root} failed on rank {_rank()} ({reason}); the previous "
            f"checkpoint and {LATEST} are intact: free space or fix --save, then resume."
        ) from None
    _barrier()
    trainer.log.info(f" saved checkpoint at iteration {it} to {final}")
    return final


def _write(args, trainer, tmp) -> None:
    """Every rank's shards and RNG state, then metadata.json with the integrity record (rank 0)."""
    if _rank() == 0:
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a killed save
        os.makedirs(tmp)
    _barrier()
    state = build_state(trainer, with_optim=True)
    with warnings.catch_warnings():  # DCP warns that a single process saves without a process group
        warnings.simplefilter("ignore")
        _dcp().save(state, checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{_rank()}.pt"))
    files = safe_dcp.integrity_record(tmp)
    if _rank() == 0:
        _write_json(os.path.join(tmp, METADATA_JSON), {**_metadata(args, trainer), "files": files})
    _barrier()


def _save_failure(err, root, needed: int) -> str:
    """Why a save failed, in words: torch.save reports a full disk as 'unexpected pos 704 vs 598'."""
    reason = _root_cause(err)
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return reason
    if getattr(err, "errno", None) == errno.ENOSPC or free < needed:
        return f"No space left on device: {free / 1e6:.1f} MB free, a checkpoint needs about {needed / 1e6:.1f} MB"
    return reason


def _root_cause(err) -> str:
    """The first rank's OSError inside DCP's CheckpointException, as 'No space left on device'."""
    for failure in getattr(err, "failures", {}).values():
        err = failure[0] if isinstance(failure, tuple) else failure
        break
    return getattr(err, "strerror", None) or failures.one_sentence(err)


def _metadata(args, trainer) -> dict:
    return {
        "iteration": trainer.state.iteration,
        "train_state": asdict(trainer.state),
        "tokens_seen": trainer.state.consumed_train_samples * args.seq_length,
        "tensor_model_parallel_size": trainer.ps.tp_size,
        "data_parallel_size": trainer.ps.dp_size,
        "sequence_parallel": trainer.cfg.sequence_parallel,
        "config": asdict(trainer.cfg),
        "loss_scale": trainer.scaler.state_dict() if trainer.scaler else None,
        "format": "megatron_sp-dcp-1",
    }


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def _write_text_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state():
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# ---- load --------------------------------------------------------------------------------------


def load(args, trainer) -> None:
    """Collective. Restores model, optimizer, LR schedule position, RNG and data position from the
    latest checkpoint in --load (weights only with --finetune); every rank loads the same one."""
    iteration = _agreed_iteration(args)
    if iteration is None:
        trainer.log.info(f" no checkpoint in {args.load} (also --save): starting from scratch")
        return
    path = checkpoint_dir(args.load, iteration)
    meta = _collectively(read_metadata_json, path)
    _check_same_everywhere(path, meta)
    _check_compatible(meta, trainer.cfg, path)
    _collectively(check_files_present, path, meta)
    _verify_digests(path, meta)
    with_optim = not (args.finetune or args.no_load_optim)
    if with_optim and not _collectively(_has_optimizer_state, path):
        trainer.log.info(f" {path} holds no optimizer state (converted weights?): the optimizer starts fresh")
        with_optim = False
    state = _target_state(trainer, with_optim)
    _read_tensors(state, path)
    _restore_model(trainer, state["model"])
    if with_optim:
        _restore_optim(trainer, state["optim"])
    if not args.finetune:
        trainer.state = TrainState(**meta["train_state"])
        if trainer.scaler and meta.get("loss_scale"):
            trainer.scaler.load_state_dict(meta["loss_scale"])
        rng = None if args.no_load_rng else _collectively(_read_rng, path)
        if rng is not None:
            _restore_rng(rng)
    _check_same_everywhere(path, asdict(trainer.state), what="restored training state")
    trainer.log.info(
        f" loaded checkpoint {path} (saved at TP={meta['tensor_model_parallel_size']}, "
        f"iteration {meta['iteration']}){' for finetuning' if args.finetune else ''}"
    )


def _agreed_iteration(args):
    """Collective: rank 0 reads the marker and decides; every rank gets its answer (or its error)."""
    answer = [None, None]
    if _rank() == 0:
        try:
            answer[0] = locate(args.load, is_save_dir=same_path(args.load, args.save))
        except CheckpointError as err:
            answer[1] = str(err)
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    if answer[1]:
        raise CheckpointError(answer[1])
    return answer[0]


def _collectively(fn, *args):
    """fn(*args) on every rank; if it fails on any rank, every rank raises that rank's CheckpointError."""
    result, error = None, None
    try:
        result = fn(*args)
    except CheckpointError as err:
        error = str(err)
    except safe_dcp.UnsafeCheckpointError as err:
        error = f"{err}; megatron_sp loads only the checkpoints it writes."
    except OSError as err:
        error = f"{getattr(err, 'filename', None) or args[0]} cannot be read ({err.strerror or err})."
    failure = failures.agree(error)
    if failure:
        raise CheckpointError(failure[1])
    return result


def _check_same_everywhere(path, value, what="metadata.json"):
    """Collective: every rank holds the same `value` (a JSON-able dict), or all raise."""
    if not dist.is_initialized():
        return
    digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, digest)
    differ = [rank for rank, view in enumerate(views) if view != views[0]]
    if differ:
        raise CheckpointError(
            f"ranks {differ} see a different {what} of {path} than rank 0; --load must be one "
            f"directory that every node reads the same (a shared file system)."
        )


def _verify_digests(path, meta) -> None:
    """Collective: the files' sha256 against the record, each rank hashing its share, before unpickling."""
    record = sorted((meta.get("files") or {}).items())
    world = dist.get_world_size() if dist.is_initialized() else 1
    problem = safe_dcp.check_digests(path, record[_rank() :: world])
    failure = failures.agree(problem)
    if failure:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {failure[1]}; load an earlier iteration by "
            f"writing its number into {LATEST}."
        )


def _read_tensors(state, path) -> None:
    try:
        safe_dcp.load(state, path, no_dist=not dist.is_initialized())
    except (Exception, _checkpoint_exception()) as err:  # noqa: BLE001 - DCP wraps any reader error
        if failures.is_collective_failure(err):  # a peer died while reading: not the files' fault
            raise
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({_root_cause(err)}); it is damaged or not "
            f"a megatron_sp checkpoint: load an earlier iteration."
        ) from None


def _has_optimizer_state(path) -> bool:
    return any(key.startswith("optim.") for key in safe_dcp.read_metadata(path).state_dict_metadata)


def _read_rng(path):
    """This rank's RNG state (weights_only: tensors and plain containers only), or None if not saved."""
    file = os.path.join(path, f"rng_rank{_rank()}.pt")
    if not os.path.exists(file):
        return None
    try:
        state = torch.load(file, weights_only=True)
        ok = (
            isinstance(state, dict)
            and isinstance(state.get("torch"), torch.Tensor)
            and state["torch"].dtype == torch.uint8
            and state["torch"].shape == torch.get_rng_state().shape
        )
    except Exception as err:  # noqa: BLE001 - truncated zip, foreign pickle, ...: all mean "not ours"
        ok, state = False, failures.one_sentence(err)
    if not ok:
        raise CheckpointError(
            f"{file} is not a readable RNG state; resume with --no-load-rng or from an earlier iteration."
        )
    return state


def _check_compatible(meta, cfg, path):
    """The model against the checkpoint's on every field with a resume rule (config.py's table); a
    field the checkpoint lacks takes its default, resolved as GPTConfig resolves it for the saved shape."""
    try:
        saved = config_from_dict(meta["config"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path} holds a model config this version cannot build ({failures.one_sentence(err)})."
        ) from None
    name = mismatch(dataclasses.fields(cfg), cfg, saved)
    if name is not None:
        raise CheckpointError(
            f"checkpoint {path} has {name}={getattr(saved, name)} but the model has "
            f"{getattr(cfg, name)}; use the same model flags as the saved run."
        )


@torch.no_grad()
def _restore_model(trainer, tensors):
    for name, p, ps in _model_items(trainer):
        p.copy_(from_canonical_local(tensors[name], p, ps))


@torch.no_grad()
def _restore_optim(trainer, tensors):
    optimizer = local_optimizer(trainer.optimizer)
    fused = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    for name, p, ps in _model_items(trainer):
        if name not in tensors:  # distributed optimizer: another rank's parameter
            continue
        saved = tensors[name]
        step_device = p.device if fused else "cpu"
        optimizer.state[p] = {
            "step": saved["step"].to(step_device),
            "exp_avg": from_canonical_local(saved["exp_avg"], p, ps).to(p.dtype),
            "exp_avg_sq": from_canonical_local(saved["exp_avg_sq"], p, ps).to(p.dtype),
        }


def _restore_rng(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

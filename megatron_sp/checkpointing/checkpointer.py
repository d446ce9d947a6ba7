"""Checkpoints in torch.distributed.checkpoint (DCP) format that load at any TP size, of the states a
run gives (states.py: model, optimizer, train state, loss scaler, RNG; torchtitan's checkpointer
takes its `states={...}` the same way): `save(root, states, cfg, ps)`, `load(root, states, cfg)`.

Layout of --save DIR:
    DIR/iter_0000010/            one checkpoint: DCP shards (*.distcp, .metadata) of the tensor states,
                                 <key>_rank<r>.pt of the per-rank states (rng_rank*.pt), metadata.json
                                 (metadata.py: config, layout, iteration, JSON states, integrity record)
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

import torch
import torch.distributed as dist

from megatron_sp import failures, heartbeat
from megatron_sp.checkpointing import async_save as async_save_module
from megatron_sp.checkpointing import files, locks, metadata, safe_dcp
from megatron_sp.checkpointing.paths import (
    LATEST,
    CheckpointError,
    check_files_present,
    check_save_dir,
    checkpoint_dir,
    damaged,
    digest_problem,
    drop_unretained,
    locate,
    read_metadata_json,
    same_path,
    write_latest,
)
from megatron_sp.config import config_from_dict
from megatron_sp.fields import mismatch


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


def _kinds(states: dict) -> tuple[dict, dict, dict]:
    """(tensor, per-rank, JSON) states, as states.py's protocol tells them apart (None: JSON null)."""
    tensors = {k: s for k, s in states.items() if hasattr(s, "load_target")}
    per_rank = {k: s for k, s in states.items() if getattr(s, "per_rank", False)}
    rest = {k: s for k, s in states.items() if k not in tensors and k not in per_rank}
    return tensors, per_rank, rest


def _label(key, state) -> str:
    return getattr(state, "label", key)


def _rank_file(path, key) -> str:
    return os.path.join(path, f"{key}_rank{_rank()}.pt")


# ---- start-up checks ---------------------------------------------------------------------------


def check_inputs(load_dir, save_dir, cfg) -> None:
    """What --load and --save need, checked on every rank before the model is built (no collectives):
    the checkpoint to resume from (path, marker, metadata.json, model flags, file sizes) and a
    writable --save with room for one more checkpoint."""
    if load_dir:
        iteration = locate(load_dir, is_save_dir=same_path(load_dir, save_dir))
        if iteration is not None:
            path = checkpoint_dir(load_dir, iteration)
            meta = read_metadata_json(path)
            _check_compatible(meta, cfg, path)
            check_files_present(path, meta)
    if save_dir:
        check_save_dir(save_dir, checkpoint_bytes(cfg))


def checkpoint_bytes(cfg) -> int:
    """About one checkpoint's size: fp32 weights and two AdamW moments per parameter."""
    return 3 * 4 * cfg.num_parameters()


# ---- save --------------------------------------------------------------------------------------


def save(root: str, states: dict, cfg, ps, log=print, extra=None, async_save=False, retain_interval=None) -> str:
    """Collective. Writes `states` (states["train_state"] says the iteration) as iter_N of `root`,
    atomically, and then moves the latest marker to it. extra: more metadata.json entries (tools).
    async_save (--async-save): the shards are copied to memory now and written by a background thread;
    the record, the rename and the marker follow once every rank has written (`finalize_async_save`).
    retain_interval (--save-retain-interval): older checkpoints not at a multiple of it are deleted."""
    finalize_async_save(blocking=True)  # one save in flight at a time
    it = states["train_state"].iteration
    final, tmp = checkpoint_dir(root, it), checkpoint_dir(root, it) + ".tmp"
    job = _SaveJob(root, it, tmp, final, cfg, log, retain_interval)
    try:
        pending = _write(tmp, states, cfg, ps, extra or {}, async_save)
    except (OSError, _checkpoint_exception()) as err:
        job.fail(err)
    if pending is None:
        job.finish()
    else:
        job.future, job.meta = pending, pending.meta
        _PENDING.append(job)
        log(f" saving checkpoint at iteration {it} to {final} in the background")
    return final


_PENDING = []  # the one asynchronous save in flight, if any


class _SaveJob:
    """One save's ending: the integrity record, the rename, the marker (and the retain rule)."""

    def __init__(self, root, it, tmp, final, cfg, log, retain_interval):
        self.root, self.it, self.tmp, self.final, self.cfg, self.log = root, it, tmp, final, cfg, log
        self.retain_interval, self.future, self.meta = retain_interval, None, None

    def finish(self) -> None:
        """Collective: every rank has written its files."""
        try:
            if self.meta is not None:  # asynchronous: the record of the files now complete
                metadata.write(self.tmp, self.meta)
                _barrier()
            if _rank() == 0:
                files.remove_tree(self.final)
                os.replace(self.tmp, self.final)
                write_latest(self.root, self.it)
        except OSError as err:
            self.fail(err)
        _barrier()
        if self.retain_interval and _rank() == 0:
            drop_unretained(self.root, self.it, self.retain_interval)
        self.log(f" saved checkpoint at iteration {self.it} to {self.final}")

    def fail(self, err):
        reason = _save_failure(err, self.root, checkpoint_bytes(self.cfg))
        if dist.is_initialized() and "timed out" in reason.lower():  # the background save's peer hung or died
            named = heartbeat.describe(dist.get_world_size(), dist.get_rank())
            reason += f"; {named}" if named else ""
        if _rank() == 0:
            files.remove_tree(self.tmp)  # give the space back
        raise CheckpointSaveError(
            f"saving iteration {self.it} to {self.root} failed on rank {_rank()} ({reason}); the previous "
            f"checkpoint and {LATEST} are intact: free space or fix --save, then resume."
        ) from None


def finalize_async_save(blocking: bool = False) -> bool:
    """Collective. Ends the asynchronous save in flight once every rank's thread is done (blocking:
    waits for it). Returns True when none is left in flight."""
    if not _PENDING:
        return True
    job = _PENDING[0]
    if not blocking:
        done = torch.tensor([float(job.future.done())], device=_collective_device())
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 0:
            return False
    _PENDING.clear()
    try:
        job.future.result()
    except (OSError, _checkpoint_exception()) as err:
        job.fail(err)
    job.finish()
    return True


def wait_for_saves() -> None:
    """Collective: the asynchronous save in flight, finished (the end of a run)."""
    finalize_async_save(blocking=True)


def _collective_device():
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _write(tmp, states, cfg, ps, extra, async_save=False):
    """Every rank's shards and per-rank files, then metadata.json with the integrity record (rank 0).
    async_save: the shards are staged in memory and written by DCP's thread; returns the write in
    flight (with the metadata to record once it is done) instead of finishing."""
    if _rank() == 0:
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        files.remove_tree(tmp)  # leftovers of a killed save (or a planted link: removed, not followed)
        os.makedirs(tmp)
    _barrier()
    tensors, per_rank, rest = _kinds(states)
    state_dict = {k: s.state_dict() for k, s in tensors.items()}
    future = None
    with warnings.catch_warnings():  # DCP warns that a single process saves without a process group
        warnings.simplefilter("ignore")
        if async_save:
            future = async_save_module.background_save(async_save_module.snapshot(state_dict), tmp, _dcp())
        else:
            _dcp().save(state_dict, checkpoint_id=tmp)
    for key, state in per_rank.items():
        torch.save(state.state_dict(), _rank_file(tmp, key))
    entries = {k: (s.state_dict() if s is not None else None) for k, s in rest.items()}
    meta = {**metadata.describe(cfg, ps, entries.pop("train_state"), entries), **extra}
    if future is not None:
        return _Async(future, meta)
    metadata.write(tmp, meta)
    _barrier()
    return None


class _Async:
    """A DCP write in flight and the metadata.json to write when it is done."""

    def __init__(self, future, meta):
        self._future, self.meta = future, meta

    def done(self) -> bool:
        return self._future.done()

    def result(self):
        return self._future.result()


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


# ---- load --------------------------------------------------------------------------------------


def load(root: str, states: dict, cfg, is_save_dir: bool = False, log=print, strictness="assume_ok_unexpected"):
    """Collective. Restores `states` in place from the latest checkpoint in `root` (every rank loads
    the same one); a tensor state the checkpoint lacks (converted weights hold no optimizer state)
    keeps its value. Returns the checkpoint's metadata, or None when there is none to load (root
    missing or empty, allowed when it is also the save directory: is_save_dir). strictness
    (--dist-ckpt-strictness): entries of the checkpoint that the states do not ask for are ignored
    (assume_ok_*, ignore_all, return_*), logged (log_*) or refused (raise_*)."""
    iteration, reading = _reading_latest(root, is_save_dir)
    if iteration is None:
        log(f" no checkpoint in {root} (also --save): starting from scratch")
        return None
    try:
        return _load_from(checkpoint_dir(root, iteration), states, cfg, strictness, log)
    finally:
        reading.release()


READ_TRIES = 5


def _reading_latest(root, is_save_dir):
    """Collective: (the iteration to load, this rank's shared lock on it), once every rank holds the
    lock; a checkpoint retired by its run's --save-retain-interval between the marker and the lock is
    skipped for the marker's newer one (retention keeps the latest). When the marker still names the
    same iteration, nothing retired it: the checks that follow say what is wrong with its files."""
    previous = None
    for _ in range(READ_TRIES):
        iteration = _agreed_iteration(root, is_save_dir)
        if iteration is None:
            return None, None
        reading = locks.Reading(checkpoint_dir(root, iteration))
        if not failures.agree(None if reading.acquire() else "gone") or iteration == previous:
            return iteration, reading
        reading.release()
        previous = iteration
    raise CheckpointError(
        f"--load {root}: its latest checkpoint was removed {READ_TRIES} times while this run tried to read it; "
        "retry, or load a copy."
    )


def _load_from(path, states, cfg, strictness, log) -> dict:
    meta = _verified_metadata(path, cfg)
    tensors, per_rank, rest = _kinds(states)
    stored = _collectively(_stored_keys, path)
    for key, state in list(tensors.items()):
        if key not in stored:
            log(f" {path} holds no {_label(key, state)} (converted weights?): it starts fresh")
            del tensors[key]
    _load_tensors(tensors, path, strictness, log)
    for key, state in rest.items():
        if state is not None and meta.get(key) is not None:
            state.load_state_dict(meta[key])
    for key, state in per_rank.items():
        _collectively(_load_rank_file, path, key, state)
    _check_same_everywhere(
        path, {k: s.state_dict() for k, s in rest.items() if s is not None}, "restored training state"
    )
    return meta


def _verified_metadata(path, cfg) -> dict:
    """Collective: metadata.json, the same on every rank, of a model like cfg, every file of its
    record present and unchanged (sha256) before anything in it is unpickled."""
    meta = _collectively(read_metadata_json, path)
    _check_same_everywhere(path, meta)
    _check_compatible(meta, cfg, path)
    _collectively(check_files_present, path, meta)
    _verify_digests(path, meta)
    return meta


def _agreed_iteration(root, is_save_dir):
    """Collective: rank 0 reads the marker and decides; every rank gets its answer (or its error)."""
    answer = [None, None]
    if _rank() == 0:
        try:
            answer[0] = locate(root, is_save_dir=is_save_dir)
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
    world = dist.get_world_size() if dist.is_initialized() else 1
    failure = failures.agree(digest_problem(path, meta, _rank(), world))
    if failure:
        raise damaged(path, failure[1])


def _load_tensors(tensors: dict, path, strictness="assume_ok_unexpected", log=print) -> None:
    """DCP reads into each state's target (this rank's slices); then each state takes its tensors."""
    target = {k: s.load_target() for k, s in tensors.items()}
    if strictness.startswith(("log_", "raise_")):
        _report_unexpected(path, target, strictness, log)
    try:
        safe_dcp.load(target, path, no_dist=not dist.is_initialized())
    except (Exception, _checkpoint_exception()) as err:  # noqa: BLE001 - DCP wraps any reader error
        if failures.is_collective_failure(err):  # a peer died while reading: not the files' fault
            raise
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({_root_cause(err)}); it is damaged or not "
            f"a megatron_sp checkpoint: load an earlier iteration."
        ) from None
    for key, state in tensors.items():
        state.load_state_dict(target[key])


def _report_unexpected(path, target: dict, strictness: str, log) -> None:
    """The checkpoint's entries under the loaded states that `target` does not ask for."""
    wanted = set(_flat_keys(target))
    stored = {k for k in safe_dcp.read_metadata(path).state_dict_metadata if k.split(".")[0] in target}
    unexpected = sorted(stored - wanted)
    if not unexpected:
        return
    words = f"{path} holds {len(unexpected)} entries this model does not have (first: {unexpected[0]})"
    if strictness.startswith("raise_"):
        raise CheckpointError(f"{words}; load it with the model it was saved from, or --dist-ckpt-strictness log_all.")
    log(f" {words}: not loaded (--dist-ckpt-strictness {strictness})")


def _flat_keys(value, prefix=""):
    """DCP's flattened names of a nested state dict (dicts joined by '.')."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat_keys(item, f"{prefix}{key}.")
    else:
        yield prefix[:-1]


def _stored_keys(path) -> set:
    """The top-level keys of the tensor states a checkpoint holds ("model", "optim")."""
    return {key.split(".")[0] for key in safe_dcp.read_metadata(path).state_dict_metadata}


def _load_rank_file(path, key, state) -> None:
    """This rank's file of a per-rank state (weights_only: tensors and plain containers), if saved."""
    file = _rank_file(path, key)
    if not os.path.lexists(file):
        return
    problem = files.regular_file_problem(file, path)
    if problem:
        raise CheckpointError(f"{problem}; resume with --no-load-{key} or from an earlier iteration.")
    try:
        state.load_state_dict(torch.load(file, weights_only=True))
    except Exception:  # noqa: BLE001 - truncated zip, foreign pickle, wrong content: all mean "not ours"
        raise CheckpointError(
            f"{file} is not a readable {_label(key, state)}; resume with --no-load-{key} or from an earlier iteration."
        ) from None


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

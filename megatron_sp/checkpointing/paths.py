"""Where checkpoints live, and the checks on --load and --save that need no process group.

Run by every rank before the model is built (pretrain.check_inputs), so that a wrong path, a
garbled marker or metadata.json, a truncated file or an unwritable --save is one sentence at
start-up instead of a traceback or a silent start from scratch. What --load may be:

    --load DIR, DIR holds latest_checkpointed_iteration.txt   resume from the iteration it names
    --load DIR, DIR missing / empty / only a killed save's      start from scratch, but only when
        leftovers (iter_N.tmp)                                   DIR is also --save (the first run of
                                                                 a requeued job, as in Megatron-LM)
    anything else: a file, one checkpoint (iter_N), a missing     refused (CheckpointError)
        or markerless DIR that is not --save
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Optional

from megatron_sp.checkpointing import files, locks, safe_dcp, schema
from megatron_sp.checkpointing.states import TrainState

LATEST = "latest_checkpointed_iteration.txt"
METADATA_JSON = "metadata.json"
METADATA_JSON_LIMIT = 64 << 20  # bytes; megatron_sp writes a few KB
_TRAIN_STATE_KEYS = tuple(f.name for f in dataclasses.fields(TrainState))


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (missing, incomplete, incompatible): one sentence."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest(root: str) -> Optional[int]:
    """Iteration named by the latest marker, or None when the directory holds no marker."""
    path = os.path.join(root, LATEST)
    if not os.path.lexists(path):
        return None
    try:
        text = files.read_bytes(path, root, limit=64).decode("ascii").strip()
    except UnicodeDecodeError:
        text = None
    except files.UnreadableFile as err:  # a FIFO, a device, a link out of root: never opened
        raise CheckpointError(f"{err}; {LATEST} must be a regular file holding the iteration to resume from.") from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror}); fix its permissions.") from None
    if not text or not text.isdigit():
        raise CheckpointError(
            f"{path} does not hold an iteration number; write the iteration to resume "
            f"from into it (one of the iter_N directories beside it)."
        )
    return int(text)


def write_latest(root: str, iteration: int) -> None:
    """Points the latest marker at `iteration`, atomically (a crash leaves the old marker; a planted
    link or temporary file is replaced, never followed)."""
    files.write_atomic(os.path.join(root, LATEST), f"{iteration}\n".encode())


def same_path(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def _is_single_checkpoint(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, name)) for name in (METADATA_JSON, safe_dcp.METADATA_FILE))


def _leftovers_only(root: str) -> bool:
    """Nothing in root but what an interrupted first save, a write probe or the run lock leaves behind."""
    return all(
        name.endswith((".tmp", ".removing")) or name.startswith(".write_test") or name == locks.RUN_LOCK
        for name in os.listdir(root)
    )


def locate(root: str, is_save_dir: bool) -> Optional[int]:
    """The iteration --load root resumes from; None = start from scratch (see the module docstring)."""
    if os.path.isfile(root):
        raise CheckpointError(f"--load {root} is a file; pass the checkpoint directory (the one holding {LATEST}).")
    if not os.path.isdir(root):
        if is_save_dir:
            return None
        raise CheckpointError(
            f"--load {root} does not exist; fix the path (a missing --load starts from "
            f"scratch only when it is also --save)."
        )
    if _is_single_checkpoint(root):
        raise CheckpointError(
            f"--load {root} is one checkpoint, not a checkpoint directory; pass its parent "
            f"{os.path.dirname(os.path.abspath(root))} (the iteration is read from {LATEST})."
        )
    iteration = read_latest(root)
    if iteration is None:
        if is_save_dir and _leftovers_only(root):
            return None
        found = sorted(n for n in os.listdir(root) if n.startswith("iter_") and not n.endswith(".tmp"))
        hint = (
            f"write the iteration of {found[-1]} into {LATEST} to resume from it"
            if found
            else "pass the directory that --save wrote"
        )
        raise CheckpointError(f"--load {root} holds no {LATEST}; {hint}.")
    path = checkpoint_dir(root, iteration)
    if not files.inside(root, path):
        raise CheckpointError(f"checkpoint {path} is a link that leads outside --load {root}; copy it in instead.")
    if not os.path.isfile(os.path.join(path, METADATA_JSON)):
        raise CheckpointError(
            f"checkpoint {path} named by {LATEST} is missing or incomplete; point {LATEST} at a complete iteration."
        )
    return iteration


def read_metadata_json(path: str) -> dict:
    """metadata.json of one checkpoint, checked for the fields loading relies on."""
    file = os.path.join(path, METADATA_JSON)
    try:
        meta = json.loads(files.read_bytes(file, path, METADATA_JSON_LIMIT).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(
            f"{file} is not valid JSON (truncated or corrupted); load an earlier "
            f"iteration by writing its number into {LATEST}."
        ) from None
    except RecursionError:
        raise CheckpointError(f"{file} is nested too deeply to be a megatron_sp metadata.json.") from None
    except files.UnreadableFile as err:
        raise CheckpointError(f"{err}; it cannot be a checkpoint's metadata.json.") from None
    except OSError as err:
        raise CheckpointError(f"{file} cannot be read ({err.strerror}).") from None
    problem = _schema_problem(meta)
    if problem:
        raise CheckpointError(f"{file} {problem}; it was not written by megatron_sp or has been edited.")
    return meta


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _schema_problem(meta) -> Optional[str]:
    if not isinstance(meta, dict):
        return "is not a JSON object"
    state = meta.get("train_state")
    if not _is_count(meta.get("iteration")) or not isinstance(state, dict):
        return "lacks iteration/train_state"
    if set(state) != set(_TRAIN_STATE_KEYS) or not all(_is_count(state[k]) for k in _TRAIN_STATE_KEYS):
        return f"has train_state {state!r}, not the counts {list(_TRAIN_STATE_KEYS)}"
    if not _is_count(meta.get("tensor_model_parallel_size")) or not isinstance(meta.get("config"), dict):
        return "lacks tensor_model_parallel_size/config"
    record = meta.get("files")
    if record is not None and not (
        isinstance(record, dict)
        and all(
            isinstance(v, dict) and _is_count(v.get("size")) and isinstance(v.get("sha256"), str)
            for v in record.values()
        )
    ):
        return "has a malformed integrity record (files)"
    outside = [name for name in record or {} if not files.is_plain_name(name)]
    if outside:
        return f"names a file outside its directory ({outside[0]!r}) in its integrity record"
    return schema.problem(meta)


def check_files_present(path: str, meta: dict) -> None:
    """Every file of the integrity record exists with its recorded size (cheap: no reading)."""
    problem = safe_dcp.check_sizes(path, meta.get("files") or {})
    if problem:
        raise damaged(path, problem)


def digest_problem(path: str, meta: dict, rank: int = 0, world: int = 1) -> Optional[str]:
    """sha256 of this rank's share of the record's files (every world-th); None or the first mismatch."""
    return safe_dcp.check_digests(path, sorted((meta.get("files") or {}).items())[rank::world])


def damaged(path: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is damaged: {problem}; load an earlier iteration by writing its number into {LATEST}."
    )


def verified_metadata(path: str) -> dict:
    """One process reading a whole checkpoint (the tools): its metadata.json, schema checked, every
    file of its integrity record present with its size and sha256, as the trainer checks them."""
    meta = read_metadata_json(path)
    check_files_present(path, meta)
    problem = digest_problem(path, meta)
    if problem:
        raise damaged(path, problem)
    return meta


# ---- --save --------------------------------------------------------------------------------------


def check_save_dir(root: str, checkpoint_bytes: int) -> None:
    """--save can be created and written, with room for one more checkpoint (estimated)."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".write_test.{os.uname().nodename}.{os.getpid()}")
        if os.path.lexists(probe):  # a killed run's, or a planted link: the probe is created new, never through a link
            os.unlink(probe)
        with files.create_new(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as err:
        raise CheckpointError(
            f"--save {root} is not writable ({err.strerror}); choose a directory this job can write."
        ) from None
    free = shutil.disk_usage(root).free
    if free < checkpoint_bytes:
        raise CheckpointError(
            f"--save {root} has {free / 1e6:.1f} MB free but one checkpoint needs about "
            f"{checkpoint_bytes / 1e6:.1f} MB; free space or choose another directory."
        )


def drop_unretained(root, latest: int, interval: int) -> list:
    """Megatron's --save-retain-interval: keep checkpoints at multiples of it and the latest, and any
    that a rank is reading now (locks.py; removed by a later save). Returns the iterations kept so."""
    kept = []
    for name in sorted(os.listdir(root)):
        it = iteration_of(name)
        if name.startswith("iter_") and name.endswith(".removing"):
            files.remove_tree(os.path.join(root, name))  # a removal cut short
        elif it is not None and it != latest and it % interval != 0 and not locks.retire(os.path.join(root, name)):
            kept.append(it)
    return kept


def iteration_of(name: str):
    head, _, number = name.partition("_")
    return int(number) if head == "iter" and number.isdigit() else None

"""Who may write a --save directory, and which checkpoints are being read (advisory flock locks).

    run lock       <save>/.megatron_sp.lock, held exclusively by the rank 0 of the run that owns the
                   directory, for the run's life. A second run on the same --save is refused in one
                   sentence naming the holder (its host, pid and start). flock locks die with their
                   process, so a killed run leaves no lock behind; its note in the file (the holder it
                   names) does, and the next run says it took that stale lock over.
    reading        every rank loading iter_N holds a shared lock on iter_N/metadata.json while it reads
                   the checkpoint (metadata.json opened read-only: a reader needs no write permission).
    retiring       --save-retain-interval removes iter_N only under an exclusive lock on the same file,
                   taken without waiting, after renaming the directory away: a checkpoint being read is
                   kept (removed by a later save), and a reader never sees a half-removed one.

flock is advisory and per open file; on a file system without it (ENOLCK, EOPNOTSUPP) the run goes on
unlocked, and says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from typing import Optional

from megatron_sp.checkpointing import files

RUN_LOCK = ".megatron_sp.lock"
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class SaveDirInUse(OSError):
    """Another live run holds the --save directory."""


def _open_regular(path: str, flags: int) -> int:
    """An fd of a regular file (no link followed, no FIFO blocking the open)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file")
    return fd


def _holder(fd: int) -> Optional[dict]:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        note = json.loads(os.read(fd, 4096).decode("utf-8") or "null")
    except (UnicodeDecodeError, ValueError):
        return None
    return note if isinstance(note, dict) else None


def _describe(note: Optional[dict]) -> str:
    if not note:
        return "a process that left no note"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(note.get("started", 0)))
    return f"pid {note.get('pid')} on host {note.get('host')}, since {since}"


class RunLock:
    """The exclusive lock of one run on its --save directory (see the module docstring)."""

    def __init__(self, root: str):
        self.path, self.fd, self.note = os.path.join(root, RUN_LOCK), None, None

    def acquire(self) -> Optional[str]:
        """Takes the lock, or raises SaveDirInUse naming the holder. Returns a line to log (a stale lock
        taken over, or no locking on this file system), or None."""
        fd = _open_regular(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise SaveDirInUse(
                f"--save {os.path.dirname(self.path)} is in use by another run ({_describe(holder)}); give each "
                "run its own --save, or stop that run first"
            ) from None
        except OSError as err:
            os.close(fd)
            if err.errno in UNSUPPORTED:
                return f" --save {os.path.dirname(self.path)}: this file system has no flock; the run goes on unlocked"
            raise
        stale, self.fd = _holder(fd), fd
        self.note = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.note).encode(), 0)
        os.fsync(fd)
        if stale:
            return f" --save: took over the stale lock of a run that ended without releasing it ({_describe(stale)})"
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # a clean exit leaves no note: only a killed run's is "stale"
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


class Reading:
    """A shared lock on iter_N/metadata.json while a rank reads iter_N. `held` is False when the
    checkpoint is gone (retired since the marker was read): the caller reads the marker again."""

    def __init__(self, path: str):
        self.file, self.fd = os.path.join(path, "metadata.json"), None

    def acquire(self) -> bool:
        try:
            fd = _open_regular(self.file, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a retiring save holds its exclusive lock only to rename
        except OSError as err:
            if err.errno not in UNSUPPORTED:
                os.close(fd)
                return False
        try:
            same = os.stat(self.file).st_ino == os.fstat(fd).st_ino  # not renamed away meanwhile
        except OSError:
            same = False
        if not same:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
            self.fd = None


def retire(path: str) -> bool:
    """Removes checkpoint `path` unless a rank is reading it (then False: kept for a later save)."""
    try:
        fd = _open_regular(os.path.join(path, "metadata.json"), os.O_RDONLY)
    except OSError:
        fd = None  # incomplete or foreign: nobody can be reading it through us
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            except OSError as err:
                if err.errno not in UNSUPPORTED:
                    return False
        gone = f"{path}.removing"
        files.remove_tree(gone)  # an earlier removal's, cut short
        os.replace(path, gone)  # under the lock: a reader locking after this finds no iter_N
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)
    files.remove_tree(gone)
    return True

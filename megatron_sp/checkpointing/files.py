"""Opening the files of a directory one does not trust: nothing outside it read or written.

A checkpoint or model directory may have been written by someone else. Every file read from one
must be a regular file that resolves inside it (no symbolic link out of it, no FIFO that blocks
the reader, no device), and is read with a size limit; every file written into one is created
new (O_EXCL | O_NOFOLLOW, or mkstemp beside it and renamed over the old one), so that a planted
link is replaced, never followed. The checks are made when a file is opened: a writer racing the
reader inside the directory itself is out of scope (it can rewrite the data anyway).
"""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Optional


def inside(root: str, path: str) -> bool:
    """True when `path`, every link resolved, lies inside `root` (or is root)."""
    base, full = os.path.realpath(root), os.path.realpath(path)
    return full == base or full.startswith(base.rstrip(os.sep) + os.sep)


def is_plain_name(name) -> bool:
    """A file name without a directory part: what a checkpoint may name as one of its files."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.path.basename(name) == name
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def regular_file_problem(path: str, root: str) -> Optional[str]:
    """None when `path` is a regular file inside `root`; else why not, in words (nothing opened,
    and nothing said about what lies outside root)."""
    if not inside(root, path):
        return f"{path} is a link that leads outside {root}"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as err:  # a symlink loop (ELOOP), permissions
        return f"{path} cannot be read ({err.strerror or err})"
    if not stat.S_ISREG(mode):
        return f"{path} is not a regular file"
    return None


class UnreadableFile(ValueError):
    """A file of an untrusted directory that is not a regular file inside it, or too large."""


def read_bytes(path: str, root: str, limit: int) -> bytes:
    """The bytes of a regular file inside `root`, at most `limit` of them (UnreadableFile, OSError)."""
    problem = regular_file_problem(path, root)
    if problem:
        raise UnreadableFile(problem)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in after the check: no block
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile(f"{path} is not a regular file")
        if info.st_size > limit:  # refused unread
            raise UnreadableFile(f"{path} is {info.st_size} bytes, far more than such a file holds ({limit} at most)")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFile(f"{path} is larger than {limit} bytes, far more than such a file holds")
    return data


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status: an
    os.umask(0) round trip would race the async-save thread's own file creation)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The one rule for every file a save writes: what open() gives, 0o666 less the umask (DCP's
    shards are created so; mkstemp's 0o600 is widened to it)."""
    return 0o666 & ~current_umask()


def create_new(path: str, mode: str = "w"):
    """A file object for a file that does not exist yet (O_EXCL | O_NOFOLLOW: a planted name or link
    is an error, never followed), with the umask's mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return os.fdopen(fd, mode)


def write_atomic(path: str, data: bytes) -> None:
    """Replaces `path` with `data`, synced (see write_via_temp)."""

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    write_via_temp(path, write)


def write_via_temp(path: str, write) -> None:
    """Replaces `path` with what write(tmp) writes into a new temporary file beside it (mkstemp:
    exclusive, a random name ending in .tmp), then renamed over `path`: a link there is replaced,
    not followed, and a crash leaves the old file."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())  # mkstemp's 0o600 would hide the file from the checkpoint's readers
    finally:
        os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def remove_tree(path: str) -> None:
    """Removes a directory tree, or only the link when `path` is a symbolic link (rmtree would
    refuse it; nothing it points to is touched); missing is fine."""
    import shutil

    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)

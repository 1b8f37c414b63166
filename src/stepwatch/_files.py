"""Run-directory files: readable by the job's user only (directories 0700, files 0600).

Every writer of a run directory (records, manifests, stack dumps, hang and stall reports,
timelines, captures) goes through these, so the rule holds in one place.
"""

from __future__ import annotations

import json
import os
import stat
from typing import IO, Any


def make_private_dir(path: str) -> None:
    """Create ``path`` (and missing parents) with mode 0700."""
    path = os.path.abspath(path)
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def open_private(path: str, *, exclusive: bool = True) -> IO[str]:
    """Open for appending, created 0600; ``exclusive`` refuses an existing file (never overwrite)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8", buffering=1 << 16)


def create_private(path: str) -> int:
    """A new 0600 file at ``path``, opened read-write (an fd, e.g. to map), never through a link
    someone planted (a world-writable directory such as /dev/shm, a predictable name). A leftover
    regular file of ours (a crashed process whose pid came round again) is replaced; anything else
    is refused."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"{path} exists and is not a file of this user: not using it") from None
        os.unlink(path)
        return os.open(path, flags, 0o600)


def write_private(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (a reader never sees half a file), mode 0600."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_private(path: str, obj: Any) -> None:
    write_private(path, json.dumps(obj, indent=2, default=str))

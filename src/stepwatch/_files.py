"""Run-directory files: readable by the job's user only (directories 0700, files 0600).

Every writer of a run directory (records, manifests, stack dumps, hang and stall reports,
timelines, captures) goes through these, so the rules hold in one place:

* nothing is written through a link someone planted: new files are created with
  ``O_EXCL|O_NOFOLLOW``, appends are opened ``O_NOFOLLOW`` and must be regular files (a planted
  FIFO neither blocks nor receives anything), subdirectories must be real directories of ours;
* a run directory that another user owns, or that others may write to, is not used as is: one
  warning, and the files go to a private subfolder (:func:`private_run_dir`);
* what the job reads back from a run directory (other ranks' manifests, the sidecar's findings,
  stack dumps) is read the same way (:func:`read_private`): never through a link, never from a
  FIFO (which would block the reading thread), at most a bounded number of bytes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
from typing import IO, Any

from ._log import logger, warn_once

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# A rank's manifest: ``rank<R>.json``, or ``rank<R>.<K>.json`` of a relaunch in the same directory
# (groups: R, K). Written by _manifest.py; read by the report, `stepwatch capture` and the manifest.
RANK_FILE_RE = re.compile(r"^rank(\d+)(?:\.(\d+))?\.json$")
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _open_file(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a link at ``path``, never blocks on a FIFO, and hands back
    only a regular file."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(errno.EPERM, "a symbolic link: stepwatch does not write through links", path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PermissionError(errno.EPERM, "not a regular file: stepwatch does not write to it", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


# What one read of a run-directory file takes at most (a manifest, a stack dump, new findings).
READ_MAX_BYTES = 16 << 20


def read_private(path: str, *, offset: int = 0, max_bytes: int = READ_MAX_BYTES, errors: str = "strict") -> str:
    """The text of the run-directory file ``path`` from byte ``offset``, at most ``max_bytes`` of
    it; never through a link, never from anything but a regular file (OSError otherwise)."""
    fd = _open_file(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        if offset:
            f.seek(offset)
        return f.read(max_bytes).decode("utf-8", errors=errors)


def read_json_private(path: str, *, max_bytes: int = READ_MAX_BYTES) -> Any:
    """A JSON run-directory file (see :func:`read_private`); ValueError when it is not JSON."""
    return json.loads(read_private(path, max_bytes=max_bytes))


def _check_own_dir(path: str) -> None:
    """``path`` must be a real directory (not a link) of this user that no one else may write."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(errno.EPERM, "not a directory of this user (a link?): not using it", path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(errno.EPERM, "owned by another user or writable by others: not using it", path)


def make_private_dir(path: str) -> None:
    """Create ``path`` (and missing parents) with mode 0700. An existing ``path`` must be a
    directory of this user that others cannot write (a link to one is the user's choice); else
    PermissionError (entry points pass a run directory through :func:`private_run_dir` first)."""
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
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(errno.EPERM, "owned by another user or writable by others: not writing there", path)


def private_subdir(path: str) -> str:
    """Create the directory ``path`` (0700) inside a run directory, or reuse it when it is a real
    directory of ours; a link or someone else's directory there is refused (PermissionError)."""
    make_private_dir(os.path.dirname(os.path.abspath(path)))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        _check_own_dir(path)
    return path


def numbered_subdir(run_dir: str, prefix: str) -> tuple[str, int]:
    """The first ``<prefix><n>`` (n = 1, 2, ...) in ``run_dir`` that does not exist yet, created
    0700 atomically: ranks, and a watcher started again on the same run dir, share the numbers,
    and none writes into another's episode."""
    make_private_dir(run_dir)
    n = 1
    while True:
        d = os.path.join(run_dir, f"{prefix}{n}")
        try:
            os.mkdir(d, 0o700)
            return d, n
        except FileExistsError:
            n += 1


def private_run_dir(path: str, *, warn: bool = True) -> str:
    """The directory to write a run into: ``path`` itself when it does not exist yet or is ours
    and writable by us alone; else (another user's, or group/world-writable: anyone there could
    plant or swap files) one warning and the private subfolder ``path/private-<uid>``, created
    here; PermissionError when that name is taken by anything but a directory of ours, and
    NotADirectoryError when ``path`` is a file (or anything but a directory)."""
    path = os.path.abspath(path)
    try:
        st = os.stat(path)  # a link the user made to their own directory is their choice
    except OSError:
        return path
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
    if st.st_uid == os.getuid() and not st.st_mode & 0o022:
        return path
    sub = os.path.join(path, f"private-{os.getuid()}")
    why = "is owned by another user" if st.st_uid != os.getuid() else "is writable by other users"
    (logger.warning if warn else logger.info)(
        "run directory %s %s: writing into the private subfolder %s instead", path, why, sub)
    try:
        os.mkdir(sub, 0o700)
    except FileExistsError:
        _check_own_dir(sub)
    return sub


def cannot_write(path: str) -> str | None:
    """Why nothing can be created in the run directory ``path`` (or in its nearest existing
    parent, where it is still to be made): "read-only file system", "permission denied"; None
    when it can. Asked, not tried: nothing is created."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    if not os.path.isdir(p):
        return f"{p} is not a directory"
    if os.access(p, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(p).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except (OSError, AttributeError):
        pass
    return "permission denied"


def say_unwritable(run_dir: str, what: str, why: object) -> None:
    """One warning a process for the files stepwatch cannot write in ``run_dir`` (a read-only or
    full disk): each writer said it again, 6 lines a rank (records, manifest twice, stack-dump file,
    comm timeline); the rest go to the debug log. ``why``: an OSError, or the reason as text."""
    why = getattr(why, "strerror", None) or why
    if not warn_once(f"unwritable:{os.path.abspath(run_dir)}",
                     "cannot write %s in the run directory %s (%s): going on without %s; other writes that fail "
                     "there are not said again", what, run_dir, why, "them" if what.startswith("files") else "it"):
        logger.debug("cannot write %s in the run directory %s (%s)", what, run_dir, why)


def job_dir(run_dir: str) -> str:
    """The directory the job given ``run_dir`` wrote into: its private subfolder
    ``run_dir/private-<uid>`` when there is one (the run directory was shared or another user's:
    ``private_run_dir``), else ``run_dir`` itself. Only a real directory of this user counts
    as that subfolder: a link or someone else's directory under that name in a shared directory
    is none of the job's."""
    sub = os.path.join(run_dir, f"private-{os.getuid()}")
    try:
        st = os.lstat(sub)
    except OSError:
        return run_dir
    return sub if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() else run_dir


def open_private(path: str, *, exclusive: bool = True, buffering: int = 1 << 16) -> IO[str]:
    """Open for appending, created 0600; ``exclusive`` refuses an existing file (never overwrite).
    Never through a link, never to anything but a regular file."""
    return os.fdopen(append_private_fd(path, exclusive=exclusive), "a", encoding="utf-8", buffering=buffering)


def append_private_fd(path: str, *, exclusive: bool = True) -> int:
    """:func:`open_private`'s file as a bare fd, for ``os.write`` of whole lines (no buffer that a
    failed write would leave behind)."""
    return _open_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_EXCL if exclusive else 0))


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


def write_private(path: str, text: str | bytes, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``text`` (or bytes) atomically (a reader never sees half a file), mode 0600.

    The temporary file is new (``mkstemp``: a random name, ``O_EXCL|O_NOFOLLOW``), and the rename
    replaces a link at ``path`` rather than writing through it. ``mode`` other than 0600 (a path
    of the user's choice) is applied under the umask."""
    d, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=d)
    try:
        # surrogateescape: a path read from a directory whose name is not UTF-8 is written back as
        # the bytes it was (it was a UnicodeEncodeError: report.html of such a run dir, and no summary)
        with (os.fdopen(fd, "wb") if isinstance(text, bytes)
              else os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape")) as f:
            if mode != 0o600:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(f.fileno(), mode & ~umask)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def private_tmp(path: str, suffix: str = ".tmp") -> str:
    """A new empty 0600 file beside ``path`` with a random name, for a writer that opens the path
    itself (torch's trace export): it writes there, then ``os.replace(tmp, path)`` publishes it."""
    d, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=suffix, dir=d)
    os.close(fd)
    return tmp


def write_json_private(path: str, obj: Any) -> None:
    write_private(path, json.dumps(obj, indent=2, default=str))

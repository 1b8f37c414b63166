"""The progress board: a small fixed-layout shared-memory file per rank.

The training thread writes it with a few ``struct.pack_into`` calls (no locks, no allocation
beyond the packed ints); the watchdog sidecar maps the same file and reads it from another
process, so reading never needs the trainer's GIL. Timestamps are ``time.monotonic_ns()``
(CLOCK_MONOTONIC: one clock for every process of a host, so the sidecar can compare them with
its own clock).

There is no lock between the processes. The trainer writes each field with one aligned store
of its own width (``memoryview.cast``), never with ``struct.pack_into``: that zeroes the bytes it
packs before it writes the fields (CPython's ``s_pack_internal``), and a sidecar that read the
last-progress time in that window saw 0, "no progress for <the machine's uptime>", and declared a
hang. A read may still see one update and not the next (a step's number before its duration):
``Reader.read`` decodes a copy of the bytes that two reads in a row agreed on, and the watchdog
judges only a last-progress time it saw unchanged on two polls in a row.

Layout (native byte order: the board never leaves its host), ``SIZE`` bytes; every field is
aligned to its width:

====== ===== ===============================================================
offset type  field
====== ===== ===============================================================
0      u32   magic ``SWPB``
4      u32   layout version
8      u32   trainer pid
12     i32   rank
16     i64   step in progress
24     i32   phase code (``hooks/phases.py``: PHASE_OTHER..PHASE_CHECKPOINT)
32     i64   last progress (monotonic ns): a step end, a phase change, a collective
40     i64   duration of the last step (ns)
48     i64   steps completed since the board was created
56     u32   stack-dump requests (the trainer bumps it; the sidecar answers)
60     u32   closed flag (1: the trainer shut stepwatch down; the sidecar exits)
64     i64   collectives entered (total; the ring slot is ``count % RING``)
128    ...   ``GROUPS`` process-group names: code i32, name (28 bytes, UTF-8, NUL padded)
256    ...   ring of ``RING`` collectives, ``_ENTRY`` bytes each:
             op i32, group i32, seq i64, nbytes i64, enter ns i64, exit ns i64 (0: open), step i64
====== ===== ===============================================================
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import struct
import time
import zlib
from typing import Any

from .._files import create_private
from .phases import PHASE_NAMES, PHASE_OTHER

MAGIC = 0x42505753  # b"SWPB" little endian
VERSION = 1
RING = 8
_HEAD = struct.Struct("=IIIi")  # magic, version, pid, rank
_STEP = struct.Struct("=qi4xqqq")  # step, phase, last progress, last step ns, steps done (at 16)
_U32 = struct.Struct("=I")
_I64 = struct.Struct("=q")
_ENTRY = struct.Struct("=iiqqqqq")  # op, group, seq, nbytes, enter, exit, step
GROUPS = 4
_GROUP = struct.Struct("=i28s")
# The fields as indexes of the board viewed as int64s (_Q) and int32s (_L): byte offset / width.
_Q_STEP, _Q_PROGRESS, _Q_LAST_STEP, _Q_DONE, _Q_COLLS = 2, 4, 5, 6, 8
_L_PHASE, _L_DUMP_REQ, _L_CLOSED, _L_PG_TIMEOUT = 6, 14, 15, 18
_GROUPS_AT = 128
_RING_AT = _GROUPS_AT + GROUPS * _GROUP.size
SIZE = _RING_AT + RING * _ENTRY.size
_RING_Q, _RING_L, _ENTRY_Q, _ENTRY_L = _RING_AT // 8, _RING_AT // 4, _ENTRY.size // 8, _ENTRY.size // 4

# Collective names as codes (the comm hook passes a name; the board stores an int).
OPS = (
    "unknown",
    "allreduce",
    "broadcast",
    "allgather",
    "reduce_scatter",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
    "send",
    "recv",
)
_OP_CODE = {name.replace("_", ""): i for i, name in enumerate(OPS)}

_now = time.monotonic_ns


def op_code(op: Any) -> int:
    if isinstance(op, int):
        return op if 0 <= op < len(OPS) else 0
    key = str(op).lower().replace("_", "").replace("-", "")
    for prefix in ("c10d", "nccl", "gloo"):
        if key.startswith(prefix):
            key = key[len(prefix):].lstrip(":.")
    return _OP_CODE.get(key, 0)


def group_code(group: Any) -> int:
    """A process group as an int32: an int as is, a name by its CRC32 (``None``: the default group, 0)."""
    if group is None:
        return 0
    if isinstance(group, int):
        return group
    return zlib.crc32(str(group).encode()) & 0x7FFFFFFF


# A board this young may belong to a trainer that is starting (its pid seen from another pid
# namespace, say): never removed.
_STALE_AFTER_S = 60.0


def clean_stale(run_dir: str) -> list[str]:
    """Remove the boards that killed trainers left (SIGKILL, OOM killer: their sidecar, killed
    too, could not unlink them), before making ours. Only names of this user's boards, only
    regular files this user owns, only of a pid that no longer runs, and not modified in the last
    minute; a link is never followed or removed. Returns the paths removed."""
    from .._os.procs import alive

    uid = os.getuid()
    places = (("/dev/shm", re.compile(rf"^stepwatch-{uid}-.+-rank\d+-(\d+)\.board$")),
              (run_dir, re.compile(r"^\.board\.rank\d+\.(\d+)$")))
    removed = []
    now = time.time()
    for d, pattern in places:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            m = pattern.match(n)
            if m is None or int(m.group(1)) == os.getpid() or alive(int(m.group(1))):
                continue
            path = os.path.join(d, n)
            try:
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_uid == uid and now - st.st_mtime > _STALE_AFTER_S:
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue
    return removed


def default_path(run_id: str, rank: int, run_dir: str) -> str:
    """/dev/shm when it exists (memory, never written back to a network file system), else the run dir."""
    name = f"stepwatch-{os.getuid()}-{run_id}-rank{rank}-{os.getpid()}.board"
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return os.path.join("/dev/shm", name)
    return os.path.join(run_dir, f".board.rank{rank}.{os.getpid()}")


def reserve(fd: int, size: int) -> None:
    """Back the first ``size`` bytes of ``fd`` with storage now, so that writing them through a
    mapping cannot fail later. A sparse file (``ftruncate``) on a full tmpfs (``/dev/shm``) or
    disk gets its pages only when first written through the mapping, and a page the file system
    cannot back raises SIGBUS, which kills the trainer. ``posix_fallocate`` fails with ENOSPC
    instead (OSError); a file system without it gets the bytes written (ENOSPC there too)."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    except AttributeError:  # no posix_fallocate on this platform
        pass
    data = bytes(size)
    done = 0
    while done < size:
        done += os.pwrite(fd, data[done:], done)


class Board:
    """The trainer's side: create the file (0600), reserve its storage, map it, write progress.
    Every method is O(1). OSError when the file cannot be made or backed (a full /dev/shm):
    nothing is left behind, and the caller goes on without a board."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        fd = create_private(path)
        try:
            reserve(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        os.close(fd)
        self._buf = self._mm
        whole = memoryview(self._mm)
        self._q, self._l = whole.cast("q"), whole.cast("i")  # released by close()
        whole.release()
        # Before a sidecar reads it: the pack's zeroing is harmless here (the file was all zeros).
        _HEAD.pack_into(self._buf, 0, MAGIC, VERSION, os.getpid(), rank)
        self._step = 0
        self._phase = PHASE_OTHER
        self._done = 0
        self._t_step = 0
        self._colls = 0
        self._slot_seq: list[Any] = [None] * RING  # (group, seq): numbers count per group
        self._dump_req = 0
        self._groups: dict[int, int] = {}  # code -> table slot
        self._codes: dict[tuple[Any, Any], tuple[int, int]] = {}
        _STEP.pack_into(self._buf, _Q_STEP * 8, 0, PHASE_OTHER, _now(), 0, 0)

    # -- training thread -----------------------------------------------------------------------

    def set_phase(self, code: int) -> None:
        self._phase = code
        self._l[_L_PHASE] = code
        self._q[_Q_PROGRESS] = _now()

    def set_step(self, n: int) -> None:
        t = _now()
        dur = t - self._t_step if self._t_step else 0
        self._t_step = t
        self._step = n
        self._done += 1
        q = self._q
        q[_Q_STEP] = n
        q[_Q_LAST_STEP] = dur
        q[_Q_PROGRESS] = t
        q[_Q_DONE] = self._done

    def coll_enter(self, op: Any, group: Any, seq: int, nbytes: int) -> None:
        """A collective was enqueued (called by the comm hook; any thread)."""
        codes = self._codes.get((op, group))
        if codes is None:
            codes = self._codes_for(op, group)
        i = self._colls % RING
        self._colls += 1
        t = _now()
        self._slot_seq[i] = (group, seq)
        q, e, el = self._q, _RING_Q + i * _ENTRY_Q, _RING_L + i * _ENTRY_L
        q[e + 4] = 0  # exit: open
        self._l[el] = codes[0]
        self._l[el + 1] = codes[1]
        q[e + 1] = seq
        q[e + 2] = nbytes
        q[e + 3] = t  # enter
        q[e + 5] = self._step
        q[_Q_COLLS] = self._colls
        q[_Q_PROGRESS] = t

    def _codes_for(self, op: Any, group: Any) -> tuple[int, int]:
        g = group_code(group)
        if g not in self._groups and len(self._groups) < GROUPS and not isinstance(group, int):
            self._groups[g] = len(self._groups)
            _GROUP.pack_into(self._buf, _GROUPS_AT + self._groups[g] * _GROUP.size, g, str(group).encode()[:28])
        codes = (op_code(op), g)
        if len(self._codes) < 64:  # bounded: names come from a small fixed set
            self._codes[(op, group)] = codes
        return codes

    def coll_exit(self, seq: int, group: Any = "default") -> None:
        """The collective ``seq`` of ``group`` completed."""
        t = _now()
        slots = self._slot_seq
        key = (group, seq)
        q = self._q
        for i in range(RING):
            if slots[i] == key:
                q[_RING_Q + i * _ENTRY_Q + 4] = t  # exit
                break
        q[_Q_PROGRESS] = t

    # -- background thread ---------------------------------------------------------------------

    def set_pg_timeout(self, seconds: float) -> None:
        """The default process group's timeout: the sidecar must act before it ends the job."""
        self._l[_L_PG_TIMEOUT] = min(max(int(seconds), 1), 2**31 - 1)

    def number_dumps_after(self, n: int) -> None:
        """The next :meth:`request_dump` is numbered ``n + 1`` or more (the dumps of an earlier
        launch into the run dir keep their files). Not written to the board: no request is made."""
        self._dump_req = max(self._dump_req, min(int(n), 2**31 - 2))

    def request_dump(self) -> int:
        """Ask the sidecar for a stack dump; returns the request number it will answer."""
        self._dump_req = self._dump_req % (2**31 - 1) + 1
        self._l[_L_DUMP_REQ] = self._dump_req
        return self._dump_req

    def close(self, *, unlink: bool = True) -> None:
        try:
            self._l[_L_CLOSED] = 1
            self._q.release()
            self._l.release()
            self._mm.close()
        except (ValueError, OSError):
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def read(buf: Any) -> dict[str, Any] | None:
    """Decode a board (the sidecar's side). None when the file is not a board (yet)."""
    magic, version, pid, rank = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION:
        return None
    # The writers' field indexes, as byte offsets: one statement of the layout for both sides.
    step, phase, progress, last_step, done = _STEP.unpack_from(buf, _Q_STEP * 8)
    (dump_req,) = _U32.unpack_from(buf, _L_DUMP_REQ * 4)
    (closed,) = _U32.unpack_from(buf, _L_CLOSED * 4)
    (count,) = _I64.unpack_from(buf, _Q_COLLS * 8)
    (pg_timeout,) = _U32.unpack_from(buf, _L_PG_TIMEOUT * 4)
    names = {}
    for j in range(GROUPS):
        code, raw = _GROUP.unpack_from(buf, _GROUPS_AT + j * _GROUP.size)
        name = raw.rstrip(b"\0").decode("utf-8", "replace")
        if name:
            names[code] = name
    ring = []
    now = _now()  # this host's clock, like the entries: ages compare across hosts, times do not
    for k in range(max(count - RING, 0), count):
        op, group, seq, nbytes, t0, t1, cstep = _ENTRY.unpack_from(buf, _RING_AT + (k % RING) * _ENTRY.size)
        ring.append(
            {
                "op": OPS[op] if 0 <= op < len(OPS) else "unknown",
                "group": names.get(group, group),
                "seq": seq,
                "bytes": nbytes,
                "enter_ns": t0,
                "age_s": (now - t0) / 1e9,
                "exit_ns": t1,
                "completed": t1 != 0,
                "step": cstep,
            }
        )
    return {
        "pid": pid,
        "rank": rank,
        "step": step,
        "phase": PHASE_NAMES[phase] if 0 <= phase < len(PHASE_NAMES) else "other",
        "phase_code": phase,
        "last_progress_ns": progress,
        "last_step_ns": last_step,
        "steps_done": done,
        "dump_req": dump_req,
        "closed": bool(closed),
        "pg_timeout_s": pg_timeout or None,
        "collectives": ring,
    }


class Reader:
    """The sidecar's mapping of a board file (read-only)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def read(self) -> dict[str, Any] | None:
        """The board, decoded from a copy of its bytes that two reads in a row agreed on (no
        update was in flight), or the last of four reads."""
        a = self._mm[:SIZE]
        for _ in range(3):
            b = self._mm[:SIZE]
            if a == b:
                break
            a = b
        return read(a)

    def close(self) -> None:
        self._mm.close()

"""Sequential write and read throughput of a directory, the way a checkpoint uses it.

fio-style (reference B.9: ``fio --rw=write --bs=4M --direct=1``): large blocks, direct I/O where
the filesystem allows it (O_DIRECT with a page-aligned buffer; tmpfs and some FUSE mounts refuse
it, then the page cache is flushed with fsync and dropped with POSIX_FADV_DONTNEED before
reading), bounded by size and time, one file per job, removed afterwards (also when interrupted:
the streams are stopped first). At most half the free space is used; when even one block per job
would take more, nothing is written (:class:`NotEnoughSpace`). Judged against the reference's
storage checklist: > 10 GB/s healthy, < 2 GB/s degraded.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import secrets
import threading
import time
from dataclasses import dataclass, field

HEALTHY_GBPS = 10.0  # reference B.9 storage checklist
DEGRADED_GBPS = 2.0  # reference B.9 storage checklist
BLOCK = 4 * 1024 * 1024  # reference B.9 fio: --bs=4M
GRADED_JOBS = 16  # reference B.9 fio: --numjobs=16; its thresholds are for that many streams
_ALIGN = 4096  # O_DIRECT: offsets and sizes multiple of the logical block size (<= 4 KiB on Linux disks)
# Parallel streams, each one file and one thread: 16x the reference's fio --numjobs=16, beyond
# which more streams measure the machine's thread scheduling rather than the storage.
MAX_JOBS = 256


class NotEnoughSpace(ValueError):
    """The test files would not fit in half the free space: nothing was written."""


@dataclass
class StorageResult:
    path: str
    direct: bool
    jobs: int
    block_bytes: int
    write_bytes: int = 0
    write_s: float = 0.0
    read_bytes: int = 0
    read_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def write_gbps(self) -> float | None:
        # nothing written in the time (a tiny --storage-seconds) is no measurement, not 0 GB/s
        return self.write_bytes / self.write_s / 1e9 if self.write_s > 0 and self.write_bytes else None

    @property
    def read_gbps(self) -> float | None:
        return self.read_bytes / self.read_s / 1e9 if self.read_s > 0 and self.read_bytes else None

    def to_dict(self) -> dict:
        return {"path": self.path, "direct_io": self.direct, "jobs": self.jobs, "block_bytes": self.block_bytes,
                "write_bytes": self.write_bytes, "write_s": self.write_s, "write_gbps": self.write_gbps,
                "read_bytes": self.read_bytes, "read_s": self.read_s, "read_gbps": self.read_gbps,
                "verdict": judge(self.write_gbps, self.jobs), "notes": self.notes}


def judge(gbps: float | None, jobs: int = GRADED_JOBS) -> str:
    """"healthy" (> 10 GB/s), "degraded" (< 2 GB/s), "between", or "unknown"; "ungraded" for
    fewer parallel streams than the reference's fio runs (one stream of a parallel filesystem
    reads far below its aggregate, and would be called degraded while healthy)."""
    if gbps is None:
        return "unknown"
    if jobs < GRADED_JOBS:
        return "ungraded"
    if gbps > HEALTHY_GBPS:
        return "healthy"
    if gbps < DEGRADED_GBPS:
        return "degraded"
    return "between"


def _open_direct(name: str, flags: int) -> tuple[int, bool]:
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(name, flags | direct), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
    return os.open(name, flags), False


def measure(path: str, *, size_bytes: int = 1 << 30, block_bytes: int = BLOCK, max_seconds: float = 10.0,
            jobs: int = 1) -> StorageResult:
    """Write then read ``size_bytes`` per job (less if ``max_seconds`` runs out) in ``path``."""
    if not os.path.isdir(path):
        raise ValueError(f"--storage {path!r}: not an existing directory")
    if not os.access(path, os.W_OK):
        raise ValueError(f"--storage {path!r}: not writable by this user")
    if block_bytes <= 0 or block_bytes % _ALIGN:
        raise ValueError(f"block size must be a positive multiple of {_ALIGN} bytes, got {block_bytes}")
    if size_bytes < block_bytes:
        raise ValueError(f"--storage-size must be at least one block ({block_bytes} bytes), got {size_bytes}")
    if not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"--storage-jobs must be between 1 and {MAX_JOBS}, got {jobs}")
    if max_seconds <= 0:
        raise ValueError(f"--storage-seconds must be > 0, got {max_seconds}")
    result = StorageResult(path=os.path.abspath(path), direct=True, jobs=jobs, block_bytes=block_bytes)
    free = shutil.disk_usage(path).free
    least = jobs * block_bytes  # one block per stream
    if least > free // 2:  # never fill a shared checkpoint filesystem, nor a nearly full one
        raise NotEnoughSpace(
            f"{result.path}: only {free / 2**20:.1f} MiB free; the test needs at least {2 * least / 2**20:g} MiB "
            f"free ({jobs} stream(s) of at least one {block_bytes / 2**20:g} MiB block, at most half the free "
            "space): not measured, nothing written"
        )
    if size_bytes * jobs > free // 2:  # never fill a shared checkpoint filesystem
        size_bytes = max(block_bytes, (free // 2 // jobs) // block_bytes * block_bytes)
        result.notes.append(f"size reduced to {size_bytes} bytes per job: only {free} bytes free")
    size_bytes = size_bytes // block_bytes * block_bytes

    names: list[str] = []
    stop = threading.Event()
    try:
        for _ in range(jobs):
            # The name is kept before the file exists: a signal that lands as the file is made
            # (inside tempfile.mkstemp, before its name came back) left the file behind.
            name = os.path.join(path, f".stepwatch-doctor-{secrets.token_hex(8)}")
            names.append(name)
            try:
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except FileExistsError:  # not ours (2**-64): left alone
                names.pop()
                raise
        _phase(result, names, size_bytes, block_bytes, max_seconds, stop, write=True)
        _phase(result, names, size_bytes, block_bytes, max_seconds, stop, write=False)
    finally:
        # Also on Ctrl-C or the doctor's SIGTERM: _phase stopped and joined its streams first (a
        # file removed while a stream still writes it would hold its space until the stream ends).
        for name in names:
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
    return result


def _phase(result: StorageResult, names: list[str], size: int, block: int, max_s: float, stop: threading.Event,
           *, write: bool) -> None:
    done = [0] * len(names)
    errors: list[BaseException] = []
    deadline = time.monotonic() + max_s
    payload = os.urandom(block)  # incompressible: no credit for compression or dedup

    def job(k: int) -> None:
        buf = mmap.mmap(-1, block)  # anonymous mmap: page-aligned, as O_DIRECT needs
        try:
            if write:
                buf[:] = payload
                fd, direct = _open_direct(names[k], os.O_WRONLY | os.O_TRUNC)
            else:
                fd, direct = _open_direct(names[k], os.O_RDONLY)
            if not direct:
                result.direct = False
            try:
                n = 0
                while n < size and time.monotonic() < deadline and not stop.is_set():
                    if write:
                        w = os.write(fd, buf)
                    else:
                        w = os.readv(fd, [buf])
                        if w == 0:
                            break
                    n += w
                if write and not stop.is_set():
                    os.fsync(fd)  # the bytes are on storage, not in the page cache
                    if not direct and hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # so reads hit storage
                done[k] = n
            finally:
                os.close(fd)
        except BaseException as e:  # re-raised on the calling thread below
            errors.append(e)
        finally:
            buf.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=job, args=(k,), name=f"stepwatch-storage-{k}") for k in range(len(names))]
    started: list[threading.Thread] = []
    try:
        for t in threads:
            t.start()
            started.append(t)
        for t in started:
            t.join()
    except BaseException:
        # Interrupted on this thread (KeyboardInterrupt, a signal handler's exception): the
        # streams stop after their current block, before the caller removes their files.
        stop.set()
        for t in started:
            t.join()
        raise
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if write:
        result.write_bytes, result.write_s = sum(done), elapsed
    else:
        result.read_bytes, result.read_s = sum(done), elapsed
    if not result.direct and "buffered" not in " ".join(result.notes):
        result.notes.append("the filesystem refused O_DIRECT: buffered I/O with fsync, cache dropped before "
                            "reading (reads may still be served from cache)")

"""Host memory from /proc and the cgroup files (Linux): one place that reads them.

- The trainer's *current* resident set: ``/proc/self/statm`` (one ``pread`` of a held fd, O(1)
  in the kernel: counters, no page walk), not ``ru_maxrss``, a high-water mark that never falls.
- DataLoader workers: ``/proc/<pid>/smaps_rollup`` (Linux >= 4.14). RSS double-counts the pages a
  forked worker still shares copy-on-write with the trainer, so workers are summed as USS (pages
  only that worker holds: ``Private_Clean + Private_Dirty``) and PSS (shared pages divided among
  their sharers, so the sum over processes is what they cost together). The kernel walks the
  worker's page tables for this, so it is read off the training thread, at most once a second.
- The limit: the cgroup's (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) when there is one,
  else physical RAM (``MemTotal``); what is in use against it: the usage of the cgroup whose
  limit binds (ours or a parent's) less its inactive file cache (what ``docker stats`` shows), or
  ``MemTotal - MemAvailable``.

Every reader returns None when the file is missing or unreadable: unknown, never a made-up number.
"""

from __future__ import annotations

import os

from .._os.procs import read_stat

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX * page size); anything at or
# above 2**60 is no limit (kernel mm/page_counter.c).
_NO_LIMIT = 1 << 60


class StatmReader:
    """The current RSS of this process, one ``pread`` per call (the fd is opened once)."""

    def __init__(self, path: str = "/proc/self/statm") -> None:
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._fd = None

    def __call__(self) -> int | None:
        if self._fd is None:
            return None
        try:
            # statm: size resident shared text lib data dt, in pages.
            return int(os.pread(self._fd, 128, 0).split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def own_peak_rss(proc: str = "/proc") -> int | None:
    """This process's resident-set high-water mark: ``VmHWM`` of ``/proc/self/status``, its own
    address space's since ``exec``. Not ``ru_maxrss``: Linux carries the parent's high-water mark
    into it over ``vfork`` + ``exec`` (``subprocess``), so a trainer launched by a process that
    once held 1 GiB read a 1 GiB peak. None where the file says nothing (not Linux)."""
    v = _stat_value(f"{proc}/self/status", b"VmHWM:")  # "VmHWM:   312345 kB"
    return None if v is None else v * 1024


def smaps_rollup(pid: int, proc: str = "/proc") -> tuple[int, int, int] | None:
    """(USS, PSS, RSS) in bytes of ``pid``, or None (gone, no permission, kernel < 4.14)."""
    try:
        with open(f"{proc}/{pid}/smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:
        return None
    vals: dict[bytes, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(b":") and parts[1].isdigit():
            vals[parts[0][:-1]] = int(parts[1]) * 1024  # kB
    if b"Pss" not in vals:
        return None
    uss = vals.get(b"Private_Clean", 0) + vals.get(b"Private_Dirty", 0)
    return uss, vals[b"Pss"], vals.get(b"Rss", 0)


def parent_pid(pid: int, proc: str = "/proc") -> int | None:
    """The parent of ``pid`` (to make sure a pid read earlier is still our child, not a reused one)."""
    st = read_stat(pid, proc)
    return None if st is None else st.ppid


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            raw = f.read().strip()
    except OSError:
        return None
    if raw == b"max":
        return None
    try:
        v = int(raw)
    except ValueError:
        return None
    return None if v >= _NO_LIMIT else v


def _stat_value(path: str, key: bytes) -> int | None:
    try:
        with open(path, "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == key:  # "key value" (memory.stat), "key: value kB" (status)
                    return int(parts[1])
    except (OSError, ValueError):
        return None
    return None


def _cgroup_dir(proc: str, root: str) -> tuple[str, int] | None:
    """This process's memory cgroup directory and its version (2 or 1), or None."""
    try:
        with open(f"{proc}/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and ctrls == "":
            # The path as /proc names it, else the mount itself (a cgroup namespace whose path
            # the mount does not hold): one directory for the limit and the usage. (The named
            # directory was kept when it did not exist: the limit came from the mount, the usage
            # from the whole machine's /proc/meminfo, 477% of a cgroup half used.)
            d = os.path.join(root, path.lstrip("/"))
            for cand in (d, root):
                if os.path.exists(os.path.join(cand, "memory.max")):
                    return cand, 2
        if "memory" in ctrls.split(","):
            for d in (os.path.join(root, "memory", path.lstrip("/")), os.path.join(root, "memory")):
                if os.path.exists(os.path.join(d, "memory.limit_in_bytes")):
                    return d, 1
    return None


def meminfo(proc: str = "/proc") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"{proc}/meminfo", "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    out[parts[0].rstrip(b":").decode()] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


class HostLimit:
    """The memory limit this process lives under and how much of it is in use."""

    def __init__(self, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.proc = proc
        found = _cgroup_dir(proc, cgroup_root)
        self.kind = "physical RAM"
        self.limit: int | None = None
        self._cg: tuple[str, int] | None = None
        if found is not None:
            d, ver = found
            # The tightest limit from our cgroup up to the root (a limit set on a parent applies
            # too), and the use counted against it: that cgroup's, every process under it (a
            # parent's limit read against our own cgroup's use said 10% of a parent at 95%).
            lim = None
            lim_dir = d
            p = d
            name = "memory.max" if ver == 2 else "memory.limit_in_bytes"
            while True:
                v = _read_int(os.path.join(p, name))
                if v is not None and (lim is None or v < lim):
                    lim, lim_dir = v, p
                if os.path.normpath(p) == os.path.normpath(cgroup_root if ver == 2 else os.path.join(cgroup_root, "memory")):
                    break
                parent = os.path.dirname(p)
                if parent == p or not parent.startswith(cgroup_root):
                    break
                p = parent
            if lim is not None:
                self.limit, self.kind, self._cg = lim, "cgroup", (lim_dir, ver)
        if self.limit is None:
            self.limit = meminfo(proc).get("MemTotal")

    def used(self) -> int | None:
        """Bytes in use against the limit (reclaimable file cache left out)."""
        if self._cg is not None:
            d, ver = self._cg
            if ver == 2:
                cur = _read_int(os.path.join(d, "memory.current"))
                inactive = _stat_value(os.path.join(d, "memory.stat"), b"inactive_file")
            else:
                cur = _read_int(os.path.join(d, "memory.usage_in_bytes"))
                inactive = _stat_value(os.path.join(d, "memory.stat"), b"total_inactive_file")
            if cur is not None:
                return max(cur - (inactive or 0), 0)
            return None  # not the machine's use against the cgroup's limit: unknown
        mi = meminfo(self.proc)
        if "MemTotal" in mi and "MemAvailable" in mi:
            return mi["MemTotal"] - mi["MemAvailable"]
        return None

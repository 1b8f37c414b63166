"""NCCL's own warnings, read from the file the user sent NCCL's output to (``NCCL_DEBUG_FILE``).

stepwatch never sets ``NCCL_DEBUG_FILE`` (or ``NCCL_DEBUG``): setting it would move NCCL's
messages out of the user's stderr. When the user set it, NCCL writes its log there (``%h`` in the
name is the host name up to its first dot, ``%p`` the process id; NCCL docs, "NCCL_DEBUG_FILE"),
and each ``NCCL WARN`` line becomes an ``nccl_warning`` finding. Lines look like
``host:pid:tid [cudaDev] file.cc:line NCCL WARN message``; NCCL writes WARN lines only at
``NCCL_DEBUG=WARN`` or more verbose.

Off the training thread (the session's background pass), polled at most every ``poll_s``; each
poll reads at most ``MAX_READ`` new bytes. One finding per distinct message (numbers, addresses
and ranks folded), at most ``MAX_DISTINCT`` of them; the rest are counted.
"""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Any, Mapping

from ..analysis.kinds import make_finding
from ..record import Finding

MAX_READ = 1024 * 1024
MAX_LINE = 4096
MAX_DISTINCT = 64
_WARN = re.compile(r"\bNCCL WARN\b\s*(.*)")
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def debug_file_path(env: Mapping[str, str], host: str | None = None, pid: int | None = None) -> str | None:
    """The file NCCL writes to in this process, from ``NCCL_DEBUG_FILE``; None when unset."""
    raw = env.get("NCCL_DEBUG_FILE", "").strip()
    if not raw:
        return None
    short = (host or socket.gethostname()).split(".")[0]
    return raw.replace("%h", short).replace("%p", str(os.getpid() if pid is None else pid))


class NcclLogWatch:
    """Follows one NCCL debug file (which may not exist yet: NCCL opens it at its first use)."""

    def __init__(self, path: str, *, rank: int = 0, poll_s: float = 1.0, clock=time.monotonic) -> None:
        self.path = path
        self.rank = rank
        self.poll_s = poll_s
        self._clock = clock
        self._next = 0.0
        self._pos = 0
        self._partial = b""
        self._seen: set[str] = set()
        self.warnings = 0
        self.unreported = 0
        self.error: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, rank: int = 0, host: str | None = None) -> "NcclLogWatch | None":
        path = debug_file_path(env, host)
        return None if path is None else cls(path, rank=rank)

    def status(self) -> dict[str, Any]:
        return {"path": self.path, "warnings": self.warnings, "distinct": len(self._seen),
                "unreported": self.unreported, **({"error": self.error} if self.error else {})}

    def _read(self) -> bytes:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return b""  # NCCL has not opened it yet
        if size < self._pos:  # truncated (NCCL reopened it): start over
            self._pos, self._partial = 0, b""
        if size == self._pos:
            return b""
        with open(self.path, "rb") as f:
            f.seek(self._pos)
            data = f.read(MAX_READ)
        self._pos += len(data)
        return data

    def poll(self, step: int | None = None) -> list[Finding]:
        now = self._clock()
        if now < self._next:
            return []
        self._next = now + self.poll_s
        try:
            data = self._read()
        except OSError as e:
            if self.error is None:
                from .._log import logger

                logger.warning("stepwatch: cannot read NCCL_DEBUG_FILE %s: %s", self.path, e)
            self.error = str(e)
            return []
        if not data:
            return []
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()[-MAX_LINE:]  # an unfinished line waits for the rest
        out: list[Finding] = []
        for raw in lines:
            line = raw[:MAX_LINE].decode("utf-8", "replace").rstrip("\r")
            m = _WARN.search(line)
            if m is None:
                continue
            self.warnings += 1
            msg = m.group(1).strip()
            key = _NUMBERS.sub("N", msg)[:200]
            if key in self._seen:
                continue
            if len(self._seen) >= MAX_DISTINCT:
                self.unreported += 1
                continue
            self._seen.add(key)
            out.append(make_finding(
                "nccl_warning", rank=self.rank, step=step,
                summary=f"rank {self.rank}: NCCL WARN {msg} (from {self.path})",
                data={"line": line, "message": msg, "file": self.path},
            ))
        return out

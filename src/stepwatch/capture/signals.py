"""``kill -USR1 <rank pid>`` writes every thread's Python stack to ``<run_dir>/sigusr1.rank<R>.txt``.

Through ``faulthandler.register``: its handler is C code that runs in the signal handler, so it
writes the stacks even while the main thread holds the GIL in C code.

Two promises:

* A SIGUSR1 handler the job has (SLURM and Lightning use SIGUSR1) keeps running. With one in
  place we register with ``chain=True``: faulthandler dumps, then calls the previous handler.
  Without one (the default action of SIGUSR1 is to *terminate*), we register without chaining.
  If the job installs its handler *after* stepwatch (``signal.signal`` replaces ours), the
  training thread notices at the next step boundary and registers again, chained to it.
* The trainer's system calls are not interrupted. faulthandler sets ``SA_RESTART`` only when it
  does not chain (CPython Modules/faulthandler.c, ``faulthandler_register_py``: ``sa_flags =
  SA_RESTART``, replaced by ``SA_NODEFER`` when chaining; checked with sigaction(2) here), so
  after a chained registration we add ``SA_RESTART`` to the installed action ourselves.

stepwatch's own tools (the hang watchdog's fallback, ``stepwatch dump``) never send SIGUSR1: with
the job's handler chained, their dump would also run it, and SLURM/Lightning's SIGUSR1 handler
checkpoints and requeues the job. They send a signal of stepwatch's own, ``SIGRTMIN+6``, on which
the same stacks are written (no chaining; the file says which pid listens on which signal).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import signal
import sys
import threading
import time
from typing import IO, Any

from .._files import open_private, read_private
from .._os.procs import read_stat

# <signal.h> on Linux (asm-generic/signal.h; x86 and arm64 use the same value).
SA_RESTART = 0x10000000
# glibc's struct sigaction: handler pointer, sigset_t (1024 bits), int flags, restorer pointer.
_SIGSET_BYTES = 128


class _Sigaction(ctypes.Structure):
    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ubyte * _SIGSET_BYTES),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


def _action(signum: int) -> _Sigaction | None:
    """The installed action for ``signum`` (None when sigaction is unavailable)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        act = _Sigaction()
        if libc.sigaction(signum, None, ctypes.byref(act)) != 0:
            return None
        return act
    except (OSError, AttributeError):
        return None


def sa_flags(signum: int) -> int | None:
    """The flags of the installed action for ``signum`` (None when sigaction is unavailable)."""
    act = _action(signum)
    return None if act is None else int(act.flags)


def _add_restart(signum: int) -> bool:
    act = _action(signum)
    if act is None:
        return False
    if act.flags & SA_RESTART:
        return True
    act.flags |= SA_RESTART
    try:
        return ctypes.CDLL(None, use_errno=True).sigaction(signum, ctypes.byref(act), None) == 0
    except (OSError, AttributeError):
        return False


# The signals this process's stepwatch registered with faulthandler. A forked child inherits the
# registration with this set: the handler it finds there is stepwatch's, not the job's.
_REGISTERED: set[int] = set()


def native_handler(signum: int) -> bool:
    """The job handles ``signum`` outside Python's ``signal`` module: ``faulthandler.register``
    (a common way to debug hangs), or a C library. ``signal.getsignal`` does not see such a
    handler. Registering over it would take it away: faulthandler keeps one file per signal, and
    its ``unregister`` puts back the action from before the first registration (SIG_DFL, whose
    action for SIGUSR1 ends the process)."""
    if signum in _REGISTERED:
        return False
    if callable(signal.getsignal(signum)):
        return False  # a Python handler (Python's own C handler is the installed action)
    act = _action(signum)
    if act is None:
        return False
    return (act.handler or 0) not in (int(signal.SIG_DFL), int(signal.SIG_IGN))


def _has_handler(h: Any) -> bool:
    return h not in (signal.SIG_DFL, None)


# A real-time signal nobody sends by accident: glibc keeps SIGRTMIN's first values for itself
# (SIGRTMIN already accounts for that), and the low offsets are the ones libraries pick first.
DUMP_OFFSET = 6
_HEADER = "# stepwatch: pid {pid} (started {start}) writes its stacks here on signal {signum}\n"
_HEADER_RE = re.compile(r"^# stepwatch: pid (\d+) \(started (\d+)\) writes its stacks here on signal (\d+)$", re.M)


def dump_signal() -> int | None:
    """The signal stepwatch's own tools send for a stack dump (None where there is none)."""
    rt = getattr(signal, "SIGRTMIN", None)
    return None if rt is None else int(rt) + DUMP_OFFSET


def _start_ticks(pid: int) -> int | None:
    # With the pid, names one process: pids are reused (/proc/<pid>/stat, field 22).
    st = read_stat(pid)
    return st.starttime if st is not None else None


def signal_for(path: str, pid: int) -> tuple[int | None, bool]:
    """``(signal, announced)`` from the stack file at ``path``: ``announced`` when a process with
    this pid number announced a dump signal there; ``signal`` the latest one, only while ``pid`` is
    still that process (its start time matches): a reused pid belongs to some other process,
    which the signal's default action would end."""
    try:
        found = [(int(t), int(sig)) for p, t, sig in _HEADER_RE.findall(read_private(path, errors="replace"))
                 if int(p) == pid]
    except OSError:
        return None, False
    start = _start_ticks(pid)
    mine = [sig for t, sig in found if t == start]
    return (mine[-1] if mine else None), bool(found)


def signal_name(signum: int) -> str:
    rt = getattr(signal, "SIGRTMIN", None)
    if rt is not None and int(rt) < signum <= int(getattr(signal, "SIGRTMAX", signum)):
        return f"SIGRTMIN+{signum - int(rt)}"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


class StackSignal:
    """SIGUSR1 -> all threads' stacks appended to ``path``. ``check()`` runs at step boundaries."""

    def __init__(self, path: str, signum: int = signal.SIGUSR1, *, private: bool = False) -> None:
        """``private``: stepwatch's own dump signal: never chained, announced in the file."""
        self.path = path
        self.signum = signum
        self.private = private
        self.chained = False
        self.restart = False
        self._file: IO[str] | None = None
        self._seen: Any = None
        self._flags_t = 0.0

    def install(self) -> bool:
        """False (nothing installed) where the job handles the signal already and a registration
        would take its handler away: a private signal it handles at all, or any signal it handles
        outside Python's ``signal`` module (:func:`native_handler`)."""
        if native_handler(self.signum) or (self.private and _has_handler(signal.getsignal(self.signum))):
            return False
        self._file = open_private(self.path, exclusive=False, buffering=1)
        self._register()
        if self.private:
            self._file.write(_HEADER.format(pid=os.getpid(), start=_start_ticks(os.getpid()) or 0,
                                            signum=self.signum))
        return True

    def _register(self) -> None:
        prev = signal.getsignal(self.signum)
        self.chained = _has_handler(prev)
        faulthandler.register(self.signum, file=self._file, all_threads=True, chain=self.chained)
        _REGISTERED.add(self.signum)
        self.restart = _add_restart(self.signum) if self.chained else True
        self._seen = prev

    def check(self) -> None:
        """A step boundary (training thread): did the job replace our handler since?"""
        if self.private:
            return
        if signal.getsignal(self.signum) is self._seen:
            if self.chained and self.restart:
                self._keep_restart()
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works on the main thread
        theirs = signal.getsignal(self.signum)
        # unregister() puts back the action from before stepwatch; put theirs back, then chain to it.
        faulthandler.unregister(self.signum)
        signal.signal(self.signum, theirs)
        self._register()

    def _keep_restart(self) -> None:
        # CPython's faulthandler re-installs its C handler with SA_NODEFER alone each time it
        # chains to the job's handler, dropping SA_RESTART: from the second signal on, blocking
        # system calls in C code (gloo, sockets, NFS) would fail with EINTR. Looked at once a
        # second, not every step (a sigaction costs microseconds).
        now = time.monotonic()
        if now - self._flags_t < 1.0:
            return
        self._flags_t = now
        flags = sa_flags(self.signum)
        if flags is not None and not flags & SA_RESTART:
            self.restart = _add_restart(self.signum)

    def uninstall(self) -> None:
        if self._file is None:
            return
        theirs = signal.getsignal(self.signum)
        try:
            faulthandler.unregister(self.signum)
            _REGISTERED.discard(self.signum)
            if _has_handler(theirs) and threading.current_thread() is threading.main_thread():
                signal.signal(self.signum, theirs)
        except (ValueError, OSError, RuntimeError):
            pass
        try:
            self._file.close()
        except OSError:
            pass
        self._file = None

    def manifest(self) -> dict[str, Any]:
        return {"signal": signal_name(self.signum), "file": self.path, "chained": self.chained,
                "sa_restart": self.restart}


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(faulthandler, "register")

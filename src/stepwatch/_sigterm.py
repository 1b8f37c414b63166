"""SIGTERM: finish the run directory (last records, final manifest), then die of SIGTERM as before.

SIGTERM (torchrun stopping the job, a scheduler's preemption) ends a Python process without
``atexit``, so the final manifest was never written. A Python-level handler alone is not enough:
it runs only when the main thread comes back to the interpreter, and a rank stuck in a
collective (the very rank torchrun is stopping) stays in C++ until the process-group timeout:
the default action ended it at once. So the wakeup fd (written by CPython's C-level handler, in
any state of the main thread) is watched by a small thread too: when the Python handler has not
started within a second, that thread finishes and ends the process itself.

Installed only when the job has no SIGTERM handler of its own (one it installs later replaces
this one, and the watcher then leaves the signal to it) and the wakeup fd is free (asyncio uses
it); only from the main thread. A shutdown on another thread (a trainer thread, a notebook
helper) cannot give the signal back (``signal.signal`` is main-thread only): the handler is
*retired* instead, acting as the default action and holding nothing of the session, and the
next session's ``install`` on the main thread takes it over.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

# Time to write the last records and the manifest (torchrun waits 30 s before SIGKILL).
FINISH_S = 3.0
# How long the main thread may take to run the Python handler before it counts as stuck in C.
_STUCK_S = 1.0


def _die(signum: int) -> None:
    """The default action of ``signum`` from any thread (``signal.signal`` is main-thread only)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signum, None)  # SIG_DFL
        os.kill(os.getpid(), signum)
    finally:
        os._exit(128 + signum)  # not reached when the signal ended the process


class SigtermFinisher:
    def __init__(self, finish: Callable[[float], None]) -> None:
        """``finish(timeout_s)``: the session's shutdown."""
        self.finish: Callable[[float], None] | None = finish
        self.pid = os.getpid()
        self.installed = False
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._done = threading.Event()
        self._closing = False
        self._r = self._w = -1

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            current = signal.getsignal(signal.SIGTERM)
            old = getattr(current, "__self__", None)
            if isinstance(old, SigtermFinisher) and old.finish is None and old.installed:
                old._give_back()  # a retired one (its session shut down off the main thread)
                current = signal.getsignal(signal.SIGTERM)
            if current is not signal.SIG_DFL:
                return
            signal.signal(signal.SIGTERM, self._handler)
        except (ValueError, OSError):
            return
        self.installed = True
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)  # CPython writes it from its signal handler
            prev = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return
        if prev != -1:  # someone else's (an event loop): the Python handler alone
            signal.set_wakeup_fd(prev)
            os.close(r)
            os.close(w)
            return
        self._r, self._w = r, w
        threading.Thread(target=self._watch, name="stepwatch-sigterm", daemon=True).start()

    def uninstall(self) -> None:
        """At shutdown: the job's SIGTERM is the default again. Off the main thread the handler
        is retired instead (see the module's docstring)."""
        if not self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            self.finish = None  # the default action from now on; the session can be freed
            return
        self._give_back()

    def _give_back(self) -> None:
        """Main thread: SIGTERM's handler and the wakeup fd back to what they were."""
        self.installed = False
        try:
            if signal.getsignal(signal.SIGTERM) == self._handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if self._w != -1:
                prev = signal.set_wakeup_fd(-1)
                if prev != self._w:  # not ours any more: give it back
                    signal.set_wakeup_fd(prev)
                    return  # and keep our pipe open: CPython may still write it
                self._closing = True
                os.write(self._w, b"\0")  # wake the watcher, which closes the pipe
        except (ValueError, OSError):
            pass

    def after_fork_in_child(self) -> None:
        """A forked child (DataLoader worker) must not signal through the parent's pipe."""
        if self._w == -1 or threading.current_thread() is not threading.main_thread():
            return
        try:
            signal.set_wakeup_fd(-1)
            if signal.getsignal(signal.SIGTERM) == self._handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.close(self._r)
            os.close(self._w)
        except (ValueError, OSError):
            pass
        self._r = self._w = -1
        self.installed = False

    # -- finishing ------------------------------------------------------------------------------

    def _finish_once(self) -> None:
        # Runs in the signal handler, which a second SIGTERM's handler can interrupt between any
        # two bytecodes: no lock is held across it and none is waited for (the first held a lock
        # and waited on ``_done``; a nested one that landed inside either waited forever). The
        # lock is taken once, by the first caller (the handler or the watcher), and kept.
        first = self._lock.acquire(blocking=False)
        if first:
            self._started.set()
            threading.Thread(target=self._run_finish, name="stepwatch-sigterm-finish", daemon=True).start()
        deadline = time.monotonic() + FINISH_S
        while not self._done.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _run_finish(self) -> None:
        finish = self.finish
        try:
            if finish is not None:  # None: retired, nothing to finish
                finish(FINISH_S / 2)
        except Exception:  # dying anyway: nothing left to report to
            pass
        finally:
            self._done.set()

    def _handler(self, signum: int, frame: object) -> None:
        if os.getpid() == self.pid and self.finish is not None:
            self._finish_once()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _ours(self) -> bool:
        """Our handler is still SIGTERM's (a job may install its own after ``install``: then the
        signal is the job's to handle, however long its handler takes to run)."""
        try:
            return signal.getsignal(signal.SIGTERM) == self._handler  # a bound method: ==, not is
        except (ValueError, OSError):
            return False

    def _watch(self) -> None:
        r, w = self._r, self._w
        try:
            while True:
                try:
                    data = os.read(r, 64)
                except InterruptedError:
                    continue
                if not data or self._closing:
                    return
                if signal.SIGTERM not in data:
                    continue
                if not self._ours():
                    continue  # the job's own handler, installed after ours: left alone
                if self._started.wait(_STUCK_S):
                    return  # the main thread runs the handler: it finishes and ends the process
                if not self._ours():
                    continue  # replaced while the signal was on its way: the job's handler runs it
                self._finish_once()
                _die(signal.SIGTERM)
        except OSError:
            return
        finally:
            if self._closing:
                for fd in (r, w):
                    try:
                        os.close(fd)
                    except OSError:
                        pass

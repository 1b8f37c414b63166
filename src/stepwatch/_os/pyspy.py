"""Stack dumps of a running process: py-spy from outside, or faulthandler from inside.

py-spy reads the target's memory (``process_vm_readv``), so it works while the target holds the
GIL in C code or sits in a blocking call. It needs ptrace rights over the target (see
``_os/ptrace.py``). Two samples a couple of seconds apart tell *stuck* (the same frames) from
*slow* (frames moving). The second sample adds native frames (``--native``) when that finishes
within its budget: unwinding native stacks can take seconds on a large process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .._files import write_private
from .procs import STOPPED_STATES, read_stat
from .ptrace import find_pyspy

__all__ = ["find_pyspy", "dump", "two_samples", "parse_threads", "main_frames", "call_site", "parallel"]

# py-spy prints "Thread <tid> (<state>): "<name>"" then one "    func (file:line)" per frame.
_PYSPY_THREAD = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(([^)]*)\)(?:: "(.*)")?')
_PYSPY_FRAME = re.compile(r"^\s+(.+?) \((.+)\)\s*$")
# faulthandler prints "Thread 0x... (most recent call first):" / "Current thread 0x..." then
# '  File "<path>", line N in <func>'.
_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')


def _resume(pid: int) -> None:
    """py-spy stops each thread (ptrace) while it reads it; killed or failed midway, it can leave
    the trainer stopped (py-spy issues #390, #416). A SIGCONT to a running process does nothing."""
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass


def _pdeathsig() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the thread that started it dies
    (Linux ``PR_SET_PDEATHSIG``; it survives the exec): a py-spy stuck on its target must not
    outlive a watchdog sidecar that was killed while it waited. ``prctl`` is looked up here, so
    the child runs no import between fork and exec. None where there is no such call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigkill = 1, int(signal.SIGKILL)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigkill, 0, 0, 0)

    return preexec


_DIE_WITH_PARENT = _pdeathsig()


def dump(
    pyspy: str, pid: int, *, native: bool = False, nonblocking: bool = False, timeout_s: float = 10.0
) -> tuple[bool, str]:
    """One ``py-spy dump`` of ``pid``: (succeeded, output or the reason it failed).
    ``nonblocking`` reads without pausing the process (needed for a stopped or D-state one)."""
    ok, text, _ = _dump(pyspy, pid, native, nonblocking, timeout_s)
    return ok, text


def stopped(pid: int) -> bool:
    """Is ``pid`` stopped (SIGSTOP, an operator's or a scheduler's pause; a debugger's trace
    stop)? False when it cannot be read."""
    st = read_stat(pid)
    return st is not None and st.state in STOPPED_STATES


STOPPED_NOTE = ("(the process was stopped -- SIGSTOP or a debugger -- before this dump: read without "
                "pausing it, and left stopped)")


def _dump(pyspy: str, pid: int, native: bool, nonblocking: bool, timeout_s: float) -> tuple[bool, str, bool]:
    """``dump``'s (succeeded, text) and whether py-spy ran out of time (it is stuck on this
    target: a retry would wait as long). A process someone else stopped is read without pausing
    it and never resumed: a blocking dump fails on it at once, and the SIGCONT that undoes a
    py-spy killed midway restarted it (a rank paused on purpose went on training, and the hang
    report described the resumed process)."""
    held = stopped(pid)
    ok, text, timed_out = _run_dump(pyspy, pid, native, nonblocking or held, timeout_s)
    if held:
        return ok, (f"{STOPPED_NOTE}\n{text}" if ok else f"{text} {STOPPED_NOTE}"), timed_out
    if not ok and not nonblocking:
        _resume(pid)
    return ok, text, timed_out


def _run_dump(pyspy: str, pid: int, native: bool, nonblocking: bool, timeout_s: float) -> tuple[bool, str, bool]:
    cmd = [pyspy, "dump", "--pid", str(pid)]
    if native:
        cmd.append("--native")
    if nonblocking:
        cmd.append("--nonblocking")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                           preexec_fn=_DIE_WITH_PARENT)
    except subprocess.TimeoutExpired:
        return False, f"py-spy dump{' --native' if native else ''} did not finish within {timeout_s:.0f} s", True
    except OSError as e:
        return False, f"cannot run {pyspy}: {e}", False
    if r.returncode != 0 or "Thread" not in r.stdout:
        return False, _why(r.stderr or r.stdout) or f"py-spy exited with code {r.returncode}", False
    return True, r.stdout, False


def _why(text: str) -> str:
    """py-spy's error in one line: its first line and the causes under it ("Caused by: 0:
    Permission denied"), without the Rust backtrace that follows ("Stack backtrace: ... 10: main",
    whose last lines were all ``stepwatch dump 1`` printed of it)."""
    said: list[str] = []
    for line in text.strip().splitlines():
        line = line.strip()
        if line.startswith("Stack backtrace"):
            break
        line = re.sub(r"^\d+: ", "", line)
        if line and line not in said:
            said.append(line)
    return " ".join(said)


def parse_threads(text: str) -> list[dict[str, Any]]:
    """Threads of a py-spy or faulthandler dump, innermost frame first:
    ``[{"id", "name", "state", "frames": ["func (file:line)", ...]}]``."""
    threads: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in text.splitlines():
        m = _PYSPY_THREAD.match(line)
        if m:
            cur = {"id": m.group(1), "state": m.group(2), "name": m.group(3) or "", "frames": []}
            threads.append(cur)
            continue
        m = _FH_THREAD.match(line)
        if m:
            current = m.group(1) == "Current thread"
            cur = {"id": m.group(2), "state": "current" if current else "", "name": "", "frames": []}
            threads.append(cur)
            continue
        if cur is None:
            continue
        m = _FH_FRAME.match(line)
        if m:
            cur["frames"].append(f"{m.group(3)} ({m.group(1)}:{m.group(2)})")
            continue
        m = _PYSPY_FRAME.match(line)
        if m and not line.lstrip().startswith(("Process ", "Python v")):
            cur["frames"].append(f"{m.group(1)} ({m.group(2)})")
    return threads


def main_frames(text: str) -> list[str]:
    """The main thread's frames (innermost first). py-spy names it ``MainThread``; faulthandler
    lists threads newest first, so the main thread is its last block."""
    threads = parse_threads(text)
    if not threads:
        return []
    for t in threads:
        if t["name"] == "MainThread":
            return t["frames"]
    return threads[-1]["frames"]


# Top-level packages whose frames are never the job's call site. py-spy prints paths relative to
# the sys.path entry they were found under ("torch/_tensor.py"), faulthandler absolute ones.
_LIBRARIES = frozenset({"torch", "stepwatch", "numpy", "functorch", "triton", "apex", "deepspeed",
                        "lightning", "pytorch_lightning", "accelerate", "transformers"})


def _is_library(frame: str) -> bool:
    if any(s in frame for s in ("site-packages", "dist-packages", "/lib/python3", "<frozen", "<string>")):
        return True
    path = frame[frame.rfind("(") + 1:].rsplit(":", 1)[0]
    if os.path.isabs(path):
        return False
    top = path.replace("\\", "/").split("/", 1)[0]
    top = top[:-3] if top.endswith(".py") else top
    return top in _LIBRARIES or top in sys.stdlib_module_names


def call_site(frames: list[str]) -> str | None:
    """The innermost frame in the job's own code (not the standard library, torch or stepwatch)."""
    for f in frames:
        if "(" in f and not _is_library(f) and ".py:" in f:
            return f
    return None


def two_samples(
    pyspy: str, pid: int, *, gap_s: float = 2.0, native_budget_s: float = 8.0, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Two dumps ``gap_s`` apart; the second with native frames when that fits its budget.

    Returns ``{"ok", "text", "stuck", "top_frames", "native", "error"}``. ``stuck`` is True when
    the main thread's Python frames did not move between the samples. A first dump that runs out
    of time ends it there: py-spy is stuck on this target, and each retry would wait its whole
    budget too (the caller falls back to faulthandler while the hang still lasts)."""
    t0 = time.time()
    ok1, out1, timed_out = _dump(pyspy, pid, False, False, timeout_s)
    if timed_out:
        return {"ok": False, "text": f"== sample 1 at {_ts(t0)} (py-spy dump) ==\n{out1}\n", "stuck": False,
                "top_frames": [], "native": False, "error": out1}
    time.sleep(gap_s)
    t1 = time.time()
    ok2, out2 = dump(pyspy, pid, native=True, timeout_s=native_budget_s)
    native = ok2
    if not ok2:
        native_err = out2
        ok2, out2 = dump(pyspy, pid, timeout_s=timeout_s)
    else:
        native_err = None
    parts = [f"== sample 1 at {_ts(t0)} (py-spy dump) ==", out1.rstrip(), ""]
    parts += [f"== sample 2 at {_ts(t1)} (py-spy dump{' --native' if native else ''}) ==", out2.rstrip(), ""]
    if native_err:
        parts.append(f"(native frames skipped: {native_err})")
    f1 = [f for f in main_frames(out1) if _python_frame(f)] if ok1 else []
    f2 = [f for f in main_frames(out2) if _python_frame(f)] if ok2 else []
    return {
        "ok": ok1 or ok2,
        "text": "\n".join(parts) + "\n",
        "stuck": bool(f1) and f1 == f2,
        "top_frames": (f2 or f1)[:8],
        "native": native,
        "error": None if (ok1 or ok2) else out1,
    }


def _python_frame(f: str) -> bool:
    # Native frames from --native name a shared object, not a .py file.
    return ".py:" in f


def _ts(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def parallel(pyspy: str, pids: dict[int, int], out_dir: str, *, native: bool = False, timeout_s: float = 10.0) -> dict[int, str]:
    """Dump every rank's pid at once into ``out_dir/stacks.rank<R>.txt``; returns rank -> status."""
    def one(item: tuple[int, int]) -> tuple[int, str]:
        rank, pid = item
        ok, text = dump(pyspy, pid, native=native, timeout_s=timeout_s)
        path = os.path.join(out_dir, f"stacks.rank{rank}.txt")
        write_private(path, text if ok else f"py-spy failed: {text}\n")
        return rank, ("ok" if ok else text)

    if not pids:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(pids), 16)) as ex:
        return dict(ex.map(one, sorted(pids.items())))



"""Can py-spy attach to a training process here? Asked of the kernel, then tried for real.

py-spy reads another process's memory (``process_vm_readv``), which Linux allows under the same
rules as ptrace. Two things decide it: Yama's ``kernel.yama.ptrace_scope`` (kernel
Documentation/admin-guide/LSM/Yama.rst: 0 classic, 1 only descendants, 2 only with
CAP_SYS_PTRACE, 3 never) and the CAP_SYS_PTRACE capability (bit 19, linux/capability.h). A
training rank is not py-spy's descendant, so the real test attaches to a *sibling*: a child of
this process that py-spy (another child) did not start.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CAP_SYS_PTRACE = 19  # linux/capability.h
YAMA = "/proc/sys/kernel/yama/ptrace_scope"
# PR_SET_PTRACER lets the named process attach to us although it is not our ancestor (Yama).
# Value from linux/prctl.h ("Yama" in ASCII).
PR_SET_PTRACER = 0x59616D61
YAMA_MEANING = {
    0: "classic: any process of the same user",
    1: "restricted: only descendants (a training rank is not one) unless CAP_SYS_PTRACE",
    2: "admin-only: needs CAP_SYS_PTRACE",
    3: "no attach at all (until reboot)",
}
FIX = ("Give the job CAP_SYS_PTRACE (docker run --cap-add SYS_PTRACE; Kubernetes "
       "securityContext.capabilities.add: [SYS_PTRACE]) or set kernel.yama.ptrace_scope=0 "
       "(sysctl, as root).")


def ptrace_scope(path: str = YAMA) -> int | None:
    """Yama's ptrace scope, or None when Yama is not in the kernel (classic rules apply)."""
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def has_cap_sys_ptrace(status_path: str = "/proc/self/status") -> bool | None:
    try:
        for line in Path(status_path).read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def find_pyspy() -> str | None:
    """py-spy next to this Python (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("py-spy")


def try_attach(pyspy: str, timeout_s: float = 20.0) -> tuple[bool, str]:
    """Start a sleeping Python child and ``py-spy dump --pid`` it. (attached?, what happened)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile True:\n    time.sleep(0.05)\n"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)  # let the interpreter come up: py-spy needs its thread state
        last = ""
        for _ in range(3):
            try:
                res = subprocess.run([pyspy, "dump", "--pid", str(child.pid)], capture_output=True,
                                     text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return False, f"py-spy dump did not finish within {timeout_s:.0f} s"
            out = res.stdout + res.stderr
            if res.returncode == 0 and "Thread" in res.stdout and "<module>" in res.stdout:
                return True, f"dumped the stack of a sibling process (pid {child.pid})"
            last = " ".join(out.strip().splitlines()[-3:]) or f"exit code {res.returncode}"
            if "ermission" in out:  # "Permission Denied": no point retrying
                break
            time.sleep(0.3)
        return False, last
    finally:
        child.kill()
        child.wait(timeout=10)


def grant_ptrace(pid: int) -> str:
    """Let ``pid`` (our child, the sidecar) read our memory under Yama's ptrace_scope=1."""
    scope = ptrace_scope()
    if scope is None:
        return "no Yama: classic ptrace rules"
    if scope != 1:
        return f"Yama ptrace_scope={scope}: PR_SET_PTRACER does not apply"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
        return f"prctl(PR_SET_PTRACER) failed: {os.strerror(ctypes.get_errno())}"
    return f"Yama ptrace_scope=1: granted to pid {pid} with prctl(PR_SET_PTRACER)"


def can_read_memory(pid: int) -> tuple[bool, str]:
    """Can this process read ``pid``'s memory (what py-spy does)? Asked of the kernel with one
    ``process_vm_readv`` of a byte the target has mapped."""
    try:
        with open(f"/proc/{pid}/maps", encoding="ascii") as f:
            first = f.readline()
        addr = int(first.split("-", 1)[0], 16)
    except (OSError, ValueError) as e:
        return False, f"cannot read /proc/{pid}/maps: {e}"

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(1)
    local = IoVec(ctypes.cast(buf, ctypes.c_void_p), 1)
    remote = IoVec(ctypes.c_void_p(addr), 1)
    n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if n == 1:
        return True, "process_vm_readv succeeded"
    return False, os.strerror(ctypes.get_errno())

"""Can py-spy attach to a training process here? Asked of the kernel, then tried for real.

py-spy reads another process's memory (``process_vm_readv``), which Linux allows under the same
rules as ptrace. Two things decide it: Yama's ``kernel.yama.ptrace_scope`` (kernel
Documentation/admin-guide/LSM/Yama.rst: 0 classic, 1 only descendants, 2 only with
CAP_SYS_PTRACE, 3 never) and the CAP_SYS_PTRACE capability (bit 19, linux/capability.h). A
training rank is not py-spy's descendant, so the real test attaches to a *sibling*: a child of
this process that py-spy (another child) did not start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CAP_SYS_PTRACE = 19  # linux/capability.h
YAMA = "/proc/sys/kernel/yama/ptrace_scope"
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

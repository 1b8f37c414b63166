"""The vLLM server as a child process: launched in its own process group, stopped with its tree.

Stopping: SIGTERM (or the signal the wrapper got) to the API server, which stops its engine and
workers itself (~2.5 s on CPU, shared/vllm/README.md); SIGCONT to every process of the tree, so a
stopped (SIGSTOP) one can receive it; after ``grace_s`` SIGKILL to the process group and to every
process ever seen in the tree (checked by start time, so a re-used pid is never hit).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Mapping, Sequence

from .._os import procs

log = logging.getLogger("stepwatch.serving")

LOAD_TRACKING_FLAG = "--enable-server-load-tracking"
# vLLM's own defaults for the OpenAI server (vllm/entrypoints/openai/cli_args.py: host None =
# all interfaces, port 8000).
DEFAULT_PORT = 8000
# Seconds an orphan of the tree gets after its signal before SIGKILL.
ORPHAN_GRACE_S = 5.0


def is_vllm_command(cmd: Sequence[str]) -> bool:
    """``vllm serve ...``, ``python -m vllm.entrypoints.openai.api_server ...`` and the like."""
    for i, a in enumerate(cmd[:6]):
        base = os.path.basename(a)
        if base == "vllm" and i + 1 < len(cmd) and cmd[i + 1] == "serve":
            return True
        if a.startswith("vllm.entrypoints"):
            return True
    return False


def _flag_value(cmd: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(cmd):
        if a == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def server_url(cmd: Sequence[str]) -> str:
    """Where the launched server will listen, from its ``--host``/``--port`` (vLLM's defaults)."""
    host = _flag_value(cmd, "--host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = _flag_value(cmd, "--port") or str(DEFAULT_PORT)
    return f"http://{host}:{port}"


def max_num_seqs(cmd: Sequence[str]) -> int | None:
    """The command's ``--max-num-seqs`` (vLLM's batch cap), or None when it does not say (vLLM's
    default depends on its version, device and entry point: not guessed)."""
    v = _flag_value(cmd, "--max-num-seqs")
    try:
        n = int(v) if v is not None else None
    except ValueError:
        return None
    return n if n is not None and n > 0 else None


def with_load_tracking(cmd: Sequence[str]) -> list[str]:
    """vLLM counts in-flight requests at ``/load`` only with this flag; the stall detector needs it."""
    out = list(cmd)
    if is_vllm_command(out) and LOAD_TRACKING_FLAG not in out:
        out.append(LOAD_TRACKING_FLAG)
    return out


class VllmServer:
    """A server command run as a child in its own process group."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        add_load_tracking: bool = True,
        stdout: int | None = None,
        stderr: int | None = None,
        die_with_parent: bool = False,
    ) -> None:
        if not cmd:
            raise ValueError("cmd: the server command is empty (give it after `--`)")
        self.cmd = with_load_tracking(cmd) if add_load_tracking else list(cmd)
        self.url = server_url(self.cmd)
        self._env = dict(env) if env is not None else None
        self._stdout, self._stderr = stdout, stderr
        # Linux's PR_SET_PDEATHSIG fires when the *thread* that started the child exits, so it is
        # opt-in: for a wrapper process that starts the server from its main thread (the CLI).
        self._die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, int] = {}  # pid -> starttime of every process seen in the tree
        self.signalled: int | None = None  # the signal forwarded to the server, if any

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> "VllmServer":
        # start_new_session: its own process group (and session), so a signal to the group
        # reaches the engine and workers and nothing of ours; the terminal's Ctrl-C reaches
        # only the wrapper, which forwards it.
        self.proc = subprocess.Popen(
            self.cmd, env=self._env, start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=self._stdout, stderr=self._stderr,
            preexec_fn=_term_when_parent_dies if self._die_with_parent else None,
        )
        self.refresh_tree()
        return self

    def refresh_tree(self) -> list[procs.ProcStat]:
        """Remember every process now in the tree (call it now and then: orphans are found by it)."""
        if self.proc is None:
            return []
        members = procs.tree(self.proc.pid)
        for p in members:
            self._seen.setdefault(p.pid, p.starttime)
        return members

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signalled = sig
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def leftovers(self) -> list[int]:
        """Processes of the tree still alive (not zombies), the child excepted once it exited."""
        return [p for p, st in self._seen.items() if procs.alive(p, st)]

    def _continue_all(self) -> None:
        for p, st in list(self._seen.items()):
            if procs.alive(p, st):
                try:
                    os.kill(p, signal.SIGCONT)
                except OSError:
                    pass

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0, orphan_grace_s: float = ORPHAN_GRACE_S) -> int:
        """Stop the server and its whole tree; return its exit code (128+N if killed by signal N)."""
        if self.proc is None:
            return 0
        self.refresh_tree()
        # Once only: a second SIGTERM can hit a Python server while it exits, after the
        # interpreter dropped its handler, and turn a clean exit code into -15.
        if self.proc.poll() is None and self.signalled is None:
            self.send_signal(sig)
        self._continue_all()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.refresh_tree()
            time.sleep(0.1)
        if self.leftovers():
            # The server is gone (or out of time) but part of its tree is not: orphans get the
            # same signal, a few seconds to act on it, then SIGKILL.
            for p, st in list(self._seen.items()):
                if procs.alive(p, st):
                    try:
                        os.kill(p, sig)
                    except OSError:
                        pass
            self._continue_all()
            t = min(deadline, time.monotonic() + orphan_grace_s) if self.proc.poll() is not None else time.monotonic()
            while time.monotonic() < t and self.leftovers():
                time.sleep(0.1)
        self.kill_rest()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        return self.exit_code()

    def kill_rest(self) -> None:
        """SIGKILL whatever of the tree is left: the process group, then each remembered process."""
        if self.proc is None:
            return
        left = self.leftovers()
        if left:
            log.warning("stepwatch serve-vllm: %d process(es) of the server did not exit; killing %s", len(left), left)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        for p, st in list(self._seen.items()):
            if procs.alive(p, st):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        t = time.monotonic() + 5.0
        while self.leftovers() and time.monotonic() < t:
            time.sleep(0.05)

    def exit_code(self) -> int:
        rc = self.proc.returncode if self.proc is not None else 0
        if rc is None:
            return 1
        return 128 - rc if rc < 0 else rc


def _term_when_parent_dies() -> None:
    """In the child before exec: SIGTERM when the wrapper dies, even by SIGKILL (prctl
    PR_SET_PDEATHSIG = 1, linux/prctl.h), so a killed wrapper does not leave a server running."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass

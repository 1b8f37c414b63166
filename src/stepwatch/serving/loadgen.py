"""A small, bounded load generator for an OpenAI-compatible server (examples and tests).

Requests go only to the URL given (meant for a loopback server); every call is bounded in count
and time and returns when done. Threads, not asyncio: a burst of tens of requests is the point.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass
class Result:
    status: int | None  # HTTP status, None = no response (refused, timed out)
    seconds: float
    error: str | None = None


def complete(url: str, model: str, prompt: str, *, max_tokens: int = 32, timeout_s: float = 120.0,
             extra: dict | None = None) -> Result:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                       "ignore_eos": True, **(extra or {})}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    t0 = time.monotonic()
    try:
        with opener.open(req, timeout=timeout_s) as r:
            r.read()
            return Result(r.status, time.monotonic() - t0)
    except urllib.error.HTTPError as e:
        return Result(e.code, time.monotonic() - t0, str(e))
    except OSError as e:
        return Result(None, time.monotonic() - t0, repr(e))


class Burst:
    """``n`` concurrent completions, started at once in the background; ``wait()`` collects them.

    ``gate``: the threads start but send nothing until it is set, so the requests leave together
    however long starting ``n`` threads takes (seconds on a busy machine); a gate never set sends
    nothing, and ``wait()`` returns what has come back by its timeout."""

    def __init__(self, url: str, model: str, n: int, *, max_tokens: int = 32, timeout_s: float = 120.0,
                 prompt: str = "the quick brown fox jumps over the lazy dog",
                 gate: threading.Event | None = None) -> None:
        if not 1 <= n <= 1000:
            raise ValueError(f"n must be within 1..1000, got {n}")
        self.results: list[Result] = []
        self._gate = gate
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._one, args=(url, model, f"{prompt} {i}", max_tokens, timeout_s),
                             name=f"loadgen-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def _one(self, url: str, model: str, prompt: str, max_tokens: int, timeout_s: float) -> None:
        if self._gate is not None:
            self._gate.wait()
        r = complete(url, model, prompt, max_tokens=max_tokens, timeout_s=timeout_s)
        with self._lock:
            self.results.append(r)

    @property
    def in_flight(self) -> int:
        """Requests sent (or being sent) that have not returned yet."""
        with self._lock:
            return len(self._threads) - len(self.results)

    def wait(self, timeout_s: float = 300.0) -> list[Result]:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return list(self.results)

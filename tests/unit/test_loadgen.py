"""serving/loadgen.py's Burst against a real loopback HTTP server (http.server in a thread) that
counts the completions it receives."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stepwatch.serving.loadgen import Burst


class _Counting(BaseHTTPRequestHandler):
    arrived: list[dict] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.arrived.append(body)
        out = b'{"choices": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    _Counting.arrived = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_gated_burst_sends_nothing_until_the_gate_opens_then_everything(server):
    go = threading.Event()
    b = Burst(server, "m", 12, max_tokens=7, gate=go)
    time.sleep(0.3)  # every thread has started (Thread.start returns once it runs) and waits
    assert _Counting.arrived == [] and b.in_flight == 12
    go.set()
    results = b.wait(30)
    assert len(results) == 12 and all(r.status == 200 for r in results), results
    assert len(_Counting.arrived) == 12 and b.in_flight == 0
    assert {r["max_tokens"] for r in _Counting.arrived} == {7}
    assert len({r["prompt"] for r in _Counting.arrived}) == 12  # each request its own prompt


def test_an_ungated_burst_sends_at_once(server):
    results = Burst(server, "m", 5).wait(30)
    assert [r.status for r in results] == [200] * 5 and len(_Counting.arrived) == 5


def test_a_gate_never_opened_returns_what_came_back_by_the_timeout(server):
    b = Burst(server, "m", 3, gate=threading.Event())
    t0 = time.monotonic()
    assert b.wait(0.5) == [] and time.monotonic() - t0 < 5
    assert _Counting.arrived == []


def test_burst_size_is_checked():
    with pytest.raises(ValueError, match="n must be within 1..1000, got 0"):
        Burst("http://127.0.0.1:9", "m", 0)

"""The Prometheus endpoint under a flood of half-sent requests (issue 14): a real trainer process
serving /metrics, 300 connections that send ``GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n`` and never
finish, opened 10 ms apart and kept open. The trainer's thread and descriptor counts (read from
/proc/<pid>) stay bounded, it keeps training, and a normal scrape works while the flood's sockets
are still open."""

import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

TRAINER = textwrap.dedent(
    """
    import os, sys, time
    import stepwatch, torch, torch.nn as nn
    stepwatch.init(prometheus_port=int(sys.argv[1]), records=False, console="off",
                   gpu_telemetry=False, watchdog="off", capture="off")
    m = nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    print("ready", flush=True)
    while not os.path.exists(sys.argv[2]):
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.005)
    stepwatch.shutdown()
    print("done", flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _scrape(port: int, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        assert r.status == 200
        return r.read().decode()


def _steps_total(body: str) -> float:
    lines = [line for line in body.splitlines() if line.startswith("training_steps_total{")]
    return float(lines[0].split()[-1]) if lines else -1.0


def test_half_sent_request_flood_keeps_threads_and_descriptors_bounded(tmp_path):
    port = _free_port()
    stop = tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(port), str(stop)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    flood: list[socket.socket] = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while True:  # the endpoint starts with the first records
            try:
                if _steps_total(_scrape(port)) > 0:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the endpoint never served"
            time.sleep(0.1)
        threads0, fds0 = _threads(proc.pid), _fds(proc.pid)

        most_threads, most_fds = threads0, fds0
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            flood.append(s)
            time.sleep(0.01)
            most_threads = max(most_threads, _threads(proc.pid))
            most_fds = max(most_fds, _fds(proc.pid))
        assert proc.poll() is None, "the trainer died under the flood"
        # A fixed pool: no thread per connection, and a fixed number of connections held.
        assert most_threads <= threads0 + 2, f"threads {threads0} -> {most_threads}"
        assert most_fds <= fds0 + 40, f"descriptors {fds0} -> {most_fds}"

        # A normal scrape works while every flood socket is still open, and training went on.
        before = _steps_total(_scrape(port, timeout=10))
        time.sleep(0.5)
        after = _steps_total(_scrape(port, timeout=10))
        assert after > before > 0
    finally:
        for s in flood:
            s.close()
        stop.touch()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "done" in out

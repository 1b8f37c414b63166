"""Serve a local model with vLLM under stepwatch's watch, from Python, and put load on it.

    eval "$(scripts/setup_vllm.sh)"      # CPU vLLM venv + a tiny local model (cached; ~2 min once)
    python examples/vllm_serve.py "$VLLM_MODEL" --python "$VLLM_PYTHON"

What it shows: the server launched as a child (its own process group, stopped with its whole
tree), the scrape loop feeding an exporter with ``stepwatch_serving_*`` samples, a burst of
requests that fills the queue (a ``queue_depth`` finding at the lowered threshold), and the SLOs
read back. The command line does the same with ``stepwatch serve-vllm -- <vLLM command>``.
Everything stays on 127.0.0.1; the load is bounded in count and time.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from stepwatch.exporters.base import InMemoryExporter  # noqa: E402
from stepwatch.serving import names as N  # noqa: E402
from stepwatch.serving.detect import Thresholds  # noqa: E402
from stepwatch.serving.loadgen import Burst  # noqa: E402
from stepwatch.serving.watcher import ServeWatcher, WatchConfig  # noqa: E402
from stepwatch.serving.wrapper import VllmServer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="a local Hugging Face model directory")
    ap.add_argument("--python", default=sys.executable, help="the Python that has vLLM (default: this one)")
    ap.add_argument("--port", type=int, default=18123)
    ap.add_argument("--requests", type=int, default=40, help="size of the burst (default 40)")
    ap.add_argument("--run-dir", default="stepwatch-runs/vllm-example")
    args = ap.parse_args()

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [args.python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_dir,
           "--host", "127.0.0.1", "--port", str(args.port), "--served-model-name", "model",
           # float32: bfloat16's AMX kernels killed the CPU worker (SIGILL) under bursts on our test machine.
           "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager"]
    server = VllmServer(cmd, env=env).start()  # adds --enable-server-load-tracking
    mem = InMemoryExporter()  # or stepwatch.exporters.otel.OTelExporter(ctx, prometheus_port=...)
    watcher = ServeWatcher(
        WatchConfig(urls=[server.url], run_dir=args.run_dir, interval_s=1.0, stall_timeout_s=30.0,
                    windows_s=(30.0, 60.0), thresholds=Thresholds(queue_depth=5)),
        exporters=[mem], root_pid=server.pid,
    )
    stop = threading.Event()
    loop = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    loop.start()
    try:
        print(f"starting vLLM (pid {server.pid}) on {server.url} ...", flush=True)
        deadline = time.monotonic() + 600
        while True:
            try:
                if urllib.request.urlopen(server.url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print("vLLM did not come up", file=sys.stderr)
                return 1
            time.sleep(1.0)
        time.sleep(2.0)  # one scrape before the load, so the windows see all of it
        print(f"up; sending {args.requests} concurrent completions", flush=True)
        results = Burst(server.url, "model", args.requests, max_tokens=64).wait(300)
        ok = sum(1 for r in results if r.status == 200)
        time.sleep(2.5)  # the scrape after the burst
        print(f"{ok}/{len(results)} requests answered 200")

        def last(name: str, **labels: str) -> float | None:
            for s in reversed(mem.samples):
                if name in s and all(s["labels"].get(k) == v for k, v in labels.items()):
                    return s[name]
            return None

        print(f"TTFT P50/P99 over 30 s: {last(N.OUT_TTFT, window='30s', quantile='0.5')} / "
              f"{last(N.OUT_TTFT, window='30s', quantile='0.99')} s")
        print(f"inter-token latency P99: {last(N.OUT_ITL, window='30s', quantile='0.99')} s")
        print(f"generated tokens/s over 30 s: {last(N.OUT_GEN_TPS, window='30s')}")
        print(f"KV-cache usage: {last(N.OUT_KV)}")
        for f in watcher.findings:
            print(f"finding [{f.severity}] {f.kind}: {f.summary}\n  -> {f.action}")
        print(f"findings file: {watcher.findings_path}")
    finally:
        stop.set()
        loop.join(30)
        rc = server.stop()
        watcher.close()
        print(f"server stopped with exit code {rc}; processes left: {server.leftovers() or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

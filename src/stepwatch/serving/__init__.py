"""``stepwatch serve-vllm``: watch a vLLM server's SLOs and catch an engine that stops moving.

- :mod:`.parse`   ``/metrics`` text -> samples (prometheus_client's parser), bad text counted, skipped
- :mod:`.names`   vLLM metric names, both generations (0.32 and the older v0 names)
- :mod:`.slo`     windows over scrapes: histogram quantiles from bucket deltas, rates from counters
- :mod:`.detect`  findings: KV-cache cascade, TTFT P99 SLO, queue depth, spec-decode, errors
- :mod:`.stall`   no token progress with requests in flight -> py-spy dumps of the whole tree
- :mod:`.procs`   the server's process tree from /proc
- :mod:`.watcher` the scrape loop that ties them together and feeds stepwatch's exporters
- :mod:`.wrapper` the child process: launch, signals, exit code, no orphans
- :mod:`.cli`     the ``serve-vllm`` subcommand

Nothing here is imported by ``import stepwatch``; the CLI imports it when the command runs.
"""

from __future__ import annotations

__all__ = ["ServeWatcher", "WatchConfig", "VllmServer"]


def __getattr__(name: str):  # lazy: keep `import stepwatch.serving` cheap
    if name in ("ServeWatcher", "WatchConfig"):
        from . import watcher

        return getattr(watcher, name)
    if name == "VllmServer":
        from .wrapper import VllmServer

        return VllmServer
    raise AttributeError(name)

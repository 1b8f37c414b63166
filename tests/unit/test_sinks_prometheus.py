"""The Prometheus endpoint: every metric family it serves has its ``# HELP`` and ``# TYPE``
lines, and every sample belongs to a family announced so (the text format 0.0.4; a family
without HELP shows no description in Prometheus' UI and Grafana's metric browser)."""

import re
import socket
import time
import urllib.request

import torch

from stepwatch.context import RunContext
from stepwatch.exporters import names as N
from stepwatch.exporters.base import Batch
from stepwatch.exporters.otel import OTelExporter
from stepwatch.record import Finding, StepRecord

_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_families(body: str) -> set[str]:
    """The families served; asserts HELP and TYPE for each, and a family for each sample."""
    helps, types = {}, {}
    samples = []
    for line in body.splitlines():
        m = re.match(r"# (HELP|TYPE) (\S+) ?(.*)", line)
        if m:
            (helps if m[1] == "HELP" else types)[m[2]] = m[3]
        elif line and not line.startswith("#"):
            samples.append(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)[0])
    assert set(helps) == set(types), (set(types) - set(helps), set(helps) - set(types))
    assert all(text.strip() for text in helps.values()), [n for n, t in helps.items() if not t.strip()]
    for name in samples:
        owners = [f for f, t in types.items() if name == f or name in (f + s for s in _SUFFIXES.get(t, ()))]
        assert owners, f"sample {name} has no # TYPE line"
    return set(types)


def test_a_sessions_endpoint_has_help_and_type_for_every_family(sw):
    stepwatch, mem, start = sw
    port = _free_port()
    start(prometheus_port=port)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(20):
        with stepwatch.phase("fetch"):
            x = torch.randn(2, 4)
        loss = m(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        stepwatch.log(loss=loss.detach())
    deadline = time.monotonic() + 30
    while len(mem.records) < 19 and time.monotonic() < deadline:
        time.sleep(0.05)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        body = r.read().decode()
    families = _check_families(body)
    assert {N.STEP_SECONDS.name, N.STEPS_TOTAL.name, N.SCALAR.name, N.PHASE_SECONDS.name} <= families, families


def test_every_family_of_a_full_batch_has_help_and_type():
    """Every record field, phases, scalars, a finding and GPU samples: all families at once."""
    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir="/nonexistent", pid=1)
    e = OTelExporter(ctx, readers=[], prometheus_port=_free_port(), environ={})
    try:
        rec = StepRecord(
            step=1, rank=0, time=time.time(), step_s=0.2, data_wait_s=0.01, forward_s=0.05, backward_s=0.1,
            optimizer_s=0.02, mfu=0.4, hfu=0.5, tokens=4096, grad_norm=1.5, comm_s=0.02, comm_exposed_s=0.01,
            overlap=0.5, allreduce_s=0.01, busbw_gbps=100.0, phases={"fetch": 0.003}, scalars={"loss": 2.0},
        )
        finding = Finding(time=time.time(), step=1, rank=0, kind="data_loading", severity="warning",
                          summary="s", diagnosis="d", action="a")
        gpu = {"gpu": 0, **{f: 1.0 for f in N.DCGM_FIELDS}}
        e.export(Batch(records=[rec], findings=[finding], samples=[gpu]))
        with urllib.request.urlopen(e.prometheus.url, timeout=10) as r:
            body = r.read().decode()
        families = _check_families(body)
        assert N.STEP_SECONDS.name in families and "DCGM_FI_DEV_GPU_TEMP" in families, families
    finally:
        e.shutdown()


def test_a_name_that_is_not_valid_utf8_leaves_every_scrape_whole():
    """``stepwatch.log(**{os.fsdecode(b"acc_shard_\\xff.bin"): ...})`` (a file name read back as a
    lone surrogate): every /metrics scrape answered 500 from then on, the step series gone with
    it. Such a name is served escaped, beside everything else."""
    import os

    from prometheus_client.parser import text_string_to_metric_families

    bad = os.fsdecode(b"acc_shard_\xff.bin")
    ctx = RunContext(rank=0, local_rank=0, world_size=1, host="h", run_id="r", run_dir="/nonexistent", pid=1)
    e = OTelExporter(ctx, readers=[], prometheus_port=_free_port(), environ={})
    try:
        for step in (1, 2):
            e.export(Batch(records=[StepRecord(step=step, rank=0, time=time.time(), step_s=0.2, phases={bad: 0.01},
                                               scalars={"loss": 2.0, bad: 1.0})]))
            with urllib.request.urlopen(e.prometheus.url, timeout=10) as r:
                assert r.status == 200
                body = r.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(body)}
        names = {s.labels["name"]: s.value for s in fams[N.SCALAR.name].samples}
        assert names == {"loss": 2.0, "acc_shard_\\udcff.bin": 1.0}, names
        assert any(s.labels.get("phase") == "acc_shard_\\udcff.bin" for s in fams["training_phase_seconds"].samples)
        assert fams["training_steps"].samples[0].value == 2
    finally:
        e.shutdown()

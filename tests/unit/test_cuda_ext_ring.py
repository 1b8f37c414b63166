"""The event ring's logic and API on the host clock: native C ring and pure-Python ring alike.

Both backends run every test (the parametrized ``ring_cls``), so the fallback keeps the native
ring's semantics. The native ring is the installed extension, or one compiled here with the C
compiler when the tree was not built (skipped without a compiler).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

import stepwatch.cuda_ext as cuda_ext
from stepwatch.cuda_ext._python import PyHostRing


@pytest.fixture(params=["native", "python"])
def ring_cls(request):
    if request.param == "python":
        return PyHostRing
    cls = cuda_ext.native_ring_class(request.getfixturevalue("native"))
    return lambda capacity=1024: cls(capacity, "host")


def test_intervals_come_back_in_begin_order_with_their_tags(ring_cls):
    r = ring_cls(16)
    tags = ["data", "forward", "backward", "optimizer"]
    slots = []
    for tag in tags:
        s = r.begin(None, tag)
        time.sleep(0.001)
        r.end(s, None)
        slots.append(s)
    assert r.pending == 4
    got = r.poll()
    assert [g[0] for g in got] == tags
    assert [g[1] for g in got] == slots == sorted(slots)
    for _, _, elapsed in got:
        assert 0.0009 < elapsed < 0.5  # slept 1 ms inside each interval
    assert r.pending == 0 and r.completed == 4
    assert r.poll() == []


def test_elapsed_matches_the_host_clock(ring_cls):
    r = ring_cls(4)
    t0 = time.perf_counter_ns()
    s = r.begin(0, "x")
    time.sleep(0.02)
    r.end(s, 0)
    t1 = time.perf_counter_ns()
    (_, _, elapsed), = r.poll()
    assert 0.02 <= elapsed <= (t1 - t0) * 1e-9


def test_nested_regions_resolve_inner_first_and_outer_encloses_it(ring_cls):
    r = ring_cls(8)
    with r.region("step") as outer:
        with r.region("forward") as inner:
            time.sleep(0.002)
        # the inner interval is ready although the outer one (an older slot) is still open
        first = r.poll()
        assert [t for t, _, _ in first] == ["forward"]
        assert first[0][1] == inner.slot
    second = r.poll()
    assert [(t, s) for t, s, _ in second] == [("step", outer.slot)]
    assert second[0][2] >= first[0][2]


def test_region_lets_exceptions_through_and_still_ends(ring_cls):
    r = ring_cls(4)
    with pytest.raises(KeyError):
        with r.region("boom"):
            raise KeyError("user error")
    assert [t for t, _, _ in r.poll()] == ["boom"]


def test_full_ring_drops_and_counts_never_blocks(ring_cls):
    r = ring_cls(4)
    slots = [r.begin(None, i) for i in range(4)]
    assert all(s >= 0 for s in slots)
    t0 = time.perf_counter()
    assert r.begin(None, "overflow") == -1
    assert r.begin(None, "overflow") == -1
    assert time.perf_counter() - t0 < 0.05
    assert r.dropped == 2 and r.pending == 4
    r.end(-1, None)  # ending a dropped slot is a no-op
    for s in slots:
        r.end(s, None)
    assert [t for t, _, _ in r.poll()] == [0, 1, 2, 3]
    assert r.begin(None, "after") >= 0  # the freed slots are reused


def test_wraparound_keeps_slots_distinct(ring_cls):
    r = ring_cls(4)
    seen = []
    for i in range(1000):
        s = r.begin(None, i)
        r.end(s, None)
        if i % 3 == 2:
            seen += r.poll()
    seen += r.poll()
    assert [t for t, _, _ in seen] == list(range(1000))
    assert [s for _, s, _ in seen] == sorted({s for _, s, _ in seen})
    assert r.dropped == 0


def test_stale_and_doubled_end_are_ignored_and_counted(ring_cls):
    r = ring_cls(2)
    s = r.begin(None, "a")
    r.end(s, None)
    r.end(s, None)  # doubled
    assert r.bad_end == 1
    r.poll()
    for i in range(4):  # the slot index comes round again
        r.end(r.begin(None, i), None)
        r.poll()
    r.end(s, None)  # stale: its sequence number is long gone
    assert r.bad_end == 2
    r.end(12345, None)  # never issued
    assert r.bad_end == 3
    with pytest.raises(TypeError, match="slot"):
        r.end("a", None)


def test_cancel_frees_an_open_slot(ring_cls):
    r = ring_cls(2)
    a = r.begin(None, "a")
    b = r.begin(None, "b")
    assert r.begin(None, "c") == -1
    assert r.cancel(a) is True
    assert r.cancel(a) is False
    r.end(b, None)
    assert [t for t, _, _ in r.poll()] == ["b"]
    assert r.pending == 0


def test_close_drops_pending_and_later_calls_are_harmless(ring_cls):
    r = ring_cls(4)
    tag = object()
    base = sys.getrefcount(tag)
    s = r.begin(None, tag)
    assert sys.getrefcount(tag) == base + 1  # the ring holds the tag while the slot is open
    r.close()
    assert sys.getrefcount(tag) == base
    assert r.begin(None, "x") == -1
    r.end(s, None)
    assert r.poll() == []
    r.close()  # idempotent


def test_poll_hands_over_the_tag_without_leaking(ring_cls):
    r = ring_cls(4)
    tag = object()
    base = sys.getrefcount(tag)
    for _ in range(10):
        r.end(r.begin(None, tag), None)
        got = r.poll()
        assert got[0][0] is tag
        del got
    assert sys.getrefcount(tag) == base


def test_stats_report_the_counters(ring_cls):
    r = ring_cls(2)
    r.end(r.begin(None, "a"), None)
    r.begin(None, "b")
    r.begin(None, "c")  # full
    st = r.stats()
    assert st["backend"] == "host"
    assert (st["capacity"], st["pending"], st["dropped"], st["completed"]) == (2, 2, 1, 0)
    r.poll()
    assert r.stats()["completed"] == 1


@pytest.mark.parametrize("bad", [0, 1, -4, 1 << 17, "8", 2.0, True])
def test_bad_capacity_names_the_argument(ring_cls, bad):
    with pytest.raises((ValueError, TypeError), match="capacity"):
        ring_cls(bad)


def test_capacity_rounds_up_to_a_power_of_two(ring_cls):
    assert ring_cls(5).capacity == 8


def test_background_poller_sees_every_interval_once_in_order(ring_cls):
    r = ring_cls(64)
    got = []
    stop = threading.Event()

    def poller():
        while not stop.is_set():
            got.extend(r.poll())
        got.extend(r.poll())

    t = threading.Thread(target=poller)
    t.start()
    begun = 0
    try:
        for i in range(20000):
            s = r.begin(None, i)
            if s >= 0:
                begun += 1
            r.end(s, None)
    finally:
        stop.set()
        t.join(10)
    slots = [s for _, s, _ in got]
    assert slots == sorted(slots) and len(set(slots)) == len(slots)
    assert len(got) + r.dropped == 20000 and len(got) == begun


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_gives_the_child_a_fresh_ring_and_leaves_the_parent_alone(ring_cls):
    r = ring_cls(4)
    open_slot = r.begin(None, "open-at-fork")
    r.end(r.begin(None, "done-at-fork"), None)
    r.begin(None, "x")
    r.begin(None, "y")
    assert r.begin(None, "full") == -1
    pid = os.fork()
    if pid == 0:  # child: report failures through the exit code, never return into pytest
        code = 0
        try:
            checks = [
                r.pending == 0,
                r.dropped == 0,
                r.poll() == [],
            ]
            r.end(open_slot, None)  # opened by the parent: ignored, not a misuse
            checks.append(r.bad_end == 0)
            s = r.begin(None, "child")
            r.end(s, None)
            checks.append([t for t, _, _ in r.poll()] == ["child"])
            code = 0 if all(checks) else 10 + checks.index(False)
        except BaseException:
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert r.pending == 4 and r.dropped == 1
    r.end(open_slot, None)
    assert [t for t, _, _ in r.poll()] == ["open-at-fork", "done-at-fork"]


# -- the wrapper: get_timer / backend_name / fallback --


def test_get_timer_host_uses_the_native_ring_when_built():
    t = cuda_ext.get_timer()
    if cuda_ext._native is None:
        assert t.name == "python"
    else:
        assert t.name == "native host"
        assert cuda_ext.backend_name() == "native host"
    with t:
        with t.region("a"):
            pass
        assert [x[0] for x in t.poll()] == ["a"]
    assert t.closed


def test_without_the_extension_the_python_ring_serves_the_same_api(monkeypatch):
    monkeypatch.setattr(cuda_ext, "_native", None)
    monkeypatch.setattr(cuda_ext, "_NATIVE_ERROR", "not built (test)")
    monkeypatch.setattr(cuda_ext, "_backends", {})
    t = cuda_ext.get_timer(capacity=8)
    assert isinstance(t, PyHostRing) and t.name == "python"
    assert cuda_ext.backend_name() == "python"
    with pytest.raises(ImportError, match="not built"):
        cuda_ext.get_timer(native=True)
    assert cuda_ext.native_status()["extension"] is False


def test_native_false_forces_the_python_ring():
    assert cuda_ext.get_timer(native=False).name == "python"


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", -1, True, 1.5])
def test_bad_device_names_the_argument_and_valid_values(bad):
    with pytest.raises(ValueError, match="device must be"):
        cuda_ext.get_timer(bad)


def test_bad_native_flag_and_host_library_are_rejected():
    with pytest.raises(ValueError, match="native must be"):
        cuda_ext.get_timer(native="yes")
    with pytest.raises(ValueError, match="library applies only"):
        cuda_ext.get_timer(library="/x.so")


def test_native_ring_rejects_bad_backend(native):
    with pytest.raises(ValueError, match="backend must be one of 'host', 'device', 'cuda', 'hip'"):
        native.Ring(4, "gpu")
    with pytest.raises(ValueError, match="library and device apply only"):
        native.Ring(4, "host", "/x.so")

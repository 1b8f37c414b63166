"""The CUDA/HIP code path of the native ring, on CPU, against a fake runtime library.

The GPU is the one thing mocked: fake_runtime.c (compiled here with the C compiler) exports
cudaEventCreateWithFlags & co. (or the hip* names) with the real signatures and error codes,
and finishes "device work" a settable lag after it was recorded. Everything else is real: the
dlopen of a given path, the function-pointer table, non-blocking queries, graph-capture skips,
the device switch in the poller, fork handling and the Python fallback. The real CUDA path is
checked on a GPU by scripts/gpu_check_timing.py.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import stepwatch.cuda_ext as cuda_ext
from stepwatch.cuda_ext import _testing

STREAM = 0x5000  # raw stream handles are opaque pointers; the fake only compares them
OTHER = 0x6000


@pytest.fixture(scope="module")
def fake_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake")
    try:
        return _testing.build_fake_runtime(d), _testing.build_fake_runtime(d, hip=True)
    except RuntimeError as exc:
        pytest.skip(f"cannot compile the fake runtime: {exc}")


@pytest.fixture
def fake(fake_paths):
    rt = _testing.FakeRuntime(fake_paths[0])
    rt.reset()
    yield rt
    rt.reset()


@pytest.fixture
def ring(native, fake):
    r = native.Ring(8, "cuda", fake.path)
    yield r
    r.close()


def test_loads_the_given_library_and_creates_every_event_up_front(native, fake):
    before = fake.counters()
    r = native.Ring(8, "cuda", fake.path)
    assert (r.backend, r.library, r.device) == ("cuda", fake.path, 0)
    assert fake.counter("created") - before["created"] == 16  # a start and an end event per slot
    r.close()
    assert fake.counter("destroyed") - before["destroyed"] == 16


def test_intervals_are_read_from_the_events(ring, fake):
    a = ring.begin(STREAM, "forward")
    time.sleep(0.01)
    ring.end(a, STREAM)
    b = ring.begin(STREAM, "backward")
    ring.end(b, STREAM)
    got = ring.poll()
    assert [(t, s) for t, s, _ in got] == [("forward", a), ("backward", b)]
    assert 0.009 < got[0][2] < 1.0  # the fake's event times are its record times
    assert ring.pending == 0 and ring.completed == 2


def test_poll_does_not_wait_for_unfinished_work(ring, fake):
    fake.set_lag(0.15)  # "kernels" finish 150 ms after they were recorded
    s = ring.begin(STREAM, "slow")
    ring.end(s, STREAM)
    t0 = time.perf_counter()
    assert ring.poll() == []
    assert time.perf_counter() - t0 < 0.02  # a query answered "not ready", nothing waited
    assert ring.pending == 1
    time.sleep(0.2)
    assert [t for t, _, _ in ring.poll()] == ["slow"]
    assert ring.pending == 0


def test_a_stream_seen_not_ready_is_not_queried_again_in_the_same_poll(ring, fake):
    fake.set_lag(10.0)
    for i in range(3):
        ring.end(ring.begin(STREAM, i), STREAM)
    ring.end(ring.begin(OTHER, "other"), OTHER)
    q0 = fake.counter("queries")
    assert ring.poll() == []
    assert fake.counter("queries") - q0 == 2  # one per stream, not one per interval
    ring.close()  # leaves nothing behind even with work "in flight"


def test_a_full_ring_drops_while_the_device_is_behind(native, fake):
    fake.set_lag(10.0)
    r = native.Ring(2, "cuda", fake.path)
    for i in range(2):
        r.end(r.begin(STREAM, i), STREAM)
    assert r.begin(STREAM, "late") == -1
    assert r.dropped == 1 and r.pending == 2
    r.close()


def test_graph_capture_is_skipped_and_never_recorded_into(ring, fake):
    fake.set_capture(STREAM)
    r0 = fake.counter("records")
    assert ring.begin(STREAM, "captured") == -1
    assert ring.captured == 1
    assert fake.counter("records") == r0 and fake.counter("captured_records") == 0
    # other streams are not capturing: timed as usual
    s = ring.begin(OTHER, "eager")
    ring.end(s, OTHER)
    assert [t for t, _, _ in ring.poll()] == ["eager"]


def test_legacy_stream_is_not_recorded_while_a_blocking_stream_captures(ring, fake):
    """The legacy stream cannot say whether it takes part in a blocking stream's capture (the
    runtime answers an error); recording there could invalidate it, so nothing is recorded."""
    fake.set_capture(OTHER, blocking=True)
    r0 = fake.counter("records")
    assert ring.begin(0, "legacy") == -1
    assert fake.counter("records") == r0 and ring.captured == 1
    fake.set_capture(OTHER)  # a non-blocking capture leaves the legacy stream alone
    ring.end(ring.begin(0, "legacy"), 0)
    assert fake.counter("records") == r0 + 2


def test_poll_during_another_threads_global_capture_does_not_break_it(ring, fake):
    """In cudaStreamCaptureModeGlobal an EventQuery from any thread not in Relaxed mode fails
    and invalidates the capture; the poller switches itself to Relaxed and back."""
    ring.end(ring.begin(STREAM, "before-capture"), STREAM)
    fake.set_capture(OTHER)  # someone else is capturing a graph on another stream
    v0 = fake.counter("capture_violations")
    assert [t for t, _, _ in ring.poll()] == ["before-capture"]
    assert fake.counter("capture_violations") == v0
    assert fake.capture_mode() == 0  # the thread's own mode is restored (Global)
    assert ring.errors == 0


def test_capture_starting_inside_an_interval_gives_the_slot_up(ring, fake):
    s = ring.begin(STREAM, "straddles")
    fake.set_capture(STREAM)
    ring.end(s, STREAM)
    assert ring.captured == 1 and ring.pending == 0
    assert fake.counter("captured_records") == 0
    assert ring.poll() == []


def test_runtime_errors_are_counted_not_raised(ring, fake):
    fake.fail_records(1)
    assert ring.begin(STREAM, "a") == -1
    assert ring.errors == 1 and ring.stats()["last_error"] == 1
    s = ring.begin(STREAM, "b")
    fake.fail_records(1)
    ring.end(s, STREAM)  # the end record fails: the interval is lost, the slot is freed
    assert ring.errors == 2 and ring.pending == 0


def _on_fresh_thread(fn):
    """fn() on a new thread, which starts on device 0 like a real one (e.g. stepwatch's poller)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(5)
    assert out, "the thread did not finish"
    return out[0]


def _poll_from_fresh_thread(r, fake):
    """Poll from a new thread; what it got, and the device it was left on."""
    return _on_fresh_thread(lambda: (r.poll(), fake.get_device()))


def test_poller_thread_switches_to_the_ring_device_and_creates_no_context_on_device_0(native, fake):
    """Rank 1 of a node: it never used GPU 0. A fresh poller thread reports device 0 without
    having a context there; switching to the ring's device and "restoring" 0 afterwards would
    initialize a context on GPU 0 (CUDA >= 12 cudaSetDevice does), for every rank."""
    fake.reset_contexts()
    fake.set_device(1)  # the training thread works on device 1 only
    r = native.Ring(4, "cuda", fake.path)
    assert r.device == 1
    r.end(r.begin(STREAM, "on-1"), STREAM)
    w0 = fake.counter("wrong_device")
    got, device_after = _poll_from_fresh_thread(r, fake)
    assert [x[0] for x in got] == ["on-1"]
    assert fake.counter("wrong_device") == w0
    assert fake.contexts_created(0) == 0, "the poller put a context on device 0"
    assert device_after == 1  # left on the ring's device: 0 had no context to go back to
    r.close()
    assert fake.contexts_created(0) == 0


def test_poller_thread_goes_back_to_a_device_that_has_a_context(native, fake):
    fake.reset_contexts()
    fake.set_device(0)  # device 0 in use by this process: going back to it creates nothing
    fake.set_device(1)
    r = native.Ring(4, "cuda", fake.path)
    r.end(r.begin(STREAM, "on-1"), STREAM)
    got, device_after = _poll_from_fresh_thread(r, fake)
    assert [x[0] for x in got] == ["on-1"] and device_after == 0
    assert fake.contexts_created(0) == 1  # the one this test made, none more
    r.close()


def test_explicit_device_is_used_for_the_events(native, fake):
    r = native.Ring(2, "cuda", fake.path, 1)
    assert r.device == 1 and fake.get_device() == 0  # creation restored the caller's device
    r.close()
    with pytest.raises(ValueError, match="device must be"):
        native.Ring(2, "cuda", fake.path, -3)


def test_stream_must_be_a_raw_handle(ring):
    with pytest.raises(TypeError, match="raw stream handle"):
        ring.begin("stream", "x")
    assert ring.begin(None, "default stream") >= 0


def test_hip_runtime_is_recognised_by_its_symbols(native, fake_paths):
    hip = _testing.FakeRuntime(fake_paths[1], hip=True)
    hip.reset()
    r = native.Ring(4, "device", hip.path)
    assert r.backend == "hip"
    r.end(r.begin(STREAM, "k"), STREAM)
    assert [t for t, _, _ in r.poll()] == ["k"]
    r.close()
    with pytest.raises(native.RuntimeUnavailable, match="exports no cudaEvent"):
        native.Ring(4, "cuda", hip.path)


def test_missing_runtime_names_what_was_tried(native):
    with pytest.raises(native.RuntimeUnavailable) as err:
        native.Ring(4, "device", "/nonexistent/libcudart.so.99")
    assert "tried" in str(err.value) and "/nonexistent/libcudart.so.99" in str(err.value)
    assert isinstance(err.value, RuntimeError)


def test_search_lists_every_soname_it_tried(native):
    try:
        kind, path = native.load_runtime("hip")
    except native.RuntimeUnavailable as exc:
        msg = str(exc)
        assert "libamdhip64.so.7" in msg and "libamdhip64.so.6" in msg
    else:  # a ROCm machine: the search found one
        assert kind == "hip" and "amdhip64" in path


def test_runtime_without_a_driver_is_unavailable(native, fake):
    fake.set_no_device(True)
    with pytest.raises(native.RuntimeUnavailable, match="cannot create events"):
        native.Ring(2, "cuda", fake.path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_turns_device_timing_off_and_the_parent_keeps_it(ring, fake):
    s = ring.begin(STREAM, "open")
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            d0 = fake.counter("destroyed")
            checks = [
                ring.begin(STREAM, "child") == -1,
                "fork" in (ring.disabled or ""),
                ring.pending == 0,
                ring.poll() == [],
            ]
            ring.end(s, STREAM)
            ring.close()  # must not destroy the parent's events
            checks.append(fake.counter("destroyed") == d0)
            code = 0 if all(checks) else 10 + checks.index(False)
        except BaseException:
            code = 99
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ring.disabled is None
    ring.end(s, STREAM)
    assert [t for t, _, _ in ring.poll()] == ["open"]


# -- through the wrapper --


def test_get_timer_uses_the_native_device_ring(fake, monkeypatch):
    if cuda_ext._native is None:
        pytest.skip("the extension is not built into this tree (pip install -e .)")
    t = cuda_ext.get_timer("cuda", capacity=4, library=fake.path)
    assert t.name == "native cuda"
    with t.region("fwd", STREAM):
        pass
    assert [x[0] for x in t.poll()] == ["fwd"]
    t.close()


def test_missing_runtime_without_a_gpu_is_a_clear_error(monkeypatch):
    """torch here is a CPU build: no native runtime and no torch.cuda to fall back to."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the fallback would succeed")
    with pytest.raises(RuntimeError) as err:
        cuda_ext.get_timer("cuda", library="/nonexistent/libcudart.so.99")
    msg = str(err.value)
    assert "torch.cuda.is_available() is False" in msg
    if cuda_ext._native is not None:
        assert "/nonexistent/libcudart.so.99" in msg
    # native=True insists: the runtime's own error (or ImportError when the extension is not built)
    with pytest.raises(cuda_ext.RuntimeUnavailable if cuda_ext._native is not None else ImportError):
        cuda_ext.get_timer("cuda", native=True, library="/nonexistent/libcudart.so.99")


class _StandInCuda:
    """torch.cuda stand-ins for the Python fallback ring (no GPU here): events stamp the host
    clock when recorded and report ready only once `ready` is set, like unfinished GPU work."""

    def __init__(self):
        self.ready = True
        self.capturing = False
        self.streams = []
        outer = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None
                self.stream = None

            def record(self, stream=None):
                self.t = time.perf_counter()
                self.stream = stream

            def query(self):
                return self.t is not None and outer.ready

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3

        class ExternalStream:
            def __init__(self, handle, device=None):
                self.handle = handle
                outer.streams.append(handle)

        class Device:
            def __init__(self, d):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        self.Event, self.ExternalStream, self.device = Event, ExternalStream, Device

    def install(self, monkeypatch, torch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "device", self.device)
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "ExternalStream", self.ExternalStream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: "current")
        monkeypatch.setattr(torch.cuda, "default_stream", lambda d=None: "default")
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)


@pytest.fixture
def stand_in(monkeypatch):
    torch = pytest.importorskip("torch")
    cuda = _StandInCuda()
    cuda.install(monkeypatch, torch)
    monkeypatch.setattr("stepwatch._log._warned", set())
    # No runtime library answers for these events (they are Python objects): the queries go
    # through torch's own Event.query(), as on a machine where the extension cannot load one.
    monkeypatch.setattr(cuda_ext, "_direct", False)
    return cuda


def test_missing_runtime_falls_back_to_torch_events(stand_in, caplog):
    """A GPU without a loadable runtime library: torch.cuda.Event takes over, with one warning."""
    lib = "/nonexistent/libcudart.so.99"
    with caplog.at_level("WARNING", logger="stepwatch.cuda_ext"):
        t = cuda_ext.get_timer("cuda", capacity=4, library=lib)
        cuda_ext.get_timer("cuda", capacity=4, library=lib)
    assert t.name == "python" and t.backend == "cuda"
    warnings = [r.getMessage() for r in caplog.records if "torch.cuda.Event" in r.getMessage()]
    assert len(warnings) == 1
    if cuda_ext._native is not None:
        assert lib in warnings[0]
    with t.region("fwd"):
        time.sleep(0.002)
    (tag, _, elapsed), = t.poll()
    assert tag == "fwd" and elapsed >= 0.002


def test_python_device_ring_waits_for_unfinished_work_and_skips_capture(stand_in):
    t = cuda_ext.get_timer("cuda", capacity=4, native=False)
    stand_in.ready = False
    s = t.begin(STREAM, "slow")
    t.end(s, STREAM)
    t.end(t.begin(0, "default"), 0)
    assert t.poll() == [] and t.pending == 2
    assert stand_in.streams == [STREAM]  # raw handle wrapped once; 0 is torch's default stream
    stand_in.ready = True
    assert [x[0] for x in t.poll()] == ["slow", "default"]
    stand_in.capturing = True
    assert t.begin(STREAM, "captured") == -1 and t.captured == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_python_device_ring_turns_off_in_a_forked_child(stand_in):
    t = cuda_ext.get_timer("cuda", capacity=4, native=False)
    t.end(t.begin(STREAM, "parent"), STREAM)
    pid = os.fork()
    if pid == 0:
        ok = t.begin(STREAM, "child") == -1 and "fork" in (t.disabled or "") and t.poll() == []
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [x[0] for x in t.poll()] == ["parent"]


# -- event queries for the background thread (cuda_ext.event_done / event_elapsed_s) --


def _raw_event(fake, stream=STREAM):
    """A recorded event of the fake runtime, as torch.cuda.Event.cuda_event would hand it over."""
    import ctypes

    ev = ctypes.c_void_p()
    assert getattr(fake.lib, "cudaEventCreateWithFlags")(ctypes.byref(ev), 0) == 0
    assert getattr(fake.lib, "cudaEventRecord")(ev, ctypes.c_void_p(stream)) == 0
    return ev.value


def test_event_query_never_blocks_and_reads_elapsed_time(native, fake):
    fake.set_lag(0.05)
    a = _raw_event(fake)
    time.sleep(0.01)
    b = _raw_event(fake)
    assert native.event_query(b, 0, fake.path) is False  # the "kernel" is still running
    with pytest.raises(RuntimeError, match="EventQuery"):
        native.event_elapsed_ms(a, b, 0, fake.path)
    time.sleep(0.08)
    assert native.event_query(b, 0, fake.path) is True
    assert 9.0 < native.event_elapsed_ms(a, b, 0, fake.path) < 50.0
    assert native.event_query(0, 0, fake.path) is True  # torch's lazily created, never recorded


def test_event_query_does_not_break_another_threads_capture(native, fake):
    """torch.cuda.graph captures in "global" mode: an event query from any other thread would
    invalidate the capture; ours runs in relaxed mode."""
    ev = _raw_event(fake)
    fake.set_capture(OTHER)  # another thread captures on its stream
    v0 = fake.counter("capture_violations")
    assert _on_fresh_thread(lambda: native.event_query(ev, 0, fake.path)) is True
    assert fake.counter("capture_violations") == v0


def test_event_query_on_a_fresh_thread_uses_the_events_device_and_no_other(native, fake):
    """The background thread has never set a device: the query runs on the event's device
    (wrong_device counts a query made elsewhere) and puts no context on device 0."""
    fake.reset_contexts()
    fake.set_device(1)
    ev = _raw_event(fake)
    w0 = fake.counter("wrong_device")
    assert _on_fresh_thread(lambda: native.event_query(ev, 1, fake.path)) is True
    assert fake.counter("wrong_device") == w0
    assert fake.contexts_created(0) == 0


def test_event_done_passes_torch_events_to_the_extension(native, fake, monkeypatch):
    """cuda_ext.event_done / event_elapsed_s hand the torch event's raw handle and device to the
    extension (here bound to the fake runtime)."""
    import functools
    import types

    shim = types.SimpleNamespace(
        event_query=functools.partial(native.event_query, library=fake.path),
        event_elapsed_ms=functools.partial(native.event_elapsed_ms, library=fake.path),
    )
    monkeypatch.setattr(cuda_ext, "_direct", shim)

    class TorchLikeEvent:
        def __init__(self, handle):
            self.cuda_event = handle

        def query(self):  # must not be used
            raise AssertionError("torch's Event.query() was called")

    a = TorchLikeEvent(_raw_event(fake))
    time.sleep(0.005)
    b = TorchLikeEvent(_raw_event(fake))
    assert cuda_ext.event_done(b, 0) is True
    assert 0.004 < cuda_ext.event_elapsed_s(a, b, 0) < 0.05


# -- device phase timing (hooks/device.py) with intervals that never come back --


def test_end_says_whether_the_interval_will_come_out_of_poll(ring, fake):
    assert ring.end(ring.begin(STREAM, "ok"), STREAM) is True
    s = ring.begin(STREAM, "lost")
    fake.set_capture(STREAM)  # a capture began between begin and end: the slot is given up
    assert ring.end(s, STREAM) is False
    fake.set_capture(None, False)
    assert ring.end(-1, STREAM) is False and ring.end(s, STREAM) is False  # nothing / stale
    assert [x[0] for x in ring.poll()] == ["ok"]


def test_a_phase_given_up_at_its_end_is_not_waited_for(ring, fake):
    """Without this, the step's record (and every record behind it) waited for an interval that
    never comes, until the 30 s hold limit."""
    from stepwatch.hooks.device import DeviceTiming, DeviceTimingEnricher
    from stepwatch.record import StepRecord

    dev = DeviceTiming(ring, STREAM)
    dev.end(dev.begin(2))  # forward, recorded
    s = dev.begin(3)  # backward ...
    fake.set_capture(STREAM)  # ... during which a capture starts on the stream
    dev.end(s)
    fake.set_capture(None, False)
    info = dev.take()
    assert info == (0, 1)
    rec = StepRecord(step=0, rank=0, time=0.0, step_s=1.0, data_wait_s=0.0, forward_s=0.5, backward_s=0.2,
                     optimizer_s=0.1, other_s=0.2)
    assert DeviceTimingEnricher(ring).enrich(rec, {DeviceTiming.name: info}, force=False)
    assert rec.clock == "device" and rec.forward_s < 0.5  # the recorded interval, from the ring


def test_an_interval_lost_in_poll_releases_the_waiting_record():
    from stepwatch.hooks.device import DeviceTiming, DeviceTimingEnricher
    from stepwatch.record import StepRecord

    class Ring:  # the poll-side facts only: nothing finished, and then a runtime error
        errors = 0

        def poll(self):
            return []

    timer = Ring()
    e = DeviceTimingEnricher(timer)
    rec = StepRecord(step=0, rank=0, time=0.0, step_s=1.0, forward_s=0.5)
    extras = {DeviceTiming.name: (0, 2)}
    assert e.enrich(rec, extras, force=False) is False  # waits for its two intervals
    timer.errors = 1
    assert e.enrich(rec, extras, force=False) is True  # one was lost: host times are kept
    assert rec.clock == "host" and rec.forward_s == 0.5

"""Device-clock phase timing: forward, backward and optimizer as the GPU ran them.

On the training thread each phase records a begin/end event pair on the current stream through
``stepwatch.cuda_ext`` (native when built, ``torch.cuda.Event`` otherwise): a few hundred
nanoseconds, no sync. The stream handle is looked up once (``current_stream()`` costs ~4 us a
call). The background thread polls the ring without blocking; a record waits until all of its
intervals have completed, then its phase fields are replaced by device durations and its
``clock`` becomes ``"device"``. ``step_s`` and ``data_wait_s`` stay on the host clock (a step is
the wall time between step ends; a data wait is the host blocked), and ``other_s`` is the rest, so
the phase identity still holds.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ..record import StepRecord

if TYPE_CHECKING:
    from .._feature import Hub

# Phase codes as in phases.py (forward, backward, optimizer).
FIELDS = {2: "forward_s", 3: "backward_s", 4: "optimizer_s"}


class DeviceTiming:
    """Training-thread side; also the collector that tells the background how many to expect."""

    name = "device_timing"

    def __init__(self, timer: Any, stream: Any) -> None:
        self.timer = timer
        self.stream = stream
        self.step = 0
        self._begun = 0

    def begin(self, code: int) -> int:
        slot = self.timer.begin(self.stream, (self.step, code))
        if slot >= 0:
            self._begun += 1
        return slot

    def end(self, slot: int) -> None:
        # An interval given up at its end (a capture began, a runtime error) never comes out of
        # poll(): not expected, or the record would wait for it until the hold limit.
        if slot >= 0 and not self.timer.end(slot, self.stream):
            self._begun -= 1

    def cancel(self, slot: int) -> None:
        """An interval given up before its end (an optimizer step that raised: its end is not
        known, phases.py ``_opt_raised``): not expected, its time in no phase."""
        give_up = getattr(self.timer, "cancel", None)  # every ring has it (cuda_ext)
        if give_up is None:
            self.end(slot)
        elif slot >= 0 and give_up(slot):
            self._begun -= 1

    def take(self) -> tuple[int, int]:
        """At step end (training thread): (step, intervals begun in it); then the next step."""
        out = (self.step, self._begun)
        self.step += 1
        self._begun = 0
        return out


class DeviceTimingEnricher:
    """Background side: poll the ring, sum intervals per step and phase, fill the record."""

    def __init__(self, timer: Any) -> None:
        self.timer = timer
        self._sums: dict[int, dict[int, float]] = {}
        self._counts: dict[int, int] = {}
        self._errors = 0

    def _poll(self) -> None:
        for tag, _slot, elapsed in self.timer.poll():
            step, code = tag
            d = self._sums.setdefault(step, {})
            d[code] = d.get(code, 0.0) + elapsed
            self._counts[step] = self._counts.get(step, 0) + 1

    def enrich(self, rec: StepRecord, extras: dict[str, Any], *, force: bool) -> bool:
        info = extras.get(DeviceTiming.name)
        if info is None:
            return True
        step, expected = info
        self._poll()
        errors = getattr(self.timer, "errors", 0)
        if errors != self._errors:
            # An interval was lost to a runtime error while polling: the step waiting now may
            # be missing it. Keep its host times rather than hold every record behind it.
            self._errors = errors
            force = True
        if self._counts.get(step, 0) < expected and not force:
            return False
        sums = self._sums.pop(step, {})
        got = self._counts.pop(step, 0)
        for old in [k for k in self._sums if k < step]:  # steps whose records never came (dropped)
            del self._sums[old]
            self._counts.pop(old, None)
        if got < expected:  # gave up waiting (or intervals were dropped): keep host times
            return True
        for code, field in FIELDS.items():
            setattr(rec, field, sums.get(code, 0.0))
        rec.other_s = max(rec.step_s - rec.data_wait_s - rec.forward_s - rec.backward_s - rec.optimizer_s, 0.0)
        rec.clock = "device"
        return True


def install(tracker: Any, timer: Any, stream: Any) -> tuple[DeviceTiming, DeviceTimingEnricher]:
    """Attach device timing to a tracker; returns the collector and the enricher to register."""
    dev = DeviceTiming(timer, stream)
    tracker.device = dev
    tracker.collectors.append(dev)
    return dev, DeviceTimingEnricher(timer)


class DeviceTimingSwitch:
    """Device timing's wiring (``Config.device_timing``): at the first step end, on the training
    thread, if CUDA is in use by then, phases are timed on the device from the next step on.
    ``backend`` names the timer; None while the host clock times them."""

    def __init__(self, hub: "Hub") -> None:
        self.hub = hub
        self.backend: str | None = None
        hub.add_listener(self.on_step_end)

    def on_step_end(self, step: int) -> None:
        hub = self.hub
        try:
            hub.remove_listener(self.on_step_end)
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return
            from ..cuda_ext import get_timer

            timer = get_timer("cuda", capacity=4096)
            _, enricher = install(hub.tracker, timer, torch.cuda.current_stream().cuda_stream)
            # First: device times replace the host phases before any other enricher reads them.
            hub.add_enricher(enricher, first=True)
            self.backend = getattr(timer, "name", "python")
        except Exception as e:
            hub.report_error("device_timing", e)

"""Stream the events of a Chrome trace (``.json`` or ``.json.gz``) one at a time.

A Kineto / ``torch.profiler`` trace is one JSON object whose ``traceEvents`` array holds every
event; a few GB of JSON would be tens of GB as Python objects, so the file is never loaded
whole. The text is read in chunks and each event is decoded alone with the standard library's C
scanner (``json.scanner``): memory holds one chunk and one event. The other top-level keys
(``distributedInfo``, ``deviceProperties``, ...) are small and kept in ``meta``; they may come
before or after the events. The Chrome "JSON array" form (a bare list of events) is read too.
Any other JSON (an object without ``traceEvents``, a list holding no event object, ``[]`` included,
a ``traceEvents`` list of values none of which is an event object) is not a trace: ``TraceFormatError``, like a file that is not JSON.
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
from collections.abc import Iterator
from typing import IO, Any

CHUNK = 1 << 22  # characters of text decoded at a time (4 MiB)
_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")


class TraceFormatError(ValueError):
    """The file is not a Chrome trace (names the file and the offset)."""


def open_text(path: str) -> IO[bytes]:
    """The raw bytes of ``path``, gunzipped when it starts with the gzip magic."""
    f = open(path, "rb")
    head = f.read(2)
    f.seek(0)
    if head == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb")  # type: ignore[return-value]
    return f


class EventReader:
    """``for ev in EventReader(path): ...`` yields each event dict; ``meta`` fills as keys pass."""

    def __init__(self, path: str, chunk: int = CHUNK) -> None:
        self.path = path
        self.chunk = chunk
        self.meta: dict[str, Any] = {}
        self.events = 0
        self._scan = json.JSONDecoder().scan_once
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._f: IO[bytes] | None = None
        self._dec = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")  # a BOM (Windows tools write one) is not the trace

    # -- buffer ---------------------------------------------------------------------------------

    def _more(self) -> bool:
        if self._eof:
            return False
        assert self._f is not None
        raw = self._f.read(self.chunk)
        if not raw:
            self._eof = True
            self._buf = self._buf[self._pos:] + self._dec.decode(b"", final=True)
            self._pos = 0
            return False
        self._buf = self._buf[self._pos:] + self._dec.decode(raw)
        self._pos = 0
        return True

    def _skip_ws(self) -> str:
        """The next non-blank character ('' at the end of the file), not consumed."""
        while True:
            m = _WS.match(self._buf, self._pos)
            self._pos = m.end()
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._more():
                return ""

    def _value(self) -> Any:
        self._skip_ws()
        # A number or literal cut at the buffer's end would decode short: keep a margin.
        while len(self._buf) - self._pos < 64 and self._more():
            pass
        while True:
            try:
                obj, end = self._scan(self._buf, self._pos)
            except (StopIteration, json.JSONDecodeError) as e:
                if self._more():
                    continue
                raise TraceFormatError(f"{self.path}: not valid JSON near character {self._pos} ({e})") from None
            if end >= len(self._buf) and not self._eof and not isinstance(obj, (dict, list, str)):
                if self._more():
                    continue
            self._pos = end
            return obj

    def _expect(self, chars: str) -> str:
        c = self._skip_ws()
        if not c or c not in chars:
            raise TraceFormatError(f"{self.path}: expected one of {chars!r} near character {self._pos}, got {c!r}")
        self._pos += 1
        return c

    # -- structure ------------------------------------------------------------------------------

    def _array(self) -> Iterator[Any]:
        if self._skip_ws() == "]":
            self._pos += 1
            return
        # The hot loop (one turn per event): scan, then the separator, on local variables.
        scan, sep = self._scan, _SEP.match
        buf, pos = self._buf, self._pos
        while True:
            try:
                obj, end = scan(buf, pos)
                m = sep(buf, end)
            except (StopIteration, json.JSONDecodeError) as e:
                err, m = e, None
            else:
                err = None
            if m is None:  # the element or its separator runs past the chunk: read on, scan again
                self._pos = pos
                if not self._more():
                    raise TraceFormatError(f"{self.path}: not valid JSON near character {pos}"
                                           + (f" ({err})" if err else "")) from None
                buf = self._buf
                pos = _WS.match(buf, self._pos).end()  # blanks after a separator can span chunks
                continue
            yield obj
            pos = m.end()
            if m.group(1) == "]":
                self._pos = pos
                return

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with open_text(self.path) as f:
            self._f = f
            c = self._skip_ws()
            if c == "[":
                self._pos += 1
                others = 0
                for ev in self._array():
                    if isinstance(ev, dict):
                        self.events += 1
                        yield ev
                    else:
                        others += 1
                if not self.events:  # ``[]`` too: Chrome's array form of a trace has its events
                    raise TraceFormatError(f"{self.path}: not a profiler trace: a JSON list of {others} "
                                           "value(s) and no event object")
                return
            self._expect("{")
            seen = False
            if self._skip_ws() != "}":
                while True:
                    key = self._value()
                    self._expect(":")
                    if key == "traceEvents":
                        seen = True
                        self._expect("[")
                        others = 0
                        for ev in self._array():
                            if isinstance(ev, dict):
                                self.events += 1
                                yield ev
                            else:
                                others += 1
                        if others and not self.events:  # an empty list is an empty trace; [1, 2] none
                            raise TraceFormatError(f"{self.path}: not a profiler trace: its traceEvents list "
                                                   f"holds {others} value(s) and no event object")
                    else:
                        self.meta[str(key)] = self._value()
                    if self._expect(",}") == "}":
                        break
            if not seen:
                keys = ", ".join(sorted(self.meta)[:5]) or "none"
                raise TraceFormatError(f"{self.path}: not a profiler trace: a JSON object without a "
                                       f"traceEvents list (its keys: {keys})")

"""A small HTTP/1.0 GET server whose threads and descriptors are bounded whatever clients do.

For the per-rank scrape endpoint inside a training process, where ``ThreadingHTTPServer`` holds a
thread and a descriptor per connection for as long as the client likes (300 half-sent requests
made 300 threads and 300 descriptors, and the job's next ``torch.save`` failed under
``ulimit -n 256``). Here:

- one thread waits (``selectors``) on the listening socket and on the connections whose request
  has not fully arrived: at most ``max_pending`` of them, each for at most ``request_timeout_s``
  from its accept. When they are all taken the oldest is closed, so a flood of half-sent requests
  cannot shut out a real scraper, whose request arrives in one packet;
- ``workers`` threads answer complete requests, each write bounded by ``write_timeout_s``;
  when all are busy and ``max_ready`` answers wait, the next request gets a 503.

So the process holds ``1 + workers`` threads and at most ``1 + max_pending + max_ready + workers``
connection descriptors (plus a wake-up pair), from start to close.
"""

from __future__ import annotations

import collections
import queue
import selectors
import socket
import threading
import time
from typing import Callable

from .._log import warn_once

# (status, content type, body) for a request path.
Respond = Callable[[str], "tuple[int, str, bytes]"]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable"}
MAX_HEAD_BYTES = 16 * 1024


class _Waiting:
    __slots__ = ("deadline", "buf")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.buf = bytearray()


class BoundedHTTPServer:
    """Serve ``respond(path)`` for GET/HEAD on ``host:port`` (0 = a free port).

    Raises ``OSError`` (address in use, bad host) or ``OverflowError`` (port above 65535) like
    ``socket.bind``. ``port`` is the port bound; :meth:`close` stops it within about a second.
    """

    def __init__(
        self,
        host: str,
        port: int,
        respond: Respond,
        *,
        name: str = "stepwatch-http",
        workers: int = 2,
        max_pending: int = 32,
        max_ready: int = 4,
        request_timeout_s: float = 5.0,
        write_timeout_s: float = 5.0,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=64)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.refused = 0  # connections closed unanswered (too many waiting, too slow, 503)
        self._name = name
        self._respond = respond
        self._max_pending = max_pending
        self._request_timeout_s = request_timeout_s
        self._write_timeout_s = write_timeout_s
        self._pending: "collections.OrderedDict[socket.socket, _Waiting]" = collections.OrderedDict()
        self._ready: "queue.Queue[tuple[socket.socket, bytes] | None]" = queue.Queue(maxsize=max_ready)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._threads = [threading.Thread(target=self._loop, name=name, daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"{name}-worker", daemon=True) for _ in range(workers)
        ]
        for t in self._threads:
            t.start()

    # -- the waiting side (one thread) ---------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                timeout = 0.5
                if self._pending:
                    oldest = next(iter(self._pending.values()))
                    timeout = min(timeout, max(oldest.deadline - time.monotonic(), 0.0))
                for key, _ in self._sel.select(timeout):
                    obj = key.fileobj
                    if obj is self.sock:
                        self._accept()
                    elif obj is self._wake_r:
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        self._read(obj)  # type: ignore[arg-type]
                now = time.monotonic()
                while self._pending:  # accept order is deadline order
                    conn, w = next(iter(self._pending.items()))
                    if w.deadline > now:
                        break
                    self._drop(conn, "a request did not arrive in time")
        except Exception as e:  # never take the trainer down; the endpoint stops answering
            warn_once(f"{self._name}.loop", "stepwatch: %s stopped: %r", self._name, e)
        finally:
            for conn in list(self._pending):
                self._drop(conn, None)

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, then the others get their turn
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE and the like: leave it in the backlog
                return
            conn.setblocking(False)
            if len(self._pending) >= self._max_pending:
                self._drop(next(iter(self._pending)), "too many connections waiting for their request")
            self._pending[conn] = _Waiting(time.monotonic() + self._request_timeout_s)
            self._sel.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        w = self._pending.get(conn)
        if w is None:
            return
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, None)  # the client went away
            return
        w.buf += data
        if b"\r\n\r\n" not in w.buf and b"\n\n" not in w.buf:
            if len(w.buf) > MAX_HEAD_BYTES:
                self._answer_now(conn, 431)
            return
        self._forget(conn)
        try:
            self._ready.put_nowait((conn, bytes(w.buf)))
        except queue.Full:
            self._answer_now(conn, 503)

    def _forget(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass

    def _drop(self, conn: socket.socket, why: str | None) -> None:
        self._forget(conn)
        if why is not None:
            self.refused += 1
            warn_once(f"{self._name}.refused", "stepwatch: %s closed a connection (%s); counting further ones", self._name, why)
        try:
            conn.close()
        except OSError:
            pass

    def _answer_now(self, conn: socket.socket, status: int) -> None:
        self._forget(conn)
        try:
            conn.send(_head(status, "text/plain; charset=utf-8", 0))  # non-blocking, best effort
        except OSError:
            pass
        self._drop(conn, f"HTTP {status}")

    # -- the answering side (the workers) ------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._ready.get()
            if item is None:
                return
            conn, head = item
            try:
                conn.settimeout(self._write_timeout_s)
                conn.sendall(self._response(head))
            except OSError:
                pass
            except Exception as e:  # a bug in respond: the worker must survive it
                warn_once(f"{self._name}.respond", "stepwatch: %s failed to answer: %r", self._name, e)
            finally:
                try:
                    conn.close()
                except OSError:
                    pass

    def _response(self, head: bytes) -> bytes:
        line = head.split(b"\n", 1)[0].decode("latin-1").strip().split()
        if len(line) != 3 or not line[2].startswith("HTTP/"):
            return _head(400, "text/plain; charset=utf-8", 0)
        method, path = line[0], line[1]
        if method not in ("GET", "HEAD"):
            return _head(501, "text/plain; charset=utf-8", 0)
        status, ctype, body = self._respond(path)
        return _head(status, ctype, len(body)) + (body if method == "GET" else b"")

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop serving; waits at most ``timeout_s`` for the threads (daemons either way)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        deadline = time.monotonic() + timeout_s
        self._threads[0].join(max(deadline - time.monotonic(), 0.0))
        while True:  # queued answers are not sent: close them, then let the workers end
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].close()
        for _ in self._threads[1:]:
            try:
                self._ready.put_nowait(None)
            except queue.Full:
                break
        for t in self._threads[1:]:
            t.join(max(deadline - time.monotonic(), 0.0))
        self._close_sockets()

    def close_in_child(self) -> None:
        """In a forked child: its copies of the sockets, nothing else (its threads do not exist)."""
        self._stop.set()
        for conn in list(self._pending):
            try:
                conn.close()
            except OSError:
                pass
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self.sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass


def _head(status: int, ctype: str, length: int) -> bytes:
    return (
        f"HTTP/1.0 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {ctype}\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")

"""The ``stepwatch`` command. Each subcommand lives in its own module and registers itself.

A subcommand module exposes ``register(subparsers)`` which adds its parser and sets
``func=callable(args) -> int`` as the parser default. Modules are imported only when the command
line is parsed, so ``import stepwatch`` stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# Modules that provide subcommands, in the order `stepwatch --help` lists them.
SUBCOMMAND_MODULES = (
    "stepwatch.report.cli",
    "stepwatch.rules.cli",
    "stepwatch.doctor.cli",
    "stepwatch.serving.cli",
    "stepwatch.runner.cli",
    "stepwatch.comm.cli",
    "stepwatch.traces.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="stepwatch",
        description="PyTorch training-loop instrumentation: records, findings, captures.",
    )
    parser.add_argument("--version", action="version", version=f"stepwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in SUBCOMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    saved = sys.stdout
    sys.stdout = _Stdout(saved)  # type: ignore[assignment]
    try:
        rc = _run(argv)
        # What is still buffered goes out here, where a reader that has gone is caught (below),
        # not in the interpreter's last flush (a traceback, and exit status 120).
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        if not _reader_gone():
            raise  # another pipe than the command's own output: a real error
        return READER_GONE
    except _Unwritable as e:
        print(f"stepwatch: cannot write to standard output: {e}", file=sys.stderr)
        _to_devnull(saved)  # what is still buffered: not again at the interpreter's exit
        return 1
    finally:
        sys.stdout = saved


class _Unwritable(OSError):
    """Standard output refused a write: a full disk (``> /dev/full``), or closed (``>&-``)."""


class _Stdout:
    """``sys.stdout`` while a command runs: a write that standard output refuses is told apart
    from the command's own I/O errors (a run directory it cannot read), and said in one line
    instead of a traceback. An output encoding that cannot take a character (a C locale's ASCII)
    gets a ``?`` for it instead of the command's end."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        reconfigure = getattr(stream, "reconfigure", None)
        encoding = str(getattr(stream, "encoding", "utf-8") or "utf-8").lower().replace("_", "-")
        if reconfigure is not None and not encoding.startswith("utf"):
            try:
                reconfigure(errors="replace")
            except (ValueError, OSError):
                pass

    def write(self, text: str) -> int:
        if self._stream is None:
            raise _Unwritable("it is closed")
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _Unwritable(str(e)) from e

    def flush(self) -> None:
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _Unwritable(str(e)) from e

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


def _to_devnull(stream: Any) -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # no stream, no descriptor (in-process use)
        pass


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


# `stepwatch report RUN | head` once head has its lines: the exit status of a command that
# SIGPIPE's default action ended, as `git log | head` ends (128 + SIGPIPE, as a shell reports
# it: the convention of the other commands for a signal), with nothing said.
READER_GONE = 141


def _reader_gone() -> bool:
    """Whether stdout or stderr is a pipe whose reader has gone (``stepwatch ... | head``); each
    such one is pointed at /dev/null, so that the interpreter's last flush of what is still
    buffered does not fail again (Python's note on SIGPIPE, in the signal module's docs)."""
    import os
    import select

    gone = False
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if hasattr(select, "poll"):
                poll = select.poll()
                poll.register(fd, select.POLLOUT)
                # A pipe's write end with no reader left polls POLLERR (a socket's, POLLHUP).
                if not any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0)):
                    continue
            elif stream is not sys.stdout:  # no way to ask: the usual case, stdout
                continue
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (AttributeError, OSError, ValueError):  # no such stream or no descriptor (in-process use)
            continue
        gone = True
    return gone


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The terminal summary, drawn with rich: colour on a terminal, plain text in a pipe or a file."""

from __future__ import annotations

import errno
import os
import sys
from typing import TextIO

from ._table import Table

_STYLES = {"warn": "yellow", "warning": "yellow", "critical": "bold red", "bad": "red",
           "good": "green", "info": "cyan"}

# A pipe has no width; rich would fall back to 80 columns and squeeze the per-rank table.
_PIPE_WIDTH = 140
_GAP = 2  # rich's padding between columns with collapse_padding and no edge padding


def _fold(t: Table) -> tuple[list[str], list[list[str]]]:
    """Trailing free-text columns become extra lines under the column before them."""
    if not t.fold_last:
        return t.headers, t.rows
    keep = len(t.headers) - t.fold_last
    rows = [
        r[:keep - 1] + ["\n".join([r[keep - 1]] + [
            f"{h}: {c}" for h, c in zip(t.headers[keep:], r[keep:]) if c
        ])]
        for r in rows
    ] if (rows := t.rows) else []
    return t.headers[:keep], rows


def _column_groups(headers: list[str], rows: list[list[str]], width: int) -> list[list[int]]:
    """Split columns of numbers into groups that fit the width, each led by the first column.

    Numbers that wrap or get cut are misread; a second block of columns is not.
    """
    need = [max([len(h)] + [len(r[i]) for r in rows]) + _GAP for i, h in enumerate(headers)]
    groups, cur, used = [], [0], need[0]
    for i in range(1, len(headers)):
        if used + need[i] > width and len(cur) > 1:
            groups.append(cur)
            cur, used = [0], need[0]
        cur.append(i)
        used += need[i]
    groups.append(cur)
    return groups


def _render_plain(tables: list[Table], out: TextIO) -> None:
    """The same tables without rich (a broken install): aligned columns, no colour."""
    for t in tables:
        headers, rows = _fold(t)
        print(t.title, file=out)
        if rows:
            cells = [[c.replace("\n", " | ") for c in r] for r in rows]
            need = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
            if any(headers):
                print("  ".join(h.ljust(w) for h, w in zip(headers, need)).rstrip(), file=out)
            for r in cells:
                print("  ".join(c.ljust(w) for c, w in zip(r, need)).rstrip(), file=out)
        for n in t.notes:
            print("  " + n, file=out)
        print(file=out)



def printable(s: str) -> str:
    """``s`` as any terminal can take it: a byte that is not UTF-8 in a name read from the disk (a
    surrogate from ``os.listdir``: a run dir's path, its run id) shows as ``\\xff`` (it was a
    UnicodeEncodeError, and no summary)."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def render(tables: list[Table], file: TextIO | None = None, width: int | None = None) -> None:
    out = file if file is not None else sys.stdout
    try:
        from rich import box
        from rich.console import Console
        from rich.padding import Padding
        from rich.table import Table as RichTable
        from rich.text import Text
    except ImportError as e:
        print(f"stepwatch: rich cannot be imported ({e}); plain text summary "
              "(pip install rich for the formatted one)", file=sys.stderr)
        _render_plain(tables, out)
        return

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich would exit 1 here; a reader that has gone (`| head`) is the command line's to
            # handle, the same for every command (cli.main).
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    console = _Console(file=out, highlight=False, soft_wrap=False, width=width)
    if not console.is_terminal:
        console = _Console(file=out, highlight=False, width=width or _PIPE_WIDTH, no_color=True)
    for t in tables:
        headers, rows = _fold(t)
        plain_kv = all(h == "" for h in headers)
        groups = ([list(range(len(headers)))] if plain_kv or t.fold_last
                  else _column_groups(headers, rows, console.width))
        for gi, cols in enumerate(groups):
            title = t.title if gi == 0 else f"{t.title} (continued)"
            rt = RichTable(
                title=Text(title), title_justify="left", title_style="bold",
                box=box.SIMPLE_HEAD, show_header=not plain_kv, show_lines=bool(t.fold_last),
                pad_edge=False, collapse_padding=True,
            )
            for n, i in enumerate(cols):
                # Numbers never wrap; only free text (the last column of a folded table) does.
                wrap = plain_kv and n > 0 or bool(t.fold_last) and n == len(cols) - 1
                rt.add_column(headers[i], overflow="fold", no_wrap=not wrap,
                              style="bold" if plain_kv and n == 0 else None)
            for k, r in enumerate(rows):
                tag = t.tags[k] if k < len(t.tags) else ""
                # Text, not str: record contents may hold brackets that rich reads as markup.
                rt.add_row(*(Text(printable(r[i])) for i in cols), style=_STYLES.get(tag))
            if rows:
                console.print(rt)
        if not rows:
            console.print(Text(t.title, style="bold"))
        for n in t.notes:
            console.print(Padding(Text(printable(n), style="dim"), (0, 0, 0, 2)))
        console.print()

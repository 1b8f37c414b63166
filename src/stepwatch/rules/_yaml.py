"""A tiny YAML writer for the rules and test files (dicts, lists, str, int, float, bool).

Strings are written double-quoted with JSON escapes, which YAML 1.2 reads the same way; so no
PromQL character (``{``, ``:``, ``#``, ``'``) can change the meaning of a line. The dependency
on PyYAML is not worth it for writing two files.
"""

from __future__ import annotations

import json
from typing import Any


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(f"cannot write {type(v).__name__} to YAML")


def _emit(v: Any, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(v, dict):
        if not v:
            out[-1] += " {}"
            return
        for k, x in v.items():
            if isinstance(x, (dict, list)) and x:
                out.append(f"{pad}{k}:")
                _emit(x, indent + 2, out)
            else:
                out.append(f"{pad}{k}:")
                out[-1] += " " + ("{}" if isinstance(x, dict) else "[]" if isinstance(x, list) else _scalar(x))
    elif isinstance(v, list):
        for x in v:
            if isinstance(x, dict) and x:
                first = True
                sub: list[str] = []
                _emit(x, indent + 2, sub)
                for line in sub:
                    if first:
                        out.append(f"{pad}- " + line[indent + 2:])
                        first = False
                    else:
                        out.append(line)
            elif isinstance(x, list) and x:
                raise TypeError("nested lists are not needed here")
            else:
                out.append(f"{pad}- " + ("{}" if isinstance(x, dict) else "[]" if isinstance(x, list) else _scalar(x)))
    else:
        out.append(pad + _scalar(v))


def dump(doc: dict[str, Any], header: str = "") -> str:
    out: list[str] = [f"# {line}".rstrip() for line in header.splitlines()]
    _emit(doc, 0, out)
    return "\n".join(out) + "\n"

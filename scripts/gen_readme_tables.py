"""Regenerate README.md's generated tables (variables, finding kinds) from the code.

    python scripts/gen_readme_tables.py          # rewrite README.md in place
    python scripts/gen_readme_tables.py --check  # exit 1 if README.md is out of date

The code is the one place each variable and kind is declared; the README mirrors it.
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def env_table() -> str:
    from stepwatch.config import env_table as rows
    from stepwatch.config import valid_values

    out = ["| Variable | Default | Valid | Meaning |", "|---|---|---|---|"]
    for var, default, doc in rows():
        out.append(f"| `{var}` | `{_cell(default)}` | {_cell(valid_values(var))} | {_cell(doc)} |")
    return "\n".join(out)


def kinds_table() -> str:
    from stepwatch.analysis.kinds import KINDS

    out = ["| Kind | Severity | Diagnosis | Action | Source |", "|---|---|---|---|---|"]
    for k in KINDS.values():
        out.append(f"| `{k.name}` | {k.severity} | {_cell(k.diagnosis)} | {_cell(k.action)} | {_cell(k.source)} |")
    return "\n".join(out)


SECTIONS = {"env-table": env_table, "kinds-table": kinds_table}


def render(text: str) -> str:
    for name, fn in SECTIONS.items():
        pat = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pat.search(text):
            raise SystemExit(f"README.md lacks the <!-- {name}:start --> ... <!-- {name}:end --> markers")
        text = pat.sub(lambda m: m.group(1) + fn() + "\n" + m.group(2), text)
    return text


def main() -> int:
    path = os.path.join(ROOT, "README.md")
    with open(path, encoding="utf-8") as f:
        old = f.read()
    new = render(old)
    if "--check" in sys.argv:
        if new != old:
            print("README.md's generated tables are out of date: run python scripts/gen_readme_tables.py")
            return 1
        return 0
    if new != old:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())

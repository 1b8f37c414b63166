"""The core never imports a feature package or the session, at module level or in a function
(TYPE_CHECKING-only imports are types, not imports): features plug in through _feature.Hub."""

from __future__ import annotations

import ast
import pathlib

import stepwatch

SRC = pathlib.Path(stepwatch.__file__).parent
CORE = ["record.py", "_files.py", "_log.py", "config.py", "context.py", "_feature.py", "pipeline.py",
        "_manifest.py", "hooks", "analysis", "exporters", "cuda_ext", "_os"]
ABOVE = {"metrics", "comm", "telemetry", "memory", "capture", "watchdog", "traces", "session"}


def _files():
    for name in CORE:
        p = SRC / name
        yield from (sorted(p.rglob("*.py")) if p.is_dir() else [p])


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip.update(id(n) for n in ast.walk(sub))
    return skip


def _imported(path: pathlib.Path, node: ast.AST) -> list[str]:
    """Absolute module names (within stepwatch, dotted from the package root) an import names."""
    pkg = path.relative_to(SRC).with_suffix("").parts[:-1]
    if isinstance(node, ast.Import):
        return [a.name.removeprefix("stepwatch.") for a in node.names if a.name.startswith("stepwatch")]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = list(pkg[: len(pkg) - node.level + 1])
        elif node.module and node.module.startswith("stepwatch"):
            base = []
        else:
            return []
        mod = (node.module or "").removeprefix("stepwatch").lstrip(".")
        parts = base + ([*mod.split(".")] if mod else [])
        if not mod:  # from . import x: x may be a module
            return [".".join(parts + [a.name]) for a in node.names]
        return [".".join(parts)]
    return []


def test_core_modules_import_no_feature_and_not_the_session():
    bad = []
    for path in _files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_blocks(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            for name in _imported(path, node):
                if name.split(".")[0] in ABOVE:
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_violation():
    """The scan is not vacuous: relative, absolute and in-function imports of a feature are seen."""
    code = "from ..metrics import peaks\ndef f():\n    import stepwatch.session\n    from .. import comm\n"
    tree = ast.parse(code)
    names = [n for node in ast.walk(tree) for n in _imported(SRC / "exporters" / "x.py", node)]
    assert sorted(names) == ["comm", "metrics", "session"]

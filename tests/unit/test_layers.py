"""The package's one organising rule, checked on its source: a small core, features as packages
over it, the session over the features, adapters and commands on top. No import (at module level
or inside a function) runs from a lower layer to a higher one, and no two folders import each
other. The session starts features by module name (``importlib``), which this does not count: the
session sits above them anyway. Imports under ``if TYPE_CHECKING:`` are annotations, not imports."""

import ast
import os
from collections import defaultdict

import stepwatch

ROOT = os.path.dirname(stepwatch.__file__)

# Lowest first. A top-level module or a folder (a package) is one unit.
LAYERS = [
    # core: the schema, files, logging, configuration, OS and device tools
    {"record", "_log", "_version", "_table", "_terminal", "_argtypes", "_files", "_dist", "_env", "context", "config", "_os", "cuda_ext",
     "_speedups", "_excepthook", "_imports"},
    # core: the training thread's hooks and the findings catalogue, rate limit, generic detectors
    {"hooks", "analysis"},
    # core: exporters consume batches
    {"exporters"},
    # core: the runtime the session assembles (feature hub, pipeline, run-dir manifest, SIGTERM)
    {"_feature", "_pipeline", "_manifest", "_sigterm"},
    # features
    {"metrics", "telemetry", "comm", "memory", "watchdog", "capture", "traces"},
    # the session and the public API
    {"_session", "_api", "__init__", "auto"},
    # framework adapters
    {"integrations"},
    # commands and tools that read run directories or run beside the job
    {"serving", "report", "doctor", "rules", "runner", "cli", "__main__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str:
    """``stepwatch.comm.spans`` -> ``comm``; ``stepwatch`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(module: str, root: str) -> bool:
    rel = os.path.join(root, *module.split(".")[1:])
    return os.path.isdir(rel) or os.path.exists(rel + ".py")


def _imports(root: str = ROOT):
    """(importer, imported) module pairs of every stepwatch-internal import under ``root``."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
            is_pkg = name == "__init__.py"
            mod = rel[: -len(".__init__")] if is_pkg else rel
            pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            # ``if TYPE_CHECKING:`` imports name types for annotations only (the hub a hook is
            # handed); they never run, so they order nothing.
            typing_only = {id(n) for node in ast.walk(tree)
                           if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                           for sub in node.body for n in ast.walk(sub)}
            for node in ast.walk(tree):
                if id(node) in typing_only:
                    continue
                targets = []
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                        target = ".".join(base + ([node.module] if node.module else []))
                    else:
                        target = node.module or ""
                    for a in node.names:  # ``from . import x``: x may be a submodule
                        sub = f"{target}.{a.name}"
                        targets.append(sub if _is_module(sub, root) else target)
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                for t in targets:
                    if t == "stepwatch" or t.startswith("stepwatch."):
                        yield mod, t


def test_every_unit_has_a_layer():
    units = {n[:-3] if n.endswith(".py") else n for n in os.listdir(ROOT)
             if (n.endswith(".py") or os.path.isfile(os.path.join(ROOT, n, "__init__.py")))}
    assert units - RANK.keys() == set(), "a new module or folder: give it a layer here and in README's Architecture"


def _upward(root: str = ROOT) -> list[str]:
    return sorted(f"{a} -> {b}" for a, b in _imports(root) if RANK[_unit(a)] < RANK[_unit(b)])


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    assert _upward() == []


def test_no_two_folders_import_each_other():
    edges = defaultdict(set)
    for a, b in _imports():
        ua, ub = _unit(a), _unit(b)
        if ua != ub:
            edges[ua].add(ub)
    # any cycle between units (depth-first search)
    cycles = []
    state: dict[str, int] = {}

    def visit(u, path):
        state[u] = 1
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                cycles.append(path[path.index(v):] + [v] if v in path else [u, v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u, [u])
    assert cycles == []


def test_the_check_sees_a_violation(tmp_path):
    """The checker itself, on a planted tree: a hook importing a feature inside a function, and
    a feature importing the session, are both caught."""
    pkg = tmp_path / "stepwatch"
    for d in ("hooks", "metrics"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "_session.py").write_text("")
    (pkg / "metrics" / "flops.py").write_text("from .. import _session\n")
    (pkg / "hooks" / "install.py").write_text("def f():\n    from ..metrics.flops import x\n")
    assert _upward(str(pkg)) == ["stepwatch.hooks.install -> stepwatch.metrics.flops",
                                 "stepwatch.metrics.flops -> stepwatch._session"]


def test_the_run_shim_spells_stepwatchs_own_variables_as_env_py_does():
    """The shim cannot import the package (it runs first in every process of a job): every
    ``STEPWATCH_*`` name it reads or sets must be one of _env.py's, or a Config variable."""
    import re

    from stepwatch import _env
    from stepwatch.config import env_table

    with open(os.path.join(ROOT, "runner", "shim", "sitecustomize.py"), encoding="utf-8") as f:
        used = set(re.findall(r"STEPWATCH_[A-Z_]+", f.read()))
    known = {v for k, v in vars(_env).items() if k.isupper()} | {row[0].strip("`") for row in env_table()}
    assert used and used <= known, used - known

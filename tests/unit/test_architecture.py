"""The package's layering, enforced: each part of ``tide`` imports only its own layer or lower ones,
nothing imports in a cycle (function-level imports included), the contracts module needs only
the standard library, and nothing outside the engine probes an engine with hasattr/getattr.

A new top-level module or subpackage must be placed in LAYERS: the test fails until it is.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import tide

ROOT = Path(tide.__file__).resolve().parent

# lowest first; a module may import its own layer and the ones before it
LAYERS: list[tuple[str, ...]] = [
    ("tide.contracts",),  # what components exchange: stdlib only
    ("tide.config", "tide.redact", "tide.records", "tide.metrics", "tide.metrics_text", "tide.process",
     "tide.health_server"),
    # capture takes what engines offer from tide.contracts: it sits below the engine, which starts it
    ("tide.models", "tide.drafter", "tide.spec", "tide.workloads", "tide.dataset", "tide.capture"),
    ("tide.engine", "tide.registry", "tide.drafting"),  # the engine knows nothing of ops/training
    ("tide.ops", "tide.train", "tide.schedule", "tide.report", "tide.traffic", "tide.prometheus", "tide.broker"),
    # services: processes and commands, built over the library; the library never imports them
    ("tide.services", "tide.service", "tide.stack", "tide.comparison", "tide.demo_watch", "tide.demo", "tide.cli"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("tide",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every tide module ``name`` imports, at module level or inside functions."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES and m != name and m != "tide"}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int | None:
    for i, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return i
    return None


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "tide" and _layer(m) is None] == []


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
           for m, deps in GRAPH.items() if m != "tide" for d in deps if _layer(d) > _layer(m)]
    assert bad == []


def test_the_engine_imports_nothing_from_ops_schedule_or_train():
    engine = [m for m in GRAPH if m.startswith("tide.engine")]
    assert engine and not [(m, d) for m in engine for d in GRAPH[m]
                           if d.startswith(("tide.ops", "tide.schedule", "tide.train"))]


def test_capture_imports_nothing_of_the_engine():
    capture = [m for m in GRAPH if m.startswith("tide.capture")]
    assert capture and not [(m, d) for m in capture for d in GRAPH[m] if d.startswith("tide.engine")]


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2
    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_contracts_need_only_the_standard_library():
    tree = ast.parse(MODULES["tide.contracts"].read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_nothing_outside_the_engine_probes_an_engine():
    probes = []
    for name, path in MODULES.items():
        if name.startswith("tide.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args
                    and "engine" in ast.unparse(node.args[0]).lower()):
                probes.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert probes == []


def test_the_checks_see_real_edges():
    # guards against a parser bug that would make every check above pass vacuously
    assert "tide.engine.base" in GRAPH["tide.ops.swap"]
    assert "tide.contracts" in GRAPH["tide.records"]
    assert "tide.contracts" in GRAPH["tide.capture.tap"]

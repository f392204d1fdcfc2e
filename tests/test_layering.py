"""The package's module graph: no import cycles, nothing low imports something high, small modules.

Every ``import`` / ``from ... import`` of every module under ``mla_spec/`` is read with ``ast``,
wherever it sits (module level, inside a function, under ``TYPE_CHECKING``): an import deferred
into a function is still a dependency. ``from mla_spec import Name`` counts as an import of the
module that the package's lazy ``_LAZY`` table resolves ``Name`` to. The layers, low to high, are
``LAYERS`` below (docs/architecture.md draws them); a module may import its own layer and lower.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mla_spec"
MAX_LINES = 400
MAX_FLAT_KERNEL_FILES = 12

#: layer of each top-level module / subpackage of ``mla_spec`` (0 = lowest)
LAYERS: dict[str, int] = {
    # base: configs, devices, batches, the TP group state and collectives, timing records
    "config": 0, "device": 0, "forward_mode": 0, "forward_batch": 0, "distributed": 0,
    "metrics": 0, "data": 0,
    "quant": 1,
    "kernels": 2,
    "kv_cache": 3, "attention": 3,
    # the model and its checkpoints
    "models": 4, "loader": 4, "checkpoint_writer": 4, "model_api": 4,
    "runtime": 5,
    "model_runner": 6, "scheduler": 6, "spec": 6, "engine": 6, "request_checks": 6, "pipeline": 6,
    # tools on top
    "eval": 7, "viz": 7, "cli": 7, "memory_plan": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


@cache
def lazy_table() -> dict[str, str]:
    """``mla_spec.__init__._LAZY``: public name -> module."""
    for node in ast.walk(ast.parse((PKG / "__init__.py").read_text())):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to (its longest prefix that is a module)."""
    mods = modules()
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@cache
def graph() -> dict[str, frozenset[str]]:
    """``module -> modules of the package it imports`` (itself excluded)."""
    mods, lazy = modules(), lazy_table()
    out: dict[str, frozenset[str]] = {}
    for mod, path in mods.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(_resolve(a.name) for a in node.names if a.name.startswith("mla_spec"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package of this module
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                if not src.startswith("mla_spec"):
                    continue
                for a in node.names:
                    if f"{src}.{a.name}" in mods:
                        deps.add(f"{src}.{a.name}")
                    elif src == "mla_spec" and a.name in lazy:
                        deps.add(lazy[a.name])
                    else:
                        deps.add(_resolve(src))
        deps.discard(None)
        deps.discard(mod)
        out[mod] = frozenset(deps)
    return out


def _top(mod: str) -> str:
    """``mla_spec.models.mla`` -> ``models``; the package root -> ``""``."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def _edges_from(area: str):
    for mod, deps in graph().items():
        if _top(mod) == area:
            for d in sorted(deps):
                yield mod, d


def find_cycle() -> list[str] | None:
    """One import cycle of the package (as a list of modules, first == last), or None."""
    g, state, stack = graph(), {}, []

    def visit(m: str) -> list[str] | None:
        state[m] = "open"
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_graph_sees_every_module_and_lazy_imports():
    g = graph()
    assert "mla_spec.engine" in g and "mla_spec.models.mla" in g
    assert "mla_spec.distributed" in g["mla_spec.models.linear"]
    # the lazy public API resolves to modules that exist
    missing = {k: v for k, v in lazy_table().items() if v not in modules()}
    assert not missing, f"_LAZY entries naming no module: {missing}"


def test_public_api_resolves():
    """Every name of ``mla_spec.__all__`` imports (a lazy one from the module ``_LAZY`` names)."""
    import mla_spec

    missing = [n for n in mla_spec.__all__ if getattr(mla_spec, n, None) is None]
    assert not missing, f"public names that do not resolve: {missing}"


def test_no_import_cycles():
    cycle = find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_top_level_module_has_a_layer():
    tops = {_top(m) for m in modules()} - {""}
    assert not tops - set(LAYERS), f"give these a layer in LAYERS: {sorted(tops - set(LAYERS))}"


def test_nothing_low_imports_something_high():
    bad = [f"{m} (layer {LAYERS[_top(m)]}) imports {d} (layer {LAYERS[_top(d)]})"
           for m, deps in graph().items() if _top(m) for d in deps
           if _top(d) and LAYERS[_top(d)] > LAYERS[_top(m)]]
    assert not bad, "upward imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("area, forbidden", [
    ("kernels", {"models", "attention", "spec", "engine", "eval", "viz", "runtime", "cli"}),
    ("models", {"runtime", "engine", "spec", "eval", "viz", "cli", "model_runner",
                "scheduler"}),
    ("runtime", {"engine", "spec", "model_runner", "scheduler", "eval", "viz", "cli"}),
])
def test_area_imports_nothing_above_it(area, forbidden):
    bad = [f"{m} imports {d}" for m, d in _edges_from(area) if _top(d) in forbidden]
    assert not bad, "\n".join(bad)


def test_modules_are_small():
    big = {m: n for m, p in modules().items()
           if (n := len(p.read_text().splitlines())) >= MAX_LINES}
    assert not big, f"modules of {MAX_LINES}+ lines: {big}"


def test_kernels_folder_is_grouped():
    flat = sorted(p.name for p in (PKG / "kernels").glob("*.py"))
    assert len(flat) <= MAX_FLAT_KERNEL_FILES, (
        f"{len(flat)} .py files directly under mla_spec/kernels/ (at most "
        f"{MAX_FLAT_KERNEL_FILES}): {flat}")

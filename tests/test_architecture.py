"""The package's shape, checked from the source: no import circle between files under
fltune/, and stages that import one way.

Every ``import`` / ``from ... import`` of every module is read with ``ast`` — including the
ones inside functions (a lazy import is still a dependency: it only moves the circle to
run time). ``from pkg import name`` counts as an import of ``pkg/name.py`` when that is a
module, else of ``pkg/__init__.py``; the implicit run of parent packages' ``__init__`` is
not counted (it is not what the file asked for).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fltune"

#: stage rank: a module may import only modules of the same or a lower rank
STAGES = {
    "": 0, "util": 0,                       # fltune/__init__.py, fltune/util.py
    "ops": 1,
    "backends": 2, "dispatch": 2, "profiles": 2,
    "store": 3,
    "tune": 4,
    "freeze": 5,
    "evaluate": 6,
    "integrations": 7,
    "cli": 8, "__main__": 8,
}
LOW = ("ops", "backends", "dispatch")
HIGH = ("tune", "store", "freeze", "evaluate", "cli")


def _modules() -> dict:
    """dotted module name -> path, for every .py under fltune/."""
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _is_pkg(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _imports(name: str, path: Path) -> list:
    """(imported fltune module, line) for every import statement in the file."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if _is_pkg(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "fltune" or a.name.startswith("fltune."):
                    out.append((_existing(a.name), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not (mod == "fltune" or mod.startswith("fltune.")):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in MODULES else _existing(mod), node.lineno))
    return [(m, ln) for m, ln in out if m is not None]


def _existing(mod: str):
    while mod and mod not in MODULES:
        mod = mod.rpartition(".")[0]
    return mod or None


GRAPH = {name: sorted({m for m, _ in _imports(name, p) if m != name})
         for name, p in MODULES.items()}


def _stage(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_has_a_stage():
    assert {_stage(m) for m in MODULES} <= set(STAGES), sorted(
        {_stage(m) for m in MODULES} - set(STAGES))


def test_the_parser_sees_lazy_imports():
    """The graph must include imports inside functions (the circles were lazy ones)."""
    src = "def f():\n    from .store import device\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
    # a known lazy import in the package: cli.main imports the evaluate stage in functions
    assert "fltune.evaluate.bench" in GRAPH["fltune.cli.main"]


def _cycles() -> list:
    """Every strongly connected component with more than one file (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_files():
    assert _cycles() == []


def test_cycle_finder_finds_a_cycle():
    """The check itself can fail: a made-up edge back from the store to the CLI is a circle."""
    GRAPH["fltune.store.db"].append("fltune.cli.main")
    try:
        assert _cycles(), "a circle through store -> cli -> store was not found"
    finally:
        GRAPH["fltune.store.db"].remove("fltune.cli.main")


def test_stages_import_one_way():
    bad = []
    for name, path in MODULES.items():
        for dep, line in _imports(name, path):
            if STAGES[_stage(dep)] > STAGES[_stage(name)]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} {name} -> {dep}")
    assert bad == []


@pytest.mark.parametrize("low", LOW)
def test_core_never_imports_measurement_or_commands(low):
    bad = [(m, d) for m in MODULES if _stage(m) == low
           for d in GRAPH[m] if _stage(d) in HIGH]
    assert bad == []


def test_only_the_cli_renders():
    """rich (and the rendering module) is imported by nothing outside fltune/cli/."""
    bad = []
    for name, path in MODULES.items():
        if _stage(name) == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                    else [])
            bad += [f"{name}: {m}" for m in mods if m == "rich" or m.startswith("rich.")]
        bad += [f"{name}: {d}" for d in GRAPH[name] if d == "fltune.cli.render"]
    assert bad == []


def test_one_manifest_type_and_one_race():
    """The manifest's format lives in dispatch/manifest.py and the race loop in
    tune/race.py; nothing else defines them again."""
    defs = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:      # module-level definitions
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in (
                    "fingerprint_of", "load_manifest", "verify_manifest", "race",
                    "pick_winner", "fl_pick", "resolve_device", "write_json_atomic",
                    "fmt_us", "has_sqlite_header"):
                defs.setdefault(node.name, []).append(name)
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id == "MANIFEST_FORMAT":
                        defs.setdefault("MANIFEST_FORMAT", []).append(name)
    dup = {k: v for k, v in defs.items() if len(v) > 1}
    assert dup == {}
    assert defs["MANIFEST_FORMAT"] == ["fltune.dispatch.manifest"]
    assert defs["race"] == ["fltune.tune.race"]

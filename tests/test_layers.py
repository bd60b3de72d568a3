"""The package's layers point down only: each module imports (at any depth, lazily or not)
only from its own layer or the layers below it, and no two modules import each other in a
circle. Read from the source with `ast`, so a lazy import inside a function counts too."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "perfloop"

# Bottom to top. A module belongs to the first prefix it matches; within a layer, modules may
# import each other (without a cycle).
LAYERS = [
    ("device", "settings", "errors"),
    ("harness.stats", "harness.measurement", "harness.sampling"),
    ("harness.ceilings",),  # measured with the harness's samplers
    ("harness.timing", "harness"),  # bench/compare/sweep report against the ceilings
    ("ops", "results"),  # beside each other, never importing each other
    ("analysis",),
    ("workflows", "experiments", "nn"),
    ("cli", "pytest_plugin", "__main__", ""),  # the faces, and the package's public front
]
APART = [("ops", "results")]  # same layer, no imports either way


def _module(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _layer(mod: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if mod == p or (p and mod.startswith(p + ".")):
                return i
    return len(LAYERS) - 1  # the package root


def _family(mod: str) -> str:
    return mod.split(".")[0]


def _is_module(name: str) -> bool:
    path = SRC / Path(*name.split(".")) if name else SRC
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path, mod: str) -> set[str]:
    """The perfloop modules `path` imports (names relative to the package; "" is the package's
    own front, `perfloop/__init__.py`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from perfloop.x import y`: the submodule x.y if y is one, else x itself
            names = [
                f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}"[9:]) else node.module
                for a in node.names
            ]
        else:
            continue
        for n in names:
            if n == "perfloop" or n.startswith("perfloop."):
                out.add(n[len("perfloop.") :] if n != "perfloop" else "")
    out.discard(mod)
    return out


GRAPH = {_module(p): _imports(p, _module(p)) for p in SRC.rglob("*.py")}


@pytest.mark.parametrize("mod", sorted(GRAPH), ids=lambda m: m or "perfloop")
def test_imports_point_down(mod):
    up = [t for t in GRAPH[mod] if _layer(t) > _layer(mod)]
    assert not up, f"perfloop.{mod} (layer {_layer(mod)}) imports upward: {up}"
    for a, b in APART:
        if _family(mod) in (a, b):
            other = b if _family(mod) == a else a
            crossing = [t for t in GRAPH[mod] if _family(t) == other]
            assert not crossing, f"perfloop.{mod} imports {crossing}: {a} and {b} stand apart"


def test_no_import_cycles():
    # package __init__ files re-export their submodules: an edge into a package's own
    # children is not a cycle back to the parent
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in GRAPH.get(m, ()):
            if t in GRAPH and not (m == "" or t.startswith(m + ".") if m else True):
                if state.get(t) == 1:
                    cycle = stack[stack.index(t) :] + [t]
                    raise AssertionError("import cycle: " + " -> ".join(c or "perfloop" for c in cycle))
                if t not in state:
                    visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: device facts that measured with the harness, and the lazy import
    the demo used to make of the CLI, are both seen."""
    fake = tmp_path / "device.py"
    fake.write_text("def f():\n    from perfloop.harness.timing import bench\n    from perfloop import cli\n")
    found = _imports(fake, "device")
    assert found == {"harness.timing", "cli"}
    assert all(_layer(t) > _layer("device") for t in found)
    assert _layer("cli.bench") > _layer("workflows.ops") > _layer("analysis.profiling") > _layer("ops.base")

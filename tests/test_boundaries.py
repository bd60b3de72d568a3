"""No module reads or writes another module's private names (STYLE: objects passed, not privates
filled from outside): read from the source with `ast`, as tests/test_layers.py reads imports. A
private name is one a perfloop module defines with a leading underscore (a function, a class, a
module-level name, or `self._x`); touching it from another module, or importing it, fails."""

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "perfloop"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _outside_modules(tree: ast.Module) -> set[str]:
    """Names a file binds to modules not of perfloop (`os`, `torch`...): their privates are theirs."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names if not a.name.startswith("perfloop")}
        elif isinstance(n, ast.ImportFrom) and n.module and not n.module.startswith("perfloop"):
            out |= {a.asname or a.name for a in n.names}
    return out


def violations(files: dict[str, ast.Module]) -> list[str]:
    owners = defaultdict(set)  # private name -> the modules defining it
    for mod, tree in files.items():
        for n in ast.walk(tree):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id in ("self", "cls")
            ):
                if _private(n.attr):
                    owners[n.attr].add(mod)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(n.name):
                owners[n.name].add(mod)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    if isinstance(t, ast.Name) and _private(t.id):
                        owners[t.id].add(mod)
    out = []
    for mod, tree in files.items():
        outside = _outside_modules(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("perfloop"):
                out += [f"{mod}:{n.lineno} imports {n.module}.{a.name}" for a in n.names if _private(a.name)]
            elif isinstance(n, ast.Attribute) and _private(n.attr) and mod not in owners.get(n.attr, {mod}):
                base = n.value.id if isinstance(n.value, ast.Name) else None
                if base not in ("self", "cls") and base not in outside:
                    out.append(f"{mod}:{n.lineno} {ast.unparse(n)} (private to {sorted(owners[n.attr])[0]})")
    return out


def test_no_module_touches_another_modules_private_names():
    files = {str(p.relative_to(SRC)): ast.parse(p.read_text()) for p in SRC.rglob("*.py")}
    assert violations(files) == []


def test_the_check_sees_a_private_filled_from_outside():
    files = {
        "analysis/profiling.py": ast.parse(
            "class Profile:\n    def __init__(self):\n        self._samples = None\n"
        ),
        "workflows/script.py": ast.parse("import os\ndef f(p):\n    p._samples = 1\n    os._exit(0)\n"),
        "nn/patch.py": ast.parse("from perfloop.nn.modules import _RECORDING\n"),
    }
    found = violations(files)
    assert found == [
        "workflows/script.py:3 p._samples (private to analysis/profiling.py)",
        "nn/patch.py:1 imports perfloop.nn.modules._RECORDING",
    ]

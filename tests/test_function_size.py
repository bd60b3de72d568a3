"""perfloop reads top-down in small pieces: no function in src/ over 80 lines (a new cause is a
small analyzer, not another branch in one function)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "perfloop"
LIMIT = 80


def long_functions(folder: Path) -> list[str]:
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    out.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_in_perfloop_is_over_80_lines():
    assert long_functions(SRC) == []


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        assert long_functions(tmp_path) == ["m.py:1 f (81 lines)"]
    finally:
        SRC = saved

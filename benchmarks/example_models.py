"""examples/NAME.py imported as the module NAME, for the benchmarks that run the example models
(without putting examples/ on sys.path: a benchmark imports only what it names)."""

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str):
    """The module examples/NAME.py, imported once as NAME (a patched model pickles by reference)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

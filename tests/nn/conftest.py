"""The models of examples/, importable by name (a patched model pickles by reference)."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    """examples/NAME.py as the module NAME."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def nanogpt():
    return example("nanogpt_model")


@pytest.fixture(scope="module")
def mingpt():
    return example("mingpt_model")


@pytest.fixture(scope="module")
def llama():
    return example("llama_model")

"""The nanoGPT-style model of examples/, importable by name (a patched model pickles by reference)."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def nanogpt():
    spec = importlib.util.spec_from_file_location("nanogpt_model", EXAMPLES / "nanogpt_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_model"] = mod
    spec.loader.exec_module(mod)
    return mod

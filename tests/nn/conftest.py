"""The models of examples/, importable by name (a patched model pickles by reference)."""

from pathlib import Path

import pytest

from helpers import example

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def nanogpt():
    return example("nanogpt_model")


@pytest.fixture(scope="module")
def mingpt():
    return example("mingpt_model")


@pytest.fixture(scope="module")
def llama():
    return example("llama_model")

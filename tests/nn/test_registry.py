"""One row per fused op (nn.registry), read by pl.patch, the rerouted call sites and the compiled
graphs; one dispatch makes every op's compiling / cannot-run / kernel choice; which ops go into
a compiled graph is context-local."""

import threading
from pathlib import Path

import pytest
import torch

import perfloop.nn as pnn
from perfloop.nn import compiled, functional, registry

OPS = Path(__file__).resolve().parents[2] / "src" / "perfloop" / "ops"


def test_every_row_names_an_op_folder_a_function_and_a_module_that_exist():
    for r in registry.OPS:
        assert (OPS / r.op).is_dir(), r
        if r.module:
            assert (
                hasattr(pnn, r.module) and hasattr(torch.nn, r.module) or r.module == "LinearCrossEntropy"
            ), r
    in_functional = {r.name for r in registry.OPS if r.call_site or r.gate_of}
    assert set(functional.FUSED) == in_functional
    assert all(hasattr(torch.nn.functional, n) for n in registry.CALLS)
    assert set(registry.GATES) == {"silu", "gelu"} and registry.DEFAULT_IN_GRAPH <= registry.GRAPH_OPS


def test_the_kinds_the_analysis_names_come_from_the_rows():
    assert registry.kinds() == {
        "normalization": ("layer_norm", "rms_norm"),
        "cross_entropy": ("cross_entropy",),
        "gelu": ("gelu",),
    }
    assert registry.by_module("LayerNorm").op == "layernorm" and registry.by_module("Linear") is None


@pytest.mark.parametrize(
    "compiling, why, expected",
    [
        (True, None, "torch: compiling"),
        (False, "a CPU tensor", "torch: a CPU tensor"),
        (False, None, "kernel"),
    ],
)
def test_dispatch_makes_the_three_way_choice(compiling, why, expected):
    calls = []
    got = registry.dispatch(
        why=lambda: calls.append("why") or why,
        kernel=lambda: "kernel",
        fallback=lambda reason: f"torch: {reason}",
        compiling=compiling,
    )
    assert got == expected
    assert calls == ([] if compiling else ["why"])  # under compile the kernels' checks do not run


def test_under_compile_a_graph_op_that_takes_the_call_is_used_and_one_that_does_not_falls_back():
    kw = dict(why=lambda: None, kernel=lambda: "kernel", fallback=lambda r: r, compiling=True)
    assert registry.dispatch(graph=lambda: "graph op", **kw) == "graph op"
    assert registry.dispatch(graph=lambda: None, **kw) == "compiling"


def test_which_ops_go_into_a_graph_is_local_to_the_context_that_chose():
    seen = {}

    def other():
        seen["thread"] = compiled.taken("layer_norm")

    with compiled.in_graph({"layer_norm"}):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        seen["here"] = compiled.taken("layer_norm")
    assert seen == {"thread": False, "here": True}
    assert not compiled.taken("layer_norm") and compiled.taken("linear_cross_entropy")  # as shipped


def test_in_graph_names_only_ops_that_have_a_graph_op():
    with pytest.raises(ValueError, match=r"names: \['gelu'\] have no graph op"), compiled.in_graph({"gelu"}):
        pass

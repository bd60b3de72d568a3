"""Each op's tuning: the table its launcher reads, the shared timing of candidates, and the
choice of the best config."""

import json

import pytest
import torch

from perfloop.ops import tuning


@pytest.mark.parametrize(
    "op",
    [
        "attention",
        "cross_entropy",
        "gelu",
        "layernorm",
        "linear_cross_entropy",
        "rowsum",
        "softmax",
        "swiglu",
    ],
)
def test_every_tuned_table_is_there_and_says_where_it_was_measured(op):
    from pathlib import Path

    import perfloop.ops

    doc = json.loads((Path(perfloop.ops.__file__).parent / op / "tuned.json").read_text())
    assert doc["measured_on"] and doc["date"] and doc["table"]
    assert tuning.load_table(Path(perfloop.ops.__file__).parent / op) == doc["table"]


def test_save_then_load_round_trips(tmp_path):
    tuning.save_table(tmp_path, {"block": 2048, "num_warps": 4}, "a test GPU", "note")
    assert tuning.load_table(tmp_path) == {"block": 2048, "num_warps": 4}
    assert json.loads((tmp_path / "tuned.json").read_text())["measured_on"] == "a test GPU"


def test_a_failing_candidate_costs_only_itself():
    x = torch.randn(1000)

    def broken():
        raise RuntimeError("out of resources: shared memory")

    times = tuning.time_candidates({"ok": lambda: x * 2, "broken": broken}, budget_s=0.05)
    assert isinstance(times["ok"], float) and times["ok"] > 0
    assert "out of resources" in times["broken"]
    assert tuning.fastest(times) == "ok"
    assert tuning.fastest({"a": "error"}) is None


def test_the_launcher_reads_its_table(monkeypatch):
    """The row sum launches with the table's block and warps, not a number in the code."""
    from perfloop.ops.rowsum import triton_impl

    seen = []
    kernel = triton_impl.rowsum_kernel
    spy = type(
        "Spy",
        (),
        {"__getitem__": lambda self, grid: lambda *a, **kw: seen.append(kw) or kernel[grid](*a, **kw)},
    )()
    monkeypatch.setattr(triton_impl, "rowsum_kernel", spy)
    monkeypatch.setattr(triton_impl, "TUNED", {"block": 64, "num_warps": 2})
    x = torch.randn(3, 300)
    torch.testing.assert_close(triton_impl.rowsum(x), x.sum(-1), rtol=1e-5, atol=1e-5)
    assert seen[0]["BLOCK"] == 64


def test_attention_choice_is_the_best_geometric_mean():
    from perfloop.ops.attention import tuning as at

    rows = [
        {
            "kernel": "fwd",
            "head_dim": 128,
            "BLOCK_M": 64,
            "BLOCK_N": 64,
            "num_warps": 4,
            "num_stages": 3,
            "ratio": 0.8,
        },
        {
            "kernel": "fwd",
            "head_dim": 128,
            "BLOCK_M": 64,
            "BLOCK_N": 64,
            "num_warps": 4,
            "num_stages": 3,
            "ratio": 0.8,
        },
        {
            "kernel": "fwd",
            "head_dim": 128,
            "BLOCK_M": 128,
            "BLOCK_N": 64,
            "num_warps": 8,
            "num_stages": 2,
            "ratio": 1.5,
        },
        {
            "kernel": "fwd",
            "head_dim": 128,
            "BLOCK_M": 128,
            "BLOCK_N": 64,
            "num_warps": 8,
            "num_stages": 2,
            "ratio": 0.5,
        },  # one great case, one poor: geometric mean 0.87 > 0.8
        {
            "kernel": "fwd",
            "head_dim": 128,
            "BLOCK_M": 32,
            "BLOCK_N": 32,
            "num_warps": 4,
            "num_stages": 2,
            "ratio": 2.0,
        },  # ran one case only: not comparable
    ]
    table = {"16bit": {"fwd": {"64": [1, 1, 1, 1], "128": [1, 1, 1, 1]}}}
    out = at._choose(rows, ["fwd"], table)
    assert out["16bit"]["fwd"]["128"] == [128, 64, 8, 2]
    assert out["16bit"]["fwd"]["64"] == [1, 1, 1, 1]  # nothing measured: the table stands


def test_a_table_tuned_on_another_gpu_is_not_used_silently(tmp_path, monkeypatch):
    import warnings

    folder = tmp_path / "softmax"
    folder.mkdir()
    tuning.save_table(folder, {"block": 2048}, "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "NVIDIA H200")
    with pytest.warns(
        tuning.TableWarning,
        match=r"softmax/tuned.json was tuned on NVIDIA A100-SXM4-80GB, "
        r"not on this NVIDIA H200",
    ):
        assert tuning.load_table(folder) == {"block": 2048}
    monkeypatch.setattr(tuning, "_gpu_name", lambda: "NVIDIA A100-SXM4-80GB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning.load_table(folder)  # the GPU it was tuned on: no word
    monkeypatch.setattr(tuning, "_gpu_name", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning.load_table(folder)  # interpreted or no GPU: the configs are not a speed here


def test_the_norms_launch_settings_come_from_their_table():
    """Rows of <= 1024 in pairs, 4 programs an SM; wider rows one at a time, 2 an SM; warps by
    the tile's bytes: the choices norm_tune.py measured, read from layernorm/tuned.json."""
    from perfloop.ops.layernorm import triton_impl as ln

    cpu = torch.device("cpu")  # 2 "SMs" on a CPU
    assert ln._bwd_config(12288, 1024, 2, cpu) == (8, 2, 4)  # 768-wide bf16 rows: pairs, 4 a SM
    assert ln._bwd_config(8192, 4096, 2, cpu) == (4, 1, 8)  # 4096-wide bf16 rows: 1 a step, 2 a SM
    assert ln._bwd_config(3, 65536, 4, cpu) == (3, 1, 16)  # never more programs than rows
    assert [ln._warps(b) for b in (256, 1024, 2048, 4096, 8192, 65536)] == [4, 4, 8, 8, 16, 16]


SETTINGS = ("num_warps", "num_stages", "ROWS", "GROUP_M")  # and every tile size (*BLOCK*)


def _launch_settings_chosen_in_code(path) -> list[str]:
    """Keyword arguments of the kernel launches in one launcher file whose value is a number
    written there: a literal, a conditional of literals, or a module-level name bound to one.
    The interpreter's own configs (under `if interpreting():`) are not launch settings of a GPU."""
    import ast

    tree = ast.parse(path.read_text())

    def constants(v) -> bool:
        return all(isinstance(e, ast.Constant) for e in (v.elts if isinstance(v, ast.Tuple) else [v]))

    literal_names = {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign) and constants(node.value)
        for t in ast.walk(node.targets[0])
        if isinstance(t, ast.Name)
    }

    def numeric(v) -> bool:
        if isinstance(v, ast.Constant):
            return isinstance(v.value, int) and not isinstance(v.value, bool)
        if isinstance(v, ast.IfExp):
            return numeric(v.body) and numeric(v.orelse)
        return isinstance(v, ast.Name) and v.id in literal_names

    interpreted = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "interpreting" in ast.unparse(node.test):
            interpreted |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in interpreted:
            continue
        is_launch = (isinstance(node.func, ast.Name) and node.func.id == "launch") or isinstance(
            node.func, ast.Subscript
        )  # launch(kernel, ...) or kernel[grid](...)
        if is_launch:
            out += [
                f"{path.parent.name}:{node.lineno} {k.arg}={ast.unparse(k.value)}"
                for k in node.keywords
                if k.arg in SETTINGS or "BLOCK" in (k.arg or "")
                if numeric(k.value)
            ]
    return out


def test_no_launch_writes_a_tile_warp_or_stage_count_of_its_own():
    """Issue 25 item 4: tiles, warps and stages from the op's tuned.json; a number written in a
    launch is a setting no tuner can change and no table records. (Rules computed before the
    launch -- softmax's warps from the row's block, a small block's 4 warps in row sum and the
    online softmax -- are not what this reads.)"""
    from pathlib import Path

    import perfloop.ops

    root = Path(perfloop.ops.__file__).parent
    found = [s for p in sorted(root.glob("*/triton_impl.py")) for s in _launch_settings_chosen_in_code(p)]
    assert found == [], "\n".join(found)

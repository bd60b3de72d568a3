"""Script mode on compiled code (issue 39): perfloop's window must not change what is compiled,
and the compilation a window meets is seen, kept out of the steps and said."""

import json
import textwrap

import pytest

from perfloop.workflows.script import profile_script

# a training script in the popular style: the model compiled whole, AdamW, the loop steps by
# optimizer.step(); it writes what Dynamo did after each step
SCRIPT = """
import json, sys
import torch
import torch.nn as nn
from torch._dynamo.utils import counters, get_compilation_metrics


class MLP(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


torch.manual_seed(0)
model = torch.compile(MLP())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
seen = []
for step in range({steps}):
    x = torch.randn(16, {length}, 64)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    seen.append({{"compiles": [f"{{m.compile_id}} {{m.co_name}}" for m in get_compilation_metrics()],
                  "graph_breaks": sum(counters["graph_break"].values())}})
json.dump(seen, open(sys.argv[1], "w"))
"""


def _script(tmp_path, steps=8, length="8"):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT.format(steps=steps, length=length)))
    return path


@pytest.mark.parametrize("count_work", [True, False])
def test_a_window_opening_and_closing_on_a_warm_compiled_model_recompiles_nothing(tmp_path, count_work):
    """Dynamo traced perfloop's global forward pre-hook into the user's graph and guarded on its
    state: the window opening (the step found) recompiled the model inside the profiled step."""
    import warnings

    out = tmp_path / "seen.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = profile_script(_script(tmp_path), [str(out)], skip=2, steps=2, count_work=count_work)
    seen = json.loads(out.read_text())
    assert len(seen) == 8 and p.calls == 2
    warm = seen[0]["compiles"]  # the first step compiles the forward and, lazily, the backward
    assert warm, "the model compiled nothing: the test tests nothing"
    assert [s["compiles"] for s in seen[1:]] == [warm] * 7, "a step after the first compiled again"
    assert [s["graph_breaks"] for s in seen] == [0] * 8
    # torch's warning that global module hooks fire for the compiled wrapper: perfloop's hooks, and
    # perfloop's own ranges handle the wrapper
    assert not [w for w in caught if "global hooks" in str(w.message)]


# planted compile problems, each in a model written as people write them; {plant} chooses one
PLANTED = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

plant = sys.argv[1]


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

        self.window = None  # a context-length curriculum sets it: attend to the last `window` tokens

    def forward(self, x):
        if self.window is not None:
            x = x[:, -self.window :]
        h = self.fc(self.ln(x))
        if plant == "branch" and h.mean() > 0:  # a data-dependent branch
            h = h - h.mean()
        if plant == "item":
            scale = h.abs().max().item()  # a value read to the host
            h = h / scale
        return x + self.proj(F.gelu(h))


torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range(2)]) if plant != "scalar" else Block()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = torch.compile(model, dynamic=False if plant == "shape" else None)
for step in range(6):
    length = 8 + step if plant == "shape" else 8  # a new sequence length every step
    x = torch.randn(4, length, 64)
    if plant == "scalar":
        model.window = 4 + step  # the curriculum: a Python int on the module, new every step
    y = compiled(x)
    y.pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def _planted(tmp_path, plant: str, skip=2):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(PLANTED))
    p = profile_script(path, [plant], skip=skip, steps=1)
    return p, p.diagnose(ceilings={"copy_gbps": 20.0, "matmul_fp32_tflops": 0.5})


def _line_of(tmp_path, text: str) -> str:
    lines = (tmp_path / "train.py").read_text().splitlines()
    return f"train.py:{next(i for i, x in enumerate(lines, 1) if text in x)}"


@pytest.mark.slow
def test_a_model_recompiling_every_step_on_a_new_length_is_told_which_dim_and_how_to_fix_it(tmp_path):
    p, d = _planted(tmp_path, "shape")
    top = d.findings[0]
    assert top.kind == "recompile" and "every step" in top.title, str(d)
    # the input's name is torch.compile's wrapper's (args[0]); the line is the user's call
    assert "size of dim 1 of `args[0]` changed: 10 -> 11" in top.title, str(d)
    # the compiles at the pace of the skipped steps that recompiled, without the profiler (which
    # can slow Dynamo's tracing several times): not more than such a step took
    assert p.profiled_wall_ms_per_call, "the unprofiled pace of the recompiling steps"
    assert 0.3 * p.wall_ms_per_call < top.saves_ms <= p.wall_ms_per_call, (top.saves_ms, p.wall_ms_per_call)
    assert top.site.line == _line_of(tmp_path, "y = compiled(x)"), top
    assert "mark_dynamic" in top.advice and "torch.compile" not in top.advice.replace("torch.compile(", "")
    assert not any("use torch.compile" in f.advice or "(torch.compile)" in f.advice for f in d.findings), str(
        d
    )


@pytest.mark.slow
def test_a_python_int_that_changes_every_step_is_named_as_the_recompiles_cause(tmp_path):
    p, d = _planted(tmp_path, "scalar")
    top = d.findings[0]
    assert top.kind == "recompile" and "every step" in top.title and "`self.window`" in top.title, str(d)
    assert "as a tensor" in top.advice


@pytest.mark.slow
def test_a_data_dependent_branch_in_a_compiled_forward_is_a_named_graph_break(tmp_path):
    p, d = _planted(tmp_path, "branch")
    breaks = p.graph_breaks()
    assert breaks and breaks[0].where == _line_of(tmp_path, "h.mean() > 0"), breaks
    assert breaks[0].kind == "data-dependent branch"
    found = [f for f in d.findings if f.kind == "graph break"]
    assert found and found[0].site.line == breaks[0].where and "torch.where" in found[0].advice, str(d)


@pytest.mark.slow
def test_an_item_in_a_compiled_forward_is_a_named_graph_break(tmp_path):
    p, _ = _planted(tmp_path, "item")
    kinds = {(b.where, b.kind) for b in p.graph_breaks()}
    assert (_line_of(tmp_path, ".item()"), "item") in kinds, kinds


@pytest.mark.slow
def test_a_warm_compiled_step_has_no_compile_cause_and_no_advice_to_compile(tmp_path):
    p, d = _planted(tmp_path, "none", skip=None)  # the default steps: past the ones that compiled
    assert not p.compiles(), p.compiles()
    assert p.compiled_regions(), "nothing ran compiled: the control controls nothing"
    assert not [f for f in d.findings if f.kind in ("compile", "recompile", "graph break")], str(d)
    assert not any("(torch.compile)" in f.advice or "use torch.compile" in f.advice for f in d.findings), str(
        d
    )


def test_a_profiled_step_that_compiles_once_is_dropped_and_the_window_opens_again(tmp_path):
    """By default a step that compiled is not the step's cost: the length changes once, at the
    third step, so the first profiled step compiles; the window moves past it, and says so."""
    import torch

    torch._dynamo.reset()
    path = _script(tmp_path, steps=10, length="8 if step < 3 else 12")
    p = profile_script(path, [str(tmp_path / "seen.json")], skip=None, steps=2)
    assert not p.compiles(), p.compiles()
    assert any("compiled while profiled: dropped" in w for w in p.warnings), p.warnings
    import torch

    torch._dynamo.reset()  # else Dynamo remembers the first run's lengths as dynamic: no recompile
    forced = profile_script(path, [str(tmp_path / "seen.json")], skip=2, steps=2)  # the user's --skip: kept
    assert forced.compiles() and any("compiled (Dynamo, Inductor)" in w for w in forced.warnings)


def test_a_compiled_scripts_kernels_are_charged_to_its_modules_with_their_work(tmp_path):
    """Inductor's provenance, switched on for the script: the compiled graph's launches (here
    its extern matmuls; on a GPU its kernels too) placed in the model's modules, not in the
    compiled wrapper, and their FLOPs counted with the code still compiled."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch_dynamo_reset()
    # the other tests' graphs of this model, cached from files elsewhere, carry those files' lines
    no_cache = functorch_config.patch(enable_autograd_cache=False)
    with inductor_config.patch({"fx_graph_cache": False}), no_cache:
        p = profile_script(_script(tmp_path), [str(tmp_path / "seen.json")], skip=2, steps=1)
    modules = {r.name: r for r in p.breakdown(by="module")}
    assert {"fc", "proj"} <= set(modules) and "_orig_mod" not in modules, sorted(modules)
    # fc: (16*8) x 64 -> 256, forward and the two backward matmuls
    assert modules["fc"].flops == pytest.approx(3 * 2 * 16 * 8 * 64 * 256, rel=1e-6), modules["fc"]
    lines = {i.line for i in p.items() if i.module == "fc"}
    assert lines == {f"train.py:{_line_no(tmp_path, 'return x + self.proj')}"}, lines


def torch_dynamo_reset():
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.clear_compilation_metrics()


def _line_no(tmp_path, text: str) -> int:
    lines = (tmp_path / "train.py").read_text().splitlines()
    return next(i for i, x in enumerate(lines, 1) if text in x)


def test_on_a_cpu_a_compiled_scripts_kernels_are_ops_not_host_work(tmp_path):
    """On a CPU Inductor's kernels are C++ functions the profiler does not see unless asked
    (cpp.enable_kernel_profile): their time read as "host work outside torch" at the generated
    file's `call` line. Compiled under the window's switches, they are rows like any op."""
    import torch

    torch._dynamo.reset()
    out = tmp_path / "seen.json"
    p = profile_script(_script(tmp_path, steps=6), [str(out)], skip=2, steps=2)
    rows = [r.name for r in p.breakdown(by="op")]
    assert any(r.startswith("(compiled) cpp_") for r in rows), rows
    d = p.diagnose(ceilings={"copy_gbps": 20.0, "matmul_fp32_tflops": 0.5})
    assert not any(".py:" in f.where and "(call)" in f.where for f in d.findings if f.kind == "host"), str(d)

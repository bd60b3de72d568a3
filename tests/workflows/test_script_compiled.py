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
    seen.append({{"compiles": [m.compile_id + " " + m.co_name for m in get_compilation_metrics()],
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

"""tune's patch candidate on a script that calls its model the way Hugging Face's docs do,
by keywords only (`model(input_ids=x, labels=x)`): the candidate sees the call's real
arguments and keywords, and pl.patch checks and swaps on them."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from perfloop.workflows.tune.child import Child
from perfloop.workflows.tune.spec import RunSpec

LLAMA = textwrap.dedent(
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(6):
        x = torch.randint(0, 128, (2, 16))
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    """
)


class _Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, *, input_ids, scale=1.0):
        return self.proj(input_ids) * scale


def _seen_calls(model, *args, **kwargs) -> list:
    seen = []
    child = Child(RunSpec(script="train.py", warmup=1, steps=1))
    child.on_model(lambda m, a, k: seen.append((m, a, dict(k))))
    child._hook_model()
    try:
        model(*args, **kwargs)
        model(*args, **kwargs)  # a second call: the hook fired once, at the first
    finally:
        assert nn.Module.__call__ is torch.nn.modules.module.Module._wrapped_call_impl
    return seen


def test_the_first_model_hook_gets_the_calls_keywords():
    model, x = _Keywords(), torch.randn(2, 4)
    seen = _seen_calls(model, input_ids=x, scale=2.0)
    assert len(seen) == 1
    m, args, kwargs = seen[0]
    assert m is model and args == () and kwargs.keys() == {"input_ids", "scale"}
    assert kwargs["input_ids"] is x


def test_the_first_model_hook_gets_a_compiled_models_keywords():
    model, x = _Keywords(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="eager")
    seen = _seen_calls(compiled, input_ids=x)
    assert len(seen) == 1 and seen[0][0] is compiled and seen[0][2]["input_ids"] is x


def test_a_compiled_step_calls_the_hook_eager_once_then_compiles_the_whole_model():
    model, x, graphs = _Keywords(), torch.randn(2, 4), []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(lambda x: model(input_ids=x).sum(), backend=backend)
    seen = _seen_calls(step, x)
    assert len(seen) == 1 and seen[0][0] is model and seen[0][2]["input_ids"] is x
    step(x)
    linears = [n for n in graphs[-1].graph.nodes if "linear" in str(n.target)]
    assert linears, "the step after the hook's is one graph with the model in it"


@pytest.mark.slow
def test_the_patch_candidate_patches_a_llama_called_by_keywords_only(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("triton")
    (tmp_path / "train.py").write_text(LLAMA)
    spec = {
        "script": str(tmp_path / "train.py"),
        "candidates": ["patch"],
        "warmup": 1,
        "steps": 1,
        "out": str(tmp_path / "out.json"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run(
        [sys.executable, "-m", "perfloop.workflows.tune.child", str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**__import__("os").environ, "TRITON_INTERPRET": "1"},
    )
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["ok"], (out.get("error"), p.stderr[-2000:])
    said = " ".join(out["notes"])
    assert "pl.patch replaced" in said and "model.norm" in said, said
    assert out["steps_seen"] == 2 and len(out["losses"]) == 2

"""pl.patch on Hugging Face transformers models, called the way their docs call them (a dict
batch, keyword-only forwards, a ModelOutput back), built from configs only: each of their
modules swapped where it checks equal, or named with why not; the patched model's loss and
gradients those of the unpatched one."""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import perfloop as pl
import perfloop.nn as pnn

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")


def _llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _ids(seed=1):
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # GPT-2 drops out in training: the same masks both ways
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_training_step(patched, unpatched, x):
    loss, grads = _loss_and_grads(patched, x)
    want, want_grads = _loss_and_grads(unpatched, x)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.fixture(scope="module")
def llama_patched():
    model, x = _llama(), _ids()
    unpatched = copy.deepcopy(model)
    report = pl.patch(model, {"input_ids": x, "labels": x})
    return model, unpatched, report, x


def test_a_dict_batch_is_called_as_keywords_and_the_llamas_norms_are_swapped(llama_patched):
    model, _, report, _ = llama_patched
    norms = [
        "model.norm",
        *(f"model.layers.{i}.{n}" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")),
    ]
    assert set(norms) <= set(report.replaced), str(report)
    assert all(isinstance(model.get_submodule(n), pnn.RMSNorm) for n in norms)


def test_the_llamas_gated_mlp_and_its_loss_are_checked_then_swapped(llama_patched):
    model, _, report, _ = llama_patched
    said = str(report)
    gates = [s for s in report.swaps if s.site and s.site[1] == "silu_gate"]
    assert [s.site[0] for s in gates] == ["model.layers.0.mlp", "model.layers.1.mlp"], said
    assert all(s.replaced for s in gates), said
    loss = [s for s in report.swaps if s.name == "loss_function"]
    assert loss and loss[0].replaced and "ForCausalLMLoss" in loss[0].via, said


def test_the_llamas_rotary_is_fused_and_its_attention_said_to_be_sdpa_already(llama_patched):
    _, _, report, _ = llama_patched
    for i in (0, 1):
        swap = next(s for s in report.swaps if s.name == f"model.layers.{i}.self_attn")
        assert swap.replaced and "fused RoPE" in swap.via, str(report)
        assert "scaled_dot_product_attention call already" in swap.via, swap.via


def test_the_patched_llama_trains_to_the_unpatched_ones_loss_and_gradients(llama_patched):
    model, unpatched, _, x = llama_patched
    _same_training_step(model, unpatched, x)
    _same_training_step(model, unpatched, _ids(seed=5))  # another batch than the one checked on


def test_a_gpt2s_norms_and_gelu_are_swapped_and_its_attention_says_why_not():
    model, x = _gpt2(), _ids()
    unpatched = copy.deepcopy(model)
    report = pl.patch(model, transformers.BatchEncoding({"input_ids": x, "labels": x}))
    said = str(report)
    assert {"transformer.ln_f", "transformer.h.0.ln_1", "transformer.h.1.mlp.act"} <= set(report.replaced), (
        said
    )
    assert (
        isinstance(model.transformer.h[0].mlp.act, pnn.GELU)
        and model.transformer.h[0].mlp.act.approximate == "tanh"
    )
    assert "scaled_dot_product_attention" in report.refused["transformer.h.0.attn"], said
    assert "loss_function" in report.replaced, said
    _same_training_step(model, unpatched, x)


class _Net(nn.Module):
    """A norm and a linear, the output in the form `kind` names."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.norm, self.proj = kind, nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x, y=None):
        h = self.proj(self.norm(x))
        loss = (h - (x if y is None else y)).pow(2).mean()
        return {
            "tensor": loss,
            "tuple": (loss, h),
            "dict": {"logits": h, "loss": loss},
            "dataclass": _Out(h, loss),
            "output": transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=h),
            "logits only": transformers.modeling_outputs.CausalLMOutput(logits=h),
            "words": "no tensor at all",
        }[self.kind]


@dataclass
class _Out:
    logits: torch.Tensor
    loss: torch.Tensor


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "dataclass", "output", "logits only"])
def test_the_step_is_timed_on_the_loss_wherever_the_model_puts_it(kind):
    torch.manual_seed(0)
    model, x = _Net(kind), torch.randn(4, 8)
    report = pl.patch(model, {"x": x}, measure=True, budget_s=0.05)
    assert report.timing is not None and "after" in report.timing["candidates"], str(report)


def test_a_step_with_no_loss_to_backpropagate_keeps_the_model_and_says_why():
    torch.manual_seed(0)
    model, x = _Net("words"), torch.randn(4, 8)
    report = pl.patch(model, (x,), measure=True, budget_s=0.05)
    assert report.replaced == [] and type(model.norm) is nn.LayerNorm
    assert "no loss" in report.skipped["step"] and "str" in report.skipped["step"]


def test_a_tuple_batch_is_called_as_arguments_and_a_tensor_as_one():
    torch.manual_seed(0)
    model, x = _Net("tensor"), torch.randn(4, 8)
    assert pl.patch(model, (x, x)).replaced == ["norm"]
    model = _Net("tensor")
    assert pl.patch(model, x).replaced == ["norm"]


def test_a_lightning_modules_training_step_is_the_step():
    lightning = pytest.importorskip("lightning")

    class Lit(lightning.LightningModule):
        def __init__(self, as_dict):
            super().__init__()
            self.as_dict, self.net = as_dict, _Net("tensor")

        def training_step(self, batch, batch_idx):
            loss = self.net(*batch)
            return {"loss": loss} if self.as_dict else loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for as_dict in (False, True):
        lit = Lit(as_dict)
        step = lambda m, b: m.training_step(b, 0)
        report = pl.patch(lit, (x, x), loss_fn=step)
        assert report.replaced == ["net.norm"] and isinstance(lit.net.norm, pnn.LayerNorm), str(report)
        timed = pl.patch(Lit(as_dict), (x, x), loss_fn=step, measure=True, budget_s=0.05)
        assert timed.timing is not None, str(timed)

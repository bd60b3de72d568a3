"""Script mode on a generation script that steps no optimizer and opens no range (issue 65): a
step is one decode call of its model -- the module with parameters it calls again and again
under no_grad, one token per sequence -- the prompt's prefill told apart by its token count."""

import textwrap

import pytest
import torch

from perfloop.analysis import annotate
from perfloop.cli import main
from perfloop.workflows.script import OPTIMIZER_STEP, profile_script
from perfloop.workflows.step_sources import MODEL_CALL

# gpt-fast's generate.py in small: a KV cache, a prefill, then decode_n_tokens calling
# decode_one_token(model, x, input_pos), greedy; argv: new tokens, batch, whether the batch shrinks
GEN = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, dim, heads, batch, max_len):
            super().__init__()
            self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
            self.heads = heads
            self.register_buffer("k_cache", torch.zeros(batch, heads, max_len, dim // heads))
            self.register_buffer("v_cache", torch.zeros(batch, heads, max_len, dim // heads))

        def forward(self, x, input_pos, mask):
            b, t, d = x.shape
            q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.wqkv(x).split(d, -1))
            self.k_cache[:b, :, input_pos] = k
            self.v_cache[:b, :, input_pos] = v
            y = F.scaled_dot_product_attention(q, self.k_cache[:b], self.v_cache[:b], attn_mask=mask)
            return self.wo(y.transpose(1, 2).reshape(b, t, d))

    class Transformer(nn.Module):
        def __init__(self, vocab=64, dim=32, heads=2, batch=4, max_len=64):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.attention = Attention(dim, heads, batch, max_len)
            self.output = nn.Linear(dim, vocab, bias=False)
            self.register_buffer("causal_mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))

        def forward(self, idx, input_pos):
            x = self.tok_embeddings(idx)
            return self.output(x + self.attention(x, input_pos, self.causal_mask[None, None, input_pos]))

    def prefill(model, x, input_pos):
        return model(x, input_pos)[:, -1].argmax(-1, keepdim=True)

    def decode_one_token(model, x, input_pos):
        return model(x, input_pos)[:, -1].argmax(-1, keepdim=True)

    def decode_n_tokens(model, cur_token, input_pos, num_new_tokens, shrink):
        new_tokens = []
        for i in range(num_new_tokens):
            if shrink:  # sequences that ended leave the batch
                cur_token = cur_token[: max(1, cur_token.shape[0] - i // 3)]
            next_token = decode_one_token(model, cur_token, input_pos)
            input_pos += 1
            new_tokens.append(next_token.clone())
            cur_token = next_token
        return new_tokens

    @torch.no_grad()
    def generate(model, prompt, max_new_tokens, shrink=False):
        t = prompt.shape[1]
        next_token = prefill(model, prompt, torch.arange(0, t))
        return decode_n_tokens(model, next_token, torch.tensor([t]), max_new_tokens - 1, shrink)

    new, batch, shrink = (int(a) for a in (sys.argv[1:] + ["24", "1", "0"][len(sys.argv) - 1 :]))
    torch.manual_seed(0)
    model = Transformer().eval()
    prompt = torch.randint(0, 64, (batch, 12))
    print(generate(model, prompt, new, bool(shrink))[-1].flatten().tolist())
    """
)

HF = textwrap.dedent(
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()  # random weights from a config: nothing downloaded
    prompt = torch.randint(0, 128, (1, 12))
    out = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    print(out[0, -4:].tolist())
    """
)


def _clean():
    assert not torch.autograd.profiler._is_profiler_enabled
    assert annotate.RANGE_WATCHERS == []
    assert not torch.nn.modules.module._global_forward_hooks


def _script(tmp_path, text, name="gen.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_gpt_fast_decode_loop_is_stepped_by_its_decode_calls_and_its_prefill_is_told_apart(tmp_path):
    p = profile_script(_script(tmp_path, GEN), [], skip=None, steps=2)
    _clean()
    assert p.step == MODEL_CALL and p.calls == 2
    said = "a step: one decode call of Transformer (1 token per sequence, batch 1); "
    said += "prefill (1 call, 12 tokens) left out"
    assert said in p.warnings
    assert any(i.module.startswith("attention") for i in p.items())
    assert p.tokens().per_step == 1  # the embedding saw one token: a decode call, not the prefill


def test_the_step_chosen_is_printed_where_the_profile_says_what_it_profiled(tmp_path, capsys):
    path = _script(tmp_path, GEN)
    assert main(["profile", "--db", str(tmp_path / "r.db"), "--no-count", "--script", str(path)]) == 0
    _clean()
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "profiled" in line)
    assert "2 decode call(s) of Transformer" in header, out
    assert "a step: one decode call of Transformer (1 token per sequence, batch 1)" in out
    assert "prefill (1 call, 12 tokens) left out" in out


@pytest.mark.slow
def test_a_transformers_generate_script_is_stepped_by_its_models_decode_calls(tmp_path):
    p = profile_script(_script(tmp_path, HF), [], skip=None, steps=2, count_work=False)
    _clean()
    assert p.step == MODEL_CALL and p.calls == 2
    said = "a step: one decode call of LlamaForCausalLM (1 token per sequence, batch 1); "
    said += "prefill (1 call, 12 tokens) left out"
    assert said in p.warnings
    assert any(i.module.startswith("model.layers.0") for i in p.items())


def test_a_decode_loop_whose_batch_varies_is_stepped_and_the_varying_batch_said(tmp_path):
    p = profile_script(_script(tmp_path, GEN), ["16", "4", "1"], skip=None, steps=2, count_work=False)
    _clean()
    assert p.step == MODEL_CALL
    varies = [w for w in p.warnings if "batch varies" in w]
    assert varies and "4, 3, 2, 1 sequences" in varies[0], p.warnings


def test_a_model_called_once_is_no_decode_loop_and_that_is_said(tmp_path):
    once = GEN.split("new, batch, shrink")[0] + textwrap.dedent(
        """
        model = Transformer().eval()
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 12)), torch.arange(12))
        """
    )
    with pytest.raises(
        ValueError, match=r"Transformer was called once under no_grad \(12 tokens\): no decode"
    ):
        profile_script(_script(tmp_path, once), [], skip=None, steps=2)
    _clean()


def test_a_training_script_that_evaluates_under_no_grad_is_still_stepped_by_its_optimizer(tmp_path):
    train = textwrap.dedent(
        """
        import torch
        net = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randint(0, 64, (4, 8))
        with torch.no_grad():  # an evaluation first, as nanoGPT's estimate_loss
            for _ in range(4):
                net(x)
        for _ in range(6):
            torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
        """
    )
    p = profile_script(_script(tmp_path, train), [], skip=1, steps=2)
    _clean()
    assert p.step == OPTIMIZER_STEP and p.calls == 2
    assert not any(w.startswith("a step: ") for w in p.warnings)


def test_of_two_models_decoding_the_step_is_the_larger_ones_and_which_is_said(tmp_path):
    two = GEN.split("new, batch, shrink")[0] + textwrap.dedent(
        """
        class Draft(Transformer):
            pass

        torch.manual_seed(0)
        draft, model = Draft(dim=8).eval(), Transformer(dim=64).eval()
        prompt = torch.randint(0, 64, (1, 12))
        with torch.no_grad():
            d, t = prefill(draft, prompt, torch.arange(12)), prefill(model, prompt, torch.arange(12))
            pos = torch.tensor([12])
            for _ in range(12):
                d = decode_one_token(draft, d, pos)  # the small one first, each token
                t = decode_one_token(model, t, pos)
                pos += 1
        """
    )
    p = profile_script(_script(tmp_path, two), [], skip=None, steps=2, count_work=False)
    _clean()
    assert p.step == MODEL_CALL
    said = next(w for w in p.warnings if w.startswith("a step: "))
    assert said.startswith("a step: one decode call of Transformer"), said
    models = next(w for w in p.warnings if "models were called under no_grad" in w)
    assert "Transformer (13 calls" in models and "Draft (13 calls" in models
    assert "the step is Transformer's, the one with the most parameters" in models
    assert all(i.module != "Draft" for i in p.items())

"""How perfloop tune checks a generation script's candidates (issue 65): the logits are read
wherever the model puts them (a tensor, a tuple, a Hugging Face ModelOutput's `.logits`), each
model call's top logits kept on the device; a candidate's greedy token that differs from the
script's is a tie where the script's own margin at that position is within the candidate's
numerics floor (bf16 casts flip near-ties), refused otherwise with the position, the margin and
the floor; a run whose logits could not be read is "not checked", never kept."""

import copy
import json
import math
import textwrap
from dataclasses import dataclass

import pytest
import torch

from perfloop.workflows.tune.candidates import Numerics
from perfloop.workflows.tune.logits import LogitsRecord, find_logits
from perfloop.workflows.tune.report import payload, text
from perfloop.workflows.tune.tuner import Options, tune
from perfloop.workflows.tune.verify import Logits, judge_tokens

REORDERED, BF16 = float(Numerics.REORDERED), float(Numerics.BF16)

HF_GENERATE = textwrap.dedent(
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()  # random weights from the config: nothing downloaded
    prompt = torch.randint(0, 128, (1, 6))
    for _ in range(8):
        with torch.profiler.record_function("token"):
            model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    """
)

HF_PLANT = textwrap.dedent(
    """
    from perfloop.workflows.tune.candidates import Candidate, Numerics

    def _drop(child):
        def drop(model, args, kwargs):
            del model.model.layers[-1]
        child.on_model(drop)

    DROP_LAYER = Candidate(name="drop-layer", what="the last decoder layer skipped", lines=(),
                           apply=_drop, numerics=Numerics.REORDERED)
    """
)

# A decode whose next token is the input's successor, except after token 5, where 6 and 2 tie
# within bf16's rounding (1.0001 and 1.0: 1.0001 rounds to 1.0 in bf16, whose argmax then picks
# 2, the first of the two): fp32 goes 0 1 2 3 4 5 6 7 ..., bf16 weights 0 1 2 3 4 5 2 3 ...
CHAIN = textwrap.dedent(
    """
    import torch

    V = 16

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, V)
            self.head = torch.nn.Linear(V, V, bias=False)
            scores = 0.01 * torch.randn(V, V)
            for i in range(V):
                scores[(i + 1) % V, i] = 1.0
            scores[6, 5], scores[2, 5] = 1.0001, 1.0
            with torch.no_grad():
                self.emb.weight.copy_(torch.eye(V))
                self.head.weight.copy_(scores)

        def forward(self, idx):
            return self.head(self.emb(idx))

    torch.manual_seed(0)
    model = Chain()
    token = torch.tensor([[0]])
    with torch.no_grad():
        for _ in range(12):
            with torch.profiler.record_function("token"):
                token = model(token)[:, -1:].argmax(-1)
    """
)

CHAIN_PLANT = textwrap.dedent(
    """
    from perfloop.workflows.tune.candidates import Candidate, Numerics

    def _bias(child):
        def bias(model, args, kwargs):
            def add(module, inputs, out):
                out = out.clone()
                out[..., 9] += 1.5
                return out
            model.register_forward_hook(add)
        child.on_model(bias)

    BIASED = Candidate(name="biased-logit", what="token 9's logit 1.5 up", lines=(), apply=_bias,
                       numerics=Numerics.REORDERED)
    """
)

# A model whose output holds no logits perfloop can read, and a candidate that makes it faster.
OPAQUE = textwrap.dedent(
    """
    import time
    import torch

    class Opaque(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.delay = 0.01

        def forward(self, idx):
            time.sleep(self.delay)
            return {"hidden": self.emb(idx)[..., :1]}

    model = Opaque()
    token = torch.tensor([[0]])
    with torch.no_grad():
        for _ in range(12):
            with torch.profiler.record_function("token"):
                model(token)
    """
)

OPAQUE_PLANT = textwrap.dedent(
    """
    from perfloop.workflows.tune.candidates import Candidate, Numerics

    def _fast(child):
        def fast(model, args, kwargs):
            model.delay = 0.0
        child.on_model(fast)

    FAST = Candidate(name="no-delay", what="the delay removed", lines=(), apply=_fast)
    """
)


def _tuned(tmp_path, monkeypatch, script, plant, module, tried, steps=3):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "generate.py").write_text(script)
    (folder / f"{module}.py").write_text(plant)
    monkeypatch.chdir(folder)  # --try module:NAME is found from here, in the children too
    monkeypatch.syspath_prepend(str(folder))
    opts = Options(
        script=str(folder / "generate.py"),
        budget_s=300,
        steps=steps,
        warmup=1,
        rounds=1,
        tried=tried,
        profile_first=False,
        range="token",
    )
    result = tune(opts)
    return result, {row["candidate"]: row for row in payload(result)["candidates"]}


@pytest.mark.slow
def test_a_hugging_face_generate_script_is_checked_on_its_logits_and_a_dropped_layer_refused(
    tmp_path, monkeypatch
):
    result, rows = _tuned(
        tmp_path, monkeypatch, HF_GENERATE, HF_PLANT, "plant_hf", ["plant_hf:DROP_LAYER", "bf16-weights"]
    )
    dropped = rows["drop-layer"]["loss_check"]
    assert rows["drop-layer"]["verified"] is False, dropped
    assert rows["drop-layer"]["check"] == "refused" and not rows["drop-layer"]["kept"], dropped
    assert "position" in dropped["reason"] and "floor" in dropped["reason"], dropped
    assert dropped["checked"] and dropped["compared"] >= 1
    bf16 = rows["bf16-weights"]["loss_check"]
    assert bf16["checked"] and "not checked" not in bf16["reason"], bf16  # read from .logits
    assert result.best is None or result.best.label != "drop-layer"


@pytest.mark.slow
def test_a_bf16_cast_that_flips_a_near_tie_is_a_tie_and_a_biased_logit_is_refused(tmp_path, monkeypatch):
    _, rows = _tuned(
        tmp_path, monkeypatch, CHAIN, CHAIN_PLANT, "plant_chain", ["bf16-weights", "plant_chain:BIASED"], 6
    )
    tie = rows["bf16-weights"]["loss_check"]
    assert rows["bf16-weights"]["verified"] is True, tie
    assert rows["bf16-weights"]["check"] == "ok", tie
    assert "tie at position 5" in tie["reason"] and tie["compared"] == 6, tie
    biased = rows["biased-logit"]["loss_check"]
    assert rows["biased-logit"]["check"] == "refused", biased
    assert "position 0" in biased["reason"] and "margin" in biased["reason"], biased


@pytest.mark.slow
def test_a_run_whose_logits_cannot_be_read_is_not_checked_and_not_kept(tmp_path, monkeypatch):
    result, rows = _tuned(
        tmp_path, monkeypatch, OPAQUE, OPAQUE_PLANT, "plant_opaque", ["plant_opaque:FAST"], 8
    )
    row = rows["no-delay"]
    assert not row["kept"] and result.best is None, row
    assert row["speedup"] > 1.5 and row["check"] == "not checked" and row["verified"] is None, row
    assert "dict" in row["loss_check"]["reason"] and not row["kept"] and result.best is None
    lines = "\n".join(text(result))
    assert "no-delay: not checked" in lines and "best kept" not in lines, lines


class Chain(torch.nn.Module):
    """CHAIN's model, in this process."""

    def __init__(self, vocab=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)
        self.head = torch.nn.Linear(vocab, vocab, bias=False)
        scores = 0.01 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
        for i in range(vocab):
            scores[(i + 1) % vocab, i] = 1.0
        scores[6, 5], scores[2, 5] = 1.0001, 1.0
        with torch.no_grad():
            self.emb.weight.copy_(torch.eye(vocab))
            self.head.weight.copy_(scores)

    def forward(self, idx):
        return self.head(self.emb(idx))


class Tiny(torch.nn.Module):
    """A small residual language model with random weights."""

    def __init__(self, vocab=32, dim=24, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def _decoded(model, steps=12, wrap=lambda out: out) -> Logits:
    """A greedy decode of `model` with the child's recorder on it, read back as the child's
    result is (through JSON); `wrap` puts the logits where a model may."""
    record = LogitsRecord()
    model.register_forward_hook(lambda m, i, out: record.add(wrap(out)) and None)
    token = torch.tensor([[0]])
    with torch.no_grad():
        for _ in range(steps):
            token = find_logits(wrap(model(token)))[:, -1:].argmax(-1)
    return Logits.of(json.loads(json.dumps(record.readings())))


def test_an_unchanged_model_is_accepted_and_says_what_was_compared():
    model = Tiny()
    base, same = _decoded(model), _decoded(copy.deepcopy(model))
    v = judge_tokens(same, base, base, REORDERED)
    assert v.ok and v.checked and v.compared == 12, v.reason
    assert (
        "the first 12 greedy tokens equal the script's, their top 8 logits at most 0 of the logits' scale"
        in v.reason
    )


def test_a_bf16_cast_that_flips_a_near_tie_is_a_tie_past_which_nothing_is_compared():
    base = _decoded(Chain())
    assert base.tokens[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    cast = _decoded(Chain().to(torch.bfloat16))
    assert cast.tokens[:8] == [1, 2, 3, 4, 5, 2, 3, 4] and cast.dtype == "torch.bfloat16"
    v = judge_tokens(cast, base, base, BF16)
    assert v.ok and v.compared == 6, v.reason
    assert "tie at position 5 (model call 5): token 2 where the script's is 6" in v.reason
    assert "margin between them 0.0001" in v.reason and "past it the sequences part" in v.reason
    exact = judge_tokens(cast, base, base, float(Numerics.EXACT))  # bf16 logits: their own rounding
    assert exact.ok and "bfloat16 logits' rounding" in exact.reason


def test_a_biased_logit_is_refused_with_the_position_the_margin_and_the_floor():
    def biased(out):
        out = out.clone()
        out[..., 9] += 1.5
        return out

    base, cand = _decoded(Chain()), _decoded(Chain(), wrap=biased)
    v = judge_tokens(cand, base, base, BF16)
    assert not v.ok and v.checked
    assert "refused: greedy token 9 at position 0 (model call 0) where the script's is 1" in v.reason
    assert "the script's margin between them is" in v.reason and "over the floor 0.03" in v.reason


def test_a_bias_that_leaves_the_greedy_tokens_is_refused_on_the_top_logits():
    def nudged(out):
        out = out.clone()
        out[..., 9] += 0.5  # token 9 second everywhere, first nowhere
        return out

    base, cand = _decoded(Chain()), _decoded(Chain(), wrap=nudged)
    assert cand.tokens == base.tokens
    v = judge_tokens(cand, base, base, REORDERED)
    assert not v.ok and "refused: the top logits at position 0" in v.reason and "by 0.48" in v.reason


def test_a_dropped_layer_is_refused():
    model = Tiny()
    dropped = copy.deepcopy(model)
    del dropped.layers[-1]
    v = judge_tokens(_decoded(dropped), _decoded(model), None, REORDERED)
    assert not v.ok and "refused:" in v.reason and "floor" in v.reason and v.early_err > v.early_tol


@dataclass
class _Output:
    logits: torch.Tensor
    hidden: torch.Tensor


@pytest.mark.parametrize(
    "wrap",
    [
        lambda out: out,
        lambda out: (out.sum(), out),  # (loss, logits): the first tensor over a vocabulary
        lambda out: {"logits": out, "past_key_values": None},
        lambda out: _Output(out, out[..., :2]),
    ],
    ids=["tensor", "tuple", "dict", "dataclass"],
)
def test_the_logits_are_read_wherever_the_model_puts_them(wrap):
    model = Tiny()
    assert _decoded(model, wrap=wrap).tokens == _decoded(model).tokens != []


def test_a_run_with_no_logits_read_is_not_checked_and_says_why():
    record = LogitsRecord()
    record.add({"hidden": torch.zeros(1, 1, 1)})
    base = Logits.of(record.readings())
    v = judge_tokens(_decoded(Tiny()), base, None, REORDERED)
    assert not v.ok and not v.checked
    assert "not checked: no logits read" in v.reason and "dict with keys ['hidden']" in v.reason


def test_a_nan_the_script_does_not_have_is_refused():
    base = _decoded(Tiny())
    nan = Logits.of(
        {"tokens": base.tokens, "top_logits": [[math.nan] * 8] + base.top[1:]}
        | {"top_tokens": base.top_tokens, "logit_scale": base.scale}
    )
    v = judge_tokens(nan, base, None, BF16)
    assert not v.ok and "position 0" in v.reason and "by inf" in v.reason


def test_the_scripts_own_runs_bound_what_is_compared():
    model = Tiny()
    base = _decoded(model)
    other = Logits.of(
        {**base.__dict__, "tokens": base.tokens[:4] + [99] + base.tokens[5:]}
        | {"top_logits": base.top, "top_tokens": base.top_tokens, "logit_scale": base.scale}
    )
    v = judge_tokens(base, base, other, REORDERED)
    assert v.ok and v.compared == 4 and "the script's own runs part at position 4" in v.reason


def test_the_recorder_keeps_at_most_its_limit_and_still_counts_each_calls_tokens():
    record = LogitsRecord(limit=5)
    assert record.add(torch.randn(2, 3, 10)) == 6 and record.add(torch.randn(1, 1, 10)) == 1
    got = record.readings()
    assert len(got["tokens"]) == 5 and got["logit_calls"] == [5] and len(got["top_logits"][0]) == 8

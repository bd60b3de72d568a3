"""pl.patch merges attention written as one module per head (the lecture's GPT) into one
projection and one SDPA call, where the merge checks equal on the model's own batch."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import perfloop as pl
from perfloop.nn import heads as pheads

pytest.importorskip("triton")

N_EMBD, BLOCK = 32, 16


class Head(nn.Module):
    def __init__(self, head_size, width_scale=True, bias=0.0):
        super().__init__()
        self.key = nn.Linear(N_EMBD, head_size, bias=False)
        self.query = nn.Linear(N_EMBD, head_size, bias=False)
        self.value = nn.Linear(N_EMBD, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(BLOCK, BLOCK)))
        self.dropout = nn.Dropout(0.2)
        self.width_scale, self.bias = width_scale, bias

    def forward(self, x):
        B, T, C = x.shape
        k, q = self.key(x), self.query(x)
        wei = q @ k.transpose(-2, -1) * (C if self.width_scale else k.shape[-1]) ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = self.dropout(F.softmax(wei, dim=-1))
        return wei @ self.value(x) + self.bias


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, **kw):
        super().__init__()
        self.heads = nn.ModuleList([Head(N_EMBD // n_head, **kw) for _ in range(n_head)])
        self.proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class Model(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.emb = nn.Embedding(50, N_EMBD)
        self.sa = nn.ModuleList([MultiHeadAttention(4, **kw) for _ in range(2)])
        self.head = nn.Linear(N_EMBD, 50)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for sa in self.sa:
            x = x + sa(x)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, 50), targets.view(-1))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(50, (3, 13), generator=g), torch.randint(50, (3, 13), generator=g)


@pytest.mark.parametrize("width_scale, said", [(True, "model width"), (False, "head size")])
def test_per_head_modules_are_merged_into_one_projection_and_one_sdpa(width_scale, said):
    torch.manual_seed(0)
    model = Model(width_scale=width_scale)
    keys = list(model.state_dict())
    idx, targets = _batch()
    model.eval()
    with torch.no_grad():
        want = model(idx, targets)[0]
    model.train()
    report = pl.patch(model, (idx, targets), loss_fn=lambda m, b: m(*b)[1])
    merged = [s for s in report.swaps if s.kind == pheads.KIND]
    assert [s.name for s in merged] == ["sa.0", "sa.1"] and all(s.replaced for s in merged), report
    assert all(f"scale=1/sqrt({said})" in s.via and "is_causal=True" in s.via for s in merged)
    assert not any(
        s.replaced and s.name.startswith("sa.0.heads") for s in report.swaps
    )  # merged, not one by one
    assert list(model.state_dict()) == keys  # the parameters, their names, the optimizer's view: the model's
    model.eval()
    with torch.no_grad():
        got = model(idx, targets)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    model.train()
    model(idx, targets)[1].backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for h in model.sa[0].heads for p in h.parameters()
    )


def test_heads_that_compute_something_else_are_kept_with_the_reason():
    torch.manual_seed(0)
    model = Model(bias=0.05)  # each head adds a constant SDPA does not
    report = pl.patch(model, _batch(), loss_fn=lambda m, b: m(*b)[1])
    merged = [s for s in report.swaps if s.kind == pheads.KIND]
    assert merged and not any(s.replaced for s in merged)
    assert all("off by" in s.reason for s in merged), [s.reason for s in merged]
    assert all(h.__dict__.get("forward") is None or not hasattr(h.__dict__.get("forward"), "merged_by")
               for h in model.sa[0].heads)  # fmt: skip


def test_plan_says_the_win_is_the_heads_merged():
    from perfloop.nn.plan import plan

    said = plan(Model())["sa.0"]["attention"]
    assert "4 attention heads in their own modules (Head)" in said and "merged" in said, said

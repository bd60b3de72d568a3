"""Issue 40: rotary embeddings written out op by op (the real form with neighbouring pairs,
rotate_half, Meta's complex product) found in Dynamo's capture of a module's forward and replaced
by the fused RoPE op, checked like every swap. The kernels run under TRITON_INTERPRET=1."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import perfloop as pl
from perfloop.nn import rewrite


def _ops(fn) -> set:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_the_llama_examples_real_form_is_replaced_by_the_fused_rope(llama):
    """examples/llama_model.py: x[..., 0::2], x[..., 1::2], stack, flatten on (B, T, H, D) with fp32
    tables: both q and k's rotations become the fused op, the tables' positions on dim -3."""
    torch.manual_seed(0)
    cfg = llama.ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, multiple_of=16, max_seq_len=32)
    model = llama.Transformer(cfg)
    tokens = torch.randint(0, 128, (2, 12))
    want = model(tokens, tokens)
    report = pl.patch(model, (tokens, tokens))
    swaps = {s.name: s for s in report.swaps}
    attn = swaps["layers.0.attention"]
    assert attn.replaced and attn.kind == rewrite.ROPE, str(report)
    assert attn.via == "RoPE (real form, neighbouring pairs) -> perfloop's fused RoPE"
    torch.testing.assert_close(model(tokens, tokens), want, atol=1e-5, rtol=1e-5)
    model(tokens, tokens)  # the first call in eval mode captures
    ops = _ops(lambda: model(tokens, tokens))
    assert "aten::stack" not in ops, ops  # the written form's stack is gone


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class NeoXAttention(nn.Module):
    """rotate_half with doubled tables, as GPT-NeoX-style code writes it; SDPA for the rest."""

    def __init__(self, dim=32, heads=2, per_row=False):
        super().__init__()
        self.heads, self.hd, self.per_row = heads, dim // heads, per_row
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None], emb.sin()[None]
        if self.per_row:  # Hugging Face's: one table a row, from position_ids
            cos, sin = cos.expand(b, -1, -1), sin.expand(b, -1, -1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_rotate_half_is_replaced_and_tables_a_row_are_refused_with_the_reason():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    model = NeoXAttention()
    want = model(x)
    report = pl.patch(model, (x,), loss_fn=lambda m, b: m(*b).square().mean())
    assert report.swaps[0].replaced and "RoPE (rotate_half form, halves)" in report.swaps[0].via, str(report)
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    per_row = NeoXAttention(per_row=True)
    report = pl.patch(per_row, (x,), loss_fn=lambda m, b: m(*b).square().mean())
    assert not report.swaps[0].replaced
    assert "not one angle per position shared by the batch and heads" in report.swaps[0].reason, str(report)


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis, x):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class MetaAttention(nn.Module):
    """Meta's llama model.py (no KV cache): the complex RoPE and the attention written out."""

    def __init__(self, dim=32, n_heads=2):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.wv, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        xq, keys, values = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


def test_metas_complex_rope_and_written_attention_are_both_replaced():
    torch.manual_seed(0)
    model, x = MetaAttention(), torch.randn(2, 9, 32)
    freqs = precompute_freqs_cis(16, 9)
    mask = torch.triu(torch.full((9, 9), float("-inf")), diagonal=1)
    want = model(x, freqs, mask)
    report = pl.patch(model, (x, freqs, mask), loss_fn=lambda m, b: m(*b).square().mean())
    swap = report.swaps[0]
    assert swap.replaced and swap.kind == f"{rewrite.ROPE} and {rewrite.ATTENTION}", str(report)
    assert "RoPE (complex form, neighbouring pairs)" in swap.via and "is_causal=True" in swap.via, swap.via
    torch.testing.assert_close(model(x, freqs, mask), want, atol=1e-5, rtol=1e-5)
    assert "aten::view_as_complex" not in _ops(lambda: model(x, freqs, mask))
    assert not any("softmax" in o for o in _ops(lambda: model(x, freqs, mask)))


def apply_rotary_mixed(x, cos, sin):
    """Not a rotation: the second part takes cos with x1 and sin with x2."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * cos + x2 * sin), dim=-1).flatten(-2)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, cos, sin):
        return apply_rotary_mixed(self.proj(x), cos, sin)


def test_a_form_that_is_not_a_rotation_is_not_taken_for_one():
    x = torch.randn(2, 3, 5, 16)
    cos, sin = torch.rand(5, 8), torch.rand(5, 8)
    report = pl.patch(Mixed(), (x, cos, sin), loss_fn=lambda m, b: m(*b).sum())
    [swap] = report.swaps
    assert not swap.replaced and "holds none of the written forms" in swap.reason, str(report)

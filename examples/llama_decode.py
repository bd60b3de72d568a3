"""A gpt-fast-style Llama decode, written the way gpt-fast writes it (KV-cache buffers updated
by index_put, SDPA with a boolean mask over the whole cache, RMSNorm, complex RoPE), with random
weights: a prompt prefilled, then one token per call, greedy (or, with --temperature, sampled
with torch.multinomial, whose host-side check syncs each token). Each call is marked with a
record_function range ("prefill", "decode"), so perfloop can read it per token:

    perfloop profile --range decode --script examples/llama_decode.py --compile reduce-overhead

--layers 8 --dim 4096 is 8 layers of the 7B shape (3.76 GB of bf16 weights read per token);
the defaults are small enough for a laptop's CPU.
"""

import argparse
import functools
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    n_layer: int = 2
    n_head: int = 8
    dim: int = 256
    intermediate_size: int = 0
    block_size: int = 2048
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if not self.intermediate_size:
            hidden = int(2 * 4 * self.dim / 3)
            self.intermediate_size = hidden + (-hidden % 256)
        self.head_dim = self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, batch, seq_len, n_heads, head_dim, dtype):
        super().__init__()
        shape = (batch, n_heads, seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        k_out = torch.ops.aten.index_put_(self.k_cache, [None, None, input_pos], k_val)
        v_out = torch.ops.aten.index_put_(self.v_cache, [None, None, input_pos], v_val)
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_frequencies(seq_len, head_dim, base):
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # complex64, [seq, head_dim / 2]


def apply_rope(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.n_head, self.head_dim, self.dim = cfg.n_head, cfg.head_dim, cfg.dim
        self.kv_cache = None

    def forward(self, x, freqs_cis, mask, input_pos):
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split(self.dim, dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_head, self.head_dim)
        v = v.view(bsz, seqlen, self.n_head, self.head_dim)
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, input_pos, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.freqs_cis = None
        self.causal_mask = None

    def setup_caches(self, batch, seq_len):
        dtype = self.output.weight.dtype
        device = self.output.weight.device
        for b in self.layers:
            b.attention.kv_cache = KVCache(
                batch, seq_len, self.config.n_head, self.config.head_dim, dtype
            ).to(device)
        self.freqs_cis = rope_frequencies(
            self.config.block_size, self.config.head_dim, self.config.rope_base
        ).to(device)
        self.causal_mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device))

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        return self.output(self.norm(x))


def prefill(model, x, input_pos):
    logits = model(x, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)


def decode_one_token(model, x, input_pos):
    logits = model(x, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)


def sample_one_token(model, x, input_pos, temperature: float = 0.8):
    logits = model(x, input_pos)
    probs = torch.softmax(logits[:, -1] / temperature, dim=-1)
    return torch.multinomial(probs, num_samples=1)


@torch.no_grad()
def generate(model, prompt, max_new_tokens):
    batch, t = prompt.shape
    input_pos = torch.arange(0, t, device=prompt.device)
    with torch.profiler.record_function("prefill"):
        next_token = prefill(model, prompt, input_pos).clone()
    tokens = [next_token]
    input_pos = torch.tensor([t], device=prompt.device, dtype=torch.int)
    for _ in range(max_new_tokens - 1):
        with torch.profiler.record_function("decode"):
            next_token = decode_one_token(model, next_token, input_pos).clone()
        input_pos += 1
        tokens.append(next_token)
    return torch.cat([prompt, *tokens], dim=1)


def main():
    global decode_one_token
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--compile", default="none", choices=["none", "default", "reduce-overhead"])
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sample with torch.multinomial")
    args = p.parse_args()
    if args.temperature > 0:
        decode_one_token = functools.partial(sample_one_token, temperature=args.temperature)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(1234)
    cfg = ModelArgs(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, dim=args.dim)
    with torch.device(device):
        model = Transformer(cfg)
    model = model.to(dtype=dtype).eval()
    model.setup_caches(args.batch, args.prompt_len + args.max_new_tokens)
    weights = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "tok_embeddings" not in n
    )
    if args.compile != "none":
        mode = None if args.compile == "default" else args.compile
        decode_one_token = torch.compile(decode_one_token, mode=mode, fullgraph=True)

    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), device=device)
    for i in range(args.samples):
        t0 = time.perf_counter()
        y = generate(model, prompt, args.max_new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens_sec = args.batch * args.max_new_tokens / dt
        bandwidth = weights * tokens_sec / args.batch / 1e9
        print(f"sample {i}: {dt:.2f} s, {tokens_sec:.1f} tokens/s, {bandwidth:.2f} GB/s")
    print("last tokens:", y[0, -8:].tolist())


if __name__ == "__main__":
    main()

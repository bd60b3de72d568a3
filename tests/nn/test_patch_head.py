"""A language model's head written the usual way (a bias-free Linear, views or slices of its
logits, F.cross_entropy or nn.CrossEntropyLoss) fused by pl.patch into perfloop's linear + cross
entropy (issue 39): only with the user's word that the step does not read the logits, checked
on the model's own loss and gradients, eager and under an outer torch.compile, and only on the
model patched (a copy compiled in the same process keeps torch's head)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import perfloop as pl
from perfloop.nn import head as nnhead
from perfloop.nn import rewrite

pytest.importorskip("triton")

VOCAB = 96


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    if not torch.cuda.is_available():  # the kernels interpreted (on a GPU they would not compile)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gpt(nanogpt):
    torch.manual_seed(0)
    cfg = nanogpt.GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=32)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)
    y[0, :3] = -1  # nanoGPT's ignore_index
    return nanogpt.GPT(cfg), (x, y)


class HFStyleLM(nn.Module):
    """The head of Hugging Face's causal LMs (as LlamaForCausalLM wrote it): logits in fp32,
    shifted by one, the loss by CrossEntropyLoss, (loss, logits) returned."""

    def __init__(self, vocab=VOCAB, dim=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.vocab_size = vocab

    def forward(self, input_ids, labels=None):
        hidden_states = self.norm(self.embed_tokens(input_ids))
        logits = self.lm_head(hidden_states)
        logits = logits.float()
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss_fct = nn.CrossEntropyLoss()
            shift_logits = shift_logits.view(-1, self.vocab_size)
            shift_labels = shift_labels.view(-1)
            loss = loss_fct(shift_logits, shift_labels)
        return loss, logits


class WithAccuracy(nn.Module):
    """A forward that reads its logits beyond the loss (the accuracy of its predictions)."""

    def __init__(self, vocab=VOCAB, dim=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x, y):
        logits = self.out(self.emb(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        acc = (logits.argmax(-1) == y).float().mean()
        return loss, acc


def _seeded(cls, length: int, seed: int):
    """(cls(), a batch of (tokens, targets) of that length), seeded."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(seed)
    return cls(), tuple(torch.randint(0, VOCAB, (2, length), generator=g) for _ in range(2))


def _loss_and_grads(model, batch, pick):
    for p in model.parameters():
        p.grad = None
    loss = pick(model(*batch))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a, b):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-4, atol=1e-6, msg=k)


def _head_row(report):
    return next(s for s in report.swaps if nnhead.LOSS in s.kind)


def test_without_the_users_word_the_head_is_named_and_kept(nanogpt):
    model, batch = _gpt(nanogpt)
    report = pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[1])
    row = _head_row(report)
    assert not row.replaced and "logits=False" in row.reason
    assert model(*batch)[0] is not None  # the logits still come back


def test_a_nanogpt_head_is_fused_with_logits_false_and_equal(nanogpt):
    model, batch = _gpt(nanogpt)
    want = _loss_and_grads(copy.deepcopy(model), batch, lambda out: out[1])
    report = pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[1], logits=False)
    row = _head_row(report)
    assert row.replaced, report
    assert "nanogpt_model.py:114" in row.via and "None" in row.via
    logits, _ = model(*batch)
    assert logits is None
    _close(_loss_and_grads(model, batch, lambda out: out[1]), want)


def test_a_hugging_face_style_shifted_fp32_head_is_fused_and_equal():
    model, batch = _seeded(HFStyleLM, 12, seed=2)
    want = _loss_and_grads(copy.deepcopy(model), batch, lambda out: out[0])
    report = pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[0], logits=False)
    assert _head_row(report).replaced, report
    loss, logits = model(*batch)
    assert logits is None
    _close(_loss_and_grads(model, batch, lambda out: out[0]), want)


def test_logits_read_beyond_the_loss_keep_the_head_as_written():
    model, batch = _seeded(WithAccuracy, 8, seed=3)
    report = pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[0], logits=False)
    row = _head_row(report)
    assert not row.replaced and "read beyond the loss" in row.reason, report
    assert model(*batch)[1].item() >= 0  # runs as written


@pytest.mark.slow
def test_under_torch_compile_the_patched_head_is_perfloops_op_and_a_copy_keeps_torchs(nanogpt):
    model, batch = _gpt(nanogpt)
    plain = copy.deepcopy(model)
    want = _loss_and_grads(copy.deepcopy(model), batch, lambda out: out[1])
    pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[1], logits=False)
    compiled, compiled_plain = torch.compile(model), torch.compile(plain)

    def ops(m):
        with torch.profiler.profile() as prof:
            got = _loss_and_grads(m, batch, lambda out: out[1])
        return got, {e.name for e in prof.events()}

    got, names = ops(compiled)
    assert "perfloop::linear_cross_entropy" in names
    assert compiled(*batch)[0] is None
    _close((got[0], {k.removeprefix("_orig_mod."): v for k, v in got[1].items()}), want)
    _, plain_names = ops(compiled_plain)
    assert "perfloop::linear_cross_entropy" not in plain_names
    assert compiled_plain(*batch)[0] is not None


def test_a_head_put_back_is_no_longer_registered_and_returns_its_logits(nanogpt):
    model, batch = _gpt(nanogpt)
    pl.patch(model, batch, loss_fn=lambda m, b: m(*b)[1], logits=False)
    assert nnhead.allowed(model.lm_head.weight) is False
    rewrite.restore(model)
    assert nnhead.allowed(model.lm_head.weight) is None
    assert model(*batch)[0] is not None


def test_logits_must_be_a_bool(nanogpt):
    model, batch = _gpt(nanogpt)
    with pytest.raises(TypeError, match="logits"):
        pl.patch(model, batch, logits="no")


def test_a_llama2c_style_head_that_keeps_its_loss_on_the_module_is_fused_and_equal(llama):
    """llama2.c's Transformer: `self.last_loss = F.cross_entropy(...)`, the logits returned; the
    loss the forward sets on the module is checked as an output."""
    torch.manual_seed(0)
    cfg = llama.ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=VOCAB, multiple_of=16, max_seq_len=16)
    model = llama.Transformer(cfg)
    g = torch.Generator().manual_seed(4)
    batch = (torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g))
    plain = copy.deepcopy(model)

    def last_loss(m):
        return lambda out: m.last_loss

    want = _loss_and_grads(plain, batch, last_loss(plain))
    report = pl.patch(model, batch, loss_fn=lambda m, b: (m(*b), m.last_loss)[1], logits=False)
    assert _head_row(report).replaced, report
    assert model(*batch) is None
    _close(_loss_and_grads(model, batch, last_loss(model)), want)


@pytest.mark.gpu
def test_on_the_gpu_the_compiled_patched_head_holds_less_and_gives_compiles_loss(nanogpt):
    """A GPT-2 vocabulary (50304) on 2 layers, 8 x 512 tokens, bf16 autocast: compiled with the
    head fused, the step's peak is below compile's own by at least half the fp32 logits
    (8 x 512 x 50304 x 4 bytes = 0.77 GiB), at compile's loss."""
    from perfloop.nn.keep import step_peak

    torch.manual_seed(0)
    cfg = nanogpt.GPTConfig(block_size=512, vocab_size=50304, n_layer=2, n_head=4, n_embd=256)
    model = nanogpt.GPT(cfg).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    batch = tuple(torch.randint(0, 50304, (8, 512), device="cuda", generator=g) for _ in range(2))

    def loss_fn(m, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(*b)[1]

    plain = copy.deepcopy(model)
    report = pl.patch(model, batch, loss_fn=loss_fn, logits=False)
    assert _head_row(report).replaced, report
    runs = {"compiled": torch.compile(plain), "patched": torch.compile(model)}
    losses = {k: [loss_fn(m, batch).detach() for _ in range(2)][-1] for k, m in runs.items()}
    torch.testing.assert_close(losses["patched"], losses["compiled"], rtol=2e-3, atol=2e-3)
    peaks = {k: step_peak(m, lambda m=m: loss_fn(m, batch).backward()) for k, m in runs.items()}
    assert peaks["compiled"] - peaks["patched"] > 0.5 * 8 * 512 * 50304 * 4, peaks

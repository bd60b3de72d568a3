"""FlashAttention-2: forward, log-sum-exp and all three gradients against float64."""

import pytest
import torch

import perfloop as pl
from helpers import tf32_matmuls
from perfloop.ops.attention import reference, reference_lse

triton_impl = pytest.importorskip("perfloop.ops.attention.triton_impl")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # (B, H, Sq, Sk, D, causal): seq 1, primes, Sq != Sk, head dims 16 and 40; and
    # multiples of every tile, so the kernels' unmasked loops run too (causal, Sq < Sk, Sq > Sk)
    (1, 1, 1, 1, 16, False),
    (1, 2, 32, 32, 16, True),
    (1, 1, 32, 64, 32, True),
    (1, 1, 64, 32, 32, False),
    (1, 1, 48, 48, 32, True),
    (1, 2, 17, 17, 16, True),
    (1, 1, 33, 70, 40, True),
    (2, 1, 100, 37, 32, False),
]
TOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = [torch.float32] if DEV == "cpu" else [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_flash_attention_gradients_on_the_gpu(dtype):
    shapes = SHAPES[-3:] + [  # ragged (every loop masked), and multiples of the GPU tiles
        (2, 4, 257, 300, 128, True),
        (1, 2, 256, 256, 64, True),
        (1, 1, 256, 384, 128, False),
        (1, 1, 384, 256, 128, True),
    ]
    for shape in shapes:
        test_forward_lse_and_gradients_match_float64(shape, dtype)


@pytest.mark.gpu
def test_flash_attention_memory_grows_linearly_with_sequence():
    from perfloop.ops.attention.triton_impl import flash_attention

    peaks = {}
    for s in (4096, 16384):
        q, k, v = (torch.randn(1, 8, s, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        flash_attention(q, k, v)
        torch.cuda.synchronize()
        peaks[s] = torch.cuda.max_memory_allocated() - base
        del q, k, v
    assert peaks[16384] / peaks[4096] < 5  # 4x the tokens: ~4x, where S^2 would be 16x


def _ref_grads(q, k, v, causal, g):
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    o = _ref_autograd(q64, k64, v64, causal)
    (o * g.double().cpu()).sum().backward()
    return o.detach(), q64.grad, k64.grad, v64.grad


def _ref_autograd(q, k, v, causal):
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def _close(got, want, tol, what):
    err = (got.double().cpu() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err <= tol * max(1.0, scale), f"{what}: max abs err {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_lse_and_gradients_match_float64(shape, dtype):
    q, k, v, causal = pl.ops.get("attention").make_inputs(shape, dtype=dtype, device=DEV, seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = triton_impl.flash_attention(q, k, v, causal)
    g = torch.randn_like(o)
    (o * g).sum().backward()
    o_ref, dq, dk, dv = _ref_grads(q, k, v, causal, g)
    tol = TOL[dtype]
    _close(o.detach(), o_ref, tol, "out")
    _close(lse, reference_lse(q, k, causal), tol, "lse")
    _close(q.grad, dq, 2 * tol, "dq")
    _close(k.grad, dk, 2 * tol, "dk")
    _close(v.grad, dv, 2 * tol, "dv")


def test_non_contiguous_inputs_are_handled():
    q, k, v, _ = pl.ops.get("attention").make_inputs((1, 3, 20, 20, 16, False), device=DEV, seed=1)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, S, H, D) memory order
    assert not qt.is_contiguous()
    o, _ = triton_impl.flash_attention(qt, k, v)
    _close(o, reference(q, k, v), 2e-3, "out")
    # k and v broadcast over heads (GQA written with expand: stride 0), and a strided last dim
    g = torch.Generator(device=DEV).manual_seed(2)
    kb = torch.randn(1, 1, 20, 16, generator=g, device=DEV).expand(1, 3, 20, 16)
    vs = torch.randn(1, 3, 20, 32, generator=g, device=DEV)[..., ::2]
    assert kb.stride(1) == 0 and vs.stride(-1) == 2
    ins = [t.detach().clone().requires_grad_() for t in (qt, kb, vs)]
    o, _ = triton_impl.flash_attention(*ins, causal=True)
    refs = [t.detach().cpu().double().requires_grad_() for t in (qt, kb, vs)]
    want = torch.nn.functional.scaled_dot_product_attention(*refs, is_causal=True)
    _close(o, want, 2e-3, "out, broadcast k")
    dy = torch.randn(o.shape, generator=g, device=DEV)
    o.backward(dy)
    want.backward(dy.cpu().double())
    for name, a, b in zip("qkv", ins, refs, strict=True):
        _close(a.grad, b.grad, 2e-3, f"d{name}, broadcast k")


def test_bad_inputs_are_clear_errors():
    f = triton_impl.flash_attention
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="shapes must be"):
        f(q, torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32))
    with pytest.raises(ValueError, match="one dtype"):
        f(q, q.half(), q)
    with pytest.raises(ValueError, match="maximum of 128"):
        big = torch.randn(1, 1, 4, 256)
        f(big, big, big)
    with pytest.raises(ValueError, match="expected 4 dims"):
        f(q[0], q[0], q[0])


def test_flash_torch_never_builds_a_seq_by_seq_tensor():
    # the teaching version's largest intermediate is Sq x block_n, not Sq x Sk
    op = pl.ops.get("attention")
    q, k, v, c = op.make_inputs((1, 1, 64, 512, 16, False), seed=3)
    seen = []
    orig = torch.Tensor.__matmul__

    def spy(a, b):
        r = orig(a, b)
        seen.append(tuple(r.shape))
        return r

    torch.Tensor.__matmul__ = spy
    try:
        out = op.variant("flash_torch")(q, k, v, c)
    finally:
        torch.Tensor.__matmul__ = orig
    assert max(s[-1] * s[-2] for s in seen) <= 64 * 64
    _close(out, reference(q, k, v), 2e-5, "flash_torch")


@pytest.mark.parametrize("tiles", [(32, 16), (16, 32)], ids=str)
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 64, 64, 16, True), (1, 1, 50, 70, 16, True), (1, 1, 70, 50, 16, False), (1, 1, 96, 64, 16, True)],
    ids=str,
)
def test_unequal_tiles_split_the_loops_right(shape, tiles):
    """BLOCK_M != BLOCK_N moves the diagonal band and the ragged tail inside the tiles:
    the split into unmasked and masked loops must still visit every (query, key) once."""
    bm, bn = tiles
    q, k, v, causal = pl.ops.get("attention").make_inputs(shape, device=DEV, seed=3)
    scale = shape[4] ** -0.5
    fwd = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1}
    o, lse = triton_impl.run_forward(q, k, v, causal, scale, fwd)
    g = torch.randn_like(o)
    bwd = {
        "dkdv": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1},
        "dq": {"BLOCK_M": bn, "BLOCK_N": bm, "num_warps": 4, "num_stages": 1},
    }
    dq, dk, dv = triton_impl.run_backward(q, k, v, o, lse, g, causal, scale, bwd)
    o_ref, dq_ref, dk_ref, dv_ref = _ref_grads(q, k, v, causal, g)
    _close(o, o_ref, 2e-3, "out")
    _close(lse, reference_lse(q, k, causal), 2e-3, "lse")
    for got, want, what in ((dq, dq_ref, "dq"), (dk, dk_ref, "dk"), (dv, dv_ref, "dv")):
        _close(got, want, 4e-3, what)


def test_scale_must_be_positive():
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="scale: need a finite number > 0"):
        triton_impl.flash_attention(q, q, q, scale=-1.0)


def test_a_config_that_does_not_fit_steps_down_and_is_remembered(monkeypatch):
    """On a GPU with less shared memory than the H200 the table's tiles raise OutOfResources
    at launch: fewer stages, then smaller tiles, until one fits; the next call starts there."""
    from triton.runtime.errors import OutOfResources

    class Kernel:  # stands in for a Triton kernel: records each launch's config
        def __init__(self):
            self.tried = []

        def __getitem__(self, grid):
            def run(*args, **kw):
                cfg = {k: kw[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
                self.tried.append(cfg)
                if cfg["num_stages"] > 2 or cfg["BLOCK_N"] > 32:  # "~100 KB a block"
                    raise OutOfResources(164864, 101376, "shared memory")

            return run

    monkeypatch.setattr(triton_impl, "interpreting", lambda: False)  # the GPU tables, not the interpreter's
    monkeypatch.setattr(triton_impl, "_FITTED", {})
    monkeypatch.setattr(triton_impl, "_PLANS", {})
    q = torch.randn(1, 1, 256, 128, dtype=torch.bfloat16)
    k = Kernel()
    launch = lambda cfg=None: triton_impl._launch(
        k, "dkdv", cfg, lambda c: (1, 1), (), (False, False, "tf32"), 128, 256, 256, q
    )
    launch()
    assert [(c["BLOCK_N"], c["num_stages"]) for c in k.tried] == [(128, 3), (128, 2), (64, 2), (32, 2)]
    k.tried.clear()
    launch()
    assert [(c["BLOCK_N"], c["num_stages"]) for c in k.tried] == [(32, 2)]
    with pytest.raises(OutOfResources):  # a config asked for by name is not swapped behind one's back
        launch({"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3})


@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "exact"])
def test_fp32_runs_on_tensor_cores_and_reads_v_sequence_major(tf32, monkeypatch):
    """fp32 runs its dots on tensor cores either way: TF32 where torch allows it, three TF32
    products (tf32x3, fp32's accuracy) where it does not -- exact fp32 on the FMA units ran
    0.21-0.43x SDPA (run24). Both take V sequence-major (a copy: wgmma's 32-bit operands are
    K-major only, and V is P V's second operand)."""
    seen = []
    kernel = triton_impl.attn_fwd_kernel
    spy = type(
        "Spy",
        (),
        {
            "__getitem__": lambda self, grid: (
                lambda *a, **kw: seen.append((a[16:18], kw["PRECISION"])) or kernel[grid](*a, **kw)
            )
        },
    )()
    monkeypatch.setattr(triton_impl, "attn_fwd_kernel", spy)
    shape = (1, 2, 40, 48, 32, True)
    q, k, v, causal = pl.ops.get("attention").make_inputs(shape, device=DEV, seed=12)
    with tf32_matmuls(tf32):
        o, _ = triton_impl.run_forward(q, k, v, causal, 32**-0.5)
    assert seen == [((1, 48), "tf32" if tf32 else "tf32x3")]  # V's (sequence, head-dim) strides
    o_ref, *_ = _ref_grads(q, k, v, causal, torch.ones_like(o))
    _close(o, o_ref, 2e-3, "out")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_fp32_without_tf32_keeps_fp32s_accuracy_on_the_gpu(d):
    """tf32x3 against float64: within 2e-5 of the largest value, output and every gradient
    (SDPA's fp32 measured 3e-7 to 2e-6, one TF32 product 7e-4 to 4e-3; run24)."""
    shape = (2, 3, 1000, 1000, d, True)  # ragged: every loop's masked and unmasked tiles
    q, k, v, causal = pl.ops.get("attention").make_inputs(shape, dtype=torch.float32, device="cuda", seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    with tf32_matmuls(False):
        o, _ = triton_impl.flash_attention(q, k, v, causal)
        grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref, *ref_grads = _ref_grads(q, k, v, causal, do)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (o, *grads), (o_ref, *ref_grads), strict=True):
        err = (got.detach().double().cpu() - ref.double()).abs().max().item() / ref.abs().max().item()
        assert err < 2e-5, (name, err)


def test_fp32_tiles_come_from_the_table_by_head_dim(monkeypatch):
    """fp32's tiles are chosen per head dim as the 16-bit ones are: at head dim 128 the fp32 forward's
    64x64 tiles ran 0.32x SDPA at 1000 tokens, 128x32 0.50x (run24)."""
    monkeypatch.setattr(triton_impl, "interpreting", lambda: False)  # the GPU tables, not the interpreter's
    table = triton_impl.TUNED["fp32"]
    for kind in ("fwd", "dkdv", "dq"):
        for d, row in ((40, "64"), (64, "64"), (80, "128"), (128, "128")):
            cfg = triton_impl._config(d, kind, torch.float32)
            assert [cfg[k] for k in triton_impl.CONFIG_KEYS] == table[kind][row]
    assert table["fwd"]["64"] != table["fwd"]["128"]


def test_v_taken_k_major_keeps_rows_of_a_multiple_of_16_elements():
    """The K-major copy of V at a sequence length that is not a multiple of 16 (1000): its
    rows padded to 1008, the values V's own, the padding zeros (the forward reads V up to the
    padded length, where p = 0: a NaN there would poison the sum)."""
    from perfloop.ops.base import k_major_for_tf32

    v = torch.randn(2, 3, 1000, 64)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # torch.empty then fills with NaN: unwritten memory shows
    try:
        km = k_major_for_tf32(v, "tf32x3")
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(km, v)
    assert km.stride()[2:] == (1, 1008) and km.stride(1) % 16 == 0 and km.stride(0) % 16 == 0
    rows = km.as_strided((2, 3, 64, 1008), (km.stride(0), km.stride(1), 1008, 1))  # the copy, padding too
    assert torch.equal(rows[..., 1000:], torch.zeros(2, 3, 64, 8))


@pytest.mark.slow
def test_fp32_attention_at_a_ragged_length_copies_k_and_v_16_bytes_at_a_time(monkeypatch):
    """The forward as it launches in fp32 at 1000 keys, compiled for the H200: every async copy
    into shared memory is 16 bytes. With V's K-major rows 1000 long Triton could not prove them
    16-byte aligned and copied V 4 bytes at a time (64 of its 80 copies; run24: 0.51x SDPA at head
    dim 128 and 1000 tokens where 4096 ran 1.24x)."""
    from helpers import sm90_ptx
    from perfloop.analysis.asm import vector_widths

    launched = []
    monkeypatch.setattr(triton_impl, "launch", lambda kernel, grid, *args, **meta: launched.append(args))
    q, k, v = (torch.randn(1, 2, 1000, 128) for _ in range(3))
    triton_impl.run_forward(
        q, k, v, True, 128**-0.5, cfg={"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    )
    monkeypatch.undo()
    cfg = dict(zip(triton_impl.CONFIG_KEYS, triton_impl.TUNED["fp32"]["fwd"]["128"], strict=True))
    meta = {
        "CAUSAL": True,
        "UPCAST": False,
        "PRECISION": "tf32x3",
        **triton_impl._shape_consts(128, 1000, 1000, cfg),
        **cfg,
    }
    copies = {
        k: n
        for k, n in vector_widths(sm90_ptx(triton_impl.attn_fwd_kernel, launched[0], meta)).items()
        if k.startswith("cp.async")
    }
    assert list(copies) == ["cp.async 16B"], copies

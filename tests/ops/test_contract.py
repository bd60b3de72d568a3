"""Every variant of every op against its float64 reference; known-wrong kernels rejected."""

import subprocess
import zlib

import pytest
import torch

import perfloop as pl
from perfloop.ops import CheckFailed, Unavailable

CASES = [(op, v) for op in pl.ops.names() for v in pl.ops.get(op).variants]


def case_seed(op_name: str, variant: str) -> int:
    """The same inputs every run (a failure reruns as it failed); other inputs for every case."""
    return zlib.crc32(f"{op_name}/{variant}".encode())


SLOW = {("attention", "triton")}  # interpreted on the CPU: over 5 s


@pytest.mark.parametrize(
    "op_name, variant",
    [pytest.param(o, v, marks=pytest.mark.slow) if (o, v) in SLOW else (o, v) for o, v in CASES],
    ids=[f"{o}-{v}" for o, v in CASES],
)
def test_every_variant_matches_the_reference(op_name, variant):
    op = pl.ops.get(op_name)
    v = op.variant(variant)
    reason = v.why_unavailable("cpu")
    if reason:
        pytest.skip(f"{op_name}/{variant}: {reason}")
    kwargs = {}
    if variant == "compiled":
        # torch.compile takes ~15 s a graph on 2 cores: two shapes, fp32 and bf16 (with a
        # backward, compiled too: one shape)
        kwargs = {
            "shapes": op.test_shapes[2 : 3 if op.grad_tolerances else 4],
            "dtypes": [torch.float32, torch.bfloat16],
        }
    records = op.check(variant, device="cpu", seed=case_seed(op_name, variant), **kwargs)
    assert records and all(r["bad"] == 0 for r in records)


def test_a_check_with_a_seed_takes_the_same_inputs_every_time():
    op = pl.ops.get("softmax")
    a, b = (op.check("builtin", device="cpu", shapes=[(17, 97)], seed=5) for _ in range(2))
    c = op.check("builtin", device="cpu", shapes=[(17, 97)], seed=6)
    errors = lambda recs: [(r["max_abs"], r["max_rel"]) for r in recs]
    assert a == b and errors(a) != errors(c)
    assert all(0 < r["of_tolerance"] < 1 for r in a)
    for bad in (2**64, -(2**64), 1.5, "7"):
        with pytest.raises(ValueError, match="seed: "):
            op.check("builtin", device="cpu", shapes=[(17, 97)], seed=bad)


# Seeds on which torch's own arithmetic in 16 bits crossed its op's line (CI's run, and scans
# of 2000-3000 seeds): cross entropy's CPU kernel sums the rows' bf16 losses in bf16; the
# written-out GELU's autograd in fp16 cancels where the slope crosses 0 (x near -0.75)
@pytest.mark.parametrize(
    "op_name, variant, shape, dtype, seed",
    [
        ("cross_entropy", "builtin", (33, 129), torch.bfloat16, 2908552026),
        ("cross_entropy", "builtin", (33, 129), torch.bfloat16, 778),
        ("cross_entropy", "builtin", (33, 129), torch.bfloat16, 1230),
        ("gelu", "naive", (7,), torch.float16, 380),
    ],
)
def test_torchs_own_16_bit_arithmetic_is_held_to_what_it_can_do(op_name, variant, shape, dtype, seed):
    op = pl.ops.get(op_name)
    recs = op.check(variant, device="cpu", shapes=[shape], dtypes=[dtype], seed=seed, seeds=1)
    assert recs and all(r["bad"] == 0 for r in recs)
    # looser for that variant only: a Triton kernel of the op is still held to the op's line
    assert op.variant(variant).tolerances or op.variant(variant).grad_tolerances
    assert all(not op.variant(v).tolerances for v in op.variants if v.startswith("triton"))


def test_cuda_variant_says_why_it_cannot_run_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    op = pl.ops.get("gelu")
    assert "CUDA GPU" in op.variant("cuda").why_unavailable("cpu")
    with pytest.raises(Unavailable, match="CUDA GPU"):
        op.check("cuda")


def _gelu_tail_unwritten(x, out=None):
    """Triton GELU with an off-by-one mask: the last element is never written."""
    import triton

    from perfloop.ops.gelu.triton_impl import gelu_kernel

    out = torch.empty_like(x) if out is None else out
    n = x.numel()
    gelu_kernel[(triton.cdiv(n - 1, 1024),)](x, out, n - 1, EXACT=False, BLOCK=1024)
    return out


def _softmax_no_max(x, out=None):
    """Softmax without subtracting the row max: exp overflows on large logits."""
    e = torch.exp(x.float())
    y = (e / e.sum(-1, keepdim=True)).to(x.dtype)
    return y if out is None else out.copy_(y)


def _rowsum_drops_last_tile(x, out=None):
    """Tiled row sum whose loop stops one tile early when the row has a partial tile."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, y_ptr, n_cols, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, (n_cols // BLOCK) * BLOCK, BLOCK):  # bug: floor, not ceil
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + row * stride + offs, mask=offs < n_cols, other=0.0)
        tl.store(y_ptr + row, tl.sum(acc, axis=0))

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x.shape[:-1], dtype=x.dtype) if out is None else out
    k[(x2.shape[0],)](x2, out, x2.shape[1], x2.stride(0), BLOCK=1024)
    return out


@pytest.mark.parametrize(
    "op_name, bad, match",
    [
        ("gelu", _gelu_tail_unwritten, "NaN: [1-9]"),
        ("softmax", _softmax_no_max, "off"),
        ("rowsum", _rowsum_drops_last_tile, "off"),
    ],
)
def test_known_wrong_variants_are_rejected(op_name, bad, match):
    op = pl.ops.get(op_name)
    with (
        pl.ops.temporary_variant(op, "known_wrong", bad) as name,
        pytest.raises(CheckFailed, match=match) as e,
    ):
        op.check(name, device="cpu", dtypes=[torch.float32])
    assert "first bad" in str(e.value) and "max abs err" in str(e.value)


def _layernorm_backward_without_the_mean_term(x, weight, bias):
    """LayerNorm whose backward forgets that the mean depends on x (the forward is right)."""

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
            xhat = (x - mean) / torch.sqrt(var + 1e-5)
            ctx.save_for_backward(xhat, var, w)
            return xhat * w + b

        @staticmethod
        def backward(ctx, dy):
            xhat, var, w = ctx.saved_tensors
            wdy = dy * w
            dx = (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)) / torch.sqrt(var + 1e-5)  # no - mean(wdy)
            return dx, (dy * xhat).flatten(0, -2).sum(0), dy.flatten(0, -2).sum(0)

    return Wrong.apply(x, weight, bias)


def test_a_backward_that_is_wrong_is_rejected_though_its_forward_is_right():
    op = pl.ops.get("layernorm")
    with (
        pl.ops.temporary_variant(op, "known_wrong", _layernorm_backward_without_the_mean_term) as name,
        pytest.raises(CheckFailed, match="grad of input 0") as e,
    ):
        op.check(name, device="cpu", dtypes=[torch.float32])
    assert "max abs err" in str(e.value)


def test_unknown_op_and_variant_list_the_valid_ones():
    with pytest.raises(KeyError, match="valid: " + ", ".join(pl.ops.names())):
        pl.ops.get("gleu")
    with pytest.raises(KeyError, match="valid: naive, builtin"):
        pl.ops.get("gelu").variant("fast")


@pytest.mark.parametrize("variant", ["triton"])
def test_launchers_reject_bad_dtype_rank_and_shape(variant):
    gelu = pl.ops.get("gelu")
    with pytest.raises(TypeError, match="x: dtype torch.int64 unsupported"):
        gelu.run(variant, torch.arange(10))
    mm = pl.ops.get("matmul_relu")
    a, b = torch.randn(4, 5), torch.randn(6, 3)
    with pytest.raises(ValueError, match="inner dims differ"):
        mm.run(variant, a, b)
    with pytest.raises(ValueError, match="expected 2 dims"):
        mm.run(variant, torch.randn(2, 3, 4), torch.randn(4, 2))
    with pytest.raises(TypeError, match="b: dtype torch.float64 unsupported"):
        mm.run(variant, torch.randn(4, 5), torch.randn(5, 3).double())


def test_non_contiguous_and_empty_inputs_are_handled():
    x = torch.randn(64, 33)[:, ::2]  # a strided view
    assert not x.is_contiguous()
    for op_name in ("gelu", "softmax", "rowsum"):
        op = pl.ops.get(op_name)
        y = op.run("triton", x)
        ref = op.reference(x)
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
        empty = torch.randn(0, 8)
        assert op.run("triton", empty).numel() == 0


def test_work_models_count_the_fewest_bytes():
    w = pl.ops.get("gelu").work((16384, 16384), torch.float32)
    assert w.bytes == 2 * 16384 * 16384 * 4
    mm = pl.ops.get("matmul_relu").work((8192, 8192, 8192), torch.bfloat16)
    assert mm.flops == 2 * 8192**3 and mm.intensity > 1000


def test_inputs_are_seeded_random_and_never_zero():
    op = pl.ops.get("softmax")
    (a,) = op.make_inputs((4, 100), seed=1)
    (b,) = op.make_inputs((4, 100), seed=1)
    (c,) = op.make_inputs((4, 100), seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a != 0).all()


@pytest.mark.slow
def test_loading_an_op_does_not_set_up_torch_compile():
    """A `compiled` variant sets torch.compile up on its first call: importing its module
    (every command that loads the op, every rank of a distributed sweep) must not pay the
    seconds that importing dynamo takes. Checked in a fresh interpreter."""
    import sys

    code = (
        "import sys, torch\n"
        "import perfloop.ops.softmax.torch_impl as t\n"
        "print('torch._dynamo' in sys.modules)\n"
        "x = torch.randn(4, 8)\n"
        "y = t.compiled(x)\n"
        "print('torch._dynamo' in sys.modules, bool(torch.allclose(y, torch.softmax(x, -1))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == ["False", "True", "True"]


@pytest.mark.gpu
@pytest.mark.parametrize("op_name, variant", CASES, ids=[f"{o}-{v}" for o, v in CASES])
def test_every_variant_on_the_gpu(op_name, variant):
    op = pl.ops.get(op_name)
    # torch.compile specializes per shape and dtype: a few shapes keep this test to seconds
    kwargs = {"shapes": op.test_shapes[1:4]} if variant == "compiled" else {}
    recs = op.check(variant, device="cuda", seed=case_seed(op_name, variant), **kwargs)
    assert all(r["bad"] == 0 for r in recs)


TARGET_CASES = [
    (o, v)
    for o in ("cross_entropy", "linear_cross_entropy")
    for v in pl.ops.get(o).variants
    if v != "compiled"
]


def _classes(op_name, inputs) -> int:
    return inputs[0].shape[1] if op_name == "cross_entropy" else inputs[1].shape[0]


@pytest.mark.parametrize("op_name, variant", TARGET_CASES, ids=[f"{o}-{v}" for o, v in TARGET_CASES])
def test_ops_with_targets_refuse_out_of_range_and_agree_on_ignored_and_empty(op_name, variant):
    op = pl.ops.get(op_name)
    reason = op.variant(variant).why_unavailable("cpu")
    if reason:
        pytest.skip(reason)
    *xs, target = op.make_inputs(op.test_shapes[1], seed=3)
    for bad in (_classes(op_name, xs), -1):
        t = target.clone()
        t[len(t) // 2] = bad
        with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
            op.run(variant, *xs, t)
    ignored = torch.full_like(target, -100)
    assert torch.isnan(op.reference(*xs, ignored)) and torch.isnan(op.run(variant, *xs, ignored))
    empty = [x[:0] if i == 0 else x for i, x in enumerate(xs)]
    assert torch.isnan(op.reference(*empty, target[:0])) and torch.isnan(op.run(variant, *empty, target[:0]))


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm", "softmax", "rowsum"])
def test_row_reductions_over_no_rows_agree_with_the_reference(op_name):
    op = pl.ops.get(op_name)
    inputs = op.make_inputs(op.test_shapes[1], seed=4)
    empty = [x[:0] if x.ndim == 2 else x for x in inputs]
    got = op.run("triton", *empty)
    assert got.shape == op.reference(*empty).shape and got.numel() == 0

"""The C++ autograd path (ops/native.py, ops/native_launch.h, ops/layernorm/native.cpp): how a
compiled Triton kernel's parameters are read and packed (CPU: Triton compiles for sm_90 here
without a GPU, and the extension builds against the CPU torch), and on a GPU that the C++
Function gives exactly what the Python one gives."""

import pytest
import torch

from perfloop.ops import native

pytest.importorskip("triton")


_COMPILE = """
import json, sys
from perfloop.analysis.asm import compile_spec
from perfloop.ops import native
from perfloop.ops.layernorm import triton_impl

out = []
for name, signature, constexprs in json.loads(sys.argv[1]):
    jit = getattr(triton_impl, name)
    sig = {p.name: signature.get(p.name, "constexpr") for p in jit.params}
    ck = compile_spec({"kernel": jit, "signature": sig, "constexprs": constexprs})
    out.append([native.launch_spec(jit, ck), native.ptx_param_bytes(ck.asm["ptx"], ck.metadata.name)])
print(json.dumps(out))
"""


def _compiled_specs(*kernels):
    """native.launch_spec and the PTX's parameter sizes of each (kernel name, signature,
    constexprs), compiled by Triton for an H100/H200 (sm_90) -- possible on any machine. In a
    process of its own: under TRITON_INTERPRET=1 a kernel's language is the interpreter's."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", _COMPILE, json.dumps(kernels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    return [(tuple(spec) if spec else None, sizes) for spec, sizes in out]


NORM_FWD = {
    "X": "*bf16",
    "W": "*bf16",
    "B": "*bf16",
    "Y": "*bf16",
    "STATS": "*fp32",
    "stride_x": "i32",
    "stride_y": "i32",
    "n_rows": "i32",
    "n_cols": "i32",
    "eps": "fp32",
}


def test_compiled_kernels_parameters_are_read_from_their_signature_and_ptx():
    """Five pointers, four 32-bit sizes and eps as fp32 passed, three constexprs not; then an
    integer Triton specialized into a constexpr (equal to 1: the dw sum over one program's
    partials, for a single row) not passed either, or every later parameter is read one off."""
    colsum = {"PARTIAL": "*fp32", "OUT": "*bf16", "n_parts": "constexpr", "n_cols": "i32"}
    (fwd, fwd_sizes), (one, one_sizes) = _compiled_specs(
        ("norm_fwd_kernel", NORM_FWD, {"RMS": True, "HAS_B": False, "BLOCK": 1024}),
        ("colsum_kernel", colsum, {"n_parts": 1, "ROWS": 32, "BLOCK": 64}),
    )
    assert fwd[0] == "pppppiiiif---"
    nulls = fwd[1]
    assert fwd_sizes == [8] * 5 + [4] * 5 + [8] * nulls
    assert one[0] == "pp-i--" and one[1] == nulls
    assert one_sizes == [8, 8, 4] + [8] * nulls


def test_parameters_that_do_not_line_up_with_the_ptx_are_refused():
    # a 64-bit integer where the PTX has a 32-bit one, and an unknown type
    assert native.trailing_nulls("pil", [8, 4, 4]) is None
    assert native.trailing_nulls("pi", [8, 4, 4]) is None  # a 4-byte extra is no scratch pointer
    assert native.trailing_nulls("p-i", [8, 4, 8, 8]) == 2
    assert native.param_kinds(["flag"], {"flag": "i1"}) is None
    assert native.param_kinds(["x", "n"], {"x": "*fp16", "n": "i64"}) == "pl"
    assert native.ptx_param_bytes(".visible .entry other(\n.param .u64 other_param_0\n)", "k") is None


def _need_compiler() -> None:
    """Skip only where a C++ compiler or ninja is missing: a native.cpp that does not compile
    fails (the CPU machine is the only place before a GPU that compiles them all)."""
    import os
    import shutil

    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which(os.environ.get("CXX", "c++")) is None or not is_ninja_available():
        pytest.skip("no C++ compiler or ninja on this machine: the C++ Functions cannot build")


@pytest.fixture(scope="module")
def ext():
    _need_compiler()
    return native.build("layernorm")


@pytest.mark.slow
def test_the_other_ops_cpp_functions_compile():
    """The gated, attention and cross entropy extensions, built by native.prebuild at once in
    three processes (a build is mostly one compiler parsing torch's headers: on two cores, about
    the time of two), as the first fused op on a GPU builds every op's; then the cross entropy's
    C++ Function, loaded from that build, refuses targets that do not match the logits before
    any launch, inside its profiler op."""
    _need_compiler()
    ops = ("swiglu", "attention", "cross_entropy")
    assert set(ops) | {"layernorm"} == set(native.OPS)
    assert native.prebuild(ops) == {}
    assert all(native.built(op) for op in ops)
    with pytest.raises(ValueError, match="ops: rmsnorm has no C\\+\\+ Function; those with one: attention"):
        native.prebuild(("rmsnorm",))
    ce = native.build("cross_entropy")
    plan = ce.add_plan(0, 0, 0)
    logits, ok = torch.randn(4, 10), torch.ones((), dtype=torch.int32)
    wrong = pytest.raises(RuntimeError, match="logits \\(N, C\\) and targets \\(N,\\) needed")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, wrong:
        ce.cross_entropy(logits, torch.tensor([1, 2, 3]), ok, -100, True, plan, 0)
    assert "perfloop::cross_entropy" in {e.name for e in prof.events()}
    with pytest.raises(RuntimeError, match="targets must be int64 class indices"):
        ce.cross_entropy(logits, torch.tensor([1, 2, 3, 4], dtype=torch.int32), ok, -100, True, plan, 0)


@pytest.mark.slow
def test_arguments_are_packed_as_cuLaunchKernel_reads_them(ext):
    # a 32-bit integer in the low bytes of its slot, a 64-bit one whole, a float's bits, a
    # constexpr skipped, Triton's scratch pointers null
    big = 2**40 + 3
    slots = ext.pack_for_test("il-f", 2, [-7, big, 5, 1.5])
    assert slots[0] & 0xFFFFFFFF == (-7) & 0xFFFFFFFF
    assert slots[1] == big
    assert slots[2] == 0x3FC00000  # 1.5f
    assert slots[3:] == [0, 0]


def test_a_wrong_argument_count_is_an_error_that_says_so(ext):
    with pytest.raises(RuntimeError, match="3 arguments for a kernel of 4"):
        ext.pack_for_test("iiii", 0, [1, 2, 3])


def test_kernels_and_plans_are_numbered_in_the_order_handed_over(ext):
    first = ext.add_kernel(0, 128, 0, "pi", 2)
    assert ext.add_kernel(0, 256, 1024, "ppl", 0) == first + 1
    plan = ext.add_plan(first, first + 1, first, 4, 8, 2)
    assert ext.add_plan(first, first, first, 1, 1, 1) == plan + 1


def test_the_cpp_function_is_a_profiler_op_named_for_the_fused_op(ext):
    """The forward opens "perfloop::norm" before anything else (here a weight of the wrong size
    is refused before any launch): a profile charges its kernels to the fused op, where before
    the forward recorded no op and the backward autograd's name for the C++ node."""
    plan = ext.add_plan(0, 0, 0, 1, 1, 1)
    x, w = torch.randn(4, 8), torch.randn(5)
    refused = pytest.raises(RuntimeError, match="weight and bias must have x's last dimension \\(8\\)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, refused:
        ext.norm(x, w, None, 1e-5, plan, 0)
    assert "perfloop::norm" in {e.name for e in prof.events()}


def test_an_extension_that_does_not_build_leaves_the_python_function_and_says_why(monkeypatch):
    def fails(op):
        raise RuntimeError("Error building extension 'perfloop_native_layernorm': g++ not found")

    monkeypatch.setattr(native.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(native, "build", fails)
    native.extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="layernorm's C\\+\\+ autograd Function is not in use"):
            assert native.extension("layernorm") is None
        assert "g++ not found" in native.why_not("layernorm")
    finally:
        native.extension.cache_clear()
        native._WHY.clear()


def test_perfloop_native_0_turns_the_path_off(monkeypatch):
    monkeypatch.setenv("PERFLOOP_NATIVE", "0")
    monkeypatch.setattr(native.torch.cuda, "is_available", lambda: True)
    native.extension.cache_clear()
    try:
        assert native.extension("swiglu") is None and native.why_not("swiglu") == "PERFLOOP_NATIVE=0"
    finally:
        native.extension.cache_clear()
        native._WHY.clear()


class _FakeExtension:
    """The C++ side's registry as Python sees it: plans numbered in order."""

    def __init__(self):
        self.plans = []

    def add_plan(self, *ids_and_sizes):
        self.plans.append(ids_and_sizes)
        return len(self.plans) - 1


def _recording_plans(monkeypatch):
    """native.add_kernel replaced by a record of what each op's plan hands over (no GPU)."""
    handed = []

    def add_kernel(ext, kernel, grid, *args, **meta):
        handed.append((kernel, grid, args, meta))
        return len(handed) - 1

    ext = _FakeExtension()
    monkeypatch.setattr(native, "extension", lambda op: ext)
    monkeypatch.setattr(native, "add_kernel", add_kernel)
    return ext, handed


def _every_parameter_given(handed):
    for kernel, _, args, meta in handed:
        names = kernel.arg_names  # the interpreter's kernels and JITFunction both have them
        launch_options = {"num_warps", "num_stages"}
        assert set(meta) <= set(names) | launch_options, (kernel, meta)
        assert len(args) + len(set(meta) - launch_options) == len(names), (kernel, len(args), meta)


def test_each_ops_plan_compiles_its_kernels_with_every_parameter_given(monkeypatch):
    """The Python half of each C++ Function on the CPU: every kernel of a plan is compiled with a
    value for each of its parameters (the positional ones in the kernel's order, the constexprs
    by name), and the plan gets the kernels' indices in the order its C++ launches them."""
    from perfloop.ops.attention import triton_impl as at
    from perfloop.ops.cross_entropy import triton_impl as ce
    from perfloop.ops.layernorm import triton_impl as ln
    from perfloop.ops.swiglu import triton_impl as sw

    ext, handed = _recording_plans(monkeypatch)
    x, w = torch.randn(300, 1000), torch.randn(1000)
    assert ln._make_plan(x, w, w, rms=False) == 0
    assert [h[0] for h in handed] == [ln.norm_fwd_kernel, ln.norm_bwd_kernel, ln.colsum_kernel]
    assert ext.plans[0][:3] == (0, 1, 2)
    _every_parameter_given(handed)

    handed.clear()
    assert sw._make_plan(torch.randn(7, 333), sw.GELU_TANH) == 1
    assert [h[0] for h in handed] == [sw.gated_fwd_kernel, sw.gated_bwd_kernel]
    _every_parameter_given(handed)

    handed.clear()
    monkeypatch.setattr(at, "_PLANS", {})
    monkeypatch.setattr(at, "_FITTED", {})
    q = torch.randn(2, 3, 300, 80).transpose(1, 2).contiguous().transpose(1, 2)  # a (b, s, h, d) layout
    k = torch.randn(2, 3, 700, 80)
    assert at._native_plan(q, k, k, causal=True) == 2
    assert [h[0] for h in handed] == [
        at.attn_fwd_kernel,
        at.attn_bwd_dkdv_kernel,
        at.attn_bwd_dq_kernel,
        at.attn_bwd_preprocess,
    ]
    fwd_ids = ext.plans[2][:4]
    assert fwd_ids == (0, 3, 1, 2)  # the C++ plan's order: forward, preprocess, dk/dv, dq
    assert handed[0][2][6:10] == q.stride()  # the forward is compiled for q's own strides
    _every_parameter_given(handed)

    handed.clear()
    logits = torch.randn(64, 300)[:, :257]  # rows of a padded vocabulary: a row stride of 300
    assert ce._make_plan(logits, -100, torch.float32, ce._row_stride(logits)) == 3
    assert [h[0] for h in handed] == [ce.ce_fwd_kernel, ce.ce_mean_kernel, ce.ce_bwd_kernel]
    assert ext.plans[3] == (0, 1, 2)  # the C++ plan's order: forward, mean, backward
    assert handed[0][2][5:8] == (300, 257, -100)  # compiled for the logits' own row stride
    assert handed[1][2][2].dtype == torch.float32  # the loss in the dtype asked for
    _every_parameter_given(handed)


def _python_norm(x, w, b, eps, rms):
    from perfloop.ops.layernorm.triton_impl import NormFunction

    return NormFunction.apply(x, w, b, eps, rms)


CASES = [  # (shape, dtype, rms, bias, x made non-contiguous)
    ((1024, 768), torch.bfloat16, True, False, False),
    ((4, 256, 768), torch.bfloat16, False, True, False),
    ((64, 4096), torch.float32, True, False, False),
    ((300, 1000), torch.float16, False, True, True),
    ((1, 4096), torch.bfloat16, True, False, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,rms,bias,strided", CASES)
def test_the_cpp_function_gives_what_the_python_one_gives(shape, dtype, rms, bias, strided):
    from perfloop.ops.layernorm.triton_impl import fused_norm

    if native.extension("layernorm") is None:
        pytest.fail(f"the C++ Function is not in use: {native.why_not('layernorm')}")
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    n = shape[-1]
    x0 = torch.randn(*shape[:-1], 2 * n if strided else n, device="cuda", dtype=dtype, generator=g)
    w0 = 1 + 0.1 * torch.randn(n, device="cuda", dtype=dtype, generator=g)
    b0 = 0.1 * torch.randn(n, device="cuda", dtype=dtype, generator=g) if bias else None
    dy = torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
    results = []
    for fn in (fused_norm, _python_norm):
        leaf, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        x = leaf[..., ::2] if strided else leaf  # every other column: rows with a stride of 2n
        y = fn(x, w, b, 1e-5, rms)
        y.backward(dy)
        results.append((y.grad_fn, y, leaf.grad, w.grad, b.grad if bias else None))
    (cpp_fn, *cpp), (_, *py) = results
    assert "NormFn" in cpp_fn.name(), cpp_fn.name()
    for a, c in zip(cpp, py, strict=True):
        assert (a is None and c is None) or torch.equal(a, c)


@pytest.mark.gpu
def test_the_cpp_function_runs_on_the_callers_stream_and_takes_an_expanded_gradient():
    from perfloop.ops.layernorm.triton_impl import fused_norm

    g = torch.Generator(device="cuda").manual_seed(1)
    x0 = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    w0 = torch.rand(2048, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    side = torch.cuda.Stream()
    outs = []
    for fn in (fused_norm, _python_norm):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = fn(x, w, None, 1e-6, True)
            y.float().sum().backward()  # the gradient reaches the norm as an expanded (stride-0) tensor
        torch.cuda.current_stream().wait_stream(side)
        outs.append((y.grad_fn.name(), y, x.grad, w.grad))
    assert "NormFn" in outs[0][0]
    for a, c in zip(outs[0][1:], outs[1][1:], strict=True):
        assert torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "tanh", "none"])
@pytest.mark.parametrize("shape,dtype", [((4096, 2816), torch.bfloat16), ((7, 333), torch.float32)])
def test_the_gated_cpp_function_gives_what_the_python_one_gives(act, shape, dtype):
    from perfloop.ops.swiglu import triton_impl as sw

    if native.extension("swiglu") is None:
        pytest.fail(f"the C++ Function is not in use: {native.why_not('swiglu')}")
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    a0, b0, dy = (torch.randn(*shape, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    code = {"silu": sw.SILU, "tanh": sw.GELU_TANH, "none": sw.GELU_ERF}[act]
    outs = []
    for fn in (sw._gated_function, sw.GatedFunction.apply):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        y = fn(a, b, code)
        y.backward(dy)
        outs.append((y.grad_fn.name(), y, a.grad, b.grad))
    assert "GatedFn" in outs[0][0], outs[0][0]
    for x, z in zip(outs[0][1:], outs[1][1:], strict=True):
        assert torch.equal(x, z)


ATTENTION = [  # (b, h, sq, sk, d, causal, dtype, layout): "bshd" is q of (b, s, h, d) transposed
    (2, 8, 512, 512, 64, True, torch.bfloat16, "bhsd"),
    (1, 4, 1000, 1000, 128, False, torch.float16, "bhsd"),
    (2, 3, 300, 700, 80, False, torch.bfloat16, "bshd"),
    (1, 2, 1, 77, 64, True, torch.bfloat16, "bhsd"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,sq,sk,d,causal,dtype,layout", ATTENTION)
def test_the_attention_cpp_function_gives_what_the_python_one_gives(b, h, sq, sk, d, causal, dtype, layout):
    from perfloop.ops.attention import triton_impl as at

    if native.extension("attention") is None:
        pytest.fail(f"the C++ Function is not in use: {native.why_not('attention')}")
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)

    def make(s):
        if layout == "bshd":  # the layout a (b, s, h*d) projection reshaped gives, then transposed
            return torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g)

    q0, k0, v0 = make(sq), make(sk), make(sk)
    do = torch.randn(b, h, sq, d, device="cuda", dtype=dtype, generator=g)
    scale = d**-0.5
    outs = []
    for fn in (at._attention_function, at.FlashAttention.apply):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q0, k0, v0))
        assert q.stride() == q0.stride()  # clone keeps a dense layout: the C++ side sees the strides
        o, lse = fn(q, k, v, causal, scale)
        o.backward(do)
        outs.append((o.grad_fn.name(), o, lse, q.grad, k.grad, v.grad))
    assert "AttentionFn" in outs[0][0], outs[0][0]
    assert not outs[0][2].requires_grad  # the log-sum-exp is not differentiable, as in the Python Function
    for x, z in zip(outs[0][1:], outs[1][1:], strict=True):
        assert torch.equal(x, z)


def _norm_step():
    from perfloop.ops.layernorm.triton_impl import fused_norm

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=g)).requires_grad_()
    return lambda: fused_norm(x, w, None, 1e-6, True).float().square().sum().backward()


def _cross_entropy_step():
    from perfloop.ops.cross_entropy.triton_impl import fused_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(4)
    logits = torch.randn(512, 8192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    target = torch.randint(0, 8192, (512,), device="cuda", generator=g)
    return lambda: fused_cross_entropy(logits, target, -100, torch.float32).backward()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "op,make_step,forward_kernels,backward_kernels",
    [
        ("perfloop::norm", _norm_step, 1, 2),  # forward one kernel; backward dx, then the dw column sums
        # forward the rows' and the mean's kernels (torch's target check is its own op); backward one
        ("perfloop::cross_entropy", _cross_entropy_step, 2, 1),
    ],
)
def test_a_profile_charges_the_cpp_functions_kernels_to_the_fused_op(
    op, make_step, forward_kernels, backward_kernels
):
    import perfloop as pl

    ops = {r.name: r for r in pl.profile(make_step(), calls=2).breakdown("op")}
    assert ops[op].calls == 2 * forward_kernels, sorted(ops)
    assert ops[f"{op}_backward"].calls == 2 * backward_kernels, sorted(ops)


CROSS_ENTROPY = [  # (rows, vocabulary, logits' dtype, loss dtype, rows of a padded vocabulary)
    (1024, 50304, torch.bfloat16, torch.float32, False),
    (1024, 50304, torch.bfloat16, torch.bfloat16, False),
    (333, 1000, torch.float32, torch.float32, True),
    (1, 77, torch.float16, torch.float32, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab,dtype,loss_dtype,padded", CROSS_ENTROPY)
def test_the_cross_entropy_cpp_function_gives_what_the_python_one_gives(
    rows, vocab, dtype, loss_dtype, padded
):
    from perfloop.ops.cross_entropy import triton_impl as ce

    if native.extension("cross_entropy") is None:
        pytest.fail(f"the C++ Function is not in use: {native.why_not('cross_entropy')}")
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    width = vocab + 64 if padded else vocab
    logits0 = (3 * torch.randn(rows, width, device="cuda", generator=g)).to(dtype)
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    target[torch.rand(rows, device="cuda", generator=g) < 0.125] = -100
    side = torch.cuda.Stream()
    outs = []
    for fn in (ce.fused_cross_entropy, ce.CrossEntropyFunction.apply):
        leaf = logits0.clone().requires_grad_()
        logits = leaf[:, :vocab] if padded else leaf
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = fn(logits, target, -100, loss_dtype)
            (2.5 * loss).backward()  # an upstream gradient other than 1
        torch.cuda.current_stream().wait_stream(side)
        outs.append((loss.grad_fn.name(), loss, leaf.grad))
    assert "CrossEntropyFn" in outs[0][0], outs[0][0]
    assert outs[0][1].dtype == loss_dtype
    for a, c in zip(outs[0][1:], outs[1][1:], strict=True):
        assert torch.equal(a, c)

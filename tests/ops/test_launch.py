"""The cached launch path (ops/launch.py): a repeated call must run what Triton's own path would,
including when a later call's arguments fall into another of Triton's specializations."""

import pytest
import torch

from perfloop.ops import launch as L


def test_the_key_separates_what_triton_specializes_on():
    x = torch.randn(64)
    # alignment: a view 1 element in is not 16-byte aligned
    assert L._spec(x) != L._spec(x[1:])
    assert L._spec(x) != L._spec(x.to(torch.float64))
    # integers: 1, a multiple of 16, other, past 32 bits
    assert len({L._spec(1), L._spec(16), L._spec(17), L._spec(2**31 + 16)}) == 4
    # an integer is keyed by its value: finer than Triton's classes (a new size launches once
    # through Triton's path, which finds the kernel it compiled), and cheaper to take
    assert L._spec(17) != L._spec(33) and L._spec(17) == L._spec(17)
    assert L._spec(True) != L._spec(1) and L._spec(0.5) == L._spec(1.5)


def test_on_the_cpu_every_call_goes_through_tritons_own_path(monkeypatch):
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    L.launch(Kernel(), (3,), 1, 2, BLOCK=4)
    L.launch(Kernel(), (3,), 1, 2, BLOCK=4)
    assert calls == [((3,), (1, 2), {"BLOCK": 4})] * 2 and not L._CACHE


def test_an_interpreted_kernel_goes_through_tritons_path_even_beside_a_gpu(monkeypatch):
    """What decides is the kernel's class (the interpreter's triton.jit makes its own), not only
    whether a GPU is present: with one present, an interpreted kernel is run and never cached."""
    from perfloop.ops.base import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (the CI sets it)")
    import triton
    import triton.language as tl

    @triton.jit
    def double(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * 2, mask=offs < n)

    monkeypatch.setattr(L, "_cuda", lambda: True)
    monkeypatch.setattr(L, "_CACHE", {})
    x = torch.randn(10, generator=torch.Generator().manual_seed(0))
    y = torch.empty_like(x)
    L.launch(double, (1,), x, y, 10, BLOCK=16)
    assert torch.equal(y, x * 2) and not L._CACHE


class _Compiled:
    """A compiled kernel's launcher, as Triton hands it back: records what it was asked to run."""

    def __init__(self, runs):
        self.runs, self.function, self.packed_metadata = runs, "fn", "meta"

    def run(self, *a):
        self.runs.append(a)


class _Param:
    def __init__(self, name, default=None):
        self.name, self.has_default, self.default = name, default is not None, default


def test_the_cached_path_on_a_stand_in_gpu(monkeypatch):
    """The cached launch path with the GPU calls stood in: the first call of a specialization
    goes through Triton's own path and is kept; a repeat goes straight to the compiled kernel
    with the grid, stream, arguments and constexprs in Triton's order; what Triton specializes
    on (an integer's divisibility by 16, a tensor's alignment or dtype) compiles anew."""
    slow, runs = [], []

    class Kernel:
        params = [_Param("X"), _Param("n"), _Param("BLOCK"), _Param("EVEN", default=False)]

        def __getitem__(self, grid):
            def call(*a, **k):
                slow.append((grid, a, k))
                return _Compiled(runs)

            return call

    monkeypatch.setattr(L, "_cuda", lambda: True)
    monkeypatch.setattr(L, "_jit_function", lambda: Kernel)
    monkeypatch.setattr(L, "_hooks_off", lambda: True)
    monkeypatch.setattr(L, "_CACHE", {})
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 77, raising=False)
    k, x = Kernel(), torch.randn(64)
    L.launch(k, (3,), x, 32, BLOCK=16)
    L.launch(k, (3, 2), x, 32, BLOCK=16)  # cached: the launcher, with the default constexpr
    assert len(slow) == 1 and runs == [(3, 2, 1, 77, "fn", "meta", None, None, None, x, 32, 16, False)]
    for other in [(x, 33), (x[1:], 32), (x.double(), 32)]:  # 33 % 16, misaligned, another dtype
        L.launch(k, (3,), *other, BLOCK=16)
    L.launch(k, (3,), x, 32, BLOCK=8)  # another constexpr
    assert len(slow) == 5 and len(runs) == 1
    L.launch(k, (1,), x[1:], 32, BLOCK=16)  # each new specialization was kept too
    assert len(slow) == 5 and len(runs) == 2


@pytest.mark.gpu
def test_cached_launches_match_tritons_own_across_specializations():
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(X, Y, OUT, n, a, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + offs, mask=m)
        tl.store(OUT + offs, (a * x * SCALE + tl.load(Y + offs, mask=m)).to(OUT.dtype.element_ty), mask=m)

    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4099, device="cuda", generator=g)
    other = torch.randn(4099, device="cuda", generator=g)
    cases = [(4096, 0), (4096, 1), (17, 0), (1, 3), (4000, 2), (4096, 0)]  # (n, offset): aligned, not, ...
    for dtype in (torch.float32, torch.bfloat16):
        for n, off in cases:
            x, y = base.to(dtype)[off : off + n], other.to(dtype)[off : off + n]
            out = torch.empty_like(x)
            L.launch(axpy, (triton.cdiv(n, 256),), x, y, out, n, 0.5, SCALE=2.0, BLOCK=256)
            want = (0.5 * x.float() * 2.0 + y.float()).to(dtype)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert sum(1 for k in L._CACHE if k[0] is axpy) >= 4  # several specializations were cached, each used


def test_an_installed_launch_hook_sends_every_call_through_triton(monkeypatch):
    from triton import knobs

    assert L._hooks_off()  # Triton as installed: no hook (None, or an empty chain)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # what Proton installs
    assert not L._hooks_off()

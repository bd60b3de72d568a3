"""The op contract: a float64 reference, seeded inputs, a work model, shapes,
tolerances, and named variants -- plus `check`, which holds every variant to it.

An op lives in its own folder (`ops/<name>/`): `__init__.py` builds its `Op`,
and one file per way of writing it (`torch_impl.py`, `triton_impl.py`,
`cuda_impl.py` + `kernel.cu`) registers variants. Variants share one
signature: `fn(*inputs) -> output`, with `out=None` where the function can write
into a given tensor; called through its `Variant`, `out` is always honoured (written
in place, or the result copied in), and check passes a NaN-poisoned one so an
unwritten element shows.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from perfloop.device import default_device
from perfloop.errors import ArgumentError
from perfloop.harness.measurement import Work

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ArgumentError("dtype", f"unknown {dtype!r}; use one of fp32, fp16, bf16 (or a torch.dtype)")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


class Unavailable(RuntimeError):
    """A variant cannot run here; the message says why (no GPU, no Triton, no nvcc...)."""


class CheckFailed(AssertionError):
    """A variant disagreed with the reference; the message has the details."""


# an elementwise op's (atol, rtol) by dtype: its output rounded once to the dtype, and its
# gradients once more
ELEMENTWISE_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 1.6e-2),
}
ELEMENTWISE_GRAD_TOLERANCES = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1.6e-2, 3e-2),
}


@dataclass
class Variant:
    """One way of writing an op.

    `needs`: what it requires -- "cuda" (a GPU), "triton" (Triton importable;
    on the CPU it runs in the interpreter, correct but slow), "nvcc".
    """

    name: str
    fn: Callable[..., torch.Tensor] | None = None
    loader: str | None = None  # "module:function", imported on first use
    needs: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    doc: str = ""
    backward: bool = True  # False: forward only (check() skips its gradients; training warns)
    # (atol, rtol) by dtype where this variant is held looser than its op: torch's own
    # arithmetic in 16 bits, measured over thousands of seeds; the reason goes beside it
    tolerances: dict = field(default_factory=dict)
    grad_tolerances: dict = field(default_factory=dict)
    _ready: dict = field(default_factory=dict, repr=False, compare=False)  # (device, interpreting) -> reason
    _takes_out: bool | None = field(default=None, repr=False, compare=False)

    def why_unavailable(self, device: str = "") -> str | None:
        """None if it can run on `device` here, else the reason."""
        device = device or default_device()
        if "cuda" in self.needs and device != "cuda":
            return "needs a CUDA GPU" + ("" if torch.cuda.is_available() else " (none found)")
        if "triton" in self.needs:
            from perfloop.device import triton_version

            if triton_version() is None:
                return "needs Triton (pip install triton; Linux only)"
            if device == "cpu" and not interpreting():
                return "Triton on the CPU needs TRITON_INTERPRET=1 set before Triton loads"
        if "nvcc" in self.needs:
            from perfloop.ops.cuda_build import why_no_cuda_build

            reason = why_no_cuda_build()
            if reason:
                return reason
        return None

    @property
    def interpreted(self) -> bool:
        """True when it runs through the Triton interpreter: correct, but not a speed."""
        return "triton" in self.needs and not torch.cuda.is_available()

    def resolve(self) -> Callable[..., torch.Tensor]:
        if self.fn is None:
            mod, _, attr = self.loader.partition(":")
            self.fn = getattr(importlib.import_module(mod), attr)
        if self._takes_out is None:
            self._takes_out = "out" in inspect.signature(self.fn).parameters
        return self.fn

    def __call__(self, *inputs: Any, out: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """The variant on `inputs`, written into `out` when given; keywords pass through to the
        function it wraps. Availability is resolved once per device, not on every call."""
        first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        key = (first.device.type if first is not None else "", interpreting())
        if key not in self._ready:
            self._ready[key] = self.why_unavailable(key[0])
        if self._ready[key]:
            raise Unavailable(f"variant {self.name!r}: {self._ready[key]}")
        fn = self.fn if self._takes_out is not None else self.resolve()
        if out is None:
            result = fn(*inputs, **kwargs)
        elif self._takes_out:
            result = fn(*inputs, out=out, **kwargs)
        else:
            result = fn(*inputs, **kwargs)
            if result.shape != out.shape or result.dtype != out.dtype:
                raise ValueError(
                    f"out: a {out.dtype} tensor of shape {tuple(out.shape)}, but {self.name!r} "
                    f"gives {result.dtype} {tuple(result.shape)}"
                )
            result = out.copy_(result)
        # cheapest tests first: this runs inside every timed call
        wants_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in inputs)
        if wants_grad and isinstance(result, torch.Tensor) and result.grad_fn is None:
            _warn_detached(self)
        return result


_DETACHED_WARNED: set[str] = set()


def _warn_detached(v: Variant) -> None:
    import warnings

    if v.name + v.doc in _DETACHED_WARNED:
        return
    _DETACHED_WARNED.add(v.name + v.doc)
    warnings.warn(
        f"variant {v.name!r} ({v.doc}) has no backward: its output is detached from autograd, so no "
        "gradient flows to its inputs. Use a variant with a backward (e.g. 'builtin') for training, "
        "or call it under torch.no_grad().",
        RuntimeWarning,
        stacklevel=3,
    )


def free_memory(device: str) -> int | None:
    """Bytes free on `device` (the GPU's free memory; the machine's available RAM), or None."""
    try:
        if device.startswith("cuda") and torch.cuda.is_available():
            return torch.cuda.mem_get_info()[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_on(device_type: str) -> bool:
    """torch.is_autocast_enabled(device_type), answered first by torch's one flag for all
    devices (a tenth of the per-device query's host time, in the common case: autocast off)."""
    return (_ANY_AUTOCAST is None or _ANY_AUTOCAST()) and torch.is_autocast_enabled(device_type)


def autocast_fp32(x: torch.Tensor) -> torch.Tensor:
    """Under autocast torch computes norms and the loss in fp32 and returns fp32: x so cast."""
    if x.dtype != torch.float32 and autocast_on(x.device.type):
        return x.float()
    return x


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as rows of its last dimension, each contiguous (t itself where it is that already)."""
    if t.ndim != 2:
        t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def check_seed(seed, seeds: int = 1) -> None:
    """A check's first seed: None (fresh), or an integer that leaves `seeds` seeds within 64 bits."""
    if seed is not None and not (type(seed) is int and -(2**63) <= seed <= 2**63 - 1 - seeds):
        raise ValueError(f"seed: need an integer of 64 bits (as a failure prints it), got {seed!r}")


def needs_grad(*tensors) -> bool:
    """Whether autograd must record this call: grad mode on and an input that wants a gradient
    (else a fused op runs its forward alone, without an autograd Function's host cost)."""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return False


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1): triton.next_power_of_2 without its ~2 us of
    constexpr-function wrapping on each launch (Triton 3.9)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported here (without importing it: perfloop runs without it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


TRITON_MISSING = (
    "Triton is not installed: perfloop's fused kernels need it "
    '(pip install "perfloop[triton]"); torch\'s own ops run instead'
)


def dot_precision(dtype: torch.dtype, exact: str = "ieee") -> str:
    """tl.dot's input_precision for a Triton kernel: fp32 follows PyTorch's TF32 switch, as
    cuBLAS does (TF32 tensor cores when allowed, `exact` when not: "ieee", fp32 on the FMA
    units, or "tf32x3", three TF32 products at fp32's accuracy); 16-bit types always use
    tensor cores."""
    return "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else exact


def k_major_for_tf32(x: torch.Tensor, precision: str) -> torch.Tensor:
    """`x`, the second operand (K, N) of a tl.dot run at `precision`, as a view whose K dim (-2)
    is contiguous where the dot runs on TF32 tensor cores ("tf32", "tf32x3"). Hopper's wgmma
    reads 32-bit operands K-major only: given x with its last dim contiguous, Triton gathers it
    into shared memory 4 bytes at a time (sm_90 PTX: 4-byte cp.async, against 16-byte ones;
    0.22x cuBLAS for the matmul). One copy of x, small against the dot's time, makes every copy 16 bytes.
    The copy's rows are padded to a multiple of 16 elements (`padded_rows`)."""
    tf32 = x.dtype == torch.float32 and precision != "ieee"
    if tf32 and x.stride(-1) == 1 and x.shape[-2] > 1:
        return padded_rows(x.transpose(-1, -2)).transpose(-1, -2)
    return x


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """A copy of x whose rows (and so every batch stride) are a multiple of 16 elements apart,
    zeros past x's own, as a view of x's shape: Triton proves a row 16-byte aligned only from a
    stride it was told is divisible by 16, and copies rows it cannot prove aligned 4 bytes at a
    time (a kernel may read the zeros to keep a mask's bound a multiple of 16 too)."""
    n = x.shape[-1]
    buf = x.new_empty((*x.shape[:-1], cdiv(n, 16) * 16))
    if buf.shape[-1] > n:
        buf[..., n:].zero_()
    return buf[..., :n].copy_(x)


@dataclass
class Op:
    """The contract of one op. See the module docstring."""

    name: str
    doc: str
    reference: Callable[..., torch.Tensor]  # float64 truth
    make_inputs: Callable[..., tuple[torch.Tensor, ...]]  # (shape, dtype, device, seed)
    work: Callable[[tuple, torch.dtype], Work]
    test_shapes: Sequence[tuple]  # awkward: 1, primes, odd, non-multiples of blocks
    bench_shape_gpu: tuple
    bench_shape_cpu: tuple
    tolerances: dict  # dtype -> (atol, rtol)
    out_shape: Callable[[tuple], tuple]
    validate: Callable[..., None] | None = None  # raises ValueError on bad input
    shape_names: tuple[str, ...] | None = None  # a fixed-rank shape's sizes, e.g. ("M", "N", "K")
    variants: dict[str, Variant] = field(default_factory=dict)
    baseline: str = "naive"
    # with a backward: check() compares every floating input's gradient with the reference's
    # (reference differentiable in float64), each within these tolerances scaled to its size
    grad_tolerances: dict | None = None

    def add(self, variant: Variant) -> Variant:
        self.variants[variant.name] = variant
        return variant

    def variant(self, name: str) -> Variant:
        if name not in self.variants:
            raise KeyError(
                f"variant: {self.name!r} has no variant {name!r}; valid: {', '.join(self.variants)}"
            )
        return self.variants[name]

    def check_shape(
        self, shape: tuple, dtype: torch.dtype = torch.float32, device: str | None = None
    ) -> None:
        """Raise ValueError (naming `shape`) for a shape this op cannot take, or one whose inputs
        and output would not fit in the device's memory -- before anything is allocated."""
        if self.shape_names and len(shape) != len(self.shape_names):
            names = ", ".join(self.shape_names)
            raise ArgumentError(
                "shape",
                f"{self.name} takes {len(self.shape_names)} sizes ({names}), "
                f"got {len(shape)}: {'x'.join(map(str, shape))}",
            )
        flags = {i for i, n in enumerate(self.shape_names or ()) if n == "causal"}  # 0 or 1
        sizes = [s for i, s in enumerate(shape) if i not in flags]
        if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in sizes):
            raise ArgumentError("shape", f"{shape!r}: sizes must be positive integers")
        need = self.work(shape, dtype).bytes
        have = free_memory(device or default_device())
        if have and need > have:
            shown = "x".join(map(str, shape))
            raise ArgumentError(
                "shape",
                f"{shown} {dtype_name(dtype)} needs ~{need / 2**30:.1f} GiB for its "
                f"inputs and output, more than the {have / 2**30:.1f} GiB free here; choose a "
                "smaller shape",
            )

    def bench_shape(self, device: str) -> tuple:
        return self.bench_shape_gpu if device == "cuda" else self.bench_shape_cpu

    def tolerance(self, dtype: torch.dtype, shape: tuple | None = None) -> tuple[float, float]:
        return self.tolerances[dtype]

    def run(self, variant: str, *inputs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.validate:
            self.validate(*inputs)
        return self.variant(variant)(*inputs, out=out)

    def check(
        self,
        variant: str,
        *,
        dtypes: Sequence[torch.dtype] | None = None,
        shapes: Sequence[tuple] | None = None,
        device: str | None = None,
        seeds: int = 2,
        seed: int | None = None,
    ) -> list[dict]:
        """Hold a variant to the float64 reference on fresh random awkward shapes.

        For every shape, dtype and seed: fresh inputs (never zeros), a NaN-poisoned
        output buffer, then compare. Raises CheckFailed with the first bad indices,
        the max abs and relative error, and NaN/inf counts; returns one record per case.
        `seed`: the first case's seed (the next ones count up from it); fresh if None.
        """
        v = self.variant(variant)
        device = device or default_device()
        reason = v.why_unavailable(device)
        if reason:
            raise Unavailable(f"{self.name}/{variant}: {reason}")
        dtypes = [d for d in (dtypes or v.dtypes) if d in v.dtypes]
        check_seed(seed, seeds)
        base_seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        records = []
        for shape in shapes or self.test_shapes:
            for dtype in dtypes:
                for k in range(seeds):
                    seed = base_seed + k
                    inputs = self.make_inputs(shape, dtype=dtype, device=device, seed=seed)
                    out = torch.full(self.out_shape(shape), float("nan"), dtype=dtype, device=device)
                    try:
                        got = v(*inputs, out=out)
                    except ValueError as exc:
                        if not str(exc).startswith("out:"):
                            raise
                        raise CheckFailed(f"{self.name}/{variant} {shape} {dtype}: {exc}") from None
                    if got is not out:
                        raise CheckFailed(
                            f"{self.name}/{variant}: returned a new tensor where `out=` was "
                            "given: a variant writes the tensor it is handed"
                        )
                    if isinstance(out, torch.Tensor) and out.dtype != dtype:
                        raise CheckFailed(
                            f"{self.name}/{variant} {shape} {dtype} seed={seed}: output dtype {out.dtype}, "
                            f"input dtype {dtype}: a variant returns its input's dtype"
                        )
                    ref = self.reference(*inputs)
                    atol, rtol = v.tolerances.get(dtype) or self.tolerance(dtype, shape)
                    what = f"{self.name}/{variant} {shape} {dtype} seed={seed}"
                    records.append(compare_to_reference(out, ref, atol, rtol, what))
                    if self.grad_tolerances and v.backward:
                        records += self.check_grads(v, inputs, dtype, seed, what)
        return records

    def check_grads(self, v: Variant, inputs: tuple, dtype: torch.dtype, seed: int, what: str) -> list[dict]:
        """Backward of the variant against the float64 reference's, for one upstream gradient:
        each floating input's gradient within grad_tolerances, atol scaled by the largest
        reference gradient (a weight's gradient sums over every row)."""
        ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        y = v(*ins)
        if y.grad_fn is None:
            raise CheckFailed(f"{what}: the output has no backward (detached from autograd)")
        dy = torch.randn(y.shape, generator=seeded(y.device.type, seed + 1), device=y.device).to(y.dtype)
        wanted = [t for t in ins if t.requires_grad]
        got = torch.autograd.grad(y, wanted, dy)
        ref_ins = [
            t.detach().to("cpu", torch.float64).requires_grad_() if t.is_floating_point() else t.cpu()
            for t in inputs
        ]
        ref_y = self.reference(*ref_ins)
        want = torch.autograd.grad(
            ref_y, [t for t in ref_ins if t.requires_grad], dy.to("cpu", torch.float64)
        )
        atol, rtol = v.grad_tolerances.get(dtype) or self.grad_tolerances[dtype]
        return [
            compare_to_reference(
                g, r, atol * max(1.0, float(r.abs().max())), rtol, f"{what} grad of input {i}"
            )
            for i, (g, r) in enumerate(zip(got, want, strict=True))
        ]


def compare_to_reference(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, what: str):
    """Elementwise |out - ref| <= atol + rtol*|ref|; NaN/inf never pass. Raises CheckFailed."""
    if tuple(out.shape) != tuple(ref.shape):
        raise CheckFailed(f"{what}: output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    err = (o - r).abs()
    bad = ~(err <= atol + rtol * r.abs())  # NaN compares False: counted bad
    n_nan, n_inf = int(torch.isnan(o).sum()), int(torch.isinf(o).sum())
    finite = err[torch.isfinite(err)]
    max_abs = float(finite.max()) if finite.numel() else float("nan")
    # Relative error where it means something: |ref| below atol counts as atol.
    rel = finite / r.abs()[torch.isfinite(err)].clamp_min(max(atol, 1e-30))
    max_rel = float(rel.max()) if rel.numel() else float("nan")
    # The worst element's error as a share of what it was allowed (1.0: on the line)
    share = finite / (atol + rtol * r.abs()[torch.isfinite(err)]).clamp_min(1e-300)
    of_tolerance = float(share.max()) if share.numel() else float("nan")
    rec = {
        "case": what,
        "max_abs": max_abs,
        "max_rel": max_rel,
        "of_tolerance": of_tolerance,
        "bad": int(bad.sum()),
    }
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        firsts = "; ".join(
            f"{tuple(i)}: got {o[tuple(i)].item():.6g}, want {r[tuple(i)].item():.6g}" for i in idx
        )
        raise CheckFailed(
            f"{what}: {rec['bad']} of {o.numel()} elements off (atol={atol:g}, rtol={rtol:g}); "
            f"NaN: {n_nan}, inf: {n_inf}; max abs err {max_abs:.3g}, max rel err {max_rel:.3g}; "
            f"first bad: {firsts}"
        )
    return rec


def seeded(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def check_tensor(name: str, t: Any, *, ndim: int | None = None, min_ndim: int = 1) -> None:
    """The checks every launcher needs, with errors that say how to fix the input.

    Empty tensors pass: each launcher returns an empty (or, for matmul, zero) result.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: dtype {t.dtype} unsupported; use float32, float16 or bfloat16")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if t.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dim(s), got a scalar")


def compile_variant(fn: Callable) -> Callable:
    """torch.compile(fn) for a `compiled` variant: specialized to each shape and dtype,
    as a model with fixed shapes would be, so the benchmark times the best kernel
    rather than a shape-generic one. check() calls it on many shapes, so the
    recompile limit (8 by default) is raised; past it dynamo silently runs eager.

    Set up on the first call, not at import: importing torch.compile's machinery takes
    seconds (~7 s on a 2-core CPU), which every command that loads an op module would
    otherwise pay -- each rank of a distributed sweep too -- whether or not it runs a
    compiled variant."""
    compiled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch._dynamo

            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
            compiled = torch.compile(fn, dynamic=False)
        return compiled(*args, **kwargs)

    return run

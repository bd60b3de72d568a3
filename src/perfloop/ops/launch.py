"""`launch(kernel, grid, *args, **meta)`: `kernel[grid](*args, **meta)` at a fraction of the host
cost, for the calls that repeat.

Triton's `JITFunction.run` binds and specializes every argument, hashes a cache key and builds
launch metadata on each call before its C launcher runs. The first call of a specialization goes
through it (and compiles); its CompiledKernel is kept under a key built here from what Triton
specializes on -- each tensor's dtype and 16-byte alignment, each integer's value (which decides
its equality to 1, divisibility by 16 and width), the other arguments' types, the keyword
arguments' values, the current device -- and later calls hand the arguments straight to the
compiled kernel's launcher, the call Triton itself makes after a cache hit. Under the
interpreter (whose `triton.jit` makes another class than JITFunction), for autotuned kernels,
and while a launch hook is installed (Proton), every call goes through Triton's own path.
"""

from __future__ import annotations

import functools

import torch

_CACHE: dict = {}
_cuda = functools.cache(torch.cuda.is_available)


def _spec(a, tensor=torch.Tensor):
    """An argument's part of the key: an integer itself (finer than Triton's specialization on
    it, and cheaper to take than that), a tensor's dtype and 16-byte alignment, else its type."""
    t = type(a)
    if t is int:  # most arguments (sizes, strides): tested first
        return a
    if t is tensor or isinstance(a, tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    return t


@functools.cache
def _runtime():
    """Triton's runtime knobs (its launch hooks), or None where this Triton has none."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime


def _unhooked(hook) -> bool:
    """No launch hook installed: None, or an empty chain (Triton >= 3.5 keeps a HookChain)."""
    return hook is None or getattr(hook, "calls", None) == []


def _hooks_off() -> bool:
    rt = _runtime()
    return rt is not None and _unhooked(rt.launch_enter_hook) and _unhooked(rt.launch_exit_hook)


@functools.cache
def _jit_function() -> type:
    """Triton's compiled-kernel class (under the interpreter `triton.jit` makes another one)."""
    from triton.runtime.jit import JITFunction

    return JITFunction


def _tail(kernel, n_args: int, meta: dict) -> tuple | None:
    """The values of the kernel's parameters after the positional ones, in order (the
    constexprs given by keyword, else their defaults); None if a parameter has no value."""
    out = []
    for p in kernel.params[n_args:]:
        if p.name in meta:
            out.append(meta[p.name])
        elif p.has_default:
            out.append(p.default)
        else:
            return None
    return tuple(out)


def launch(kernel, grid: tuple, *args, **meta):
    """Launch `kernel` over `grid` (a tuple of 1-3 ints) with `args` (positional, in the
    kernel's order) and `meta` (constexprs and launch options by keyword)."""
    if not _cuda() or not isinstance(kernel, _jit_function()):  # interpreted, autotuned: Triton's own path
        return kernel[grid](*args, **meta)
    dev = torch._C._cuda_getDevice()
    key = (kernel, dev, tuple(meta.items()), tuple(map(_spec, args)))
    hit = _CACHE.get(key)
    if hit is None or not _hooks_off():
        ck = kernel[grid](*args, **meta)
        if hit is None and ck is not None and _hooks_off():
            ck = ck.result() if hasattr(ck, "result") else ck
            tail = _tail(kernel, len(args), meta)
            if tail is not None and all(hasattr(ck, a) for a in ("run", "function", "packed_metadata")):
                _CACHE[key] = (ck, tail)
        return ck
    ck, tail = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(dev)
    ck.run(grid[0], g1, g2, stream, ck.function, ck.packed_metadata, None, None, None, *args, *tail)
    return ck

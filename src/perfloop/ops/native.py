"""Fused ops whose autograd Function is written in C++ (each op's `native.cpp`, on
`native_launch.h`): the forward and the backward launch the op's compiled Triton kernels with
no Python between, so a training call costs the host about what torch's own modules do.

`extension(op)` builds (once per machine and torch version, cached) and loads the op's C++;
`add_kernel(ext, kernel, grid, *args, **meta)` compiles one specialization of a Triton kernel
and hands it to the C++ side, which then launches it with arguments of the same specialization.
Where a GPU, a C++ compiler or a Triton this reads is missing, `extension` answers None and
`why_not()` says why: the op runs its Python autograd Function instead. `PERFLOOP_NATIVE=0`
turns the path off.
"""

from __future__ import annotations

import functools
import os
import re
import time
import warnings
from pathlib import Path

import torch

from perfloop.ops.cuda_build import build_dir, build_path

HERE = Path(__file__).parent
_WHY: dict[str, str] = {}
_BUILDING_S = [0.0]  # seconds this process waited for C++ builds (a machine pays them once)


def build_seconds() -> float:
    """Seconds this process has waited for C++ Functions to compile: a later process on the
    same machine loads them from the cache instead."""
    return _BUILDING_S[0]


def enabled() -> bool:
    return os.environ.get("PERFLOOP_NATIVE", "1") != "0"


def why_not(op: str) -> str | None:
    """Why `op`'s C++ Function is not in use (None: it is, or has not been asked for yet)."""
    return _WHY.get(op)


OPS = tuple(sorted(p.parent.name for p in HERE.glob("*/native.cpp")))  # the ops with a C++ Function


def _sources(op: str) -> tuple[str, str]:
    return (HERE / op / "native.cpp").read_text(), (HERE / "native_launch.h").read_text()


def built(op: str) -> bool:
    """Whether op's C++ extension is in the cache for this torch (loading it is then quick)."""
    return any(build_path(f"native_{op}", *_sources(op)).glob("*.so"))


def prebuild(ops: tuple[str, ...] = OPS, timeout_s: float = 900.0) -> dict[str, str]:
    """Build the extensions of `ops` not in the cache yet, each in its own process, all at once:
    a build is one compiler parsing torch's headers (20-60 s on one core), so on a machine with
    cores to spare the first fused model waits for one build, not one per op. {op: why} for
    those that did not build (loading one then builds it again in-process and says why)."""
    import subprocess
    import sys

    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"ops: {', '.join(unknown)} has no C++ Function; those with one: {', '.join(OPS)}")
    missing = [op for op in ops if not built(op)]
    if not missing:
        return {}
    print(
        f"perfloop: compiling the C++ Functions of {', '.join(missing)} at once (once per machine and "
        "torch version, about a minute)",
        file=sys.stderr,
    )
    src_root = str(Path(__file__).resolve().parents[2])  # the folder holding the perfloop package
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (src_root, os.environ.get("PYTHONPATH")) if p),
    }
    code = "import sys; from perfloop.ops import native; native.build(sys.argv[1])"
    procs = {
        op: subprocess.Popen([sys.executable, "-c", code, op], stderr=subprocess.PIPE, text=True, env=env)
        for op in missing
    }
    failed = {}
    for op, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"{err}\nnot built in {timeout_s:.0f} s"
        if proc.returncode != 0:
            failed[op] = (err.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:300]
    return failed


@functools.cache
def _prebuilt() -> None:
    prebuild()


@functools.cache
def build(op: str):
    """Compile and load ops/<op>/native.cpp as a torch extension (raises if it cannot)."""
    from torch.utils.cpp_extension import load

    src = HERE / op / "native.cpp"
    out = build_dir(f"native_{op}", *_sources(op))
    return load(
        name=f"perfloop_{out.name}",
        sources=[str(src)],
        extra_include_paths=[str(HERE)],
        extra_cflags=["-O2"],
        extra_ldflags=["-ldl"],
        build_directory=str(out),
        verbose=False,
    )


@functools.cache
def extension(op: str):
    """op's loaded C++ extension, or None (the reason kept for `why_not(op)`, said once)."""
    if not enabled():
        _WHY[op] = "PERFLOOP_NATIVE=0"
        return None
    if not torch.cuda.is_available():
        _WHY[op] = "no CUDA GPU"
        return None
    try:
        if built(op):
            return build(op)
        started = time.perf_counter()
        _prebuilt()  # every op's at once, the first time one is missing
        ext = build(op)  # loaded from that build, or built here where it failed
        _BUILDING_S[0] += time.perf_counter() - started
        return ext
    except Exception as e:  # a missing compiler or ninja, a failed build: the Python path still runs
        _WHY[op] = f"its C++ did not build ({type(e).__name__}: {str(e).strip().splitlines()[-1][:300]})"
        warnings.warn(
            f"perfloop: {op}'s C++ autograd Function is not in use: {_WHY[op]}; the op runs "
            "its Python autograd Function (more host time per call)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


_KINDS = {"i32": "i", "u32": "i", "i64": "l", "u64": "l", "fp32": "f", "constexpr": "-"}


def param_kinds(names: list[str], signature: dict) -> str | None:
    """One letter per argument of the kernel's Python signature (native_launch.h's), from the
    compiled kernel's signature; None if an argument has a type the C++ side does not pass."""
    out = []
    for name in names:
        t = signature.get(name, "constexpr")
        kind = "p" if isinstance(t, str) and t.startswith("*") else _KINDS.get(t)
        if kind is None:
            return None
        out.append(kind)
    return "".join(out)


def ptx_param_bytes(ptx: str, name: str) -> list[int] | None:
    """The byte size of each parameter of the PTX entry `name`, in order (None if not found)."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        return None
    return [int(re.search(r"(\d+)$", t).group(1)) // 8 for t in re.findall(r"\.param\s+\.(\w+)", m.group(1))]


def trailing_nulls(kinds: str, param_bytes: list[int]) -> int | None:
    """How many pointer parameters the compiled kernel takes after the signature's (Triton's
    scratch buffers); None where the passed ones do not line up with the PTX's."""
    want = [8 if k in "pl" else 4 for k in kinds if k != "-"]
    if param_bytes[: len(want)] != want or any(b != 8 for b in param_bytes[len(want) :]):
        return None
    return len(param_bytes) - len(want)


def launch_spec(kernel, ck) -> tuple[str, int] | None:
    """(kinds, trailing nulls) of a compiled kernel, or None where it needs what a plain
    cuLaunchKernel does not give (scratch memory, clusters, PDL) or its PTX does not line up."""
    md = ck.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return None
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False):
        return None
    clusters = tuple(getattr(md, "cluster_dims", (1, 1, 1)))
    if getattr(md, "launch_cooperative_grid", False) or clusters not in ((1, 1, 1), (0, 0, 0)):
        return None
    kinds = param_kinds([p.name for p in kernel.params], dict(ck.src.signature))
    ptx = ck.asm.get("ptx") if hasattr(ck.asm, "get") else None
    sizes = ptx_param_bytes(ptx, md.name) if ptx else None
    nulls = trailing_nulls(kinds, sizes) if kinds is not None and sizes is not None else None
    return None if nulls is None else (kinds, nulls)


def plan_of(op: str, ext, kernel_ids: tuple, *sizes):
    """ext.add_plan(*kernel_ids, *sizes): the plan of op's C++ Function, or None (said by
    `why_not(op)`) where a kernel needs more than a plain launch gives."""
    if None in kernel_ids:
        _WHY[op] = "a kernel needs more than a plain launch gives (scratch memory, clusters)"
        return None
    return ext.add_plan(*kernel_ids, *sizes)


_UNSET = object()


def plan_for(plans: dict, key, make, device: torch.device):
    """plans[key], made by `make()` the first time the key is asked for (None where the C++
    Function cannot take calls with this key), with `device` current: Triton loads a kernel
    into the current device's context, and the C++ side launches it on the tensors' device."""
    plan = plans.get(key, _UNSET)
    if plan is _UNSET:
        with torch.cuda.device(device):
            plan = plans[key] = make()
    return plan


def add_kernel(ext, kernel, grid: tuple, *args, **meta) -> int | None:
    """Compile `kernel` for these arguments (no launch) and register it with the C++ side: its
    index there, or None if the C++ side cannot launch it."""
    ck = kernel.warmup(*args, grid=grid, **meta)
    ck = ck.result() if hasattr(ck, "result") else ck
    spec = launch_spec(kernel, ck)
    if spec is None:
        return None
    if ck.function is None:
        ck._init_handles()
    _KEEP.append(ck)  # the CUfunction lives as long as its CompiledKernel's module
    return ext.add_kernel(int(ck.function), 32 * ck.metadata.num_warps, ck.metadata.shared, *spec)


_KEEP: list = []

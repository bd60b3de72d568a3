"""Building the CUDA C++ variants: once per source, device and torch version, cached.

Each op's `kernel.cu` is plain CUDA (no torch headers) with a C launcher taking
raw pointers and a stream; a few lines of C++ bind it to tensors. Keeping torch
out of the .cu lets `nvcc` compile it on a machine with no GPU and no CUDA
torch (CI does), and lets `perfloop asm` read its registers and spills.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from perfloop.device import cache_dir


def nvcc_path() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def why_no_cuda_build() -> str | None:
    """None if CUDA C++ variants can be built and run here, else why not."""
    if not torch.cuda.is_available():
        return "CUDA C++ needs a CUDA GPU (none found); its source still compiles with nvcc"
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    if nvcc_path() is None:
        return "needs nvcc (the CUDA toolkit) on PATH or CUDA_HOME to build the extension"
    return None


def arch_flags() -> list[str]:
    """Build for the GPU present (sm_90 on an H100/H200), not for an old default."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cc = f"{major}{minor}"
    else:
        cc = "90"
    return [f"-gencode=arch=compute_{cc},code=sm_{cc}"]


def build_path(name: str, *texts: str) -> Path:
    """The cache folder of an extension built from these sources with this torch (not made)."""
    key = hashlib.sha1(("".join(texts) + torch.__version__).encode()).hexdigest()[:12]
    return cache_dir() / "cuda" / f"{name}_{key}"


def build_dir(name: str, *texts: str) -> Path:
    """The cache folder of an extension built from these sources with this torch (made if
    missing); said on stderr when nothing is built there yet: the caller waits for a compile."""
    out = build_path(name, *texts)
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.glob("*.so")):
        print(
            f"perfloop: compiling the {name} extension (once per machine and torch version, about a "
            f"minute) in {out}",
            file=sys.stderr,
        )
    return out


@functools.cache
def build(name: str, cu_path: str, binding_cpp: str):
    """Build (or load from the cache) a torch extension from a .cu and a C++ binding."""
    from torch.utils.cpp_extension import load

    src = Path(cu_path).read_text()
    out = build_dir(name, src, binding_cpp, " ".join(arch_flags()))
    cpp = out / "binding.cpp"
    if not cpp.exists() or cpp.read_text() != binding_cpp:
        cpp.write_text(binding_cpp)
    cu = out / "kernel.cu"
    if not cu.exists() or cu.read_text() != src:
        cu.write_text(src)
    return load(
        name=f"perfloop_{out.name}",
        sources=[str(cpp), str(cu)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", *arch_flags()],
        build_directory=str(out),
        verbose=False,
    )


def ptxas_report(cu_path: str | Path, arch: str = "sm_90") -> dict:
    """Compile a .cu with nvcc -Xptxas -v and parse registers, shared memory, spills per kernel."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc: not found on PATH or CUDA_HOME; install the CUDA toolkit")
    out_dir = cache_dir() / "asm"
    out_dir.mkdir(parents=True, exist_ok=True)
    obj = out_dir / (Path(cu_path).stem + f"_{arch}.o")
    cmd = [
        nvcc,
        "-c",
        str(cu_path),
        "-o",
        str(obj),
        "-O3",
        f"-gencode=arch=compute_{arch[3:]},code={arch}",
        "-Xptxas",
        "-v",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return {"object": str(obj), "kernels": parse_ptxas(proc.stderr), "log": proc.stderr}


def parse_ptxas(log: str) -> dict[str, dict]:
    """Registers, shared memory, stack and spills per kernel, from ptxas -v output."""
    kernels: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line) or re.search(
            r"Function properties for (\S+)", line
        )
        if m:
            current = m.group(1)
            kernels.setdefault(current, {})
            continue
        if current is None:
            continue
        info = kernels[current]
        if m := re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        ):
            info["stack_bytes"], info["spill_stores"], info["spill_loads"] = map(int, m.groups())
        if m := re.search(r"Used (\d+) registers", line):
            info["registers"] = int(m.group(1))
        if m := re.search(r"(\d+) bytes smem", line):
            info["smem_bytes"] = int(m.group(1))
    return kernels

"""Device facts, the environment fingerprint, and the machine's measured ceilings.

Throughput means little without the limit it is measured against, and the
datasheet is not the limit: `ceilings()` measures this machine's copy bandwidth
and matmul rate once, and caches them per device fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def default_device() -> str:
    return "cuda" if has_cuda() else "cpu"


def cache_dir() -> Path:
    """Where perfloop caches machine facts (XDG cache dir, or PERFLOOP_CACHE)."""
    root = os.environ.get("PERFLOOP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "perfloop"
    )
    return Path(root)


def data_dir() -> Path:
    """Where perfloop keeps results (XDG data dir)."""
    root = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(root) / "perfloop"


def triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # ImportError, or a broken install: either way, no Triton
        return None


@functools.lru_cache(maxsize=1)
def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def _git_sha() -> str | None:
    """The commit of the perfloop code measured, when it runs from a checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if out.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def l2_bytes(device: int | None = None) -> int:
    """The device's L2 cache size in bytes (0 on the CPU)."""
    if not has_cuda():
        return 0
    props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def device_info() -> dict:
    """What the compute device is: GPU name, SMs, L2, memory, driver; or the CPU."""
    if has_cuda():
        idx = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        return {
            "kind": "cuda",
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "l2_bytes": l2_bytes(idx),
            "memory_bytes": int(p.total_memory),
            "driver": _driver_version(),
            "count": torch.cuda.device_count(),
        }
    return {
        "kind": "cpu",
        "name": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def precision_flags() -> dict:
    """The global settings that change matmul results and speed (TF32 and friends)."""
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "allow_fp16_reduced_precision_reduction": bool(
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        ),
        "allow_bf16_reduced_precision_reduction": bool(
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        ),
    }


def env_fingerprint() -> dict:
    """Everything that changes a number: device, driver, versions, precision, code."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "device": device_info(),
        "precision": precision_flags(),
        "git": _git_sha(),
        "platform": f"{platform.system()} {platform.machine()}",
    }


def device_key(info: dict | None = None) -> str:
    """A short stable key for the device + software that ceilings depend on."""
    info = info or device_info()
    basis = {
        "name": info.get("name"),
        "kind": info.get("kind"),
        "driver": info.get("driver"),
        "cores": info.get("cores"),
        "torch": torch.__version__,
    }
    return hashlib.sha1(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- ceilings


def _measure_ceilings() -> dict:
    from perfloop.timing import bench  # late: timing imports this module

    dev = default_device()
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict = {"device": device_info()["name"], "kind": dev}
    if dev == "cuda":
        n = 2**28  # 1 GiB of fp32 per side: far past the L2
        copy_dtype = torch.float32
        mm = {
            "bf16": (torch.bfloat16, 8192),
            "fp32": (torch.float32, 8192),
            "tf32": (torch.float32, 8192),
        }
    else:
        n = 2**24  # 64 MiB per side: past any CPU cache
        copy_dtype = torch.float32
        mm = {"fp32": (torch.float32, 1024)}
    x = torch.randn(n, device=dev, dtype=copy_dtype, generator=gen)
    y = torch.empty_like(x)
    m = bench(y.copy_, x, budget_s=2.0, ceilings=False)
    out["copy_gbps"] = 2 * x.numel() * x.element_size() / (m.median_ms * 1e-3) / 1e9
    del x, y, m
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 ceiling is true fp32
    try:
        for name, (dtype, d) in mm.items():
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            a = torch.randn(d, d, device=dev, dtype=dtype, generator=gen)
            b = torch.randn(d, d, device=dev, dtype=dtype, generator=gen)
            m = bench(lambda a=a, b=b: a @ b, budget_s=2.0, ceilings=False)
            out[f"matmul_{name}_tflops"] = 2 * d**3 / (m.median_ms * 1e-3) / 1e12
            out[f"matmul_{name}_size"] = d
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    return out


def ceilings(refresh: bool = False, measure: bool = True) -> dict | None:
    """The machine's measured ceilings: copy GB/s (read + write) and matmul TFLOP/s.

    Measured once per device fingerprint and cached as JSON in the user's cache
    directory; `refresh=True` measures again. With `measure=False` returns the
    cached value or None.

    >>> c = ceilings()                      # doctest: +SKIP
    >>> c["copy_gbps"], c["matmul_fp32_tflops"]  # doctest: +SKIP
    """
    path = cache_dir() / "ceilings.json"
    key = device_key()
    try:
        cache = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        cache = {}  # a corrupt cache is re-measured, not fatal
    if not refresh and key in cache:
        return cache[key]
    if not measure:
        return None
    value = _measure_ceilings()
    cache[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)
    except OSError:
        pass  # read-only home: the value is still returned, just not cached
    return value


def matmul_ceiling(ceil: dict | None, dtype: torch.dtype | str | None) -> float | None:
    """The matmul TFLOP/s ceiling that applies to a dtype (fp16 uses the bf16 one)."""
    if not ceil:
        return None
    name = str(dtype).replace("torch.", "") if dtype is not None else "float32"
    if name in ("bfloat16", "float16", "bf16", "fp16"):
        return ceil.get("matmul_bf16_tflops") or ceil.get("matmul_fp32_tflops")
    if name == "tf32":  # fp32 inputs on tensor cores
        return ceil.get("matmul_tf32_tflops") or ceil.get("matmul_fp32_tflops")
    return ceil.get("matmul_fp32_tflops")

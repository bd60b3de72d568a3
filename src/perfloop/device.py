"""Device facts and the environment fingerprint: what the machine is, where perfloop keeps
its caches and results, and the GPU's per-SM limits. The bottom layer: it imports nothing
else of perfloop, and measures nothing (the measured ceilings are harness/ceilings.py).
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


@functools.lru_cache(maxsize=8)
def git_commit(folder: str) -> str | None:
    """The commit checked out in the git working tree that holds `folder` (with "-dirty" when
    tracked files changed), or None outside one."""
    here = Path(folder).resolve()
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


def perfloop_version() -> dict:
    """perfloop's installed version and, when it runs from a checkout of its own, that commit."""
    from importlib import metadata

    try:
        version = metadata.version("perfloop")
    except metadata.PackageNotFoundError:
        version = None
    source = Path(__file__).resolve().parents[2]  # src/perfloop/device.py -> the checkout's root
    commit = git_commit(str(source)) if (source / "pyproject.toml").exists() else None
    return {"version": version, "git": commit}


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
        "git": git_commit(os.getcwd()),  # the user's working tree: the code being measured
        "perfloop": perfloop_version(),
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


# ---------------------------------------------------------------- occupancy

# Hopper (sm_90) per-SM limits, from the CUDA occupancy calculator's tables.
SM_LIMITS = {
    "regs": 65536,
    "reg_granularity": 256,  # registers are allocated per warp in chunks of 256
    "threads": 2048,
    "blocks": 32,
    "smem": 233472,  # 228 KiB
    "smem_per_block_reserved": 1024,
}


def limits_of(props) -> dict:
    """SM_LIMITS with the per-SM numbers of the GPU `props` describes (torch's device properties)."""
    return {
        **SM_LIMITS,
        "regs": getattr(props, "regs_per_multiprocessor", SM_LIMITS["regs"]),
        "threads": getattr(props, "max_threads_per_multi_processor", SM_LIMITS["threads"]),
        "smem": getattr(props, "shared_memory_per_multiprocessor", SM_LIMITS["smem"]),
    }


def blocks_per_sm(regs: int, threads: int, smem: int, limits: dict = SM_LIMITS) -> tuple[int, str]:
    """How many blocks of a kernel fit on one SM at once, and what limits it."""
    warps = max(1, threads // 32)
    per_warp = -(-regs * 32 // limits["reg_granularity"]) * limits["reg_granularity"]
    fits = {
        "threads": limits["threads"] // threads,  # first: on a tie, the hard limit
        "registers": limits["regs"] // max(per_warp * warps, 1),
        "shared memory": limits["smem"] // (smem + limits["smem_per_block_reserved"]),
        "blocks per SM": limits["blocks"],
    }
    by = min(fits, key=fits.get)
    return fits[by], by


def occupancy(regs: int, threads: int, smem: int) -> tuple[float, str]:
    """Fraction of the SM's warp slots a kernel can fill, and what limits it."""
    blocks, by = blocks_per_sm(regs, threads, smem)
    return min(1.0, blocks * max(1, threads // 32) * 32 / SM_LIMITS["threads"]), by

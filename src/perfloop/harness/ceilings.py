"""The machine's measured ceilings: copy GB/s (read + write) and matmul TFLOP/s.

Throughput means little without the limit it is measured against, and the
datasheet is not the limit: `ceilings()` measures this machine's copy bandwidth
and matmul rate once, with the harness's samplers, and caches them per device
fingerprint. `bench` reads them to say what share of the machine a call used.
"""

from __future__ import annotations

import functools
import json
import os
import time

import torch

from perfloop.device import cache_dir, default_device, device_info, device_key
from perfloop.harness import stats
from perfloop.harness.measurement import Work
from perfloop.harness.sampling import prepare, sample_until

BUDGET_S = 2.0  # per ceiling


def _median_ms(fn) -> float:
    sampler = prepare(
        fn, (), {}, flush_l2=True, graph=False, warmup_s=0.025, on_cuda=torch.cuda.is_available()
    )[0]
    samples, _ = sample_until(
        sampler, min_samples=10, max_samples=10_000, target_ci=0.01, deadline=time.perf_counter() + BUDGET_S
    )
    return stats.quantile(samples, 0.5)


def _measure_ceilings() -> dict:
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
    out["copy_gbps"] = Work(bytes=2 * x.nbytes).gbps(_median_ms(functools.partial(y.copy_, x)))
    del x, y
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 ceiling is true fp32
    try:
        for name, (dtype, d) in mm.items():
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            a = torch.randn(d, d, device=dev, dtype=dtype, generator=gen)
            b = torch.randn(d, d, device=dev, dtype=dtype, generator=gen)
            out[f"matmul_{name}_tflops"] = Work(flops=2 * d**3).tflops(_median_ms(lambda a=a, b=b: a @ b))
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

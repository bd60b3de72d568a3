"""The GPU benchmark: every number perfloop claims, taken in one run.

    PYTHONPATH=src python3 benchmarks/run_gpu.py --out DIR [--only harness,ops,profile]

Sections (each written to DIR/results.json as soon as it finishes, so a run
cut short keeps what it took):
  env       the device fingerprint and the measured ceilings
  harness   perfloop.bench vs triton's do_bench vs the CUPTI kernel time
  ops       every variant checked on the GPU, then timed interleaved, per op
  profile   profile + diagnose on the lecture's cases
Runs on a CPU too (smaller shapes, no do_bench/CUPTI), to test the script.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import perfloop as pl
from perfloop.analysis.profiling import profile
from perfloop.ops.base import dtype_name

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def log(*a):
    print(*a, flush=True)


class Results:
    def __init__(self, out: Path):
        self.path = out / "results.json"
        self.data = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}

    def put(self, key, value):
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV, dtype=dtype)


# ------------------------------------------------------------------ env


def section_env(res: Results):
    res.put("env", pl.env_fingerprint())
    t = time.perf_counter()
    c = pl.ceilings(refresh=True)
    c["measure_s"] = time.perf_counter() - t
    res.put("ceilings", c)
    log("ceilings:", json.dumps(c))
    return c


# ------------------------------------------------------------------ harness


def _cupti_ms(fn, calls=20):
    p = profile(fn, calls=calls, warmup=3)
    return p.device_ms_per_call, p


def _cupti_of_bench(fn):
    """The CUPTI kernel time of bench's own samples: the same calls, each after bench's L2
    flush (a fill kernel on an int32 buffer), which splits the trace into samples."""
    from torch.autograd import DeviceType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        m = pl.bench(fn)
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    per_sample, cur = [], None
    for e in kernels:
        if "FillFunctor<int>" in e.name:
            if cur:
                per_sample.append(cur)
            cur = 0.0
        elif cur is not None:
            cur += (e.time_range.end - e.time_range.start) / 1e3
    if cur:
        per_sample.append(cur)
    return statistics.median(per_sample), len(per_sample), m


def section_harness(res: Results, ceil: dict):
    from triton.testing import do_bench

    from perfloop.ops.gelu.torch_impl import naive as gelu_naive

    cases = {}
    x = rand(16384, 16384)
    s = rand(16384, 4096)
    a, b = rand(4096, 4096), rand(4096, 4096)
    fns = {
        "naive GELU 16384^2 fp32": lambda: gelu_naive(x),
        "F.gelu 16384^2 fp32": lambda: F.gelu(x, approximate="tanh"),
        "torch.softmax 16384x4096 fp32": lambda: torch.softmax(s, -1),
        "fp32 matmul 4096^3": lambda: a @ b,
    }
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        cupti, _ = _cupti_ms(fn)
        t = time.perf_counter()
        m = pl.bench(fn)
        bench_wall = time.perf_counter() - t
        t = time.perf_counter()
        db = do_bench(fn, return_mode="median")
        db_wall = time.perf_counter() - t
        same_ms, same_n, m_prof = _cupti_of_bench(fn)
        cases[name] = {
            "cupti_same_calls_ms": same_ms,
            "cupti_same_calls_n": same_n,
            "perfloop_over_cupti_same_calls": m.median_ms / same_ms,
            "perfloop_profiled_over_cupti_same_calls": m_prof.median_ms / same_ms,
            "cupti_ms": cupti,
            "perfloop_ms": m.median_ms,
            "perfloop_ci_ms": m.ci95_ms,
            "perfloop_n": m.n,
            "perfloop_stop": m.meta["stop_reason"],
            "perfloop_wall_s": bench_wall,
            "do_bench_ms": db,
            "do_bench_wall_s": db_wall,
            "perfloop_over_cupti": m.median_ms / cupti,
            "do_bench_over_cupti": db / cupti,
        }
        log(f"{name}: " + json.dumps({k: v for k, v in cases[name].items()}, default=str))
        res.put("harness", cases)
    fns.clear()  # frees the inputs before the next case

    # launch-bound: 1024-element naive GELU -- events, graph replay, CUPTI sum
    small = rand(1024)
    fn = lambda: gelu_naive(small)
    cupti, p = _cupti_ms(fn, calls=50)
    ev = pl.bench(fn)
    gr = pl.bench(fn, graph=True)
    db = do_bench(fn, return_mode="median")
    cases["naive GELU 1024 (launch-bound)"] = {
        "cupti_ms": cupti,
        "events_ms": ev.median_ms,
        "graph_ms": gr.median_ms,
        "graph_calls_per_sample": gr.meta["calls_per_sample"],
        "do_bench_ms": db,
        "graph_over_cupti": gr.median_ms / cupti,
        "graph_kernel_ms": gr.meta.get("graph_kernel_ms"),
        "graph_kernel_over_cupti": gr.meta.get("graph_kernel_ms", float("nan")) / cupti,
        "graph_warnings": list(gr.warnings),
        "events_over_cupti": ev.median_ms / cupti,
        "kernels": p.distinct_kernels,
        "launches": p.launches_per_call,
    }
    log("launch-bound:", json.dumps(cases["naive GELU 1024 (launch-bound)"]))
    res.put("harness", cases)

    # the copy ceiling vs a plain copy timed by do_bench
    x = rand(2**28)
    y = torch.empty_like(x)
    db = do_bench(lambda: y.copy_(x), return_mode="median")
    gbps_db = 2 * x.nbytes / (db * 1e-3) / 1e9
    cases["copy ceiling"] = {
        "perfloop_copy_gbps": ceil["copy_gbps"],
        "do_bench_copy_gbps": gbps_db,
        "ratio": ceil["copy_gbps"] / gbps_db,
    }
    log("copy:", json.dumps(cases["copy ceiling"]))
    res.put("harness", cases)


# ------------------------------------------------------------------ ops

OP_RUNS = [
    # (op, dtype, shape or None for the op's bench shape, variants)
    ("gelu", torch.float32, None, ["naive", "builtin", "compiled", "triton", "cuda"]),
    ("gelu", torch.bfloat16, None, ["naive", "builtin", "compiled", "triton", "cuda"]),
    ("softmax", torch.float32, None, ["naive", "builtin", "compiled", "triton"]),
    # "triton" is softmax(): the split kernel for rows > 16384 columns; two passes, every chunk
    # in parallel, past what the GPU holds resident (8M columns: 1024 chunks a row)
    (
        "softmax",
        torch.float32,
        (1024, 262144),
        ["builtin", "compiled", "triton", "triton_online", "triton_split"],
    ),
    ("softmax", torch.float32, (16, 8388608), ["builtin", "triton", "triton_online"]),
    ("softmax", torch.float32, (1, 67108864), ["builtin", "triton", "triton_online"]),
    ("rowsum", torch.float32, None, ["builtin", "compiled", "triton"]),
    ("matmul_relu", torch.bfloat16, None, ["naive", "compiled", "triton"]),
    ("matmul_relu", torch.float16, None, ["naive", "compiled", "triton"]),
    ("matmul_relu", torch.float32, (4096, 4096, 4096), ["naive", "triton"]),
    ("matmul_relu", "tf32", (4096, 4096, 4096), ["naive", "compiled", "triton"]),
]


def section_checks(res: Results):
    out = {}
    for name in pl.ops.names():
        op = pl.ops.get(name)
        for v in op.variants:
            key = f"{name}/{v}"
            reason = op.variant(v).why_unavailable(DEV)
            if reason:
                out[key] = f"unavailable: {reason}"
                continue
            try:
                recs = op.check(v, device=DEV)
                out[key] = f"ok ({len(recs)} cases, max abs err {max(r['max_abs'] for r in recs):.2g})"
            except Exception as exc:
                out[key] = f"FAIL: {type(exc).__name__}: {str(exc)[:400]}"
            log(key, out[key])
            res.put("checks", out)


def section_ops(res: Results, ceil: dict):
    rows = []
    only = os.environ.get("OPS", "")  # e.g. OPS=softmax: only that op's runs
    for name, dtype, shape, variants in OP_RUNS:
        if only and name not in only.split(","):
            continue
        tf32 = dtype == "tf32"  # fp32 storage, TF32 tensor cores allowed for this run
        dtype = torch.float32 if tf32 else dtype
        torch.backends.cuda.matmul.allow_tf32 = tf32
        op = pl.ops.get(name)
        shape = shape or op.bench_shape(DEV)
        if not CUDA:  # a smoke run of the script on the CPU
            shape = (
                op.bench_shape("cpu")
                if shape == op.bench_shape_gpu
                else tuple(max(1, s // 64) for s in shape)
            )
        inputs = op.make_inputs(shape, dtype=dtype, device=DEV, seed=1)
        work = op.work(shape, dtype)
        fns = {}
        for v in variants:
            var = op.variant(v)
            if var.why_unavailable(DEV) or dtype not in var.dtypes:
                continue
            fns[v] = lambda var=var, inputs=inputs: var(*inputs)
        try:
            c = pl.compare(fns, baseline=variants[0], work=work, budget_s=3.0)
        except Exception as exc:
            rows.append({"op": name, "error": f"{type(exc).__name__}: {exc}"})
            log(traceback.format_exc())
            continue
        ref = fns[variants[0]]().float()
        for v, m in c.measurements.items():
            sp = c.speedups.get(v)
            cupti = profile(fns[v], calls=5, warmup=1).device_ms_per_call if CUDA else None
            rel_err = ((fns[v]().float() - ref).abs().max() / ref.abs().max()).item()
            row = {
                "op": name,
                "variant": v,
                "dtype": "fp32 (TF32 on)" if tf32 else dtype_name(dtype),
                "shape": list(shape),
                "median_ms": m.median_ms,
                "cupti_ms": cupti,
                "ci95_ms": m.ci95_ms,
                "n": m.n,
                "gbps": m.gbps,
                "tflops": m.tflops,
                "sol": m.sol,
                "of_copy": (m.gbps / ceil["copy_gbps"]) if m.gbps else None,
                "speedup_vs": variants[0],
                "speedup": sp.speedup if sp else 1.0,
                "speedup_ci": sp.ci if sp else (1.0, 1.0),
                "significant": sp.significant if sp else None,
                "tf32": tf32 if dtype == torch.float32 and name == "matmul_relu" else None,
                "work_dtype": work.dtype,
                "rel_err_vs_baseline": rel_err,  # max |out - baseline's| / max |baseline's|
            }
            rows.append(row)
            log(
                f"{name:12} {v:14} {dtype_name(dtype):5} {str(shape):22} {m.median_ms:9.4f} ms "
                f"{(m.gbps or 0):7.0f} GB/s {(m.tflops or 0):7.1f} TFLOP/s "
                f"sol {m.sol or 0:5.1%}  x{row['speedup']:.2f} [{row['speedup_ci'][0]:.2f},"
                f" {row['speedup_ci'][1]:.2f}]  err {rel_err:.1e}"
            )
        res.put("ops", rows)
        torch.backends.cuda.matmul.allow_tf32 = False
        fns = inputs = c = None
        if CUDA:
            torch.cuda.empty_cache()


# ------------------------------------------------------------------ tune


def _tune_ops(res: Results, key: str, names: list[str]):
    """Each op's own tuner (ops/<op>/tuning.py): its search space timed here, the chosen table
    written to OUT/tuned/<op>.json -- and beside the kernel, for its launcher to read, only with
    TUNE_WRITE=1 (a benchmark run does not change the checkout by default)."""
    import importlib

    out = {}
    write = os.environ.get("TUNE_WRITE") == "1"
    for name in names:
        if os.environ.get("TUNE") and os.environ["TUNE"] not in name:
            continue
        try:
            out[name] = importlib.import_module(f"perfloop.ops.{name}.tuning").tune(write=write, log=log)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
            log(f"tune {name}: {exc}")
            continue
        tuned = res.path.parent / "tuned"
        tuned.mkdir(exist_ok=True)
        (tuned / f"{name}.json").write_text(json.dumps(out[name]["table"], indent=1))
        res.put(key, out)


def section_tune(res: Results, ceil: dict):
    """Launch parameters of the hand-written elementwise and row kernels."""
    _tune_ops(res, "tune", ["gelu", "softmax", "rowsum"])


def section_attn_tune(res: Results, ceil: dict):
    """Tile configs of the Triton FlashAttention kernels against SDPA (ops/attention/tuning.py)."""
    _tune_ops(res, "attn_tune", ["attention"])


# ------------------------------------------------------------------ attention


def _attn_fns(q, k, v, causal, g):
    from perfloop.ops.attention.triton_impl import flash_attention

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def tri():
        return flash_attention(q, k, v, causal)[0]

    def both(f):
        def run():
            return torch.autograd.grad(f(), (q, k, v), g)

        return run

    return {"fwd": {"sdpa": sdpa, "triton": tri}, "fwd+bwd": {"sdpa": both(sdpa), "triton": both(tri)}}


def section_attention(res: Results, ceil: dict):
    """FlashAttention-2 (Triton) against SDPA: the issue's cases, memory, and a sweep."""
    from perfloop.results.store import Store

    op = pl.ops.get("attention")
    out = {"cases": [], "memory": {}, "sweep": []}
    b, h, s = 4, 16, 4096
    for d in (64, 128):
        for causal in (False, True):
            q, k, v, _ = op.make_inputs((b, h, s, s, d, causal), dtype=torch.bfloat16, device=DEV, seed=5)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            g = torch.randn_like(q)
            fwd_flops = op.work((b, h, s, s, d, causal), torch.bfloat16).flops
            for mode, fns in _attn_fns(q, k, v, causal, g).items():
                flops = fwd_flops * (3.5 if mode == "fwd+bwd" else 1.0)
                c = pl.compare(fns, baseline="sdpa", budget_s=3.0)
                row = {"head_dim": d, "causal": causal, "mode": mode}
                for name, m in c.measurements.items():
                    row[f"{name}_ms"] = m.median_ms
                    row[f"{name}_tflops"] = flops / (m.median_ms * 1e-3) / 1e12
                sp = c.speedups["triton"]
                row["triton_over_sdpa"] = sp.speedup
                row["ci"] = sp.ci
                out["cases"].append(row)
                log(
                    f"attention d={d} causal={causal} {mode:8} sdpa {row['sdpa_tflops']:6.1f} TFLOP/s  "
                    f"triton {row['triton_tflops']:6.1f} TFLOP/s  ratio {sp.speedup:.3f} "
                    f"[{sp.ci[0]:.3f}, {sp.ci[1]:.3f}]"
                )
                res.put("attention", out)
    # memory: forward peak, Triton vs the naive version, as the sequence grows
    from perfloop.ops.attention.torch_impl import naive
    from perfloop.ops.attention.triton_impl import flash_attention

    for s in (2048, 4096, 8192, 16384):
        q, k, v, _ = op.make_inputs((1, 16, s, s, 64, False), dtype=torch.bfloat16, device=DEV, seed=6)
        row = {}
        fns = {
            "triton": lambda q=q, k=k, v=v: flash_attention(q, k, v)[0],
            "naive": lambda q=q, k=k, v=v: naive(q, k, v),
        }
        for name, f in fns.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            f()
            torch.cuda.synchronize()
            row[name] = torch.cuda.max_memory_allocated() - base
        out["memory"][s] = row
        log(
            f"attention memory seq {s}: triton {row['triton'] / 2**20:.0f} MiB, "
            f"naive {row['naive'] / 2**20:.0f} MiB"
        )
        res.put("attention", out)
    # sweep into the store (and so the report): tokens fixed at 16K, H=16
    store = Store()
    run = store.new_run("benchmarks/run_gpu.py attention sweep", pl.env_fingerprint())
    t_end = time.perf_counter() + float(os.environ.get("ATTN_SWEEP_S", 150))  # inside the call limit
    for dtype in (torch.bfloat16, torch.float32):
        for d in (64, 128):
            for causal in (False, True):
                for s in (128, 512, 1024, 2048, 4096, 8192, 16384):
                    if time.perf_counter() > t_end:
                        break
                    bsz = max(1, 16384 // s)
                    shape = (bsz, 16, s, s, d, causal)
                    q, k, v, _ = op.make_inputs(shape, dtype=dtype, device=DEV, seed=8)
                    q, k, v = (t.requires_grad_() for t in (q, k, v))
                    g = torch.randn_like(q)
                    w = op.work(shape, dtype)
                    for mode, fns in _attn_fns(q, k, v, causal, g).items():
                        work = pl.Work(
                            bytes=w.bytes, flops=w.flops * (3.5 if mode == "fwd+bwd" else 1), dtype=w.dtype
                        )
                        for name, f in fns.items():
                            try:
                                m = pl.bench(f, work=work, budget_s=0.5)
                            except Exception as exc:
                                log(f"sweep {name} {shape} {mode}: {exc}")
                                continue
                            store.add(
                                run,
                                m,
                                op=f"attention {mode}" + (" causal" if causal else ""),
                                variant=name,
                                shape=shape[:5],
                                dtype=dtype_name(dtype),
                            )
                            out["sweep"].append(
                                {
                                    "variant": name,
                                    "mode": mode,
                                    "shape": shape,
                                    "dtype": dtype_name(dtype),
                                    "ms": m.median_ms,
                                    "tflops": m.tflops,
                                }
                            )
                    res.put("attention", out)
    log(f"attention sweep: {len(out['sweep'])} points stored in run {run}")


def section_experiments(res: Results, ceil: dict):
    """Every `perfloop experiment`, stored (and so in the report); EXP_QUICK=1 for quick sizes."""
    from perfloop import experiments
    from perfloop.results.store import Store

    store = Store()
    out = {}
    for name in experiments.describe():
        run = store.new_run(f"experiment {name}", pl.env_fingerprint())
        t = time.perf_counter()
        try:
            quick = os.environ.get("EXP_QUICK", "0") == "1"
            plots = res.path.parent / "experiments"
            r = experiments.get(name)(quick=quick, store=store, run_id=run, out_dir=str(plots))
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"experiment {name}: {exc}")
            continue
        out[name] = {k: r[k] for k in ("table", "conclusion", "plots")} | {"quick": quick}
        log(f"experiment {name} ({time.perf_counter() - t:.0f} s): {r['conclusion']}")
        res.put("experiments", out)


# ------------------------------------------------------------------ profile


def section_profile(res: Results, ceil: dict):
    gelu = pl.ops.get("gelu")
    mm = pl.ops.get("matmul_relu")
    out = {}
    big = gelu.bench_shape(DEV)
    (x,) = gelu.make_inputs(big, device=DEV, seed=2)
    (xs,) = gelu.make_inputs((1024,), device=DEV, seed=3)
    mshape = (8192, 8192, 8192) if CUDA else (256, 256, 256)
    a, b = mm.make_inputs(mshape, dtype=torch.bfloat16, device=DEV, seed=4)
    cases = {
        "naive GELU": (lambda: gelu.run("naive", x), gelu.work(big, torch.float32), "memory"),
        "fused GELU (triton)": (
            (lambda: gelu.run("triton", x)) if CUDA else (lambda: gelu.run("builtin", x)),
            gelu.work(big, torch.float32),
            "memory",
        ),
        "F.gelu 1024": (
            lambda: F.gelu(xs, approximate="tanh"),
            gelu.work((1024,), torch.float32),
            "launch",
        ),
        "bf16 matmul 8192^3": (lambda: a @ b, mm.work(mshape, torch.bfloat16), "compute"),
    }
    for name, (fn, work, want) in cases.items():
        p = profile(fn, calls=10, work=work)
        m = pl.bench(fn, work=work)
        d = p.diagnose(ceil)
        out[name] = {
            "expected": want,
            "bound": d.bound,
            "evidence": d.evidence,
            "advice": d.advice,
            "profile_device_ms": p.device_ms_per_call,
            "bench_ms": m.median_ms,
            "profile_over_bench": p.device_ms_per_call / m.median_ms,
            "distinct_kernels": p.distinct_kernels,
            "launches_per_call": p.launches_per_call,
            "busy": p.gpu_busy_fraction,
            "peak_memory_bytes": p.peak_memory_bytes,
            "table": p.table(),
        }
        log(f"== {name}: {d.bound} (want {want})\n{p.table()}\n{d}")
        res.put("profile", out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for results.json")
    ap.add_argument("--only", default="harness,tune,checks,ops,profile,attention")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = Results(out)
    ceil = section_env(res)
    steps = {
        "harness": lambda: section_harness(res, ceil) if CUDA else None,
        "tune": lambda: section_tune(res, ceil) if CUDA else None,
        "checks": lambda: section_checks(res),
        "ops": lambda: section_ops(res, ceil),
        "profile": lambda: section_profile(res, ceil),
        "attention": lambda: section_attention(res, ceil) if CUDA else None,
        "attn_tune": lambda: section_attn_tune(res, ceil) if CUDA else None,
        "experiments": lambda: section_experiments(res, ceil),
    }
    failed = []
    for step in args.only.split(","):
        t = time.perf_counter()
        log(f"### {step}")
        try:
            steps[step]()
        except Exception:
            failed.append(step)
            log(traceback.format_exc())
        log(f"### {step} took {time.perf_counter() - t:.1f} s")
    res.put("failed_sections", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

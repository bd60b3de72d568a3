"""Issue 17 on a GPU: the fused training ops, forward + backward, interleaved with torch's
module, torch.compile and Liger-Kernel (where installed), at ANCHORS.md's sizes; then the
GPT-2-small step patched against unpatched, eager and compiled; then a short training run
both ways.

    PYTHONPATH=src python3 benchmarks/fused_ops.py OUT_DIR [--only norms,ce,step,train]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from example_models import example

import perfloop as pl
import perfloop.nn as pnn

train_gpt = example("train_gpt")


def _liger():
    try:
        import liger_kernel.transformers as lk

        return lk
    except ImportError:
        return None


def _fwd_bwd(module, x, dy, params):
    def run():
        y = module(x)
        torch.autograd.grad(y, [x, *params], dy)

    return run


def _do_bench(f) -> float:
    """ANCHORS.md's method: triton's do_bench median (its own L2 clear before each call)."""
    from triton.testing import do_bench

    return do_bench(f, return_mode="median")


def _peak_gib(f) -> float:
    """GiB a second call of f allocates at its peak over what was there before it."""
    f()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    f()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def norms(out: dict, copy_gbps: float) -> None:
    lk = _liger()
    m, n = 8192, 4096
    for kind in ("rmsnorm", "layernorm"):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
            dy = torch.randn(m, n, device="cuda", dtype=dtype)
            make = {
                "rmsnorm": lambda mod: mod.RMSNorm(n, eps=1e-6),
                "layernorm": lambda mod: mod.LayerNorm(n),
            }[kind]
            torch_mod = make(nn).to("cuda", dtype)
            ours = make(pnn).to("cuda", dtype)
            ours.load_state_dict(torch_mod.state_dict())
            cands = {
                "torch": torch_mod,
                "compiled": torch.compile(make(nn).to("cuda", dtype)),
                "perfloop": ours,
            }
            if lk is not None:
                liger = lk.LigerRMSNorm(n, eps=1e-6) if kind == "rmsnorm" else lk.LigerLayerNorm(n)
                cands["liger"] = liger.to("cuda", dtype)
            fns = {k: _fwd_bwd(v, x, dy, list(v.parameters())) for k, v in cands.items()}
            c = pl.compare(fns, baseline="torch", budget_s=3.0)
            passes = 5 * m * n * x.element_size()
            row = {"op": kind, "dtype": str(dtype), "shape": [m, n]}
            for k, meas in c.measurements.items():
                s = c.speedups.get(k)
                share = passes / (meas.median_ms * 1e-3) / 1e9 / copy_gbps
                row[k] = {
                    "ms": meas.median_ms,
                    "share_of_copy": share,
                    "vs_torch": s.speedup if s else 1.0,
                    "ci": list(s.ci) if s else None,
                }
            for k, f in fns.items():  # device time alone: the kernels' sum, no host in it
                dev = pl.profile(f, calls=5, count_work=False).device_ms_per_call
                row[k]["device_ms"] = dev
                row[k]["do_bench_ms"] = _do_bench(f)
                row[k]["device_share_of_copy"] = passes / (dev * 1e-3) / 1e9 / copy_gbps
            others = [row[k]["ms"] for k in row if isinstance(row[k], dict) and k != "perfloop"]
            row["perfloop_vs_fastest_other"] = min(others) / row["perfloop"]["ms"]
            dev_others = [row[k]["device_ms"] for k in row if isinstance(row[k], dict) and k != "perfloop"]
            row["perfloop_vs_fastest_other_device"] = min(dev_others) / row["perfloop"]["device_ms"]
            out.setdefault("norms", []).append(row)
            print(json.dumps(row))


def gated(out: dict, copy_gbps: float) -> None:
    """SwiGLU and GeGLU, act(a) * b at 8192 x 11008 bf16, forward + backward."""
    m, n = 8192, 11008
    a = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lk = _liger()
    for kind, act, ours in (
        ("swiglu", F.silu, pnn.SwiGLU()),
        ("geglu", lambda t: F.gelu(t, approximate="tanh"), pnn.GeGLU()),
    ):
        eager = lambda a, b, act=act: act(a) * b
        cands = {"eager": eager, "compiled": torch.compile(eager), "perfloop": ours}
        if lk is not None:
            from liger_kernel.ops.geglu import LigerGELUMulFunction
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            cands["liger"] = (LigerSiLUMulFunction if kind == "swiglu" else LigerGELUMulFunction).apply

        def fb(fn):
            def run():
                torch.autograd.grad(fn(a, b), [a, b], dy)

            return run

        fns = {k: fb(f) for k, f in cands.items()}
        c = pl.compare(fns, baseline="eager", budget_s=3.0)
        passes = 7 * m * n * a.element_size()  # ANCHORS.md's count (the kernels make 8 passes)
        row = {"op": kind, "shape": [m, n], "dtype": "bf16"}
        for k, meas in c.measurements.items():
            dev = pl.profile(fns[k], calls=5, count_work=False).device_ms_per_call
            db = _do_bench(fns[k])
            row[k] = {
                "ms": meas.median_ms,
                "do_bench_ms": db,
                "device_ms": dev,
                "do_bench_share_of_copy": passes / (db * 1e-3) / 1e9 / copy_gbps,
                "device_share_of_copy": passes / (dev * 1e-3) / 1e9 / copy_gbps,
            }
        others = [row[k]["do_bench_ms"] for k in ("compiled", "liger") if k in row]
        row["perfloop_vs_fastest_other_do_bench"] = min(others) / row["perfloop"]["do_bench_ms"]
        out[kind] = row
        print(json.dumps(row))


def linear_cross_entropy(out: dict) -> None:
    from perfloop.ops.linear_cross_entropy.triton_impl import linear_cross_entropy as lce_kernel

    n, d, v = 16384, 768, 50304
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = nn.Parameter(torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * 0.02)
    target = torch.randint(0, v, (n,), device="cuda")
    eager = lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t)
    ours = pnn.LinearCrossEntropy(d, v, device="cuda", dtype=torch.bfloat16)
    ours.weight = w
    cands = {"eager": eager, "compiled": torch.compile(eager), "perfloop": lambda h, w, t: ours(h, t)}

    def fb(fn):
        def run():
            torch.autograd.grad(fn(h, w, target), [h, w])

        return run

    fns = {k: fb(f) for k, f in cands.items()}
    row = {"op": "linear_cross_entropy", "shape": [n, d, v], "dtype": "bf16"}
    for k, f in fns.items():
        row.setdefault(k, {})["peak_gib"] = _peak_gib(f)
    c = pl.compare(fns, baseline="eager", budget_s=4.0)
    for k, meas in c.measurements.items():
        row[k]["ms"] = meas.median_ms
    row["perfloop_vs_compiled"] = row["compiled"]["ms"] / row["perfloop"]["ms"]
    sweep = {}
    for rows in (512, 1024, 1536, 2048, 4096):
        f = fb(lambda h, w, t, rows=rows: lce_kernel(h, w, t, chunk=rows))
        peak = _peak_gib(f)
        sweep[rows] = {
            "do_bench_ms": _do_bench(f),
            "peak_gib": peak,
            "peak_vs_eager": peak / row["eager"]["peak_gib"],
        }
    row["perfloop_chunk_sweep"] = sweep
    for k, f in fns.items():
        row[k]["do_bench_ms"] = _do_bench(f)
    row["perfloop_vs_compiled_do_bench"] = row["compiled"]["do_bench_ms"] / row["perfloop"]["do_bench_ms"]
    row["perfloop_peak_vs_eager"] = row["perfloop"]["peak_gib"] / row["eager"]["peak_gib"]
    out["linear_cross_entropy"] = row
    print(json.dumps(row))


def cross_entropy(out: dict) -> None:
    lk = _liger()
    n, v = 16384, 50304
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (n,), device="cuda")
    eager = lambda lg, t: F.cross_entropy(lg.float(), t)
    cands = {"eager": eager, "compiled": torch.compile(eager), "perfloop": pnn.CrossEntropyLoss()}
    if lk is not None:
        cands["liger"] = lk.LigerCrossEntropyLoss()

    def fb(fn):
        def run():
            torch.autograd.grad(fn(logits, target), [logits])

        return run

    fns = {k: fb(f) for k, f in cands.items()}
    c = pl.compare(fns, baseline="eager", budget_s=4.0)
    row = {"op": "cross_entropy", "shape": [n, v], "dtype": "bf16"}
    for k, meas in c.measurements.items():
        s = c.speedups.get(k)
        row[k] = {
            "ms": meas.median_ms,
            "vs_eager": s.speedup if s else 1.0,
            "ci": list(s.ci) if s else None,
            "do_bench_ms": _do_bench(fns[k]),
        }
    others = [row[k]["ms"] for k in ("compiled", "liger") if k in row]
    row["perfloop_vs_fastest_other"] = min(others) / row["perfloop"]["ms"]
    out["cross_entropy"] = row
    print(json.dumps(row))


def step(out: dict) -> None:
    c = train_gpt.SIZES["small"]
    model, fn, batch = train_gpt.make_step(c, 12, "cuda")
    fn()

    def loss_fn(m, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(*b)

    report = pl.patch(model, batch, loss_fn=loss_fn, measure=True, budget_s=6.0)
    out["step_eager"] = {
        "replaced": report.replaced,
        "refused": report.refused,
        "timing": report.timing,
        "errors": {s.name: s.errors for s in report.swaps},
    }
    print(report)
    # compiled alone against patched then compiled, each a fresh model from the same seed
    plain, _, _ = train_gpt.make_step(c, 12, "cuda")
    patched, _, _ = train_gpt.make_step(c, 12, "cuda")
    pl.patch(patched, batch, loss_fn=loss_fn)
    fns = {}
    for label, m in (("compiled", plain), ("patched+compiled", patched)):
        cm = torch.compile(m)

        def run(cm=cm):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = cm(*batch)
            loss.backward()

        t0 = time.perf_counter()
        run()
        run()
        torch.cuda.synchronize()
        fns[label] = run
        out.setdefault("compile_s", {})[label] = time.perf_counter() - t0
    cmp = pl.compare(fns, baseline="compiled", budget_s=6.0)
    s = cmp.speedups["patched+compiled"]
    out["step_compiled"] = {
        "compiled_ms": cmp.measurements["compiled"].median_ms,
        "patched_compiled_ms": cmp.measurements["patched+compiled"].median_ms,
        "speedup": s.speedup,
        "ci": list(s.ci),
    }
    print(json.dumps(out["step_compiled"]))


def host(out: dict, out_dir: Path) -> None:
    """Host time of one forward + backward of each norm (a small shape, so the GPU waits on the
    host) and where our module's host time goes (cProfile)."""
    import cProfile
    import io
    import pstats

    m, n = 64, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    mods = {
        "torch": nn.RMSNorm(n, eps=1e-6),
        "compiled": torch.compile(nn.RMSNorm(n, eps=1e-6)),
        "perfloop": pnn.RMSNorm(n, eps=1e-6),
    }
    row = {}
    for k, mod in mods.items():
        mod.to("cuda", torch.bfloat16)
        f = _fwd_bwd(mod, x, dy, list(mod.parameters()))
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            f()
        torch.cuda.synchronize()
        row[k] = (time.perf_counter() - t0) / 500 * 1e6
    out["host_us_per_fwd_bwd"] = row
    print(json.dumps(row))
    f = _fwd_bwd(mods["perfloop"], x, dy, list(mods["perfloop"].parameters()))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        f()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    (out_dir / "host-cprofile.txt").write_text(buf.getvalue())


def memory(out: dict) -> None:
    """GPT-2 small under autocast: memory held after the forward and the peaks of forward and
    backward, unpatched and with only the LayerNorms swapped."""
    c = train_gpt.SIZES["small"]
    res = {}
    for label in ("original", "layernorm", "all"):
        model, _, batch = train_gpt.make_step(c, 12, "cuda")
        if label == "layernorm":
            for mod in list(model.modules()):
                for name, ch in list(mod.named_children()):
                    if type(ch) is nn.LayerNorm:
                        setattr(mod, name, pnn.modules.fused_like(ch))
        elif label == "all":
            pl.patch(model, batch, loss_fn=lambda m, b: m(*b))
        for _ in range(2):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(*batch)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
            fwd_peak = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            torch.cuda.synchronize()
            bwd_peak = torch.cuda.max_memory_allocated() - base
            model.zero_grad(set_to_none=True)
            del loss
        res[label] = {
            "held_after_fwd_mib": held / 2**20,
            "fwd_peak_mib": fwd_peak / 2**20,
            "bwd_peak_mib": bwd_peak / 2**20,
        }
        del model
    out["memory"] = res
    print(json.dumps(res))


def train(out: dict) -> None:
    c = train_gpt.GPTConfig(256, 4, 4, vocab=8192, context=256)
    curves = {}
    for patched in (False, True):
        model, fn, batch = train_gpt.make_step(c, 8, "cuda", seed=0)
        if patched:
            pl.patch(model, batch, loss_fn=lambda m, b: m(*b))
        curves["patched" if patched else "original"] = [fn().item() for _ in range(60)]
    a, b = torch.tensor(curves["original"]), torch.tensor(curves["patched"])
    out["train"] = {
        "curves": curves,
        "max_abs_diff": float((a - b).abs().max()),
        "first": a[0].item(),
        "last": a[-1].item(),
    }
    print(json.dumps({k: v for k, v in out["train"].items() if k != "curves"}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--only", default="norms,ce,swiglu,lce,step,train")
    a = ap.parse_args()
    res = {"device": pl.device_info(), "torch": torch.__version__, "liger": _liger() is not None}
    ceil = pl.ceilings()
    res["ceilings"] = ceil
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for part in a.only.split(","):
        try:
            {
                "norms": lambda: norms(res, ceil["copy_gbps"]),
                "ce": lambda: cross_entropy(res),
                "swiglu": lambda: gated(res, ceil["copy_gbps"]),
                "lce": lambda: linear_cross_entropy(res),
                "step": lambda: step(res),
                "train": lambda: train(res),
                "host": lambda: host(res, Path(a.out)),
                "memory": lambda: memory(res),
            }[part]()
        except Exception as exc:
            res.setdefault("errors", {})[part] = repr(exc)
            print(f"{part}: {exc!r}")
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "fused-ops.json").write_text(json.dumps(res, indent=1, default=str))

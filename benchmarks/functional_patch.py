"""pl.patch on models written as popular training code writes them (examples/nanogpt_model.py:
GPT-2 with F.layer_norm in a LayerNorm class, F.cross_entropy(ignore_index=-1) in forward, nn.GELU()
exact; examples/llama_model.py: an fp32 RMSNorm class, SwiGLU written out, the loss in forward):
which call sites it reaches, the step before and after (measure=True: each kind alone, interleaved),
the step's device time both ways, what the rerouting itself costs the host per call; with
--compiled, torch.compile of the model against torch.compile of the patched model (the losses in
the graph as perfloop's ops; and with every fused op in the graph); with --curves N, N training
steps (bf16 autocast, fused AdamW) patched and not, from the same weights on the same batches.

    PYTHONPATH=src python3 benchmarks/functional_patch.py --out DIR [--model gpt2|llama] [--small]
        [--compiled] [--curves N] [--no-measure] [--four-ways] [--head]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from example_models import example

import perfloop as pl
from perfloop.device import env_fingerprint
from perfloop.nn import functional as pf

llama_model, mingpt_model, nanogpt_model = (
    example(n) for n in ("llama_model", "mingpt_model", "nanogpt_model")
)


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def mechanism_cost() -> dict:
    """Host time of one call of a LayerNorm class over F.layer_norm, plain and rerouted with its
    site sent to torch's own function (the mechanism alone), on a tiny CPU tensor."""
    plain_ln, routed_ln = nanogpt_model.LayerNorm(8, bias=True), nanogpt_model.LayerNorm(8, bias=True)
    pf.reroute(routed_ln, {})  # no site fused: every call resolved through the proxy to torch's
    x = torch.randn(2, 8)
    plain, routed = [], []
    for _ in range(9):  # alternated: drift hits both
        plain.append(host_us(lambda: plain_ln(x)))
        routed.append(host_us(lambda: routed_ln(x)))
    p, r = sorted(plain)[4], sorted(routed)[4]
    return {"plain_us": p, "rerouted_us": r, "overhead_us": r - p}


def build(name: str, small: bool, dev: str):
    """(model, batch size, sequence length, vocabulary) of the named model, seeded."""
    torch.manual_seed(0)
    if name == "mingpt":  # GPT-2 small written out (attention, GELU), dropout 0.1, batch 12 x 1024
        cfg = (
            mingpt_model.GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64)
            if small
            else mingpt_model.GPTConfig()
        )
        if os.environ.get("NO_DROPOUT"):  # the curves with nothing random in the step
            cfg.embd_pdrop = cfg.resid_pdrop = cfg.attn_pdrop = 0.0
        return mingpt_model.GPT(cfg).to(dev), cfg, *((2, 64) if small else (12, 1024)), cfg.vocab_size
    if name == "gpt2":  # GPT-2 small, batch 12 x 1024
        cfg = (
            nanogpt_model.GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=2, n_embd=64)
            if small
            else nanogpt_model.GPTConfig()
        )
        return nanogpt_model.GPT(cfg).to(dev), cfg, *((2, 64) if small else (12, 1024)), cfg.vocab_size
    # 8 layers, d 1024, 16 heads, vocab 32000, batch 8 x 1024
    tiny = dict(dim=64, n_layers=2, n_heads=2, vocab_size=512, multiple_of=32, max_seq_len=64)
    cfg = llama_model.ModelArgs(**tiny) if small else llama_model.ModelArgs()
    return llama_model.Transformer(cfg).to(dev), cfg, *((2, 64) if small else (8, 1024)), cfg.vocab_size


def make_loss_fn(dev: str):
    amp = torch.autocast(dev, dtype=torch.bfloat16) if dev == "cuda" else torch.autocast(dev, enabled=False)

    def loss_fn(m, b):
        with amp:
            out = m(*b)
        return out[1] if isinstance(out, tuple) else m.last_loss

    return loss_fn


def device_ms(model, batch, loss_fn, steps: int = 3) -> dict:
    """The step's GPU kernel time (summed, per step) and its wall time, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        loss_fn(model, batch).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / steps / 1e3
    return {"kernel_ms": total, "kernels": len(kernels) // steps, "wall_ms_profiled": wall}


def seeded_batch(name: str, small: bool, dev: str) -> tuple:
    """(the named model, seeded; a batch of (tokens, targets) for it)."""
    base, _, bsz, seq, vocab = build(name, small, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    return base, tuple(torch.randint(0, vocab, (bsz, seq), device=dev, generator=g) for _ in range(2))


def step_of(m, batch, loss_fn):
    """One training step's forward and backward, as a call."""

    def run():
        loss_fn(m, batch).backward()

    return run


def warmed(models: dict, batch, loss_fn) -> float:
    """Run each model's step twice (a compiled one compiles, and recompiles once); seconds taken."""
    t0 = time.perf_counter()
    for m in models.values():
        for _ in range(2):
            step_of(m, batch, loss_fn)()
    return time.perf_counter() - t0


def compiled_comparison(name: str, small: bool, dev: str, budget_s: float) -> dict:
    """torch.compile(model) against torch.compile(patched model): the losses in the graph as
    perfloop's ops (compiled.in_graph as shipped), then every fused op in the graph."""
    from perfloop.harness.timing import compare
    from perfloop.nn import compiled as pc

    loss_fn = make_loss_fn(dev)
    out = {}
    shipped = pc.DEFAULT_IN_GRAPH
    every = shipped | {"layer_norm", "rms_norm"}
    for label, in_graph in (("losses in graph", shipped), ("all in graph", every)):
        with pc.in_graph(in_graph):
            torch._dynamo.reset()
            base, batch = seeded_batch(name, small, dev)
            patched = __import__("copy").deepcopy(base)
            report = pl.patch(patched, batch, loss_fn=loss_fn)
            models = {"compiled": torch.compile(base), "patched+compiled": torch.compile(patched)}
            compile_s = warmed(models, batch, loss_fn)  # compiled outside the timing
            steps = {k: step_of(m, batch, loss_fn) for k, m in models.items()}
            c = compare(steps, baseline="compiled", budget_s=budget_s)
            s = c.speedups["patched+compiled"]
            out[label] = {
                "in_graph": sorted(in_graph),
                "replaced": report.replaced,
                "compile_s": compile_s,
                "compiled_ms": c.measurements["compiled"].median_ms,
                "patched_compiled_ms": c.measurements["patched+compiled"].median_ms,
                "speedup": s.speedup,
                "ci": s.ci,
                "significant": s.significant,
            }
            print(
                f"{name} {label}: compiled {out[label]['compiled_ms']:.2f} ms, patched+compiled "
                f"{out[label]['patched_compiled_ms']:.2f} ms, {s.speedup:.3f}x [{s.ci[0]:.3f}, {s.ci[1]:.3f}]"
                f" (compiles {compile_s:.0f} s)",
                flush=True,
            )
    return out


def four_ways(name: str, small: bool, dev: str, budget_s: float) -> dict:
    """Eager, patched (measure=True: what pays kept), compiled and patched+compiled, the step
    (forward, backward) timed interleaved in one run, with peak memory."""
    import copy

    from perfloop.harness.timing import compare
    from perfloop.nn.keep import step_peak

    loss_fn = make_loss_fn(dev)
    torch._dynamo.reset()
    base, batch = seeded_batch(name, small, dev)
    patched = copy.deepcopy(base)
    t0 = time.perf_counter()
    report = pl.patch(patched, batch, loss_fn=loss_fn, measure=True, budget_s=budget_s)
    patch_s = time.perf_counter() - t0
    models = {
        "eager": base,
        "patched": patched,
        "compiled": torch.compile(copy.deepcopy(base)),
        "patched+compiled": torch.compile(patched),
    }
    compile_s = warmed(models, batch, loss_fn)  # compiled outside the timing
    steps = {k: step_of(m, batch, loss_fn) for k, m in models.items()}
    peaks = {k: step_peak(m, steps[k]) for k, m in models.items()} if dev == "cuda" else {}
    c = compare(steps, baseline="eager", budget_s=budget_s)
    ms = {k: c.measurements[k].median_ms for k in models}
    out = {
        "replaced": report.replaced,
        "kept": (report.timing or {}).get("kept"),
        "patch_s": patch_s,
        "compile_s": compile_s,
        "ms": ms,
        "peak_bytes": peaks,
        "report": str(report),
        "patched_vs_eager": ms["eager"] / ms["patched"],
        "compiled_vs_eager": ms["eager"] / ms["compiled"],
        "patched_vs_compiled": ms["compiled"] / ms["patched"],
        "patched_compiled_vs_compiled": ms["compiled"] / ms["patched+compiled"],
    }
    print(report, flush=True)
    times = ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
    print(
        f"{name}: {times}; patched {out['patched_vs_eager']:.2f}x eager, {out['patched_vs_compiled']:.2f}x "
        f"compiled; compiled {out['compiled_vs_eager']:.2f}x eager; patched+compiled "
        f"{out['patched_compiled_vs_compiled']:.3f}x compiled",
        flush=True,
    )
    return out


def for_compile(name: str, small: bool, dev: str, budget_s: float) -> dict:
    """pl.patch(measure=True, compiled=True) (each candidate timed compiled, only what pays kept),
    then compiled, against the model compiled: one interleaved run."""
    import copy

    from perfloop.harness.timing import compare

    loss_fn = make_loss_fn(dev)
    torch._dynamo.reset()
    base, batch = seeded_batch(name, small, dev)
    patched = copy.deepcopy(base)
    t0 = time.perf_counter()
    report = pl.patch(patched, batch, loss_fn=loss_fn, measure=True, compiled=True, budget_s=budget_s)
    patch_s = time.perf_counter() - t0
    models = {"compiled": torch.compile(base), "patched for compile, compiled": torch.compile(patched)}
    warmed(models, batch, loss_fn)
    steps = {k: step_of(m, batch, loss_fn) for k, m in models.items()}
    c = compare(steps, baseline="compiled", budget_s=budget_s)
    s = c.speedups["patched for compile, compiled"]
    out = {
        "kept": report.timing["kept"] if report.timing else [],
        "patch_s": patch_s,
        "report": str(report),
        "speedup": s.speedup,
        "ci": s.ci,
        "significant": s.significant,
        "ms": {k: c.measurements[k].median_ms for k in models},
    }
    print(report, flush=True)
    print(
        f"{name}: patched for compile then compiled {s.speedup:.3f}x compiled [{s.ci[0]:.3f}, "
        f"{s.ci[1]:.3f}]; kept {out['kept']}; patch took {patch_s:.0f} s",
        flush=True,
    )
    return out


def head_under_compile(name: str, small: bool, dev: str, budget_s: float) -> dict:
    """pl.patch(logits=False) (the head's linear and cross entropy fused where the model writes
    them the usual way), eager and then compiled, against the model eager and compiled: the
    step's time (one interleaved run), its peak memory and its loss each way."""
    import copy

    from perfloop.harness.timing import compare
    from perfloop.nn.keep import step_peak

    loss_fn = make_loss_fn(dev)
    torch._dynamo.reset()
    base, batch = seeded_batch(name, small, dev)
    patched = copy.deepcopy(base)
    t0 = time.perf_counter()
    report = pl.patch(patched, batch, loss_fn=loss_fn, logits=False)
    patch_s = time.perf_counter() - t0
    models = {"eager": copy.deepcopy(base), "patched": patched}
    models |= {"compiled": torch.compile(base), "patched+compiled": torch.compile(patched)}
    compile_s = warmed(models, batch, loss_fn)
    losses = {k: loss_fn(m, batch).detach().item() for k, m in models.items()}
    peaks = {k: step_peak(m, step_of(m, batch, loss_fn)) for k, m in models.items()} if dev == "cuda" else {}
    c = compare(
        {k: step_of(m, batch, loss_fn) for k, m in models.items()}, baseline="compiled", budget_s=budget_s
    )
    s = c.speedups["patched+compiled"]
    head = [sw for sw in report.swaps if "cross entropy written out" in sw.kind]
    out = {
        "report": str(report),
        "head_fused": bool(head and head[0].replaced),
        "head": head[0].via or head[0].reason if head else "no head found",
        "patch_s": patch_s,
        "compile_s": compile_s,
        "losses": losses,
        "peak_bytes": peaks,
        "ms": {k: c.measurements[k].median_ms for k in models},
        "speedup": s.speedup,
        "ci": s.ci,
        "significant": s.significant,
    }
    if peaks:
        out["peak_ratio"] = peaks["patched+compiled"] / peaks["compiled"]
    e = c.measurements["eager"].median_ms / c.measurements["patched"].median_ms
    out["patched_vs_eager"] = e
    print(report, flush=True)
    gib = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in peaks.items())
    print(
        f"{name}: head fused {out['head_fused']}; patched+compiled {s.speedup:.3f}x compiled "
        f"[{s.ci[0]:.3f}, {s.ci[1]:.3f}]; patched {e:.3f}x eager; peak {gib}; losses {losses}",
        flush=True,
    )
    return out


def breakdown(name: str, small: bool, dev: str, top: int = 20) -> dict:
    """Where the step's device time goes, eager, patched (every verified swap) and compiled:
    pl.profile's rows by op, and the patched step's findings."""
    import copy

    loss_fn = make_loss_fn(dev)
    torch._dynamo.reset()
    base, batch = seeded_batch(name, small, dev)
    patched = copy.deepcopy(base)
    pl.patch(patched, batch, loss_fn=loss_fn)
    models = {"eager": base, "patched": patched, "compiled": torch.compile(copy.deepcopy(base))}
    warmed(models, batch, loss_fn)
    out = {}
    for label, m in models.items():
        p = pl.profile(step_of(m, batch, loss_fn))
        rows = p.breakdown(by="op")
        total = sum(r.device_ms for r in rows)
        out[label] = {
            "device_ms": total,
            "rows": [
                {
                    "name": r.name,
                    "calls": r.calls,
                    "ms": round(r.device_ms, 3),
                    "dtype": r.dtype,
                    "gb": round((r.bytes or 0) / 1e9, 3),
                    "bound": str(r.bound),
                }
                for r in rows[:top]
            ],
        }
        print(f"{name} {label}: {total:.2f} ms of device time by op", flush=True)
        for r in rows[:top]:
            gb = (r.bytes or 0) / 1e9
            print(f"  {r.device_ms:8.3f} ms {r.calls:5d}x {r.name} {r.dtype} {gb:.3f} GB {r.bound}")
        if label == "patched":
            out[label]["diagnosis"] = str(p.diagnose())
            print(out[label]["diagnosis"], flush=True)
    return out


def curves(name: str, small: bool, dev: str, steps: int, seeds: int = 1) -> dict:
    """`steps` training steps from the same weights on the same batches, torch's code and the
    patched model (every verified swap kept): each step's loss both ways. With `seeds` > 1 each
    way runs that many times, its random draws (dropout) from another seed: the spread of
    torch's own runs is what the patched runs are held to."""
    loss_fn = make_loss_fn(dev)
    model, _, bsz, seq, vocab = build(name, small, dev)
    g = torch.Generator().manual_seed(3)
    # a corpus with structure to learn: each token followed by one of 4 likely successors
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    toks = [int(torch.randint(0, vocab, (1,), generator=g))]
    picks = torch.randint(0, 4, (200_000,), generator=g)
    for p in picks.tolist():
        toks.append(int(succ[toks[-1], p]))
    corpus = torch.tensor(toks)
    starts = torch.randint(0, len(corpus) - seq - 1, (steps, bsz), generator=g)
    window = lambda row, k: torch.stack([corpus[s + k : s + k + seq] for s in row]).to(dev)
    batches = [(window(row, 0), window(row, 1)) for row in starts]
    patched = __import__("copy").deepcopy(model)
    report = pl.patch(patched, batches[0], loss_fn=loss_fn)
    # the floor: torch's code from weights 1e-6 (relative) away, to tell drift from bias
    nudged = __import__("copy").deepcopy(model)
    with torch.no_grad():
        gn = torch.Generator(device=dev).manual_seed(4)
        for q in nudged.parameters():
            q.mul_(1 + 1e-6 * torch.randn(q.shape, device=dev, generator=gn))
    out = {"replaced": report.replaced}
    runs = [("torch", model), ("patched", patched), ("torch, nudged", nudged)]
    for seed in range(1, seeds):
        runs += [
            (f"torch, seed {seed}", __import__("copy").deepcopy(model)),
            (f"patched, seed {seed}", __import__("copy").deepcopy(patched)),
        ]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for label, m in runs:
        m.load_state_dict(start) if label != "torch, nudged" else None
        torch.manual_seed(int(label.rsplit(" ", 1)[-1]) if "seed" in label else 0)
        opt = torch.optim.AdamW(m.parameters(), lr=6e-4, fused=dev == "cuda")
        losses = []
        for b in batches:
            loss = loss_fn(m, b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        out[label] = losses
    diffs = [abs(a - b) for a, b in zip(out["torch"], out["patched"], strict=True)]
    out["max_abs_diff"] = max(diffs)
    out["max_abs_diff_nudged"] = max(
        abs(a - b) for a, b in zip(out["torch"], out["torch, nudged"], strict=True)
    )
    out["mean_signed_diff"] = sum(b - a for a, b in zip(out["torch"], out["patched"], strict=True)) / steps
    out["first_last"] = {
        "torch": [out["torch"][0], out["torch"][-1]],
        "patched": [out["patched"][0], out["patched"][-1]],
    }
    tail = lambda v: sum(v[-20:]) / len(v[-20:])
    out["last20"] = {label: tail(out[label]) for label, _ in runs}
    if seeds > 1:
        mine = [v for k, v in out["last20"].items() if k.startswith("torch")]
        theirs = [v for k, v in out["last20"].items() if k.startswith("patched")]
        out["spread"] = {
            "torch": [min(mine), max(mine)],
            "patched": [min(theirs), max(theirs)],
            "mean_gap": sum(theirs) / len(theirs) - sum(mine) / len(mine),
        }
        print(
            f"{name} last-20 mean loss: torch {sorted(round(v, 3) for v in mine)}, patched "
            f"{sorted(round(v, 3) for v in theirs)}",
            flush=True,
        )
    t, p = out["torch"], out["patched"]
    print(
        f"{name} curves over {steps} steps: loss {t[0]:.3f} -> {t[-1]:.3f} (torch), -> {p[-1]:.3f} "
        f"(patched); largest gap {out['max_abs_diff']:.4f} (torch from weights 1e-6 away: "
        f"{out['max_abs_diff_nudged']:.4f})",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--small", action="store_true", help="a tiny model (to test the script on a CPU)")
    ap.add_argument("--model", choices=["gpt2", "llama", "mingpt"], default="gpt2")
    ap.add_argument("--no-measure", action="store_true", help="skip pl.patch(measure=True)")
    ap.add_argument("--compiled", action="store_true", help="compiled against patched+compiled")
    ap.add_argument("--curves", type=int, default=0, help="training steps for the loss curves")
    ap.add_argument("--curve-seeds", type=int, default=1, help="runs each way, their random draws apart")
    ap.add_argument("--four-ways", action="store_true", help="eager, patched, compiled, patched+compiled")
    ap.add_argument("--breakdown", action="store_true", help="device time by op: eager, patched, compiled")
    ap.add_argument("--for-compile", action="store_true", help="pl.patch(compiled=True) then compiled")
    ap.add_argument("--head", action="store_true", help="pl.patch(logits=False) then compiled, time and peak")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    budget = 4.0 if dev == "cuda" else 1.0
    out: dict = {"device": env_fingerprint(), "model": a.model}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"functional_patch_{a.model}{'_compiled' if a.compiled else ''}.json")

    def save():
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)

    if not a.no_measure:
        model, cfg, batch, seq, vocab = build(a.model, a.small, dev)
        out.update(config=cfg.__dict__, batch=[batch, seq])
        g = torch.Generator(device=dev).manual_seed(1)
        xy = tuple(torch.randint(0, vocab, (batch, seq), device=dev, generator=g) for _ in range(2))
        loss_fn = make_loss_fn(dev)
        before = __import__("copy").deepcopy(model) if dev == "cuda" else None
        t0 = time.perf_counter()
        report = pl.patch(model, xy, loss_fn=loss_fn, measure=True, budget_s=budget)
        out["patch_s"] = time.perf_counter() - t0
        out["report"] = str(report)
        out["replaced"] = report.replaced
        out["timing"] = report.timing
        out["mechanism"] = mechanism_cost()
        sites = sum(1 for s in report.swaps if s.site and s.replaced)
        step_ms = (report.timing or {}).get("after_ms")
        if step_ms:  # rerouted calls a step: each site's module runs once a step forward
            out["mechanism"]["share_of_step"] = sites * out["mechanism"]["overhead_us"] / (step_ms * 1e3)
        if before is not None:  # every verified swap, kept or not: where the device time went
            every = __import__("copy").deepcopy(before)
            pl.patch(every, xy, loss_fn=loss_fn)
            out["device_time"] = {
                "torch": device_ms(before, xy, loss_fn),
                "patched": device_ms(every, xy, loss_fn),
            }
            print(json.dumps(out["device_time"]), flush=True)
        print(report, flush=True)
        print(json.dumps(out["mechanism"]), flush=True)
        save()
    if a.compiled:
        out["compiled"] = compiled_comparison(a.model, a.small, dev, budget)
        save()
    if a.four_ways:
        out["four_ways"] = four_ways(a.model, a.small, dev, budget)
        save()
    if a.for_compile:
        out["for_compile"] = for_compile(a.model, a.small, dev, budget)
        save()
    if a.head:
        out["head"] = head_under_compile(a.model, a.small, dev, budget)
        save()
    if a.breakdown:
        out["breakdown"] = breakdown(a.model, a.small, dev)
        save()
    if a.curves:
        out["curves"] = curves(a.model, a.small, dev, a.curves, a.curve_seeds)
        save()


if __name__ == "__main__":
    main()

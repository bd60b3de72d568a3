"""What a CUDA-graph replay leaves in the profiler, for attributing its kernels: the decode of
examples/llama_decode.py compiled with reduce-overhead, profiled for a few tokens; written as JSON
(the device kernels in order with the events above their launch, Inductor's provenance
launches of each graph, and each generated kernel's estimated FLOPs and bytes).

    PYTHONPATH=src python3 benchmarks/experiments/replay_facts.py out.json [--benchmark-kernel]
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType

from perfloop.analysis.compilation import live_metrics
from perfloop.analysis.inductor import graph_launches, kernel_costs, tracking_sources

_spec = importlib.util.spec_from_file_location(
    "llama_decode", Path(__file__).resolve().parents[2] / "examples" / "llama_decode.py"
)
ld = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ld)


def main(out: str, benchmark_kernel: bool) -> None:
    import torch._inductor.config as cfg

    cfg.benchmark_kernel = benchmark_kernel
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    mc = ld.ModelArgs(n_layer=2, dim=1024, n_head=8)
    with torch.device(device):
        model = ld.Transformer(mc)
    model = model.to(torch.bfloat16).eval()
    model.setup_caches(1, 64)
    with tracking_sources():
        step = torch.compile(ld.decode_one_token, mode="reduce-overhead", fullgraph=True)
        x = torch.randint(0, mc.vocab_size, (1, 1), device=device)
        pos = torch.tensor([4], device=device, dtype=torch.int)
        with torch.no_grad():
            for _ in range(4):
                x = step(model, x, pos).clone()
                pos += 1
            with torch.profiler.profile(record_shapes=True) as prof:
                for _ in range(2):
                    with torch.profiler.record_function("decode"):
                        x = step(model, x, pos).clone()
                    pos += 1
                if device == "cuda":
                    torch.cuda.synchronize()
    events = prof.events()
    launchers = {}
    for e in events:
        for k in getattr(e, "kernels", ()) or ():
            chain, a = [], e
            while a is not None:
                chain.append(a.name)
                a = a.cpu_parent
            launchers.setdefault(k.name, chain)
    kernels = [
        {"name": e.name, "us": e.time_range.elapsed_us(), "launcher": launchers.get(e.name)}
        for e in sorted(events, key=lambda e: e.time_range.start)
        if e.device_type == DeviceType.CUDA
    ]
    graphs = [
        [(la.key, la.traces[0][-300:] if la.traces else "") for la in g]
        for g in graph_launches(live_metrics())
    ]
    metas = kernel_costs()  # each Triton kernel's (FLOPs, bytes) as Inductor estimated them
    cpu_names = sorted({e.name for e in events if e.device_type == DeviceType.CPU})
    facts = {
        "kernels": kernels,
        "graphs": graphs,
        "metas": metas,
        "cpu_names": cpu_names,
        "torch": torch.__version__,
    }
    Path(out).write_text(json.dumps(facts, indent=1))
    print(len(kernels), "kernels;", len(graphs), "graphs;", len(metas), "kernel costs")


if __name__ == "__main__":
    main(sys.argv[1], "--benchmark-kernel" in sys.argv)

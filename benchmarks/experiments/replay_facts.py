"""What a CUDA-graph replay leaves in the profiler, for attributing its kernels: the decode of
examples/llama_decode.py compiled with reduce-overhead, profiled for a few tokens; written as JSON
(the device kernels in order with the runtime call and ops above their launch, Inductor's
provenance launches of each graph, and each generated kernel's inductor_meta keys).

    PYTHONPATH=src python3 benchmarks/experiments/replay_facts.py out.json [--benchmark-kernel]
"""

import json
import sys

import torch
from torch.autograd import DeviceType

sys.path.insert(0, "examples")
import llama_decode as ld  # noqa: E402

from perfloop.analysis.compilation import live_metrics  # noqa: E402
from perfloop.analysis.inductor import graph_launches, tracking_sources  # noqa: E402


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
    graphs = [[(la.key, la.traces[0][-300:] if la.traces else "") for la in g] for g in graph_launches(live_metrics())]
    from torch._inductor.codecache import PyCodeCache

    metas = {}
    for mod in list(getattr(PyCodeCache, "modules", [])) + list(getattr(PyCodeCache, "modules_no_attr", {}).values()):
        for name, obj in vars(mod).items():
            meta = getattr(obj, "inductor_meta", None)
            if isinstance(meta, dict):
                metas[f"{getattr(mod, '__file__', '?')}::{name}"] = {
                    k: v for k, v in meta.items() if k in ("kernel_num_gb", "kernel_flop", "kernel_name")
                } | {"keys": sorted(meta)}
    cpu_names = sorted({e.name for e in events if e.device_type == DeviceType.CPU})
    json.dump(
        {"kernels": kernels, "graphs": graphs, "metas": metas, "cpu_names": cpu_names, "torch": torch.__version__},
        open(out, "w"),
        indent=1,
    )
    print(len(kernels), "kernels;", len(graphs), "graphs;", len(metas), "kernel metas")


if __name__ == "__main__":
    main(sys.argv[1], "--benchmark-kernel" in sys.argv)

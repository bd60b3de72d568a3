"""`perfloop env`: what this machine is, and what it can do."""

from __future__ import annotations

from perfloop.cli.output import emit_json, table


def register(verb) -> None:
    p = verb("env", "what this machine is, and what it can do", run)
    p.add_argument("--ceilings", action="store_true", help="also measure (or read the cached) ceilings")
    p.add_argument("--refresh", action="store_true", help="measure the ceilings again")


def run(args) -> int:
    from perfloop.device import env_fingerprint
    from perfloop.harness.ceilings import ceilings

    info = env_fingerprint()
    if args.ceilings:
        info["ceilings"] = ceilings(refresh=args.refresh)
    if args.json:
        emit_json(info)
        return 0
    d = info["device"]
    rows = [
        ["python", info["python"]],
        ["torch", info["torch"]],
        ["triton", info["triton"] or "not installed (Triton variants unavailable)"],
        ["cuda", info["cuda"] or "none (CPU build)"],
        ["device", d["name"]],
    ]
    if d["kind"] == "cuda":
        rows += [
            ["capability", d["capability"]],
            ["SMs", d["sms"]],
            ["L2", f"{d['l2_bytes'] / 2**20:.0f} MiB"],
            ["memory", f"{d['memory_bytes'] / 2**30:.1f} GiB"],
            ["driver", d["driver"]],
        ]
    else:
        rows += [["cores", d["cores"]], ["torch threads", d["torch_threads"]]]
    rows += [[f"precision: {k}", v] for k, v in info["precision"].items()]
    rows.append(["git (this folder's repository)", info["git"] or "- (not in a git working tree)"])
    pv = info["perfloop"]
    rows.append(["perfloop", (pv["version"] or "?") + (f" (checkout {pv['git']})" if pv["git"] else "")])
    if args.ceilings:
        c = info["ceilings"]
        rows.append(["ceiling: copy", f"{c['copy_gbps']:.0f} GB/s (read + write)"])
        for k, v in c.items():
            if k.startswith("matmul_") and k.endswith("_tflops"):
                name = k[len("matmul_") : -len("_tflops")]
                rows.append([f"ceiling: {name} matmul", f"{v:.1f} TFLOP/s"])
    table("perfloop env", ["what", "value"], rows)
    return 0

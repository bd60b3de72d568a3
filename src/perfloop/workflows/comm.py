"""Collective benchmarks on torch.distributed (NCCL on GPUs, gloo on CPUs).

`perfloop comm` times all-reduce, all-gather, reduce-scatter, broadcast and
all-to-all over a range of sizes, on every rank, and reports per size the time of
the slowest rank, the algorithm bandwidth (bytes / time) and the bus bandwidth
(nccl-tests' formulas: what each link carried), after checking the result.

Launch with `torchrun --nproc-per-node N -m perfloop comm`, or let it spawn its
own ranks with `perfloop comm --nproc N`. NVLink multicast stays off in every
process it starts (NCCL_NVLS_ENABLE=0 and friends), and every collective has a
timeout, so a rank that dies ends the others with an error, not a hang.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def bus_factor(name: str, n: int) -> float:
    """busbw = algbw * factor (nccl-tests PERFORMANCE.md)."""
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast


def default_sizes(on_gpu: bool) -> list[int]:
    """Bytes per rank: 1 KB to 1 GB on GPUs, 1 KB to 16 MB on CPUs (gloo is slow)."""
    top = 2**30 if on_gpu else 2**24
    out, s = [], 2**10
    while s <= top:
        out.append(s)
        s *= 4
    return out


def _run_one(name: str, nbytes: int, rank: int, world: int, device: str, dtype=torch.float32):
    """Inputs (rank-dependent, never zeros) and three callables: reset, the collective, check.

    The size is rounded down to a multiple of the world size (reduce-scatter and
    all-to-all split it evenly). The bytes returned are nccl-tests' size, on which its
    algbw and busbw formulas rest: each rank's largest buffer -- the gathered output of
    all-gather and the full input of reduce-scatter (world x the per-rank piece).
    """
    elem = torch.empty((), dtype=dtype).element_size()
    n = max(world, nbytes // elem // world * world)
    base = torch.arange(n, device=device, dtype=dtype) % 97  # small integers: exact in fp32
    x = base + rank + 1
    total = world * (world + 1) / 2
    if name == "all_reduce":
        buf = x.clone()
        return (
            n * elem,
            lambda: buf.copy_(x),
            lambda: dist.all_reduce(buf),
            lambda: torch.equal(buf, base * world + total),
        )
    if name == "all_gather":
        out = torch.empty(n * world, device=device, dtype=dtype)
        want = torch.cat([base + r + 1 for r in range(world)])
        return (
            n * world * elem,
            lambda: None,
            lambda: dist.all_gather_into_tensor(out, x),
            lambda: torch.equal(out, want),
        )
    if name == "reduce_scatter":
        big = torch.arange(n * world, device=device, dtype=dtype) % 97
        inp = big + rank + 1
        out = torch.empty(n, device=device, dtype=dtype)
        want = big[rank * n : (rank + 1) * n] * world + total
        return (
            n * world * elem,
            lambda: None,
            lambda: dist.reduce_scatter_tensor(out, inp),
            lambda: torch.equal(out, want),
        )
    if name == "broadcast":
        buf = x.clone()
        return (
            n * elem,
            lambda: buf.copy_(x),
            lambda: dist.broadcast(buf, src=0),
            lambda: torch.equal(buf, base + 1),
        )
    if name == "all_to_all":
        out = torch.empty_like(x)
        chunk = n // world
        # rank r's j-th chunk comes from rank j's r-th chunk
        want = torch.cat([base[rank * chunk : (rank + 1) * chunk] + j + 1 for j in range(world)])
        return (
            n * elem,
            lambda: None,
            lambda: dist.all_to_all_single(out, x),
            lambda: torch.equal(out, want),
        )
    raise ValueError(f"collective: unknown {name!r}; valid: {', '.join(COLLECTIVES)}")


def _time(fn: Callable, device: str, iters: int) -> float:
    """Median ms of one call on this rank (events on a GPU, a barrier'd clock on a CPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.startswith("cuda"):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def run_collectives(sizes: list[int], names=COLLECTIVES, iters: int = 10) -> list[dict]:
    """On an initialized process group: every collective at every size; rows on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    rows = []
    for name in names:
        for nbytes in sizes:
            moved, reset, fn, check = _run_one(name, nbytes, rank, world, device)
            reset()
            fn()
            ok = bool(check())  # checked once on fresh data; then timed as it stands
            ms = _time(fn, device, iters)
            gathered = [None] * world
            dist.all_gather_object(gathered, (ms, ok))
            slowest = max(t for t, _ in gathered)
            algbw = moved / (slowest * 1e-3) / 1e9
            rows.append(
                {
                    "collective": name,
                    "bytes": moved,
                    "ranks": world,
                    "backend": dist.get_backend(),
                    "time_ms": slowest,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * bus_factor(name, world),
                    "correct": all(o for _, o in gathered),
                }
            )
    return rows


def init_from_env(timeout_s: float = 60.0) -> None:
    """Join the group torchrun (or comm's own spawner) described in the environment."""
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, fn_name: str, args: tuple, results):
    os.environ.update(SAFE_ENV)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    timeout = args[-1]
    init_from_env(timeout)
    try:
        out = globals()[fn_name](*args[:-1])
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def spawn(nproc: int, fn_name: str, *args, timeout_s: float = 60.0):
    """Run `fn_name(*args)` on `nproc` fresh ranks; returns rank 0's result.

    A rank that fails makes the others fail within `timeout_s` (collective timeouts),
    and the error is raised here; nothing hangs.
    """
    if not isinstance(nproc, int) or nproc < 2:
        raise ValueError(f"--nproc: collectives need at least 2 ranks, got {nproc!r}")
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        raise ValueError(f"--nproc: {nproc} ranks but only {torch.cuda.device_count()} GPUs here")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_spawned, args=(r, nproc, port, fn_name, (*args, timeout_s), results))
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    # Read rank 0's result while the ranks run: a result larger than the pipe's buffer
    # (64 KiB) blocks its sender until someone reads, so joining first would deadlock.
    deadline = time.monotonic() + timeout_s * 4 + 60
    out, got = None, False
    while time.monotonic() < deadline:
        if not got and not results.empty():
            out, got = results.get(), True
        if not any(p.is_alive() for p in procs):
            break
        time.sleep(0.02)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    if not got and not results.empty():
        out, got = results.get(), True
    failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if failed:
        raise RuntimeError(
            f"ranks {failed} failed (exit codes; None: killed at the deadline); "
            "the others stopped, none hangs"
        )
    return out


def collectives_on_ranks(sizes, names, iters):
    return run_collectives(sizes, names, iters)


# ------------------------------------------------------------------ distributed sweeps


def distributed_sweep(
    op_name: str,
    variants: list[str],
    shapes: list[tuple],
    dtype_name: str,
    budget_s: float = 1.0,
    db: str | None = None,
    run_id: str | None = None,
    on_point: Callable | None = None,
) -> dict:
    """On an initialized group: shard (variant, shape) points across ranks, one device each,
    bench them, gather every Measurement to rank 0. Returns {"points", "by_rank"} on every rank.

    With `db` and `run_id`, each rank also stores each point the moment it is measured (the
    store takes concurrent writers): a rank that dies loses only the points it had not
    measured yet. A point that raises is reported with its error and costs only itself.
    """
    from perfloop import ops
    from perfloop.harness.timing import bench
    from perfloop.ops.base import parse_dtype
    from perfloop.results.store import Store

    store = Store(db) if db and run_id else None
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    op = ops.get(op_name)
    dtype = parse_dtype(dtype_name)
    points = [(v, tuple(s)) for v in variants for s in shapes]
    owner = shard([_cost(op, shape, dtype) for _, shape in points], world)
    mine = []
    for i, (v, shape) in enumerate(points):
        if owner[i] != rank:
            continue
        try:
            inputs = op.make_inputs(shape, dtype=dtype, device=device, seed=i)
            var = op.variant(v)
            m = bench(
                lambda var=var, inputs=inputs: var(*inputs), work=op.work(shape, dtype), budget_s=budget_s
            )
            rec = {"variant": v, "shape": list(shape), "rank": rank, "measurement": m.to_dict()}
            if store is not None:
                store.add(run_id, m, op=op_name, variant=v, shape=shape, dtype=dtype_name)
        except Exception as exc:  # one point's failure is reported, the rest go on
            rec = {"variant": v, "shape": list(shape), "rank": rank, "error": f"{type(exc).__name__}: {exc}"}
        mine.append(rec)
        if on_point is not None:
            on_point(rec)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    allpts = [p for part in gathered for p in part]
    return {"points": allpts, "by_rank": {r: len(part) for r, part in enumerate(gathered)}}


def _cost(op, shape, dtype) -> float:
    """A point's expected time, up to a constant: its bytes or its flops, whichever bounds it
    (a fixed launch cost keeps tiny points from counting as free)."""
    w = op.work(shape, dtype)
    return max(w.bytes / 1e9, (w.flops or 0) / 50e12) + 1e-5


def shard(costs: list[float], world: int) -> list[int]:
    """The rank of each point: the costliest first, each to the least-loaded rank (LPT), so
    the ranks finish together and N ranks take ~1/N of the time; every rank computes the same."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def sweep_on_ranks(op_name, variants, shapes, dtype_name, budget_s, db=None, run_id=None):
    return distributed_sweep(op_name, variants, shapes, dtype_name, budget_s, db, run_id)


def _big_result(nbytes: int) -> str:
    """For tests: a result larger than a pipe's buffer."""
    return "x" * nbytes


def _sweep_then_die(op_name, variants, shapes, dtype_name, budget_s, db, run_id):
    """For tests: rank 1 dies after its first point, mid-sweep."""

    def on_point(rec):
        if dist.get_rank() == 1:
            os._exit(3)

    return distributed_sweep(op_name, variants, shapes, dtype_name, budget_s, db, run_id, on_point)


def _fail_on_rank(rank_to_fail: int):
    """For tests: one rank dies; the others must end with an error, not hang."""
    if dist.get_rank() == rank_to_fail:
        os._exit(3)
    dist.all_reduce(torch.ones(4))
    return "unreachable"

"""Softmax in Triton: a row in one block, and two ways for rows too long for one.

`softmax_row_kernel`: one program per row, the row held in registers -- one
read, one write, the ideal. Works up to MAX_ROW_BLOCK columns.

`softmax_online_kernel`: any row length, one program per row. Pass 1 streams
the row keeping a running max m and a running sum l of exp(x - m) (rescaled
when m grows); pass 2 writes exp(x - m) / l, walking the row backwards (the
tiles pass 1 read last may still be in L2): 2 reads + 1 write, where
torch.softmax's kernel makes about 4 passes at 1024 x 262144.

`softmax_split_kernel`: any row length in one read. A row is cut into chunks,
one per program, each held in registers; a program publishes its chunk's
(max, sum) and waits, on an atomic count, for the row's other chunks, then
combines the row's stats and writes its chunk: 1 read + 1 write. It needs the
row's programs resident together: the grid is persistent and sized to what
fits; if the others never come (the interpreter runs programs one at a time)
the waiting program reads the row itself. A row with more chunks than fit at once
takes two passes instead, every chunk its own program: stats, then each row's
combined, then the chunk normalized.

Chunk sizes and warps come from `tuned.json` beside this file (`tuning.py`); what each
choice measured is in benchmarks/NOTES.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from perfloop.ops.base import as_rows, cdiv, check_tensor, interpreting, next_pow2
from perfloop.ops.launch import launch
from perfloop.ops.tuning import first_at_most, load_table

TUNED = load_table(Path(__file__).parent)  # split, online, the two-pass combine's warps (tuned.json)
MAX_ROW_BLOCK = 16384  # columns kept in registers by one program (64 KiB of fp32)
MAX_TWO_PASS_CHUNKS = 8192  # a row's chunk stats one program combines (64M columns at 8192)


@triton.jit
def softmax_row_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=-float("inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    e = tl.exp(z)
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_stats(x_row, n_cols, BLOCK: tl.constexpr):
    """(max, sum of exp(x - max)) of one row, streamed in BLOCK tiles (online softmax)."""
    m = tl.full([BLOCK], -float("inf"), tl.float32)  # per-lane running max
    l = tl.zeros([BLOCK], tl.float32)  # per-lane running sum of exp(x - m)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes that have seen only padding keep m = -inf: guard the inf - inf
        alpha = tl.where(m == -float("inf"), 0.0, tl.exp(m - m_new))
        p = tl.where(mask, tl.exp(x - m_new), 0.0)
        l = l * alpha + p
        m = m_new
    m_row = tl.max(m, axis=0)
    l_row = tl.sum(tl.where(m == -float("inf"), 0.0, l * tl.exp(m - m_row)), axis=0)
    return m_row, l_row


@triton.jit
def softmax_online_kernel(
    x_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y, BLOCK: tl.constexpr,
):  # fmt: skip
    # Persistent: the grid is sized to the GPU and each program walks rows
    # pid, pid + grid, ... Fewer rows in flight means each row's share of L2 is
    # larger, so more of pass 2's (reversed) reads hit L2 instead of HBM.
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        x_row = x_ptr + row * stride_x
        y_row = y_ptr + row * stride_y
        m_row, l_row = _row_stats(x_row, n_cols, BLOCK)
        inv = 1.0 / l_row
        n_tiles = tl.cdiv(n_cols, BLOCK)
        for i in range(0, n_tiles):
            tile = n_tiles - 1 - i  # backwards: the last tiles read may be in L2
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.exp(x - m_row) * inv
            tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combined_stats(stats_ptr, row, n_chunks, MAX_CHUNKS: tl.constexpr):
    """The row's (max, sum of exp(x - max)) from its chunks' published (max, sum) pairs."""
    c = tl.arange(0, MAX_CHUNKS)
    row_stats = stats_ptr + row * n_chunks * 2 + c * 2
    cm = tl.load(row_stats, mask=c < n_chunks, other=-float("inf"), cache_modifier=".cg")
    cl = tl.load(row_stats + 1, mask=c < n_chunks, other=0.0, cache_modifier=".cg")
    m_row = tl.max(cm, axis=0)
    return m_row, tl.sum(cl * tl.exp(cm - m_row), axis=0)


@triton.jit
def softmax_split_kernel(
    x_ptr, y_ptr, stats_ptr, count_ptr, n_rows, n_cols, stride_x, stride_y, n_chunks, spin_limit,
    BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr, PHASE: tl.constexpr = 0,
):  # fmt: skip
    # Persistent; work item i is chunk i % n_chunks of row i // n_chunks. PHASE 0: the grid
    # is a multiple of n_chunks and every program is resident, so a row's chunks run
    # together and wait for each other. Rows with more chunks than fit at once take three
    # launches instead: PHASE 1 publishes every chunk's stats, softmax_combine_kernel combines
    # each row's, PHASE 2 reads the chunk again and writes it (two reads, like online softmax,
    # but every chunk in parallel, where online softmax runs one program a row).
    for item in range(tl.program_id(0), n_rows * n_chunks, tl.num_programs(0)):
        row = (item // n_chunks).to(tl.int64)
        chunk = item % n_chunks
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=-float("inf")).to(tl.float32)
        if PHASE == 2:  # stats_ptr: each row's combined (max, sum), from softmax_combine_kernel
            m_row = tl.load(stats_ptr + row * 2)
            l_row = tl.load(stats_ptr + row * 2 + 1)
        else:
            m = tl.max(x, axis=0)  # every chunk holds at least one column: m is finite
            l = tl.sum(tl.exp(x - m), axis=0)
            stat = stats_ptr + (row * n_chunks + chunk) * 2
            tl.store(stat, m)
            tl.store(stat + 1, l)
            m_row, l_row = m, l  # PHASE 1 stops here (writes nothing)
            if PHASE == 0:
                # publish (release: the stats are visible before the count), then wait for the row
                seen = tl.atomic_add(count_ptr + row, 1, sem="release") + 1
                tries = 0
                while (seen < n_chunks) & (tries < spin_limit):
                    seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
                    tries += 1
                if seen >= n_chunks:
                    m_row, l_row = _combined_stats(stats_ptr, row, n_chunks, MAX_CHUNKS)
                else:
                    # The other chunks are not running (the Triton interpreter runs programs
                    # one at a time; on a GPU, a grid larger than what fits): read the row
                    # instead (in small tiles: the chunk in registers already takes most of them)
                    m_row, l_row = _row_stats(x_ptr + row * stride_x, n_cols, 512)
        if PHASE != 1:
            y = tl.exp(x - m_row) / l_row
            tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_combine_kernel(stats_ptr, row_stats_ptr, n_chunks, MAX_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m_row, l_row = _combined_stats(stats_ptr, row, n_chunks, MAX_CHUNKS)
    tl.store(row_stats_ptr + row * 2, m_row)
    tl.store(row_stats_ptr + row * 2 + 1, l_row)


def _rows_of(x: torch.Tensor, out: torch.Tensor | None):
    """x and the output as (rows, columns) views; the output allocated or checked."""
    check_tensor("x", x)
    x2 = as_rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != x.shape or y.dtype != x.dtype or not y.is_contiguous():
        raise ValueError(f"out: need a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")
    return x2, y.view(-1, x.shape[-1])


def softmax(
    x: torch.Tensor, out: torch.Tensor | None = None, *, num_warps: int | None = None
) -> torch.Tensor:
    x2, y2 = _rows_of(x, out)
    n_rows, n_cols = x2.shape
    if x2.numel() == 0:
        return y2.view(x.shape) if out is None else out
    if n_cols > MAX_ROW_BLOCK:
        return softmax_split(x, out=y2.view(x.shape) if out is None else out)
    block = next_pow2(n_cols)
    # enough warps that a lane holds <= 16 elements (no spills), at least 4
    warps = num_warps or min(32, max(4, block // (32 * 16)))
    launch(
        softmax_row_kernel,
        (n_rows,),
        x2,
        y2,
        n_cols,
        x2.stride(0),
        y2.stride(0),
        BLOCK=block,
        num_warps=warps,
    )
    return y2.view(x.shape) if out is None else out


def softmax_online(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    programs_per_sm: int | None = None,
) -> torch.Tensor:
    x2, y2 = _rows_of(x, out)
    n_rows, n_cols = x2.shape
    if x2.numel() == 0:
        return y2.view(x.shape) if out is None else out
    tuned_block, tuned_warps, tuned_programs = TUNED["online"]
    block = min(block or tuned_block, next_pow2(n_cols))
    num_warps = num_warps or tuned_warps
    grid = min(n_rows, _num_sms(x2.device) * (programs_per_sm or tuned_programs))
    launch(
        softmax_online_kernel,
        (grid,),
        x2,
        y2,
        n_rows,
        n_cols,
        x2.stride(0),
        y2.stride(0),
        BLOCK=block,
        num_warps=num_warps if block >= 1024 else 4,
    )
    return y2.view(x.shape) if out is None else out


def softmax_split(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    spin_limit: int | None = None,
    two_pass: bool | None = None,
) -> torch.Tensor:
    """Long rows in one read: each row is split into chunks held in registers by
    programs that run together; each publishes its chunk's (max, sum) and waits for
    the row's others, then normalizes the chunk it still holds. One read, one write
    -- where online softmax reads the row twice. A row with more chunks than the GPU
    holds programs at once (over ~4M fp32 columns on an H200) cannot wait like that: it
    takes two passes over the data, every chunk in parallel (`two_pass`; None: when
    needed); past MAX_TWO_PASS_CHUNKS chunks a row, the online kernel."""
    x2, y2 = _rows_of(x, out)
    n_rows, n_cols = x2.shape
    if x2.numel() == 0:
        return y2.view(x.shape) if out is None else out
    tuned_block, tuned_warps = TUNED["split"]
    block = min(block or tuned_block, max(16, next_pow2(n_cols)))
    num_warps = num_warps or tuned_warps
    n_chunks = cdiv(n_cols, block)
    stats = torch.empty((n_rows, n_chunks, 2), dtype=torch.float32, device=x2.device)
    count = torch.zeros(n_rows, dtype=torch.int32, device=x2.device)
    if spin_limit is None:  # ~1 s of polling on a GPU; the interpreter can never wait
        spin_limit = 0 if interpreting() else 1 << 20
    args = (x2, y2, stats, count, n_rows, n_cols, x2.stride(0), y2.stride(0), n_chunks, spin_limit)
    consts = {"BLOCK": block, "MAX_CHUNKS": max(2, next_pow2(n_chunks)), "num_warps": num_warps}
    items = n_rows * n_chunks
    resident = _resident_programs(softmax_split_kernel, args, consts, x2.device)
    if two_pass is None:  # a row's chunks cannot all be resident at once: they would wait on
        # each other until the spin limit
        two_pass = x2.device.type == "cuda" and n_chunks > resident
    if two_pass:
        if n_chunks > MAX_TWO_PASS_CHUNKS:  # the combine's stats would not fit in registers
            return softmax_online(x, out=y2.view(x.shape) if out is None else out)
        launch(softmax_split_kernel, (items,), *args, **consts, PHASE=1)
        row_stats = torch.empty((n_rows, 2), dtype=torch.float32, device=x2.device)
        launch(
            softmax_combine_kernel,
            (n_rows,),
            stats,
            row_stats,
            n_chunks,
            MAX_CHUNKS=consts["MAX_CHUNKS"],
            num_warps=first_at_most(TUNED["combine_warps"], n_chunks),
        )
        launch(softmax_split_kernel, (items,), x2, y2, row_stats, *args[3:], **consts, PHASE=2)
        return y2.view(x.shape) if out is None else out
    grid = min(items, max(n_chunks, resident // n_chunks * n_chunks))
    launch(softmax_split_kernel, (grid,), *args, **consts)
    return y2.view(x.shape) if out is None else out


_RESIDENT: dict = {}  # (kernel, device, dtype, constexprs) -> programs that fit at once


def _resident_programs(kernel, args, consts: dict, device: torch.device) -> int:
    """How many programs of `kernel` fit on the GPU at once (registers, shared memory, threads);
    worked out once per compiled variant, not on every call."""
    if device.type != "cuda":
        return _num_sms(device)
    key = (kernel, device, args[0].dtype, tuple(sorted(consts.items())))
    if key not in _RESIDENT:
        _RESIDENT[key] = _count_resident(kernel, args, consts, device)
    return _RESIDENT[key]


def _count_resident(kernel, args, consts: dict, device: torch.device) -> int:
    from perfloop.device import blocks_per_sm, limits_of

    try:
        k = kernel.warmup(*args, grid=(1,), **consts)
        k._init_handles()
        limits = limits_of(torch.cuda.get_device_properties(device))
        per_sm, _ = blocks_per_sm(k.n_regs, 32 * consts["num_warps"], k.metadata.shared, limits)
    except Exception:  # unknown compiler internals: assume one program per SM
        per_sm = 1
    return max(1, per_sm) * _num_sms(device)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so the persistent loop is exercised

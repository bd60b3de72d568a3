"""Compiled code in a profile, from torch's own records: when Dynamo and Inductor compiled (the
profiler's `(dynamo_timed)` ranges, each compile's id in its `_data` ranges), which compiled
regions ran (`Torch-Compiled Region: F/A`), and -- in the process that compiled -- Dynamo's
compilation metrics: the function and line compiled, the guard whose failure recompiled it, the
graph breaks and their reasons.

A compile id `F/A` is frame F's attempt A: A > 0 is a recompile of F.
"""

from __future__ import annotations

import bisect
import collections
import functools
import linecache
import logging
import os
import re
from dataclasses import dataclass, replace

import torch
from torch.autograd import DeviceType

TIMED = " (dynamo_timed)"
REGION = "Torch-Compiled Region: "
_ID = re.compile(r"compile_id=(\d+/\d+)")
RESUME = "torch_dynamo_resume_in_"  # the code after a graph break, compiled as its own function
_RESUME = re.compile(RESUME + r"(\w+?)_at_(\d+)$")


@dataclass(frozen=True)
class Compile:
    """One compilation on the profiler's timeline (us), and what Dynamo recorded of it."""

    compile_id: str
    start_us: float
    end_us: float
    function: str = ""  # the compiled function's name
    where: str = ""  # its file:line
    reason: str = ""  # a recompile's failed guard, in Dynamo's words
    graph_breaks: int = 0

    @property
    def ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3

    @property
    def recompile(self) -> bool:
        return bool(self.reason) or not self.compile_id.endswith("/0")


@dataclass(frozen=True)
class GraphBreak:
    """Where Dynamo split a function: the line it resumed at, and why it broke there."""

    function: str
    where: str  # file:line of the break
    frames: tuple  # the compile frames of the code resumed after it (a region's id is `frame/attempt`)
    reason: str  # Dynamo's reason, or the source line where Dynamo gave none
    kind: str  # "data-dependent branch", "item", "print", "unsupported call", "other"
    regions: int = 0  # compiled regions run after it, in the profile


def eager_hook(fn):
    """`fn`, a hook perfloop registers on every module, as Dynamo must see it: inlined into a
    graph it returns at once (reading no state a guard would keep); called from the eager code
    between a compiled function's graphs it runs as written, with Dynamo off for it and what it
    calls (else Dynamo compiles its frame, the `is_compiling()` branch taken for good)."""
    body = None

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        nonlocal body
        if torch.compiler.is_compiling():
            return None
        if body is None:
            body = _dynamo_off(fn)
        return body(*args, **kwargs)

    return hook


def _dynamo_off(fn):
    eager_hooks_skipped()
    try:
        import torch._dynamo
    except ImportError:
        return fn
    return torch._dynamo.disable(fn)


def eager_hooks_skipped() -> None:
    """Tell Dynamo never to compile an eager hook's frame; call it before registering one (the
    hook's first call may come from a compiled function's eager code)."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return
    skip_code(_hook_code)


@dataclass(frozen=True)
class CompiledCode:
    """What ran compiled in a profile: the compilations inside its calls, the graph breaks of
    the functions that ran, and how many compiled regions a call ran."""

    compiles: list
    breaks: list
    regions_per_call: float
    pace: float = 1.0  # the calls' wall time without the profiler over with it (compiles run slower under it)
    cudagraph_skips: tuple = ()  # Inductor's reasons for not replaying a graph asked to be CUDA graphs


def _is_compile(e) -> bool:
    return e.name.endswith(TIMED) or e.name in ("dynamo", "entire_frame_compile")


def compiles(events, metrics: list | None = None) -> list[Compile]:
    """The outermost compile ranges, in time order, each with its compile id (from the
    `..._data: compile_id=F/A` ranges inside it; a range with none, a lazily compiled backward,
    takes the compile before it) and, where `metrics` (Dynamo's CompilationMetrics) hold that
    id, its function, line and recompile reason."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    outer = []
    for e in cpu:
        if not _is_compile(e):
            continue
        up = e.cpu_parent
        while up is not None and not _is_compile(up):
            up = up.cpu_parent
        if up is None:
            outer.append(e)
    ids = sorted((e.time_range.start, m.group(1)) for e in cpu if (m := _ID.search(e.name)))
    # the frame's own entry: a lazily compiled backward records a second one under its id, unnamed
    by_id = {m.compile_id: m for m in metrics or [] if getattr(m, "co_name", None)}
    out = []
    for e in sorted(outer, key=lambda x: x.time_range.start):
        s, t = e.time_range.start, e.time_range.end
        cid = next((i for at, i in ids if s <= at <= t), None)
        if cid is None and out:  # a lazily compiled backward: its forward's, compiled before it
            out.append(replace(out[-1], start_us=s, end_us=t))
            continue
        m = by_id.get(cid or "?")
        out.append(Compile(cid or "?", s, t, *(_described(m) if m is not None else ())))
    return out


_FRAME = re.compile(r"Line: (\d+), Name: (.+?), Filename: (.+)$")


def _in_torch(filename: str) -> bool:
    return f"{os.sep}torch{os.sep}" in filename


def _described(m) -> tuple[str, str, str, int]:
    """(function, file:line, recompile reason, graph breaks) of a compile: where the compiled
    function is torch's own (a compiled nn.Sequential's forward, torch.compile's wrapper), the
    user's line that called it."""
    name, filename = getattr(m, "co_name", "") or "", getattr(m, "co_filename", None) or ""
    where = f"{os.path.basename(filename)}:{m.co_firstlineno}" if filename else ""
    if filename and _in_torch(filename):
        user = [f for f in (_FRAME.match(x) for x in getattr(m, "stack_trace", None) or []) if f]
        user = [f for f in user if not _in_torch(f.group(3))]
        if user:
            line, _, file = user[-1].groups()
            name, where = "the compiled call", f"{os.path.basename(file)}:{line}"
    return name, where, getattr(m, "recompile_reason", None) or "", getattr(m, "num_graph_breaks", None) or 0


def regions(events) -> list[tuple[float, float, str]]:
    """(start, end, compile id) of each compiled region that ran."""
    return [
        (e.time_range.start, e.time_range.end, e.name[len(REGION) :])
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith(REGION)
    ]


def graph_calls(events) -> list[tuple[float, float]]:
    """(start, end) of each compiled graph's run (Inductor's `## Call CompiledFxGraph ... ##`
    ranges), in time order."""
    return sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CPU and e.name.startswith("## Call CompiledFxGraph")
    )


def between_graphs(graphs: list, ran: list, spans: list) -> list[tuple[float, float, str, str]]:
    """The host's stretches between two compiled graphs' calls in one span (call or step), each
    with the compile ids of the regions running the next graph and the last one. A graph called
    in no region is a backward (its autograd node runs it); a run of backward graphs replays the
    run of forward ones before it in reverse, so the stretch between two of them takes the ids of
    the forward stretch it mirrors (where the two runs pair up)."""
    out = []
    for a, b in spans:
        runs: list = []  # [forward?, [(graph, region id)]], in time order
        for g in (g for g in graphs if a <= g[0] <= b):
            around = [r for r in ran if r[0] <= g[0] <= r[1]]
            rid = around[-1][2] if around else None
            if runs and runs[-1][0] == (rid is not None):
                runs[-1][1].append((g, rid))
            else:
                runs.append([rid is not None, [(g, rid)]])
        named: list = []
        for forward, run in runs:
            pairs = list(zip(run, run[1:], strict=False))
            if forward:
                named = [(x[1], y[0], nxt, prev) for (x, prev), (y, nxt) in pairs]
                out += [st for st in named if st[1] > st[0]]
            elif len(pairs) == len(named):
                for ((x, _), (y, _)), f in zip(pairs, reversed(named), strict=True):
                    if y[0] > x[1]:
                        out.append((x[1], y[0], f[2], f[3]))
    return out


def live_metrics() -> list:
    """Dynamo's compilation metrics since its last reset ([] where torch keeps none): torch keeps
    them across `torch._dynamo.reset()`, which numbers frames from 0 again, so a frame's compile
    id seen twice starts the metrics of the code compiled after that reset (a lazily compiled
    backward shares its forward's id, without a function: not counted)."""
    try:
        from torch._dynamo.utils import get_compilation_metrics

        metrics = list(get_compilation_metrics())
    except (ImportError, AttributeError):
        return []
    seen: set = set()
    start = 0
    for i, m in enumerate(metrics):
        key = getattr(m, "compile_id", None)
        if key is None or getattr(m, "co_name", None) is None:
            continue
        if key in seen:
            seen, start = set(), i
        seen.add(key)
    return metrics[start:]


CUDAGRAPHS_LOG = "torch._inductor.cudagraph_utils.__cudagraphs"  # Inductor's CUDA-graph decisions


class _CudagraphSkips(logging.Handler):
    """Inductor's "skipping cudagraphs due to ..." warnings, as they are logged: a handler on its
    artifact logger (which does not propagate unless TORCH_LOGS names it), so the reasons are
    kept whether or not the user asked to see them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: collections.deque = collections.deque(maxlen=64)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(("skipping cudagraphs", "disabling cudagraphs")):
            try:
                from torch._guards import CompileContext

                cid = CompileContext.current_compile_id()
            except (ImportError, AttributeError):
                cid = None
            self.seen.append((str(cid) if cid is not None else "", msg))


_SKIPS = _CudagraphSkips()
logging.getLogger(CUDAGRAPHS_LOG).addHandler(_SKIPS)  # before any compile: the same logger torch takes


def live_cudagraph_skips() -> list[tuple[str, str]]:
    """(compile id, reason) of each CUDA-graph skip Inductor logged in this process, oldest
    first; the id is that of the compiled region the graph runs in ("" where none was current)."""
    return list(dict.fromkeys(_SKIPS.seen))


def skips_of(skips: list, ran: list[tuple[float, float, str]], launched: bool = True) -> tuple[str, ...]:
    """The skip reasons of the compiled regions that ran. A reason logged outside any compile
    (CUDA-graph trees find a mutated input at run time) names no region: it is kept only where
    a region that ran `launched` kernels from the host, as a skipped graph does, not where every
    kernel was a replay."""
    ids = {cid for *_, cid in ran}
    return tuple(dict.fromkeys(msg for cid, msg in skips if (launched if not cid else cid in ids)))


def host_launched(ran: list[tuple[float, float, str]], items: list) -> bool:
    """Whether a compiled region that ran launched its kernels from the host: one with kernels
    and no replay among them (a region that replays a CUDA graph still launches the copies into
    its static inputs itself)."""
    ran = sorted(ran)
    starts = [a for a, _, _ in ran]
    kernels, replays = [0] * len(ran), [0] * len(ran)
    for i in items:
        n = bisect.bisect_right(starts, i.launch_us) - 1
        if n >= 0 and i.launch_us <= ran[n][1]:
            kernels[n] += 1
            replays[n] += i.replayed
    return any(k and not r for k, r in zip(kernels, replays, strict=True))


def live_break_reasons() -> list[str]:
    """The graph-break reasons Dynamo counted in this process (its `graph_break` and
    `unimplemented` counters)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return []
    return [*counters.get("graph_break", {}), *counters.get("unimplemented", {})]


def graph_breaks(metrics: list, reasons: list[str], ran: list[tuple[float, float, str]]) -> list[GraphBreak]:
    """The graph breaks behind the resume functions Dynamo compiled (one per break), with the
    reason Dynamo gave at that line (or the line's source), counted by the regions that ran."""
    runs: dict = {}
    for *_, cid in ran:
        runs[cid] = runs.get(cid, 0) + 1
    found: dict = {}
    for m in metrics:
        hit = _RESUME.match(getattr(m, "co_name", "") or "")
        if hit is None or not getattr(m, "co_filename", None):
            continue
        line = int(hit.group(2))
        where = f"{os.path.basename(m.co_filename)}:{line}"
        frame = m.compile_id.split("/")[0]
        if where in found:
            found[where][1].add(frame)
            continue
        reason = _reason_at(reasons, m.co_filename, line)
        found[where] = (hit.group(1), {frame}, reason)
    out = []
    for where, (function, frames, reason) in found.items():
        n = sum(c for cid, c in runs.items() if cid.split("/")[0] in frames)
        out.append(GraphBreak(function, where, tuple(sorted(frames)), reason, break_kind(reason), n))
    return out


def _reason_at(reasons: list[str], filename: str, line: int) -> str:
    """Dynamo's reason naming this file and line, else the source line itself."""
    base = os.path.basename(filename)
    for r in reasons:
        if f"line {line}" in r and base in r:
            return r.split("\n")[0] + _code_line(r)
    src = linecache.getline(filename, line).strip()
    return f"at `{src}`" if src else "a graph break (Dynamo gave no reason)"


def _code_line(reason: str) -> str:
    """The `code: ...` part of a reason that quotes the user's line."""
    m = re.search(r"code: (.+)", reason)
    return f": `{m.group(1).strip()}`" if m else ""


def break_kind(reason: str) -> str:
    r = reason.lower()
    if "data-dependent" in r or re.search(r"`if .+:`", r):
        return "data-dependent branch"
    if ".item()" in r or ".tolist()" in r or "scalar" in r:
        return "item"
    if "print" in r or "logging" in r:
        return "print"
    if "unsupported" in r or "skip" in r or "not support" in r:
        return "unsupported call"
    return "other"


BREAK_FIX = {
    "data-dependent branch": "make the branch branchless: compute both sides and pick with "
    "torch.where(cond, a, b) (or torch.cond for two real branches), so the condition stays on the device",
    "item": "keep the value on the device (a 0-d tensor in the arithmetic), read it outside the "
    "compiled function, or torch._dynamo.config.capture_scalar_outputs = True",
    "print": "take the print/logging out of the compiled code (log outside it, or every N steps)",
    "unsupported call": "let Dynamo keep the call in the graph: torch.compiler.allow_in_graph(fn), or "
    "make it a custom op (torch.library.custom_op)",
    "other": "rewrite the line so Dynamo can trace it (TORCH_LOGS=graph_breaks shows why it broke)",
}


def recompile_in_words(reason: str) -> str:
    """Dynamo's failed guard said plainly: "size of dim 1 of `idx` changed: 256 -> 288"."""
    m = re.search(r"tensor '([^']+)' size mismatch at index (\d+)\. expected (\d+), actual (\d+)", reason)
    if m:
        name, dim, was, now = m.groups()
        return f"size of dim {dim} of `{_plain(name)}` changed: {was} -> {now}"
    m = re.search(r"tensor '([^']+)' requires_grad mismatch\. expected requires_grad=(\d)", reason)
    if m:
        now = "now requires grad" if m.group(2) == "0" else "no longer requires grad"
        return f"`{_plain(m.group(1))}` {now} (the graph was made for the other)"
    m = re.search(r"^\s*(?:\d+/\d+: )?(\w[\w.\[\]']*) == (-?[\w.]+)", reason)
    if m:
        return f"the Python value `{_plain(m.group(1))}` changed (the graph holds {m.group(2)})"
    return reason.split("\n")[0].strip()


def _plain(name: str) -> str:
    """`L['x']` -> `x`, `L['self'].n` -> `self.n`, `L['fn']._modules['0'].n` -> `fn[0].n`."""
    name = re.sub(r"\._modules\['([^']+)'\]", r"[\1]", name)
    return re.sub(r"[LG]\['([^']+)'\]", r"\1", name)


def guard_source(reason: str) -> tuple[str, str] | None:
    """(file:line, code) of the user's line a failed guard reads (the last frame of Dynamo's
    `User stack trace`), None where it names none."""
    frames = re.findall(r'File "(.+?)", line (\d+), in \S+\n\s*(.+)', reason)
    if not frames:
        return None
    path, line, code = frames[-1]
    return f"{os.path.basename(path)}:{line}", code.strip()


def guard_text(reason: str) -> str:
    """A failed guard's check alone, without its compile id, its quoted line and torch's hint."""
    return re.sub(r"^\d+/\d+: ", "", reason.splitlines()[0].split("#")[0].strip())


def recompile_fix(reason: str) -> str:
    if "size mismatch" in reason:
        return (
            "mark the dimension dynamic before the call (torch._dynamo.mark_dynamic(x, dim)), compile "
            "with dynamic=True, or pad the inputs to a few bucket lengths so a handful of graphs serve them"
        )
    if " == " in reason:
        module_int = "integer attributes of the nn.Module" in reason
        return (
            "pass the changing Python number as a tensor (torch.tensor(v, device=...)), so it is an "
            "input to the graph, not a constant baked into it"
            + (", or torch._dynamo.config.allow_unspec_int_on_nn_module = True" if module_int else "")
        )
    return "keep what the guard checks the same from call to call (TORCH_LOGS=recompiles shows each guard)"


@dataclass(frozen=True)
class Compiled:
    """One compiled function's compilations over the run."""

    function: str
    where: str
    count: int
    seconds: float
    reasons: tuple  # the recompiles' failed guards, in words
    graph_breaks: int


def summary(metrics: list) -> list[Compiled]:
    """The run's compilations by function (Dynamo's metrics), the most time first: a resume
    function (the code after a graph break) is its own row."""
    named = {m.compile_id: m for m in metrics if getattr(m, "co_name", None)}
    rows: dict = {}
    for m in metrics:
        if not getattr(m, "co_name", None):  # a lazily compiled backward: its frame's row
            if m.compile_id not in named:
                continue
            name, where, reason, breaks = _described(named[m.compile_id])
            reason, breaks = "", 0
        else:
            name, where, reason, breaks = _described(m)
        key = (name, where)
        count, secs, reasons, b = rows.get(key, (0, 0.0, [], 0))
        said = recompile_in_words(reason) if reason else ""
        count += 1 if getattr(m, "co_name", None) else 0
        secs += (
            getattr(m, "entire_frame_compile_time_s", None)
            or getattr(m, "backend_compile_time_s", None)
            or 0.0
        )
        rows[key] = (count, secs, reasons + ([said] if said and said not in reasons else []), max(b, breaks))
    out = [Compiled(n, w, c, s, tuple(r), b) for (n, w), (c, s, r, b) in rows.items()]
    return sorted(out, key=lambda x: -x.seconds)


def recompile_limit() -> int | None:
    """Dynamo's limit on a frame's compiles, past which it runs the frame eagerly."""
    try:
        from torch._dynamo import config
    except ImportError:
        return None
    return getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", None)


def gave_up(rows: list[Compiled]) -> list[str]:
    """Warnings for the functions Dynamo stopped compiling: at its recompile limit it runs them
    eagerly from then on."""
    limit = recompile_limit()
    out = []
    for r in rows:
        if limit and r.count >= limit and r.reasons:
            fix = recompile_fix("size mismatch" if "size of dim" in r.reasons[-1] else " == ")
            out.append(
                f"{r.function} ({r.where}) hit Dynamo's recompile limit ({limit}) after recompiling "
                f"on {r.reasons[-1]}: it runs eagerly from then on, uncompiled; {fix}"
            )
    return out


def summary_lines(rows: list[Compiled]) -> list[str]:
    if not rows:
        return []
    total = sum(r.seconds for r in rows)
    n = sum(r.count for r in rows)
    lines = [f"compilation: {n} compile(s), {total:.2f} s in all (Dynamo and Inductor, the whole run)"]
    for r in rows[:8]:
        again = f"; recompiled: {'; '.join(r.reasons[:2])}" if r.reasons else ""
        breaks = f"; {r.graph_breaks} graph break(s)" if r.graph_breaks else ""
        lines.append(f"  {r.function} ({r.where}): {r.count}x, {r.seconds:.2f} s{breaks}{again}")
    return lines


_hook_code = eager_hook(lambda: None).__code__  # every eager hook's frame: Dynamo skips it

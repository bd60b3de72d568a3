"""Inductor's kernels as rows like any other: each compiled kernel with the aten ops it fused,
the module and source line they came from, and the bytes it moved.

- The kernel: Inductor wraps each launch of a kernel it generated in a profiler range named by
  the kernel (`triton_per_fused_native_layer_norm_3`; on a CPU with
  `torch._inductor.config.cpp.enable_kernel_profile`, `graph_0_cpp_fused_...`); with
  record_shapes the range holds the kernel's buffers (shapes and dtypes), whose bytes are what it
  read and wrote. Its name lists the aten ops it fused (Inductor's `descriptive_names`).
- Where it came from: with Inductor's provenance tracking on (`tracking_sources`; torch's own switch:
  INDUCTOR_PROVENANCE=1), each compiled
  graph leaves in Dynamo's compilation metrics, in call order, every kernel and extern call
  (`extern_kernels.mm`) it launches with the stack traces of the FX nodes behind it. A graph's
  call in the profile (`## Call CompiledFxGraph`) is matched to its graph by that order, and each
  trace is read down the module tree: the frames name the modules' forwards, and a frame's marked
  call (`self.c_fc(x)`) the submodule it called. Modules of one class that one line calls in a
  loop (`for block in self.h`) share their kernels (Inductor emits one for all), so the path
  says `h.*`.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import linecache
import re
from dataclasses import dataclass

import torch

from perfloop.analysis.findings import Site
from perfloop.analysis.work import shape_work

GRAPH_CALL = "## Call CompiledFxGraph"
COMPILED_OP = "(compiled)"  # a compiled kernel's op: no aten op launched it; its rows "(compiled) <kernel>"
_KERNEL = re.compile(r"^(?:graph_\d+_)?((?:triton|cpp)_\w+_\d+)$")
_FUSED = re.compile(r"^(?:triton|cpp)_(?:[a-z]+_)?fused_(\w+?)_\d+$")
_FRAME = re.compile(r'^\s*File "(.+)", line (\d+), in (\S+)')
_SELF_CALL = re.compile(r"^self\.([A-Za-z_][\w.]*)\s*\(")


def kernel_name(event_name: str) -> str | None:
    """The Inductor kernel a profiler range is the launch of, None for any other range."""
    if not event_name.startswith(("triton_", "cpp_", "graph_")):  # most names: no regex run
        return None
    m = _KERNEL.match(event_name)
    return m.group(1) if m else None


@contextlib.contextmanager
def tracking_sources():
    """Within: Inductor records, for every graph it compiles, the source of each kernel it
    generates (its provenance tracking), and its estimate of each Triton kernel's bytes and FLOPs
    (`benchmark_kernel`: what a CUDA graph's replay, which records no launch, is read by); the
    kernels are the same. Its C++ kernels (a CPU's) show in the profiler as the ops they are,
    not as host time between ops."""
    import torch._inductor.config as inductor_config
    import torch._inductor.graph as inductor_graph

    trace, before = inductor_config.trace, inductor_config.trace.provenance_tracking_level
    cpp, profiled = inductor_config.cpp, inductor_config.cpp.enable_kernel_profile
    benchmarked = inductor_config.benchmark_kernel
    trace.provenance_tracking_level = before or 1
    cpp.enable_kernel_profile = True
    inductor_config.benchmark_kernel = True
    inductor_graph.print = _quiet_print  # benchmark_kernel's "Compiled module path" line, not the user's
    try:
        yield
    finally:
        trace.provenance_tracking_level = before
        cpp.enable_kernel_profile = profiled
        inductor_config.benchmark_kernel = benchmarked
        vars(inductor_graph).pop("print", None)


def _quiet_print(*args, **kwargs) -> None:
    if not (args and str(args[0]).startswith("Compiled module path")):
        print(*args, **kwargs)


@functools.cache
def _aten_names() -> frozenset:
    return frozenset(n for n in dir(torch.ops.aten) if not n.startswith("__"))


def fused_ops(kernel: str) -> tuple[str, ...]:
    """The aten ops an Inductor kernel's name lists (`triton_poi_fused_add_native_layer_norm_2`:
    add, native_layer_norm), each name matched whole against aten's, longest first."""
    m = _FUSED.match(kernel)
    if not m:
        return ()
    text, names, out, i = m.group(1), _aten_names(), [], 0
    while i < len(text):
        ends = [j for j in range(len(text), i, -1) if text[j : j + 1] in ("", "_") and text[i:j] in names]
        j = ends[0] if ends else (text.find("_", i + 1) if text.find("_", i + 1) > 0 else len(text))
        if text[i:j] not in out:
            out.append(text[i:j])
        i = j + 1
    return tuple(out)


def launch_work(event) -> tuple[float, float, str] | None:
    """(FLOPs, bytes, dtype) of one launch from what the profiler recorded of its arguments
    (record_shapes): Inductor's own estimate where it made one (`kernel_num_gb`, `kernel_flop`),
    else each buffer's bytes once. None without shapes."""
    kw = getattr(event, "kwinputs", None) or {}
    shapes, types = getattr(event, "input_shapes", None), getattr(event, "input_dtypes", None)
    if not shapes or not types:
        return None
    flops, nbytes, dtype = shape_work(event.name, shapes, types)
    if isinstance(kw.get("kernel_num_gb"), (int, float)):
        nbytes = float(kw["kernel_num_gb"]) * 1e9
    if isinstance(kw.get("kernel_flop"), (int, float)):
        flops = float(kw["kernel_flop"])
    return flops, nbytes, dtype


@dataclass(frozen=True)
class Launch:
    """One launch a compiled graph makes, in call order: a kernel (its name) or an extern call
    (`extern:mm`), and the stack traces of the FX nodes behind it."""

    key: str
    traces: tuple[str, ...]


def _key(name: str) -> str:
    if name.startswith(("triton_", "cpp_")):
        return name
    if "::" in name:
        return f"extern:{name.split('::')[-1]}"
    parts = name.split(".")  # extern_kernels.mm, aten.mul.Tensor, torch.ops.aten.view_as_real.default
    return f"extern:{parts[parts.index('aten') + 1] if 'aten' in parts[:-1] else parts[-1]}"


def graph_launches(metrics: list | None) -> list[tuple[Launch, ...]]:
    """Each compiled graph's launches, in order, from Dynamo's compilation metrics (empty where
    Inductor's provenance tracking was off when they compiled)."""
    out = []
    for m in metrics or ():
        for text in sorted(getattr(m, "inductor_provenance", None) or ()):
            try:
                entries = json.loads(text)
            except ValueError:
                continue
            if not isinstance(entries, dict):
                continue
            handles = {k: k.rsplit(":", 1) for k in entries}  # "triton_poi_fused_add_0:7": its 7th launch
            order = sorted(entries, key=lambda k: int(handles[k][-1]) if handles[k][-1].isdigit() else 0)
            out.append(tuple(Launch(_key(handles[k][0]), tuple(entries[k] or ())) for k in order))
    return out


def _frames(trace: str) -> list[tuple[str, int, str]]:
    """(file, line, the call the frame's caret marks) of each frame of a traceback, outermost
    first; [] where a frame's line no longer reads as it did (a compiled graph from Inductor's
    cache, made before the file was edited or from another file alike)."""
    lines, out = trace.splitlines(), []
    for n, text in enumerate(lines):
        m = _FRAME.match(text)
        if not m:
            continue
        code = lines[n + 1] if n + 1 < len(lines) else ""
        if linecache.getline(m.group(1), int(m.group(2))).strip() != code.strip():
            return []
        marks = lines[n + 2] if n + 2 < len(lines) and _carets(lines[n + 2]) else ""
        start = len(marks) - len(marks.lstrip()) if marks else len(code) - len(code.lstrip())
        out.append((m.group(1), int(m.group(2)), code[start : len(marks.rstrip()) or None].strip()))
    return out


def _carets(line: str) -> bool:
    """Whether a traceback line is the carets under the call a frame made."""
    return bool(line.strip()) and set(line.strip()) <= set("^~")


def _innermost_calls(trace: str) -> list[str]:
    """The `self.NAME(...)` calls of a trace's innermost line where no caret says which one ran
    ([] where one does)."""
    lines = trace.splitlines()
    n = max((i for i, text in enumerate(lines) if _FRAME.match(text)), default=None)
    if n is None or n + 1 >= len(lines):
        return []
    if n + 2 < len(lines) and _carets(lines[n + 2]):
        return []
    return self_calls(lines[n + 1])


def self_calls(code: str) -> list[str]:
    """The `self.NAME(...)` calls a line makes, in the order Python makes them (a call's
    arguments before it); in text order where the line is not a whole statement."""
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return re.findall(r"\bself\.([A-Za-z_]\w*)\s*\(", code)
    out: list[str] = []

    def visit(node) -> None:
        for child in ast.iter_child_nodes(node):  # a call's callee, then its arguments
            visit(child)
        f = getattr(node, "func", None)
        if isinstance(f, ast.Attribute) and f.attr == "forward":  # self.attention.forward(...)
            f = f.value
        on_self = isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "self"
        if isinstance(node, ast.Call) and on_self:
            out.append(f.attr)

    visit(tree)
    return out


@functools.cache
def _span(cls: type) -> tuple[str, int, int] | None:
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    if code is None:
        return None
    lines = [n for _, _, n in code.co_lines() if n]
    return code.co_filename, code.co_firstlineno, max(lines, default=code.co_firstlineno)


class ModuleTree:
    """A model's modules by attribute path, for reading a stack trace down it."""

    def __init__(self, root: torch.nn.Module, name: str):
        self.name = name
        self.modules = {path: type(m) for path, m in root.named_modules()}  # the classes: no model kept alive
        self.weights = {path: _matrix_bytes(m) for path, m in root.named_modules()}

    def weights_of(self, module: str) -> tuple[float, str] | None:
        """(bytes, dtype) of the parameters and buffers module `module` holds itself, where one
        is a matrix a matmul reads (a Linear's; not a norm's vector, not an embedding's table
        looked up) (a pattern, `layers.*.wq`: its first match; `module` may begin with the
        root's name); None where it holds none."""
        if module == self.name or module.startswith(self.name + "."):
            module = module[len(self.name) + 1 :]
        pattern = re.compile(re.escape(module).replace(r"\*", r"\d+") + "$")
        return next((w for p, w in self.weights.items() if w and pattern.match(p)), None)

    def _runs(self, path: str, file: str, line: int) -> bool:
        span = _span(self.modules[path])
        return span is not None and span[0] == file and span[1] <= line <= span[2]

    def place(self, trace: str) -> tuple[str, str] | None:
        """(module path, "file:line") of the innermost frame, read from the first frame in this
        model's forward down (a compiled function that calls the model, gpt-fast's
        `decode_one_token`, is above it); None where no frame is this model's forward."""
        frames = _frames(trace)
        top = next((n for n, (file, line, _) in enumerate(frames) if self._runs("", file, line)), None)
        if top is None:
            return None
        frames = frames[top:]
        paths, hint = [""], []
        for n, (file, line, call) in enumerate(frames):
            below = [
                p for p in self.modules if self._runs(p, file, line) and any(_under(p, c) for c in paths)
            ]
            # a caller's line with no caret: the modules it calls, of those that run this frame
            below = [p for p in below if p.rsplit(".", 1)[-1] in hint] or below
            paths = (below if n else None) or paths
            m = _SELF_CALL.match(call)
            called = [f"{p}.{m.group(1)}" if p else m.group(1) for p in paths] if m else []
            paths = [p for p in called if p in self.modules] or paths
            hint = [] if m else self_calls(call)
        file, line, _ = frames[-1]
        return _pattern(paths), f"{file.rsplit('/', 1)[-1]}:{line}"


def _matrix_bytes(m: torch.nn.Module) -> tuple[float, str] | None:
    ts = [t for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if t is not None]
    if isinstance(m, torch.nn.Embedding) or not any(t.dim() >= 2 for t in ts):
        return None
    return float(sum(t.numel() * t.element_size() for t in ts)), str(ts[0].dtype).removeprefix("torch.")


def _under(path: str, above: str) -> bool:
    return bool(path) and (not above or path.startswith(above + "."))


def _pattern(paths: list[str]) -> str:
    """One name for modules alike but for their index (`h.0.mlp`, `h.1.mlp`: `h.*.mlp`), up to
    where they differ otherwise (`mlp.c_fc`, `mlp.gelu`: `mlp`)."""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for ps in zip(*parts, strict=False):
        if len(set(ps)) == 1:
            common.append(ps[0])
        elif all(p.isdigit() for p in ps):
            common.append("*")
        else:
            break
    return ".".join(common)


def site(launch: Launch, trees: list[ModuleTree]) -> Site | None:
    """Where a launch came from: the module all its traces share (its root's name at the top)
    and the innermost line of its first trace."""
    for tree in trees:
        places = [p for p in (tree.place(t) for t in launch.traces) if p is not None]
        if places:
            module = _pattern([p for p, _ in places]) if len(places) > 1 else places[0][0]
            return Site(module or tree.name, places[0][1])
    return None


def _units(call) -> list:
    """The launches under a graph's call, in time order: the kernels' ranges, and the outermost
    ops (an extern call's)."""
    out, todo = [], list(call.cpu_children)
    while todo:
        e = todo.pop()
        if kernel_name(e.name) or "::" in e.name:
            out.append(e)
        else:
            todo.extend(e.cpu_children)
    return sorted(out, key=lambda e: e.time_range.start)


def _align(keys: tuple, launches: tuple) -> list[tuple[int, int]]:
    pairs, j = [], 0
    for i, k in enumerate(keys):
        for jj in range(j, len(launches)):
            if launches[jj].key == k:
                pairs.append((i, jj))
                j = jj + 1
                break
    return pairs


def placements(events, graphs: list[tuple[Launch, ...]], trees: list[ModuleTree]) -> dict[int, Site]:
    """id of each launching event under a compiled graph's call -> the Site it came from. Each
    graph is read with only the launches whose traces lie in these models (a lazily compiled
    backward's record can hold an earlier graph's launches too: torch keeps adding to it). A
    launch Inductor recorded no source for (a mix-order reduction's kernel, the aten ops that
    finish it) between two placed ones of one module gets that module, one before the graph's
    first placed launch or after its last that launch's module, its line marked so."""
    if not graphs or not trees:
        return {}
    sites = {launch: site(launch, trees) for g in graphs for launch in g}
    graphs = [g for g in (tuple(x for x in g if sites[x] is not None) for g in graphs) if g]
    out: dict[int, Site] = {}
    matched: dict[tuple, list] = {}
    for call in events:
        if not call.name.startswith(GRAPH_CALL) or not graphs:
            continue
        units = _units(call)
        keys = tuple(_key(kernel_name(u.name) or u.name) for u in units)
        if keys not in matched:
            graph = max(graphs, key=lambda g: len(_align(keys, g)))
            placed_at: list[Site | None] = [None] * len(keys)
            for i, j in _align(keys, graph):
                placed_at[i] = sites[graph[j]]
            matched[keys] = _between(placed_at)
        for unit, at in zip(units, matched[keys], strict=True):
            if at is not None:
                out[id(unit)] = at
    return out


def _between(placed_at: list) -> list:
    """Each unplaced launch between two placed ones: their common module; before the first
    placed one of the graph, or after the last, that one's module."""
    out = list(placed_at)
    for i, at in enumerate(placed_at):
        if at is not None:
            continue
        before = next((a for a in reversed(placed_at[:i]) if a is not None), None)
        after = next((a for a in placed_at[i + 1 :] if a is not None), None)
        if before is not None and after is not None and _pattern([before.module, after.module]):
            out[i] = Site(_pattern([before.module, after.module]), f"{before.line}, by its neighbours")
        elif (before is None) != (after is None):  # at the graph's start or end: its one neighbour
            one = before or after
            out[i] = Site(one.module, f"{one.line}, by its neighbour")
    return out


@dataclass(frozen=True)
class Replayed:
    """A kernel of a CUDA graph's replay, read against its compiled graph: where it came from,
    which of the graph's launches it is (`triton_poi_fused_add_0`, `extern:mm`; "" where none
    was matched) and its (FLOPs, bytes, dtype) where known."""

    site: Site | None
    key: str = ""
    work: tuple | None = None


_GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|cublas|conv|sm\d\d_", re.I)
_ATTENTION = re.compile(r"sdpa|flash|fmha|attention", re.I)
_EXTERN_GEMM = ("mm", "addmm", "bmm", "baddbmm", "_int_mm", "convolution", "linear")


def _kind(name: str) -> str:
    """What a replayed kernel is, to be matched with a graph's launch: a Triton kernel's name,
    "reduce" (a GEMM's split-K reduction: its GEMM's call), "gemm", "attention", or "aten" (an
    aten fallback's kernel: no launch of the graph says which)."""
    if kernel_name(name):
        return kernel_name(name)
    if "splitkreduce" in name.lower():
        return "reduce"
    if _ATTENTION.search(name):
        return "attention"
    return "gemm" if _GEMM.search(name) else "aten"


def _launch_kind(key: str) -> str:
    """What a graph's launch is, in `_kind`'s terms."""
    if not key.startswith("extern:"):
        return key
    op = key.removeprefix("extern:")
    if op in _EXTERN_GEMM:
        return "gemm"
    return "attention" if "attention" in op else "aten"


def replayed(
    names: list[str], graphs: list[tuple[Launch, ...]], trees: list[ModuleTree], costs: dict | None = None
) -> list[Replayed]:
    """Each kernel of one replay (`names`, in the order the device ran them) placed in its
    compiled graph, the one most of the replay's Triton kernels are in. A graph's kernels run in
    the order of their dependencies, not of their launches, so each is matched by what it is:
    a Triton kernel by name, a GEMM (cuBLAS) to the graph's matmul calls, an attention kernel to
    its attention calls, the n-th of each to the n-th (a split-K reduction with its GEMM); aten
    fallbacks' kernels, and any left over, take their neighbours' module. Work: Inductor's
    estimate for a Triton kernel (`costs`: kernel_costs), a matmul's module's own weights for
    its first kernel."""
    if not graphs or not trees or not names:
        return [Replayed(None) for _ in names]
    kinds = [_kind(n) for n in names]
    graph = max(graphs, key=lambda g: len({_launch_kind(x.key) for x in g} & set(kinds)))
    queues: dict[str, list[int]] = {}
    for j, launch in enumerate(graph):
        queues.setdefault(_launch_kind(launch.key), []).append(j)
    at: list[int | None] = [None] * len(names)
    first, gemm = [False] * len(names), None
    for i, kind in enumerate(kinds):
        if kind == "reduce":
            at[i] = gemm
        elif kind != "aten" and queues.get(kind):
            at[i], first[i] = queues[kind].pop(0), True
            gemm = at[i] if kind == "gemm" else gemm
    reads = gemm_reads(graph, trees)
    at_sites = [(reads[j][0] if j in reads else site(graph[j], trees)) if j is not None else None for j in at]
    sites = _between(at_sites)
    out = []
    for i, (name, j) in enumerate(zip(names, at, strict=True)):
        key, work = (graph[j].key if j is not None else ""), None
        if kernel_name(name) and costs and kernel_name(name) in costs:
            work = costs[kernel_name(name)]
        elif first[i] and kinds[i] == "gemm" and j in reads:
            work = reads[j][1]
        out.append(Replayed(sites[i], key, work))
    return out


def gemm_reads(graph: tuple[Launch, ...], trees: list[ModuleTree]) -> dict[int, tuple[Site, tuple]]:
    """Each matmul launch of a graph (by index) -> (the Linear it is, (0, its weights' bytes,
    dtype)): the module its trace is placed in where that holds weights, else, where the line
    calls several of the module's children and no caret says which, the n-th GEMM of that line
    in the graph is the n-th child called that holds weights (`self.w2(F.silu(self.w1(x)) *
    self.w3(x))`: w1, w3, w2)."""
    out: dict[int, tuple[Site, tuple]] = {}
    seen: dict[tuple, int] = {}
    for j, launch in enumerate(graph):
        if _launch_kind(launch.key) != "gemm" or (at := site(launch, trees)) is None:
            continue
        n = seen[at.module, at.line] = seen.get((at.module, at.line), -1) + 1
        for tree in trees:
            if w := tree.weights_of(at.module):
                out[j] = (at, (0.0, w[0], w[1]))
                break
            top = "" if at.module == tree.name else at.module
            calls = _innermost_calls(launch.traces[0]) if launch.traces else []
            called = [f"{top}.{c}" if top else c for c in calls]
            held = [(p, w) for p in called if (w := tree.weights_of(p))]
            if held:
                path, w = held[n % len(held)]
                out[j] = (Site(path, at.line), (0.0, w[0], w[1]))
                break
    return out


def kernel_costs() -> dict[str, tuple]:
    """Inductor's own estimate of each Triton kernel it generated in this process, by name:
    (FLOPs, bytes, ""), from the `kernel_num_gb` and `kernel_flop` it keeps in the kernel's
    metadata (under `tracking_sources`); a name two kernels of different cost share is left out."""
    from torch._inductor.codecache import PyCodeCache

    mods = [*getattr(PyCodeCache, "modules", ()), *getattr(PyCodeCache, "modules_no_attr", {}).values()]
    found: dict[str, set] = {}
    for mod in mods:
        for obj in list(vars(mod).values()):
            meta = getattr(obj, "inductor_meta", None)
            if not isinstance(meta, dict) or not isinstance(meta.get("kernel_num_gb"), (int, float)):
                continue
            name = meta.get("kernel_name") or getattr(getattr(obj, "fn", None), "__name__", "")
            cost = (float(meta.get("kernel_flop") or 0.0), float(meta["kernel_num_gb"]) * 1e9, "")
            found.setdefault(name, set()).add(cost)
    return {n: next(iter(c)) for n, c in found.items() if n and len(c) == 1}


def module_trees(roots: dict) -> list[ModuleTree]:
    """A ModuleTree of each model still alive of `roots` (root name -> weakref, as
    modules.module_ranges keeps them)."""
    return [ModuleTree(m, name) for name, ref in roots.items() if (m := ref()) is not None]


def placed(events, metrics: list | None, trees: list | None) -> dict[int, Site]:
    """`placements` of the compiled graphs' launches in `events`, {} where none ran."""
    if not trees or not any(e.name.startswith(GRAPH_CALL) for e in events):
        return {}
    return placements(events, graph_launches(metrics), trees)


def replays(metrics: list | None, trees: list | None):
    """A reader of CUDA-graph replays against the compiled graphs of `metrics` (names of one
    replay's kernels, in order -> a Replayed each; see `replayed`), None where no graph was
    compiled with its sources kept or no model is known."""
    graphs = graph_launches(metrics) if trees else []
    if not graphs:
        return None
    costs, memo = kernel_costs(), {}

    def read(names: list[str]) -> list[Replayed]:
        key = tuple(names)
        if key not in memo:
            memo[key] = replayed(names, graphs, trees, costs)
        return memo[key]

    return read


UNPLACED = 0.05  # of the device time: compiled kernels left to the compiled function, worth a word


def unplaced_note(its: list) -> str:
    """A warning where compiled kernels (attribution.Item) carry no source line: charged to
    the compiled function, not to its modules. "" where they are placed."""
    compiled = [i for i in its if kernel_name(i.kernel) or i.op.startswith(COMPILED_OP + " ")]
    lost = sum(i.ms for i in compiled if not i.line)
    if not compiled or lost <= UNPLACED * (sum(i.ms for i in its) or 1.0):
        return ""
    return (
        "compiled kernels are charged to the compiled function, not to its modules: Inductor kept no "
        "source for them (compile under `perfloop profile --script`, or with INDUCTOR_PROVENANCE=1; a "
        "graph from torch's compile caches made before the file was edited keeps the old lines: "
        "TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0)"
    )

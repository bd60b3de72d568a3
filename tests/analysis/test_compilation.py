"""Compiled code as torch records it: compile ranges in the profiler's events, Dynamo's own
metrics (the function, the failed guard), said plainly."""

import collections
from dataclasses import replace

import pytest
import torch

import perfloop as pl
from perfloop.analysis.compilation import recompile_fix, recompile_in_words, summary, summary_lines


@pytest.mark.slow
def test_a_recompile_on_a_new_shape_is_said_as_the_dim_that_changed_with_its_fix():
    torch._dynamo.reset()

    def scale(x, n):
        return (x * n).relu()

    f = torch.compile(scale, dynamic=False)
    f(torch.randn(8, 16), 2)
    f(torch.randn(9, 16), 2)  # the planted recompile: a new length
    f(torch.randn(9, 16), 3)  # and a new Python int
    lengths = iter(range(10, 40))
    with torch._dynamo.config.patch(recompile_limit=64):  # every call a new length, each a recompile
        p = pl.profile(lambda: f(torch.randn(next(lengths), 16), 3), calls=1, count_work=False)
    made = p.compiles()
    assert made and made[0].recompile and made[0].function == "scale", made
    assert made[0].where == f"test_compilation.py:{scale.__code__.co_firstlineno}"
    assert recompile_in_words(made[0].reason).startswith("size of dim 0 of `x` changed: ")
    said = {recompile_in_words(m.recompile_reason or "") for m in p.compile_metrics}
    assert "the Python value `n` changed (the graph holds 2)" in said, said
    rows = summary(p.compile_metrics)
    [row] = [r for r in rows if r.function == "scale"]
    assert row.count >= 5 and row.seconds > 0
    assert "size of dim 0 of `x` changed: 8 -> 9" in row.reasons
    lines = summary_lines(rows)
    assert lines[0].startswith("compilation: ") and any("scale (test_compilation.py:" in x for x in lines)
    assert "mark_dynamic" in recompile_fix(row_reason(p, "size mismatch"))


def row_reason(p, part: str) -> str:
    return next(m.recompile_reason for m in p.compile_metrics if part in (m.recompile_reason or ""))


def test_the_profiled_calls_compiled_is_a_finding_and_a_warm_one_is_not():
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2).relu().sum())
    x = torch.randn(64, 64)
    warm = pl.profile(f, x, calls=2, count_work=False)
    assert warm.compiled_regions() and not warm.compiles()
    d = warm.diagnose(ceilings={"copy_gbps": 20.0})
    assert not [o for o in d.findings if o.kind in ("compile", "recompile")], str(d)


def test_cuda_graph_advice_for_compiled_code_names_what_in_the_step_blocks_them():
    """A launch-bound compiled step is told CUDA graphs, with the graph break and the sync that
    would stop them found in that step; a step with neither is told it has none."""
    from perfloop.analysis.capture import Capture, CompileFacts
    from perfloop.analysis.compilation import CompiledCode, GraphBreak
    from perfloop.analysis.findings import Finding, Kind
    from perfloop.analysis.ranking import _for_compiled_code
    from perfloop.analysis.timeline import Idle

    brk = GraphBreak("forward", "model.py:31", ("2",), "Data-dependent branching", "data-dependent branch")
    idle = Idle(
        10.0,
        5.0,
        {},
        syncs=[("aten::_local_scalar_dense", 1, 2.0, ())],
        sync_places={"aten::_local_scalar_dense": "train.py:40"},
    )
    launch = Finding("the GPU waits on launches", 5.0, 0.5, "launch", "e", "fewer launches: torch.compile")
    launch = replace(launch, kind=Kind.LAUNCH)
    blocked = Capture("cuda", 1, 10.0, idle=idle, compiled=CompileFacts(CompiledCode([], [brk], 2.0)))
    advice = _for_compiled_code(launch, blocked).advice
    assert "mode='reduce-overhead'" in advice and "torch.compile(model)" not in advice
    assert (
        "first remove: 1 graph break (model.py:31), a CPU sync (_local_scalar_dense at train.py:40)" in advice
    )

    clean = Capture(
        "cuda", 1, 10.0, idle=Idle(10.0, 5.0, {}), compiled=CompileFacts(CompiledCode([], [], 1.0))
    )
    assert "this step has none of what blocks them" in _for_compiled_code(launch, clean).advice


def test_a_compile_torch_names_no_id_is_the_one_before_it():
    """A lazily compiled backward records its compile range with no compile id of its own: it
    is the forward's compiled before it, not a second recompile of "?" with no guard (run31: "2.
    recompiles in the profiled steps: ?: a guard failed" under the real finding)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from perfloop.analysis.compilation import compiles

    def ev(i, name, start, end):
        return FunctionEvent(
            id=i, name=name, thread=1, start_us=start, end_us=end, device_type=DeviceType.CPU
        )

    events = [
        ev(1, "_compile.compile_inner (dynamo_timed)", 0, 100),
        ev(2, "CompilationMetrics_data: compile_id=0/3", 10, 11),
        ev(3, "compile_fx.<locals>.bw_compiler (dynamo_timed)", 200, 260),
    ]
    m = SimpleNamespace(
        compile_id="0/3",
        co_name="forward",
        co_filename="/w/train.py",
        co_firstlineno=26,
        recompile_reason="0/3: L['self'].step == 3",
        num_graph_breaks=0,
    )
    fwd, bwd = compiles(events, [m])
    assert (fwd.compile_id, fwd.function, fwd.where) == ("0/3", "forward", "train.py:26")
    assert (bwd.compile_id, bwd.function, bwd.where) == ("0/3", "forward", "train.py:26")
    assert bwd.reason == fwd.reason
    assert bwd.recompile and bwd.ms == 0.06


def test_in_compiled_code_a_graph_break_goes_before_the_cuda_graphs_finding_it_blocks():
    """run31's branch case: the launch gaps (3.4 ms) ranked above the graph break (1.8 ms) whose
    removal realized 3.2 ms; CUDA graphs, the launch finding's fix, cannot replay the break, so
    the break comes first. A finding that blocks nothing keeps its place by saving."""
    from perfloop.analysis import timeline
    from perfloop.analysis.capture import Capture, CompileFacts
    from perfloop.analysis.compilation import CompiledCode, GraphBreak
    from perfloop.analysis.ranking import rank

    brk = GraphBreak("forward", "train.py:33", ("2",), "Data-dependent branching", "data-dependent branch", 2)
    causes = dict.fromkeys(timeline.CAUSES, 0.0)
    causes[timeline.Cause.LAUNCH] = 3.4
    idle = timeline.Idle(8.5, 4.1, causes, break_saving_ms={"train.py:33": 1.8})
    d = rank(Capture("cuda", 1, 8.5, idle=idle, compiled=CompileFacts(CompiledCode([], [brk], 8.0))), {})
    assert [f.kind for f in d.findings] == ["graph break", "launch"], str(d)
    assert d.findings[0].where == "train.py:33" and d.findings[0].saves_ms == 1.8
    assert "largest first (what blocks CUDA graphs before them)" in str(d)
    eager = rank(Capture("cuda", 1, 8.5, idle=idle), {})
    assert [f.kind for f in eager.findings] == ["launch"]


def test_the_backward_graphs_stretches_are_the_forwards_mirrored():
    """A break splits the forward into graphs G1 G2 G3 (regions 1/0, 2/0, 1/0) and so the backward
    into B3 B2 B1, with the eager autograd nodes of the break's code between them (run31: launch
    gaps there went uncharged to the break). Each backward stretch is named as the forward stretch
    it mirrors: between B3 and B2 as between G2 and G3."""
    from perfloop.analysis.compilation import between_graphs

    graphs = [(0, 10), (20, 30), (40, 50), (100, 110), (130, 140), (170, 180)]  # G1 G2 G3 B3 B2 B1
    regions = [(0, 12, "1/0"), (18, 32, "2/0"), (38, 52, "1/0")]
    got = between_graphs(graphs, regions, [(0, 200)])
    assert got == [
        (10, 20, "2/0", "1/0"),  # G1 -> G2
        (30, 40, "1/0", "2/0"),  # G2 -> G3
        (110, 130, "1/0", "2/0"),  # B3 -> B2, as G2 -> G3
        (140, 170, "2/0", "1/0"),  # B2 -> B1, as G1 -> G2
    ]
    # a backward whose graphs do not pair with the forward's is left out
    assert between_graphs(graphs[:5], regions, [(0, 200)]) == got[:2]
    # two micro-batches in one step: each backward mirrors its own forward, and the stretch from
    # one backward to the next forward (the next batch's data, the loss) is no graph break's
    twice = graphs[:3] + [(60, 70), (75, 80), (85, 90)] + [(g0 + 200, g1 + 200) for g0, g1 in graphs]
    regions2 = regions + [(r0 + 200, r1 + 200, rid) for r0, r1, rid in regions]
    got2 = between_graphs(twice, regions2, [(0, 400)])
    want = [(10, 20), (30, 40), (70, 75), (80, 85), (210, 220), (230, 240), (310, 330), (340, 370)]
    assert [(s, e) for s, e, *_ in got2] == want


def test_a_profile_after_dynamo_reset_holds_none_of_the_compiles_before_it():
    def first(x):
        return x.sin() + 1

    def second(x):
        return x.cos() * 2

    torch.compile(first, backend="eager")(torch.randn(3))
    torch._dynamo.reset()  # a notebook's next model, or a benchmark's next case
    f = torch.compile(second, backend="eager")
    f(torch.randn(3))
    p = pl.profile(f, torch.randn(3), calls=1, count_work=False)
    names = [m.co_name for m in p.compile_metrics]
    assert "second" in names and "first" not in names, names  # both were frame 0: ids collide


def test_a_compiled_kernel_is_never_counted_as_an_autocast_cast():
    """Inductor's kernels named `..._to_copy_gelu` are the model's GELU with its cast folded in;
    bf16 parameters would not take them away."""
    from perfloop.analysis import attribution as attr
    from perfloop.analysis.inductor import COMPILED_OP

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    cm, x = torch.compile(m), torch.randn(64, 128)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cm(x).float().pow(2).mean()
        loss.backward()

    p = pl.profile(step, calls=2, warmup=2, count_work=False)
    casts = [i for i in p.items() if attr.category(i.op or i.kernel) == "dtype cast/copy"]
    folded = [i for i in casts if i.op.startswith(COMPILED_OP)]
    assert folded, [i.op for i in p.items()]  # the compiled kernels the old rule counted
    eager_ms = sum(i.ms for i in casts if i not in folded) / p.calls
    found = [f for f in p.diagnose().findings if f.kind == "dtype cast"]
    assert all(f.saves_ms <= eager_ms * 1.001 for f in found), (found, eager_ms)


class _Warmup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.step = torch.nn.Linear(8, 8), 0

    def forward(self, x):
        return self.lin(x) * (1 + 1 / (1 + self.step))  # the line the guard reads


def test_a_recompile_on_a_python_value_names_the_line_that_reads_it():
    """Dynamo's guard quotes the user's line that read the value (its `User stack trace`): that
    is where the fix goes, not the compiled call (run32: "where: train.py:62", the call)."""
    torch._dynamo.reset()
    m = _Warmup()
    f = torch.compile(m, backend="eager")
    steps = iter(range(100))

    def step():
        m.step = next(steps)
        f(torch.randn(4, 8))

    p = pl.profile(step, calls=1, count_work=False)
    [found] = [o for o in p.diagnose(ceilings={"copy_gbps": 20.0}).findings if o.kind == "recompile"]
    line = _Warmup.forward.__code__.co_firstlineno + 1
    assert found.where == f"test_compilation.py:{line}", found
    assert "(1 + 1 / (1 + self.step))" in found.evidence and "HINT" not in found.evidence, found.evidence
    assert "allow_unspec_int_on_nn_module" in found.advice  # torch's own switch for a module's int


MUTATED = (
    "skipping cudagraphs due to mutated inputs (1 instances). Found from : \n"
    '   File "/home/u/gen/model.py", line 88, in forward\n'
    "    k_out[:, :, input_pos] = k_val\n"
)


def test_inductors_cudagraph_skip_reasons_are_kept_from_its_own_log_call():
    """Inductor says why it skipped CUDA graphs on an artifact logger that does not propagate
    unless TORCH_LOGS names it; perfloop's handler keeps the reason all the same."""
    from torch._guards import CompileContext, CompileId, compile_context
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from perfloop.analysis.compilation import live_cudagraph_skips, skips_of

    with compile_context(CompileContext(CompileId(frame_id=7, frame_compile_id=0))):
        log_cudagraph_skip_and_bump_counter(MUTATED)
    assert ("7/0", MUTATED) in live_cudagraph_skips()
    # charged to the compiled region it was logged for, not to another that ran
    assert skips_of(live_cudagraph_skips(), [(0.0, 1.0, "7/0")]) == (MUTATED,)
    assert MUTATED not in skips_of(live_cudagraph_skips(), [(0.0, 1.0, "8/0")])


def test_a_skip_logged_at_run_time_is_charged_only_where_a_compiled_region_launched_from_the_host(
    monkeypatch,
):
    """CUDA-graph trees find a mutated input when the function first runs, outside any compile,
    so the reason carries no compile id. Seen on the H200: a second, unmutated step compiled in
    the same process replayed all its kernels and was still told "skipped: mutated inputs". Such
    a reason belongs to a region that ran its kernels from the host, not to one that replayed."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from perfloop.analysis import compilation
    from perfloop.analysis.compilation import live_cudagraph_skips, skips_of

    # this test's reasons only, gone after it: one logged outside a compile names no region
    monkeypatch.setattr(compilation._SKIPS, "seen", collections.deque(maxlen=64))
    log_cudagraph_skip_and_bump_counter(MUTATED)  # at run time: no compile context
    assert live_cudagraph_skips() == [("", MUTATED)]
    ran = [(0.0, 1.0, "9/1")]
    assert MUTATED not in skips_of(live_cudagraph_skips(), ran, launched=False)  # every kernel replayed
    assert skips_of(live_cudagraph_skips(), ran, launched=True) == (MUTATED,)
    # launched, read from the kernels: a replaying region still copies its inputs from the host
    from perfloop.analysis.attribution import Item
    from perfloop.analysis.compilation import host_launched

    def kernel(at, replayed):
        return Item("k", "", "", "forward", 0.01, at, at + 1, launch_us=at, replayed=replayed)

    regions = [(0.0, 10.0, "0/0"), (20.0, 30.0, "0/1")]
    replaying = [kernel(1.0, False), kernel(2.0, True), kernel(21.0, True), kernel(15.0, False)]
    assert not host_launched(regions, replaying)  # the kernel at 15 ran outside every region
    assert host_launched(regions, [kernel(1.0, False), kernel(21.0, True)])  # 0/0 launched, no replay


def test_cuda_graphs_asked_for_and_skipped_are_told_the_reason_and_line_not_to_use_cuda_graphs():
    """Issue 54: a step compiled with mode='reduce-overhead' whose graph Inductor did not record
    as CUDA graphs launches every kernel from the host; the launch gaps are this finding's, with
    the fix for what the reason names, and no advice says to use what the code already asks for."""
    from perfloop.analysis.capture import Capture, CompileFacts
    from perfloop.analysis.compilation import CompiledCode
    from perfloop.analysis.findings import Kind
    from perfloop.analysis.idle_record import Cause
    from perfloop.analysis.ranking import rank
    from perfloop.analysis.timeline import Idle

    def step(skips: tuple) -> Capture:
        causes = dict.fromkeys(Cause, 0.0) | {Cause.LAUNCH: 6.0}
        idle = Idle(10.0, 4.0, causes, launch_in_graphs_ms=5.0)
        code = CompiledCode([], [], 1.0, 1.0, skips)
        return Capture("cuda", 2, 5.0, idle=idle, compiled=CompileFacts(code))

    d = rank(step((MUTATED,)), {})
    top = d.findings[0]
    assert top.kind == Kind.CUDA_GRAPHS_SKIPPED and "mutated inputs" in top.title, str(d)
    assert top.saves_ms == pytest.approx(2.5) and top.site.line == "model.py:88"
    assert "buffer" in top.advice and "reduce-overhead" not in top.advice
    assert not any("reduce-overhead" in f.advice for f in d.findings), str(d)
    control = rank(step(()), {})
    assert control.findings[0].kind == Kind.LAUNCH and "mode='reduce-overhead'" in control.findings[0].advice
    # seen on the H100: a short compiled kernel of the skipped step was told "CUDA graphs
    # (mode='reduce-overhead') take their launch cost away": what the step already asks for
    from perfloop.analysis.ranking import CUDA_GRAPHS, _for_compiled_code

    for kind in CUDA_GRAPHS:
        f = _for_compiled_code(replace(control.findings[0], kind=kind), step((MUTATED,)))
        assert "reduce-overhead" not in f.advice and "skipped" in f.advice, (kind, f.advice)

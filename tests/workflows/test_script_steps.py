"""Script mode on a script that knows nothing of perfloop (issue 23): steps found by its
optimizer.step() calls, by torch.profiler's ProfilerStep ranges, by record_function or NVTX
ranges of its own; a script that steps its own profiler keeps working."""

import json
import textwrap
from pathlib import Path

import pytest
import torch

from perfloop.analysis import annotate
from perfloop.cli import main
from perfloop.results.store import Store
from perfloop.workflows.script import OPTIMIZER_STEP, profile_script

BENCH = Path(__file__).resolve().parents[2] / "examples" / "nanogpt_bench.py"
TINY = [
    "--n_layer=1",
    "--n_embd=32",
    "--n_head=2",
    "--block_size=32",
    "--batch_size=2",
    "--vocab_size=256",
    "--real_steps=4",
]


def _clean():
    assert not torch.autograd.profiler._is_profiler_enabled
    assert annotate.RANGE_WATCHERS == []


def test_a_benchmark_script_that_steps_its_own_profiler_is_profiled_by_its_optimizer_steps(tmp_path, capsys):
    trace_dir = tmp_path / "bench_log"
    args = [*TINY, "--profile=True", f"--trace_dir={trace_dir}"]
    db = str(tmp_path / "r.db")
    # steps 2 and 3 profiled, 4 counted: before the script's profiler leaves its 5 waiting steps
    assert main(["profile", "--db", db, "--json", "--skip", "1", "--script", str(BENCH), *args]) == 0
    _clean()
    out = capsys.readouterr().out
    payload = json.loads(out)  # the script's prints went to stderr
    [art] = Store(db).artifacts(kind="profile")
    assert art["payload"]["window"] == payload["window"]
    assert payload["window"] == "2 occurrence(s) of 'optimizer.step'"
    modules = {r["name"] for r in payload["modules"]}
    assert {"transformer.h.0", "lm_head", "optimizer"} <= modules
    assert any(
        r.get("flops") for r in payload["modules"]
    )  # a later step was counted, after the script's profiler
    assert payload["diagnosis"]["opportunities"]
    assert list(trace_dir.glob("*.json"))  # the script's own profiler wrote its trace


def test_profilerstep_ranges_are_steps_by_name(tmp_path):
    args = [*TINY, "--profile=True", f"--trace_dir={tmp_path / 'log'}"]
    p = profile_script(BENCH, args, "ProfilerStep", skip=1, steps=2)
    _clean()
    assert p.calls == 2 and p.step == "ProfilerStep"
    assert any(i.module == "transformer.h.0" for i in p.items())


def test_without_its_profiler_the_steps_are_still_the_optimizer_steps_and_their_pace_is_measured():
    p = profile_script(BENCH, TINY, skip=3, steps=2)
    _clean()
    assert p.step == OPTIMIZER_STEP and p.calls == 2
    assert p.profiled_wall_ms_per_call is not None  # the wall time per step is the unprofiled steps'
    assert not any("measured under the profiler" in w for w in p.warnings)


SCRIPT = """
import torch
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
x = torch.randn(8, 16)
for i in range(6):
    with torch.profiler.record_function("train_step"):
        net(x).square().mean().backward()
"""


def test_a_record_function_range_is_a_step_by_its_name(tmp_path):
    path = tmp_path / "rf.py"
    path.write_text(SCRIPT)
    p = profile_script(path, [], "train_step", skip=2, steps=2)
    _clean()
    assert p.calls == 2 and any(i.module == "0" for i in p.items())
    with pytest.raises(ValueError, match=r"no step found: looked for optimizer.step\(\).*train_step \(x6\)"):
        profile_script(path, [], skip=1, steps=1)
    _clean()


def test_nvtx_ranges_are_steps_by_their_name(tmp_path, monkeypatch):
    pushed = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: pushed.append(msg))  # no NVTX on a CPU
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.pop())
    path = tmp_path / "nvtx.py"
    path.write_text(
        SCRIPT.replace('with torch.profiler.record_function("train_step"):', "if True:").replace(
            "        net(x)", '        torch.cuda.nvtx.range_push("it")\n        net(x)'
        )
        + "        torch.cuda.nvtx.range_pop()\n"
    )
    p = profile_script(path, [], "it", skip=1, steps=3)
    _clean()
    assert p.calls == 3 and pushed == []


def test_two_optimizers_a_step_ends_at_the_first_ones_step_and_it_is_said(tmp_path):
    path = tmp_path / "gan.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        g, d = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
        for _ in range(6):
            d(g(torch.randn(4, 8))).mean().backward()
            og.step(); od.step()
    """)
    )
    p = profile_script(path, [], skip=1, steps=2)
    _clean()
    assert p.calls == 2 and any("several optimizers step (SGD first)" in w for w in p.warnings)


def test_the_last_optimizer_step_of_the_script_closes_the_window(tmp_path):
    path = tmp_path / "exact.py"
    path.write_text(
        textwrap.dedent("""
        import torch
        net = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(5):
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
    """)
    )
    # a step runs from one step() to the next: iterations 2-5 are steps 1-4; 3 and 4 profiled
    p = profile_script(path, [], skip=2, steps=2, count_work=False)
    _clean()
    assert p.calls == 2


def test_a_window_the_scripts_profiler_overlaps_is_refused_with_what_to_do(tmp_path):
    args = [*TINY, "--profile=True", f"--trace_dir={tmp_path / 'log'}"]
    with pytest.raises(ValueError, match=r"runs torch.profiler itself.*a smaller --skip.*--trace-file"):
        profile_script(BENCH, args, skip=4, steps=2)
    _clean()
    p = profile_script(BENCH, args, skip=1, steps=2)  # steps 2-3, counted 4: all in its waiting steps
    _clean()
    assert p.calls == 2 and not any("FLOPs and bytes not counted" in w for w in p.warnings)
    p = profile_script(BENCH, args, skip=2, steps=2)  # the counted step falls in its warm-up
    _clean()
    assert any("had started by the one after" in w for w in p.warnings)


def test_the_ranking_names_the_call_sites_and_the_patch_pl_patch_would_make(tmp_path, capsys):
    """Each fusable chain names its call site (file:line, module) and says whether pl.patch
    reaches it; the text output lists what pl.patch would check."""
    line = next(
        i
        for i, t in enumerate((BENCH.parent / "nanogpt_model.py").read_text().splitlines(), 1)
        if "loss = F.cross_entropy(" in t
    )
    db = str(tmp_path / "r.db")
    assert main(["profile", "--db", db, "--json", "--skip", "1", "--script", str(BENCH), *TINY]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out)
    sites = payload["patch_sites"]
    want = f"F.cross_entropy at nanogpt_model.py:{line} (GPT.forward)"
    assert sites["GPT"]["cross_entropy"].startswith(want)
    assert "pl.patch reaches it" in sites["transformer.h.0.ln_1"]["normalization"]
    for o in payload["diagnosis"]["opportunities"]:
        if "fused cross-entropy" in o["advice"]:
            assert f"nanogpt_model.py:{line}" in o["where"], o
    assert main(["profile", "--db", db, "--skip", "1", "--script", str(BENCH), *TINY]) == 0
    text = capsys.readouterr().out
    assert "pl.patch(model, batch) would check" in text
    assert f"F.cross_entropy at nanogpt_model.py:{line} (GPT.forward): pl.patch reaches it" in text
    assert "(x3 modules)" in text  # ln_1, ln_2, ln_f: one call site in LayerNorm.forward


def test_a_chain_whose_code_pl_patch_cannot_see_is_said_so():
    import torch.nn as nn

    from perfloop.analysis.patterns import where_called as _where
    from perfloop.nn.plan import plan

    class Head(nn.Module):  # the loss is computed by the caller, outside forward
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x)

    sites = plan(Head())
    assert "no cross entropy call pl.patch can reach in Head" in _where("Head", "cross_entropy", sites)
    gpt_sites = {f"transformer.h.{i}.ln_1": {"normalization": "N"} for i in (0, 1)}
    assert _where("transformer.h.*.ln_1", "normalization", gpt_sites) == "N (x2 modules)"


def test_an_ops_row_names_every_call_site_of_its_kind():
    from perfloop.analysis.patterns import where_any as _where_any

    sites = {
        "a.ln": {"normalization": "F.layer_norm at m.py:3 (LN.forward): pl.patch reaches it"},
        "b.ln": {"normalization": "F.layer_norm at m.py:3 (LN.forward): pl.patch reaches it"},
        "head": {"normalization": "RMSNorm module: pl.patch swaps it"},
    }
    ln = "F.layer_norm at m.py:3 (LN.forward): pl.patch reaches it"
    assert _where_any("normalization", sites) == f"{ln} (x2 modules); RMSNorm module: pl.patch swaps it"
    assert "no norm pl.patch can reach in the model" in _where_any("normalization", {"head": {}})
    assert _where_any(None, sites) == "" and _where_any("normalization", None) == ""


LONG = textwrap.dedent("""
    import sys
    import torch

    log = open(sys.argv[1], "a")
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(64, 32)
    try:
        for i in range(int(sys.argv[2])):
            opt.zero_grad()
            try:
                net(x).square().mean().backward()
                opt.step()
            except Exception:  # a loop that carries on past its own errors
                continue
            log.write(f"{i}\\n")
    finally:
        log.write("finally\\n")
        log.close()
""")


def test_exit_after_ends_the_script_once_the_profile_is_taken_and_its_finally_blocks_run(tmp_path):
    """Occurrences 2 and 3 profiled (skip 1), the 4th counted: it ends at the 5th step() call,
    so iterations 0-3 ran to their end and none after, though the loop catches Exception."""
    script, log = tmp_path / "long.py", tmp_path / "log.txt"
    script.write_text(LONG)
    p = profile_script(script, [str(log), "100000"], skip=1, steps=2, exit_after=True)
    _clean()
    assert log.read_text().split() == ["0", "1", "2", "3", "finally"]
    assert p.calls == 2 and p.step == OPTIMIZER_STEP
    assert any(r.flops for r in p.breakdown("module"))  # the counted occurrence was kept


def test_without_exit_after_the_script_runs_to_its_end_and_is_told_once(tmp_path):
    script, log = tmp_path / "long.py", tmp_path / "log.txt"
    script.write_text(LONG)
    told = []
    p = profile_script(script, [str(log), "12"], skip=1, steps=2, on_taken=lambda: told.append(1))
    _clean()
    assert log.read_text().split() == [*map(str, range(12)), "finally"]
    assert told == [1] and p.calls == 2


def test_the_cli_ends_a_long_benchmark_once_its_profile_is_taken(tmp_path, capsys):
    """nanogpt_bench at 100000 steps: without --exit-after it would run for hours on this CPU."""
    db = str(tmp_path / "r.db")
    args = [*TINY[:-1], "--real_steps=100000"]
    assert main(["profile", "--db", db, "--json", "--exit-after", "--script", str(BENCH), *args]) == 0
    _clean()
    out = capsys.readouterr().out
    payload = json.loads(out)
    assert payload["window"] == "2 occurrence(s) of 'optimizer.step'" and payload["modules"]


def test_the_cli_says_when_the_profile_is_taken_and_the_script_runs_on(tmp_path, capsys):
    script, log = tmp_path / "long.py", tmp_path / "log.txt"
    script.write_text(LONG)
    assert main(["profile", "--db", str(tmp_path / "r.db"), "--script", str(script), str(log), "12"]) == 0
    _clean()
    out, err = capsys.readouterr()
    assert err.count("the profile is taken; the script runs on to its end (--exit-after") == 1
    assert "GPU idle" not in out and "no torch op running (the CPU is the device)" in out  # no GPU here
    assert log.read_text().split()[-2:] == ["11", "finally"]


IN_MAIN = textwrap.dedent("""
    import torch
    import torch.nn as nn


    def main():  # the model lives in main's frame: gone when the script ends
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 10))
        loss_fn = nn.CrossEntropyLoss()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
        for _ in range(8):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()


    if __name__ == "__main__":
        main()
""")


def test_the_call_sites_are_read_while_the_model_lives_not_after_the_script_ends(tmp_path):
    """examples/train_gpt.py builds its model in main(): read at the script's end the model was
    gone, and every norm and loss was said to be out of pl.patch's reach."""
    script = tmp_path / "train.py"
    script.write_text(IN_MAIN)
    p = profile_script(script, [], skip=1, steps=2)
    _clean()
    assert "LayerNorm module: pl.patch swaps it" in p.sites["1"]["normalization"], p.sites
    assert "CrossEntropyLoss module" in p.sites["CrossEntropyLoss"]["cross_entropy"], p.sites


def test_a_gelu_or_rope_chain_says_where_pl_patch_reaches_it():
    """Issue 40 item 3: the where line of a GELU chain (minGPT's NewGELU module) and of a RoPE
    chain (the Llama example's rotation written out), from pl.patch's plan of the models."""
    from helpers import example
    from perfloop.analysis.patterns import chain_kind, where_called
    from perfloop.nn.plan import plan

    mingpt, llama = example("mingpt_model"), example("llama_model")
    gpt = mingpt.GPT(mingpt.GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    gelu_ops = ["pow", "mul", "add", "mul", "tanh", "add", "mul"]  # NewGELU's forward, as profiled
    said = where_called("transformer.h.*.mlp.act", chain_kind(gelu_ops), plan(gpt))
    assert said == "NewGELU module: pl.patch swaps it (x2 modules)", said
    args = llama.ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
    rope_ops = ["aten::slice", "aten::mul", "aten::sub", "aten::add", "aten::stack"]
    said = where_called("layers.*.attention", chain_kind(rope_ops), plan(llama.Transformer(args)))
    assert said.startswith("rotary embedding written out (Attention.forward): pl.patch rewrites it"), said
    assert chain_kind(["mul", "add", "sigmoid"]) is None


WARMING = """
import sys, time
import torch
net = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x = torch.randn(32, 64)
for i in range(int(sys.argv[1])):
    if i < 2:
        time.sleep(0.1)  # the first steps are slow (a cold cache, clocks ramping up)
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_the_unprofiled_pace_is_the_steps_after_the_profile_where_the_script_runs_on(tmp_path):
    """The pace the idle is scaled to was the skipped steps': early ones, slower than the steady
    state (run32: 7.1 ms a step where the script's own steady steps took 5.6)."""
    script = tmp_path / "warming.py"
    script.write_text(WARMING)
    p = profile_script(script, ["12"], skip=2, steps=2)
    _clean()
    assert p.calls == 2 and p.wall_ms_per_call < 50, p.wall_ms_per_call  # not the sleeping steps' 100
    # no step after the profile: the skipped ones' pace, the first of them (its warm-up: here the
    # sleeps) left out where a later one exists (run42: 511 ms read for a 5 ms token from it)
    short = profile_script(script, ["5"], skip=2, steps=2)
    assert short.wall_ms_per_call < 50, short.wall_ms_per_call


@pytest.mark.slow
def test_on_a_compiled_script_the_patch_named_is_the_one_that_keeps_what_pays_compiled(tmp_path, capsys):
    """A compiled model's swaps pay only if they beat Inductor's own kernels: the call to make is
    pl.patch(..., measure=True, compiled=True), which times each compiled and keeps what pays."""
    db = str(tmp_path / "r.db")
    assert main(["profile", "--db", db, "--skip", "1", "--script", str(BENCH), *TINY, "--compile=True"]) == 0
    text = capsys.readouterr().out
    assert "pl.patch(model, batch, measure=True, compiled=True) would check" in text, text[-3000:]

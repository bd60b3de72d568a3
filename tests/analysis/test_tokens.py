"""A generation step read per token (issue 54): tokens a step from the embedding's input (or
--tokens, or the KV cache's batch), the bytes a token moves against the weights and KV cache it
must read, prefill and decode as separate steps, on a gpt-fast-style decode script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from perfloop.analysis.tokens import Tokens, TokensFrom, model_bytes

ROOT = Path(__file__).resolve().parents[2]
DECODE = str(ROOT / "examples" / "llama_decode.py")


def test_model_bytes_counts_a_tied_head_once_and_an_untied_table_not_at_all():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(100, 16)
            self.mlp = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 100, bias=False)
            self.head.weight = self.wte.weight  # nanoGPT's weight tying
            self.register_buffer("k_cache", torch.ones(3, 4, 5))

    got = model_bytes(Tied())
    assert got["weights"] == (100 * 16 + 16 * 16 + 16) * 4  # the tied table read whole, by the head
    assert got["cache"] == 3 * 4 * 5 * 4 and got["batch"] == 3
    untied = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 16))
    assert model_bytes(untied)["weights"] == (16 * 16 + 16) * 4  # only rows of the table are read


def test_the_reading_against_the_ceiling():
    t = Tokens(4, 8.0, 4e9 * 8e-3, 30e6, 2e6, 5.0, TokensFrom.GIVEN)
    assert t.tokens_per_s == pytest.approx(500) and t.ms_per_token == pytest.approx(2.0)
    assert t.share == pytest.approx(0.8) and t.floor_ms == pytest.approx(6.4)
    text = "\n".join(t.lines())
    assert "80% of the measured copy ceiling" in text and "headroom 1.600 ms" in text


def _profile(db, *args):
    p = subprocess.run(
        [sys.executable, "-m", "perfloop", "profile", "--json", "--db", str(db), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout
    return json.loads(out)["tokens"]  # the script's prints went to stderr


@pytest.mark.slow
def test_decode_and_prefill_read_per_token_on_a_gpt_fast_style_script(tmp_path):
    decode = _profile(
        tmp_path / "r.db", "--range", "decode", "--steps", "3", "--script", DECODE, "--batch", "2"
    )
    assert decode["tokens_per_step"] == 2 and decode["tokens_from"] == "embedding input"
    # a decode step reads each weight once and the whole KV cache (SDPA over it, masked)
    must = decode["weights_bytes"] + decode["cache_bytes"]
    assert decode["bytes_per_token"] * 2 == pytest.approx(must, rel=0.10)
    assert decode["ms_per_token"] * decode["tokens_per_s"] == pytest.approx(1e3)
    prefill = _profile(
        tmp_path / "r.db",
        "--range",
        "prefill",
        "--steps",
        "1",
        "--skip",
        "0",
        "--script",
        DECODE,
        "--prompt_len",
        "24",
    )
    assert prefill["tokens_per_step"] == 24  # the prompt, taken in at once
    assert prefill["ttft_ms"] == pytest.approx(24 * prefill["ms_per_token"]) and decode["ttft_ms"] is None
    # its weights read once for 24 tokens: counted bytes, not a time (a loaded machine moves times)
    assert prefill["bytes_per_token"] < decode["bytes_per_token"] / 10


def test_a_bad_token_count_is_named(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "perfloop", "profile", "--tokens", "0", "--script", DECODE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "--tokens: must be >= 1" in p.stderr


def test_a_graph_replay_whose_ops_the_counter_misses_is_read_from_what_it_must_read():
    """Measured on the H200 (run36): a decode step replayed as CUDA graphs counted 36 B of ops a
    token against 3.5 GB of weights, and its host returned at 0.64 ms while the device took 1.18
    ms. The rate is read from the weights and KV cache, over the device's time."""
    from types import SimpleNamespace

    from perfloop.analysis.tokens import read

    model = {"weights": 3.5e9, "cache": 10.5e6, "batch": 1}
    work = {("m", "forward", "aten::mm"): (0.0, 36.0, "bf16")}
    replay = SimpleNamespace(work=work, calls=1, step_ms=1.175, model=model)
    t = read(replay, {"copy_gbps": 4250.0})
    assert t.source == "cache batch" and t.bytes_per_step is None and "CUDA graph" in t.note
    assert t.gbps == pytest.approx(3.5105e9 / 1.175e6, rel=1e-3) and 0.69 < t.share < 0.71
    work = {("m", "forward", "aten::mm"): (0.0, 3.53e9, "bf16")}
    eager = SimpleNamespace(work=work, calls=1, step_ms=15.7, model={"weights": 3.5e9})
    assert read(eager, {"copy_gbps": 4250.0}, 1).bytes_per_step == 3.53e9
    unknown = SimpleNamespace(work=work, calls=1, step_ms=15.7, model=None)
    assert read(unknown, {}) is None  # no tokens known: not a generation step


def test_the_napkin_math_of_the_batch_where_reading_the_weights_stops_bounding_a_step():
    from perfloop.analysis.tokens import batch_bound

    h200 = {"matmul_bf16_tflops": 990.0, "copy_gbps": 4250.0, "matmul_fp32_tflops": 60.0}
    # bf16: 2 bytes a parameter, 2 FLOPs a parameter a token: B* = 990e12 / 4.25e12
    assert batch_bound({"dtypes": {"bfloat16": 10, "float32": 1}}, h200) == pytest.approx(232.9, rel=1e-3)
    assert batch_bound({"dtypes": {"float32": 10}}, h200) == pytest.approx(2 * 60 / 4.25, rel=1e-3)
    assert batch_bound({"dtypes": {"bfloat16": 10}}, {"copy_gbps": 10.0}) is None  # no bf16 ceiling
    t = Tokens(1, 1.2, None, 3.5e9, 1e7, 4250.0, TokensFrom.CACHE_BATCH, batch_bound=233.0)
    assert "up to ~233 tokens a step" in "\n".join(t.lines())
    assert "napkin" not in "\n".join(
        Tokens(200, 1.2, None, 3.5e9, 1e7, 4250.0, TokensFrom.GIVEN, batch_bound=233.0).lines()
    )


GEN = """
import torch
m = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100))
tok = torch.tensor([[1]])
with torch.no_grad():
    with torch.profiler.record_function("prefill"):
        tok = m(torch.tensor([[1, 2, 3]]))[:, -1].argmax(-1, keepdim=True)
    for _ in range(20):
        tok = m(tok)[:, -1].argmax(-1, keepdim=True)
"""


def test_a_generation_script_without_a_step_is_stepped_by_its_models_decode_calls(tmp_path, capsys):
    """Issue 65: no optimizer and no range: a step is one decode call of the model (a token a
    sequence), the prompt's call told apart; a range seen once says the flags that take it."""
    from perfloop.cli import main

    script = tmp_path / "gen.py"
    script.write_text(GEN)
    db = ["profile", "--db", str(tmp_path / "r.db")]
    assert main([*db, "--script", str(script)]) == 0
    out = capsys.readouterr().out
    assert "one decode call of Sequential" in out and "prefill (1 call, 3 tokens) left out" in out, out
    # seen once: the flags that take it
    assert main([*db, "--range", "prefill", "--script", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--skip 0 --steps 1" in err, err
    assert main([*db, "--range", "prefill", "--skip", "0", "--steps", "1", "--script", str(script)]) == 0


CAPTURE_FAILS = """
import torch
m = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100))
tok = torch.tensor([[1]])
with torch.no_grad():
    for _ in range(8):  # the eager decode, then the capture of its graph
        with torch.profiler.record_function("decode"):
            tok = m(tok)[:, -1].argmax(-1, keepdim=True)
    raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
"""


def test_a_cuda_graph_capture_that_fails_is_said_with_its_reason_and_the_eager_profile_kept(tmp_path, capsys):
    """Issue 54's bad input: the capture's CUDA error (what torch raises when a sync or a host
    copy runs inside torch.cuda.graph) is named as a capture failure with what breaks one, and the
    eager decode profiled before it is kept in the history."""
    from perfloop.cli import main
    from perfloop.results.store import Store

    script = tmp_path / "gen.py"
    script.write_text(CAPTURE_FAILS)
    db = tmp_path / "r.db"
    status = main(["profile", "--db", str(db), "--range", "decode", "--steps", "2", "--script", str(script)])
    err = capsys.readouterr().err
    assert status == 1, err
    assert "operation not permitted when stream is capturing" in err, err
    assert "a CUDA graph capture failed" in err and ".item()" in err, err
    assert "the profile taken before it is kept" in err, err
    [art] = Store(db).artifacts(kind="profile")  # the eager decode's profile, in the history
    assert art["op"] == "script:gen.py" and art["payload"]["modules"], art


def test_a_prefill_step_is_read_as_the_time_to_first_token_and_a_decode_step_is_not():
    from perfloop.analysis.tokens import Tokens, TokensFrom

    common = dict(bytes_per_step=None, weights_bytes=None, cache_bytes=None, ceiling_gbps=None)
    prefill = Tokens(per_step=48, step_ms=6.0, source=TokensFrom.EMBEDDING, sequences=2, **common)
    assert prefill.ttft_ms == 6.0 and prefill.to_dict()["ttft_ms"] == 6.0
    said = "\n".join(prefill.lines())
    assert "time to first token: 6.000 ms (a prefill: 24 prompt tokens a sequence" in said
    decode = Tokens(per_step=2, step_ms=1.0, source=TokensFrom.EMBEDDING, sequences=2, **common)
    assert decode.ttft_ms is None and "first token" not in "\n".join(decode.lines())
    unknown = Tokens(per_step=48, step_ms=6.0, source=TokensFrom.GIVEN, **common)
    assert unknown.ttft_ms is None  # no cache: how many sequences is not known


def test_the_decode_model_compiles_inlined_into_a_function_defined_elsewhere():
    """record.sampled_decode compiles a function of its own that calls the example's model:
    Dynamo imports the module the model's globals come from, by name (run42's GPU test failed
    on 'No module named llama_decode')."""
    from fixtures.record import decode_model

    _gen, model, _device = decode_model(1, 128, torch.float32)
    x, pos = torch.tensor([[7]]), torch.tensor([3])
    with torch.no_grad():
        eager = model(x, pos)[:, -1]
        model.setup_caches(1, 256)  # the first call wrote position 3 of the cache: afresh
        compiled = torch.compile(lambda m, x, p: m(x, p)[:, -1], fullgraph=True)(model, x, pos)
    torch.testing.assert_close(compiled, eager)


WARMS_UP = """
import time
import torch
m = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 100))
tok = torch.tensor([[1]])
with torch.no_grad():
    for i in range(40):
        with torch.profiler.record_function("decode"):
            time.sleep(0.6 if i == 0 else 0.01)  # the first token's warm-up (lazy loading, first plans)
            tok = m(tok)[:, -1].argmax(-1, keepdim=True)
"""


def test_a_profile_that_ends_the_script_does_not_read_the_first_tokens_warm_up_as_the_step(tmp_path):
    """tune's profile ends the script once taken (exit_after), so the step's time without the
    profiler comes from the skipped occurrences' pace; the first of them pays the warm-up (run42:
    511 ms a token read for a 5 ms eager decode on the H100). That one is left out."""
    from perfloop.workflows.script import profile_script

    script = tmp_path / "gen.py"
    script.write_text(WARMS_UP)
    for exit_after in (True, False):
        p = profile_script(str(script), [], "decode", skip=None, steps=3, exit_after=exit_after)
        # a token is ~10 ms; the warm-up 600 ms
        assert p.wall_ms_per_call < 200 and p.diagnose().wall_ms < 200, (exit_after, p.wall_ms_per_call)


def test_only_cudas_capture_refusals_are_said_as_a_failed_capture():
    """torch's and CUDA's words for a refused capture; a Dynamo error about graphs is not one."""
    from perfloop.workflows.script import ScriptError

    said = lambda exc: "a CUDA graph capture failed" in str(ScriptError(exc))
    assert said(RuntimeError("CUDA error: operation failed due to a previous error during capture"))
    assert said(RuntimeError("Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture."))
    assert not said(RuntimeError("Dynamo failed to capture the graph: graph break in user code"))
    assert not said(ValueError("stream is capturing"))  # not a RuntimeError: not CUDA's

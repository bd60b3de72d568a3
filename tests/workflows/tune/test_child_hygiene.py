"""perfloop tune's child runs leave the user's program as plain python runs it: the seed
override takes every seed the script's calls take (offset where an offset means something), a
run's processes all end with it, and what the script writes is put back after it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from perfloop.workflows.tune.runner import run_child

STEPS = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(NSTEPS):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

SEEDS = textwrap.dedent(
    """
    import random
    import numpy as np
    import torch

    calls = {
        "random()": lambda: random.seed(),
        "random(a=3)": lambda: random.seed(a=3),
        "random(str)": lambda: random.seed("a string"),
        "random(bytes)": lambda: random.seed(b"bytes"),
        "random(bytearray)": lambda: random.seed(bytearray(b"ba")),
        "random(float)": lambda: random.seed(1.5),
        "random(version=1)": lambda: random.seed("s", version=1),
        "random(tuple)": lambda: random.seed((1, 2)),
        "np(list)": lambda: np.random.seed([1, 2]),
        "np(array)": lambda: np.random.seed(np.array([3, 4], dtype=np.uint32)),
        "np(None)": lambda: np.random.seed(None),
        "np()": lambda: np.random.seed(),
        "np(seed=5)": lambda: np.random.seed(seed=5),
        "np(int64)": lambda: np.random.seed(np.int64(6)),
        "np(-1)": lambda: np.random.seed(-1),
        "np(2**32)": lambda: np.random.seed(2**32),
        "np(float)": lambda: np.random.seed(1.5),
        "np([])": lambda: np.random.seed([]),
        "torch(tensor)": lambda: torch.manual_seed(torch.tensor(7)),
        "torch(int64)": lambda: torch.manual_seed(np.int64(8)),
        "torch(seed=9)": lambda: torch.manual_seed(seed=9),
        "torch(str)": lambda: torch.manual_seed("10"),
        "torch(bad str)": lambda: torch.manual_seed("ten"),
        "torch(-1)": lambda: torch.manual_seed(-1),
        "torch(2**64-1)": lambda: torch.manual_seed(2**64 - 1),
        "torch(2**64)": lambda: torch.manual_seed(2**64),
        "cuda(11)": lambda: torch.cuda.manual_seed(11),
        "cuda_all(12)": lambda: torch.cuda.manual_seed_all(12),
        "default_rng": lambda: np.random.default_rng(13),
        "RandomState": lambda: np.random.RandomState(14),
        "Generator": lambda: torch.Generator().manual_seed(15),
    }
    draws = {}
    for name, call in calls.items():
        try:
            got = call()
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        else:
            outcome = "ok"
            if name.startswith("random"):
                draws[name] = random.random()
            elif name.startswith("np("):
                draws[name] = float(np.random.rand())
            elif name.startswith("torch("):
                draws[name] = float(torch.rand(()))
            elif name in ("default_rng", "RandomState"):
                draws[name] = float(got.random() if name == "default_rng" else got.rand())
        print("OUTCOME", name, "->", outcome)
    print("DRAWS", __import__("json").dumps(draws))
    """
) + STEPS.replace("NSTEPS", "4")


def _spec(script, **kw) -> dict:
    return {"script": str(script), "argv": [], "warmup": 1, "steps": 2, "candidates": []} | kw


def _plain(script, *argv) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *argv], capture_output=True, text=True, cwd=script.parent, timeout=120
    )


def _lines(text: str, tag: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith(tag)]


def _logged(result: dict) -> str:
    with open(result["log"]) as f:
        return f.read()


@pytest.mark.slow
def test_every_seed_plain_python_takes_is_taken_and_offset_where_an_offset_means_something(tmp_path):
    script = tmp_path / "seeds.py"
    script.write_text(SEEDS)
    plain = _plain(script)
    assert plain.returncode == 0, plain.stderr
    got = run_child(_spec(script, seed_offset=1), 120, str(tmp_path))
    assert got["ok"], (got["error"], got.get("traceback"))
    log = _logged(got)
    assert _lines(log, "OUTCOME") == _lines(plain.stdout, "OUTCOME")  # same acceptance, same errors
    offset = json.loads(_lines(log, "DRAWS")[0][len("DRAWS ") :])
    same = json.loads(_lines(plain.stdout, "DRAWS")[0][len("DRAWS ") :])
    assert offset.keys() == same.keys()
    moved = {k for k in offset if offset[k] != same[k]}
    # an entropy seed (no argument, None) cannot be offset: its draws differ run to run anyway
    meaningful = set(offset) - {"random()", "np(None)", "np()", "RandomState"}
    assert meaningful <= moved, meaningful - moved


def tune(folder, *args, timeout=600):
    db = os.path.join(os.path.dirname(folder), "tune.sqlite")
    p = subprocess.run(
        [sys.executable, "-m", "perfloop", "tune", "--db", db, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=folder,
    )
    return p.returncode, p.stdout, p.stderr


QUICK = ("--budget", "3m", "--steps", "3", "--warmup", "1", "--rounds", "1", "--try", "fused-optimizer")


@pytest.mark.slow
def test_a_failed_run_at_another_seed_is_said_never_read_as_no_spread(tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    # fails only where its seed is shifted: the loss check has no seed spread to read
    (folder / "train.py").write_text(
        "import torch\ntorch.manual_seed(0)\n"
        "if abs(torch.rand(()).item() - 0.4963) > 1e-3:\n    raise RuntimeError('not my seed')\n"
        + STEPS.replace("NSTEPS", "20")
    )
    rc, out, err = tune(folder, *QUICK, "--script", "train.py")
    assert rc == 2, out
    assert "another seed" in err and "RuntimeError: not my seed" in err, err
    assert "ends 0 apart" not in out


def _gone(pid: int) -> bool:
    """pid has ended (a zombie waiting for init to reap it has ended too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _pids(log: str, tag: str) -> list[int]:
    return [int(x.split()[1]) for x in _lines(log, tag)]


SLEEPER = textwrap.dedent(
    """
    import subprocess, sys, time
    sleeper = subprocess.Popen(["sleep", "600"])
    print("SLEEPER", sleeper.pid, flush=True)
    if sys.argv[1:] == ["hang"]:
        time.sleep(600)
    """
) + STEPS.replace("NSTEPS", "20")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hang", "steps"])
def test_a_run_ends_with_every_process_the_script_started(tmp_path, how):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    got = run_child(_spec(script, argv=[how]), 20 if how == "hang" else 120, str(tmp_path))
    [pid] = _pids(_logged(got), "SLEEPER")
    assert _gone(pid), f"the script's subprocess {pid} outlived the run ({how})"
    if how == "hang":
        assert not got["ok"] and got["cut"] and got["error"].startswith("cut by the budget after")
    else:
        assert got["ok"] and got["ended"] == "steps taken", got


LOADER = textwrap.dedent(
    """
    import os
    import torch
    from torch.utils.data import DataLoader, Dataset

    told = []

    class Data(Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            if not told:  # once in each worker
                told.append(print("WORKER", os.getpid(), flush=True))
            g = torch.Generator().manual_seed(i)
            return torch.randn(4, generator=g), torch.randn(1, generator=g)

    if __name__ == "__main__":
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(Data(), batch_size=4, num_workers=2, pin_memory=True, shuffle=True)
        for x, y in loader:
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("seed_offset", [0, 1])
def test_a_dataloader_with_workers_is_ended_early_as_steps_taken_and_its_workers_with_it(
    tmp_path, seed_offset
):
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    got = run_child(_spec(script, seed_offset=seed_offset), 120, str(tmp_path))
    assert got["ok"] and got["ended"] == "steps taken", (got["error"], got.get("traceback"))
    assert len(got["losses"]) == 3
    workers = set(_pids(_logged(got), "WORKER"))
    assert workers and all(_gone(p) for p in workers), workers


@pytest.mark.slow
def test_a_script_that_fails_is_named_by_its_own_error_and_where_its_output_is(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', type=float)\n"
        "args = p.parse_args()\ncfg = {}\n" + STEPS.replace("NSTEPS", "100") + "    if step == 12:\n"
        "        print(cfg['lr_decay'])\n"
    )
    got = run_child(_spec(script, argv=["--bogus"]), 120, str(tmp_path))
    assert not got["ok"] and "sys.exit(2)" in got["error"], got["error"]
    assert "error: unrecognized arguments: --bogus" in got["error"] and got["log"] in got["error"]
    got = run_child(_spec(script, steps=100), 120, str(tmp_path))
    line = script.read_text().splitlines().index("        print(cfg['lr_decay'])") + 1
    assert not got["ok"] and f"KeyError: 'lr_decay' (at train.py:{line})" in got["error"], got["error"]
    assert got["log"] in got["error"]


KEEPER = textwrap.dedent(
    """
    import os
    import sys
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    ckpt = os.path.join(here, "ckpt.pt")
    steps = int(sys.argv[1]) if sys.argv[1:] else 10**6
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    os.makedirs("out", exist_ok=True)
    for step in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 2 == 1 or step == steps - 1:
            torch.save({"step": step, "model": model.state_dict()}, ckpt)
            assert torch.load(ckpt)["step"] == step  # what it wrote, read back in its own run
            with open("train.log", "a") as f:
                f.write(f"step {step} loss {loss.item():.4f}\\n")
            with open(os.path.join("out", f"step-{step}.txt"), "w") as f:
                f.write("kept\\n")
    """
)


def _tree(folder) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(top, n), folder): open(os.path.join(top, n), "rb").read()
        for top, _, names in os.walk(folder)
        for n in names
    }


@pytest.mark.slow
def test_the_files_a_script_writes_are_byte_identical_after_tune(tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "train.py").write_text(KEEPER)
    plain = _plain(folder / "train.py", "200")  # the user's own run: its checkpoint and its log
    assert plain.returncode == 0, plain.stderr
    before = _tree(folder)
    stats = {p: os.stat(folder / p).st_mtime_ns for p in before}
    rc, out, err = tune(folder, *QUICK, "--script", "train.py")
    assert rc == 0, err
    assert _tree(folder) == before  # the step-199 checkpoint, the log's 100 lines, no step-3 file
    assert {p: os.stat(folder / p).st_mtime_ns for p in before} == stats
    assert "could not put back" not in err


SHARED_WRITER = """
import subprocess, sys
import torch
m = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(8):
    if step == 1:  # past Python's open: in the temp folder (anyone's), and in the script's own
        subprocess.run(["sh", "-c", f"echo x > {sys.argv[1]}; echo x > {sys.argv[2]}"], check=True)
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_change_past_the_hooks_is_said_in_the_scripts_folder_not_in_the_shared_temp_folder(
    tmp_path, monkeypatch, capfd
):
    """H7's gpt-fast run with the cwd at /tmp: other programs' files there were said as the
    script's; the temp folder is not compared, the script's own folder still is."""
    import tempfile

    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "train.py").write_text(SHARED_WRITER)
    shared = os.path.join(tempfile.gettempdir(), f"perfloop-test-shared-{os.getpid()}.txt")
    mine = folder / "made-by-a-subprocess.txt"
    monkeypatch.chdir(tempfile.gettempdir())
    try:
        got = run_child(_spec(folder / "train.py", argv=[shared, str(mine)]), 120, str(tmp_path))
        err = capfd.readouterr().err
    finally:
        if os.path.exists(shared):
            os.remove(shared)
    assert got["ok"], _logged(got)
    assert "could not put back" in err and str(mine) in err, err
    assert shared not in err, err


DROPS_OUT = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.drop = torch.nn.Dropout(0.5)
        self.attn_dropout = 0.5  # nanoGPT's way: a float handed to a functional call
    def forward(self, x):
        h = self.drop(self.lin(x))
        return F.dropout(h, p=self.attn_dropout, training=self.training), h
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x = torch.randn(32, 64)
for step in range(40):
    out, h = net(x)
    dropped = [(t == 0).float().mean().item() for t in (h, out)]
    print(f"ZEROS {step} {dropped[0]:.2f} {dropped[1]:.2f}", flush=True)
    out.pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_search_run_checks_with_dropout_off_then_times_the_script_as_written(tmp_path):
    """The check steps run with the model's dropout off (its modules' and its functional
    calls'); from there the script's dropout is back for the warm-up and the timed steps."""
    script = tmp_path / "train.py"
    script.write_text(DROPS_OUT)
    got = run_child(_spec(script, warmup=2, steps=4, dropout="off", check_steps=5), 120, str(tmp_path))
    assert got["ok"] and got["dropout_seen"], got.get("error")
    assert got["timed_from"] == 7 and len(got["step_ms"]) == 10 and len(got["losses"]) == 5
    zeros = {
        int(s): (float(a), float(b)) for _, s, a, b in (x.split() for x in _lines(_logged(got), "ZEROS"))
    }
    assert all(zeros[s] == (0.0, 0.0) for s in range(5)), zeros  # checked: no dropout at all
    assert all(zeros[s][0] > 0.3 and zeros[s][1] > 0.6 for s in range(5, 11)), zeros  # as written


SITES_MODEL = """
import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        return self.lin(x)
"""

SITES_TRAIN = """
import torch
from model import Net

torch.manual_seed(0)
net = Net()
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
def step(x):
    loss = net(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
for i in range(20):
    step(torch.randn(4, 8))
"""


def test_the_lines_to_add_name_the_scripts_own_lines(tmp_path):
    """The model's class lives in model.py (as nanoGPT's does); the script builds it at line 6,
    its optimizer at line 7, and calls it at line 9: the lines to add say so, with the text."""
    from perfloop.workflows.tune.trials import Trial
    from perfloop.workflows.tune.tuner import lines_to_add

    (tmp_path / "model.py").write_text(SITES_MODEL)
    script = tmp_path / "train.py"
    script.write_text(SITES_TRAIN)
    got = run_child(_spec(script, sites=True), 120, str(tmp_path))
    assert got["ok"], got.get("error")
    at = {k: (v["line"], v["text"]) for k, v in got["sites"].items()}
    assert at == {
        "model": (6, "net = Net()"),
        "optimizer": (7, "opt = torch.optim.AdamW(net.parameters(), lr=1e-3)"),
        "call": (9, "loss = net(x).pow(2).mean()"),
    }, at
    lines = lines_to_add(Trial(("fused-optimizer", "compile")), got["sites"])
    assert "# at train.py:7 builds the optimizer: opt = torch.optim.AdamW(net.parameters(), lr=1e-3)" in lines
    assert "# at train.py:6 builds the model: net = Net()" in lines
    assert run_child(_spec(script), 120, str(tmp_path))["sites"] == {}  # asked for in one run only


def test_the_site_hooks_come_off_once_every_site_wanted_is_found():
    import torch

    from perfloop.workflows.tune.sites import Site, Sites

    inits = (torch.nn.Module.__init__, torch.optim.Optimizer.__init__)
    s = Sites(frozenset({Site.MODEL, Site.OPTIMIZER}))
    s.hook()
    try:
        lin = torch.nn.Linear(2, 2)  # built here, in this file
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        assert torch.nn.Module.__init__ is not inits[0]
        s.saw(Site.MODEL, lin)
        assert torch.nn.Module.__init__ is not inits[0]  # the optimizer is still wanted
        s.saw(Site.OPTIMIZER, opt)
        assert (torch.nn.Module.__init__, torch.optim.Optimizer.__init__) == inits
        assert set(s.readings()) == {"model", "optimizer"}
    finally:
        s.unhook()


def test_an_optimizer_a_library_builds_has_no_site_in_the_users_code(tmp_path):
    """A Trainer builds its optimizer inside its own code: the user's line there is
    `trainer.train()`, not one to add fused=True to, so no site is said; one built by the
    user's own helper in another of their files is found there (nanoGPT's model.py)."""
    import importlib.util

    import torch

    from perfloop.workflows.tune.sites import Site, Sites

    def load(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    text = "import torch\ndef build(params):\n    return torch.optim.SGD(params, lr=0.1)\n"
    lib = load(tmp_path / "site-packages" / "trainerlib.py", text)
    mine = load(tmp_path / "project" / "helpers.py", text)
    lin = torch.nn.Linear(2, 2)
    for module, where in ((lib, None), (mine, (str(tmp_path / "project" / "helpers.py"), 3))):
        s = Sites(frozenset({Site.OPTIMIZER}))
        s.hook()
        try:
            opt = module.build(lin.parameters())
            s.saw(Site.OPTIMIZER, opt)
        finally:
            s.unhook()
        got = s.readings().get("optimizer")
        assert (got and (got["file"], got["line"])) == (where or None), got

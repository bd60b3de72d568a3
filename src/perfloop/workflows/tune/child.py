"""The process perfloop tune runs a script in: `python -m perfloop.workflows.tune.child SPEC`.

One run of the user's unchanged script with some candidates applied (`mode: run`), or its
profile and diagnosis (`mode: profile`), written as JSON to the spec's `out` whatever happens.
A run times each step of the script's first optimizer to step (device events on a GPU, the
clock on the CPU, read once at the end: no sync between steps), records the loss each step
backpropagates (kept on the device, read at the end), overrides the script's seeds by the
spec's offset (torch, CUDA, random, NumPy), and ends the script once `warmup + steps` steps are
taken. A generation script (the spec's `range`: a record_function or pl.annotate range, one
token's call) is timed by that range's occurrences instead, and checked on its logits: each
model call's greedy tokens and top logits (workflows.tune.logits). A process per run: no
candidate's settings, compiled graphs or patches reach another's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from types import SimpleNamespace

from perfloop.workflows.tune.sites import Site, Sites
from perfloop.workflows.tune.spec import RunSpec


class _Done(BaseException):
    """The steps are taken: the script ends here (its except Exception blocks do not catch it)."""


class _CandidateFailed(BaseException):
    def __init__(self, name: str, exc: BaseException):
        super().__init__(f"{name}: {type(exc).__name__}: {exc}")
        self.name = name


class Child:
    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.notes: list[str] = []
        self.on_first_model: list[tuple[int, str, object]] = []
        self.marks: list = []  # per step of the first optimizer: a CUDA event or a clock reading
        self.host_marks: list[float] = []
        self.losses: list = []  # (step index, the loss tensor)
        self.logits = None  # a generation run: its model calls' choices (a LogitsRecord)
        self.call_tokens = 0  # the tokens the model's last call picked (a decode call's: its batch)
        self.optimizer = None
        self.current = ""  # the candidate whose apply() runs now
        self.dropout_seen = False
        # with `dropout: off`, the first check_steps run with dropout off (their losses are
        # checked), then the script's dropout is put back and the warm-up and timed steps follow
        self.check_steps = spec.checked_steps
        self._dropout_back = None
        self.sites = None  # with the spec's `sites`: where the script builds and calls its model
        self.t0 = time.perf_counter()
        self.setup_s: dict[str, float] = {}

    def note(self, text: str) -> None:
        self.notes.append(text)

    def on_model(self, fn, order: int = 50) -> None:
        """Call fn(model, args, kwargs) at the first call of the script's first module with
        parameters (its model), before that call runs; lower `order` first."""
        self.on_first_model.append((order, self.current, fn))

    # ---- what every run does around the script
    def _override_seeds(self) -> None:
        import torch

        from perfloop.workflows.tune.seeds import offset_seeds

        offset = int(self.spec.seed_offset)
        if offset:
            offset_seeds(offset)
            torch.manual_seed(0)  # a script that never seeds still runs under this offset

    def _record_losses(self) -> None:
        import torch

        backward = torch.Tensor.backward
        child = self

        def recorded(self, *args, **kwargs):
            if self.numel() == 1 and self.is_floating_point():
                child.losses.append((len(child.marks), self.detach().float().reshape(()).clone()))
            return backward(self, *args, **kwargs)

        torch.Tensor.backward = recorded

    def _mark(self) -> None:
        """A step ended: its mark (a CUDA event, or the clock); the run ends at the last one."""
        import torch

        if torch.cuda.is_available():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        self.host_marks.append(time.perf_counter())
        if len(self.marks) == self.check_steps and self._dropout_back is not None:
            self._dropout_back()  # the checked steps are taken: the script's dropout, as written
            self._dropout_back = None
        if len(self.marks) >= self.check_steps + self.spec.warmup + self.spec.steps:
            raise _Done

    def _time_steps(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def after_step(optimizer, args, kwargs) -> None:
            if self.optimizer is None:
                self.optimizer = optimizer
                if self.sites is not None:
                    self.sites.saw(Site.OPTIMIZER, optimizer)
            if optimizer is self.optimizer:
                self._mark()

        register_optimizer_step_post_hook(after_step)

    def _time_ranges(self, name: str) -> None:
        """Each end of the range `name` (record_function, torch.profiler's numbered steps, or
        pl.annotate) is a step's end; for MODEL_CALL, each decode call's (_time_model_calls)."""
        import torch

        from perfloop.analysis import annotate
        from perfloop.workflows.step_sources import MODEL_CALL, NUMBERED

        if name == MODEL_CALL:
            self._time_model_calls()
            return

        rf = torch.autograd.profiler.record_function
        rf_exit = rf.__exit__

        def __exit__(r, *exc):
            out = rf_exit(r, *exc)
            if exc[0] is None and NUMBERED.sub("", r.name) == name and not annotate.annotating():
                self._mark()
            return out

        def exit(ended: str) -> None:
            if ended == name:
                self._mark()

        rf.__exit__ = __exit__
        annotate.RANGE_WATCHERS.append(SimpleNamespace(enter=lambda _name: None, exit=exit))

    def _time_model_calls(self) -> None:
        """A generation script with no range: the end of each decode call of its model (one
        token per sequence, under no_grad; step_sources.ModelCalls, as profile reads it) is a
        step's end. The prompt's prefill is no step; the model is the decode-calling one with the
        most parameters."""
        from perfloop.workflows.step_sources import ModelCalls

        warm = max(self.spec.warmup, 1)  # a larger model takes over within the untimed steps
        ModelCalls(begin=lambda: None, end=self._mark, switchable=lambda: len(self.marks) < warm).hook()

    def _record_tokens(self, model, args, kwargs) -> None:
        """Each call of the model: its logits' greedy tokens, top logits and scale, wherever its
        output holds them (workflows.tune.logits), kept on the device until the end."""
        from perfloop.workflows.tune.logits import LogitsRecord

        self.logits = LogitsRecord()

        def greedy(module, inputs, out) -> None:
            self.call_tokens = self.logits.add(out) or self.call_tokens

        model.register_forward_hook(greedy)

    def _dropout(self) -> None:
        """Say whether the model drops out in training (its loss then differs run to run by
        design where a candidate draws its masks otherwise, as compiled code does); with the
        spec's `dropout: off`, turn it off, for a loss check that compares the same function."""
        import torch

        off = self.spec.dropout == "off"
        was: list[tuple[object, str, float]] = []  # (module, attribute, its value as written)
        F, dropout = torch.nn.functional, torch.nn.functional.dropout

        def read(model, args, kwargs) -> None:
            for m in model.modules():
                for name, value in vars(m).items():
                    if "dropout" in name.lower() and isinstance(value, float) and value > 0:
                        self.dropout_seen = True
                        if off:
                            was.append((m, name, value))
                            setattr(m, name, 0.0)  # nanoGPT's `dropout_p=self.dropout`
                if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
                    self.dropout_seen = True
                    if off:
                        was.append((m, "p", m.p))
                        m.p = 0.0

        def back() -> None:
            for m, name, value in was:
                setattr(m, name, value)
            F.dropout = dropout

        self.on_first_model.append((0, "", read))
        if off:
            F.dropout = lambda input, p=0.5, training=True, inplace=False: input
            if self.check_steps:
                self._dropout_back = back

    def _saw_model(self, model, args, kwargs) -> None:
        self.sites.saw(Site.MODEL, model)
        self.sites.saw(Site.CALL)

    def _hook_model(self) -> None:
        """Run the first-model hooks at the first call of a module with parameters, with that
        call's own arguments and keywords (a Hugging Face model is called by keywords only).
        `Module.__call__` is wrapped until then, not a global forward pre-hook: those are given
        no keywords, and torch.compile(model) warns while any is registered."""
        if not self.on_first_model:
            return
        import torch

        module_call = torch.nn.Module.__call__
        fired = []

        def first_call(module, *args, **kwargs):
            if fired or next(module.parameters(), None) is None:
                return module_call(module, *args, **kwargs)
            # a compiled step's first call of its model runs eager (a graph break), not traced
            return (untraced if torch.compiler.is_compiling() else run_hooks)(module, args, kwargs)

        def run_hooks(module, args, kwargs):
            fired.append(module)
            if torch.nn.Module.__call__ is first_call:
                torch.nn.Module.__call__ = module_call
            for _, name, fn in sorted(self.on_first_model, key=lambda t: t[0]):
                started = time.perf_counter()
                try:
                    fn(module, args, kwargs)
                except Exception as exc:
                    raise _CandidateFailed(name, exc) from exc
                if name:  # what the candidate's own work on the model took (pl.patch's checks, builds)
                    self.setup_s[name] = self.setup_s.get(name, 0.0) + time.perf_counter() - started
            return module_call(module, *args, **kwargs)

        untraced = torch.compiler.disable(run_hooks)
        torch.nn.Module.__call__ = first_call

    # ---- the run
    def run(self) -> dict:
        from perfloop.workflows.tune.candidates import get

        out: dict = {"ok": False, "error": None, "failed_candidate": None, "ended": None}
        self._override_seeds()
        self._record_losses()
        if self.spec.range:
            self._time_ranges(self.spec.range)
            self.on_first_model.append((100, "", self._record_tokens))  # after the candidates
        else:
            self._time_steps()
        for name in self.spec.candidates:
            self.current = name
            try:
                get(name).apply(self)
            except Exception as exc:
                out.update(error=f"{name}: {type(exc).__name__}: {exc}", failed_candidate=name)
                return out | self._readings()
        self.current = ""
        self._dropout()
        if self.spec.sites:
            wanted = {Site.MODEL, Site.CALL} | (set() if self.spec.range else {Site.OPTIMIZER})
            self.sites = Sites(frozenset(wanted))
            self.sites.hook()
            self.on_first_model.append((0, "", self._saw_model))
        self._hook_model()
        try:
            _run_script(self.spec.script, self.spec.argv)
            out["ended"] = "script ended"
        except _Done:
            out["ended"] = "steps taken"
        except _CandidateFailed as exc:
            out.update(error=str(exc), failed_candidate=exc.name)
        except BaseException as exc:  # the script's own error: reported, the others go on
            out.update(_script_end(exc, self.spec.script))
        out["ok"] = out["error"] is None
        return out | self._readings()

    def _readings(self) -> dict:
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            step_ms = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
            peak_mb = torch.cuda.max_memory_allocated() / 2**20
        else:
            import resource

            step_ms = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        per_step: dict[int, list[float]] = {}
        for step, loss in self.losses:
            per_step.setdefault(step, []).append(float(loss))
        # with checked steps, theirs only: the later ones drop out as written
        kept = sorted((s, v) for s, v in per_step.items() if not self.check_steps or s < self.check_steps)
        losses = [sum(v) / len(v) for _, v in kept]
        warm = self.check_steps + self.spec.warmup
        return {
            "step_ms": step_ms,  # step i -> i+1; the first `warmup` of them include compiling
            "timed_from": warm,  # step_ms[timed_from:]: the timed steps (after checks and warm-up)
            "losses": losses,  # the mean loss backpropagated in each step, from the first
            # a generation run's: each position's greedy token ("tokens"), top logits, ...
            **(self.logits.readings() if self.logits else {"tokens": []}),
            "tokens_per_step": self.call_tokens or None,  # a generation step's (its last call's)
            "peak_mb": peak_mb,
            "first_step_s": (self.host_marks[0] - self.t0) if self.host_marks else None,
            "warm_s": (self.host_marks[min(warm, len(self.host_marks)) - 1] - self.t0)
            if self.host_marks
            else None,
            "setup_s": self.setup_s,  # candidate -> seconds its work on the model took
            "builds_s": _builds_s(),  # of which C++ builds: a later run on this machine skips them
            "steps_seen": len(self.marks),
            "dropout_seen": self.dropout_seen,
            "dropout": self.spec.dropout,
            "check_steps": self.check_steps,  # steps with dropout off, before the timed ones
            "device": "cuda" if cuda else "cpu",
            "notes": self.notes,
            "sites": self.sites.readings() if self.sites is not None else {},
        }


def _builds_s() -> float:
    """Seconds this run waited for perfloop's C++ Functions to compile (0 where none did)."""
    native = sys.modules.get("perfloop.ops.native")
    return native.build_seconds() if native is not None else 0.0


def _script_end(exc: BaseException, script: str) -> dict:
    """How the script ended: by tune's _Done, also beneath an error raised while it unwound (a
    DataLoader's workers shut down, a finally block: no error plain python would have met), by
    a clean exit, or by its own error, named with where it was raised."""
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        if isinstance(e, _Done):
            return {"ended": "steps taken"}
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if isinstance(exc, SystemExit):
        if exc.code in (None, 0):
            return {"ended": "script ended"}
        return {"error": f"the script exited with sys.exit({exc.code!r})"}
    return {
        "error": f"the script raised {type(exc).__name__}: {exc} (at {_where(exc, script)})",
        "traceback": "".join(traceback.format_exception(exc, limit=-8)),
    }


def _where(exc: BaseException, script: str) -> str:
    """file:line of the innermost frame in the script's folder (its own code), else innermost."""
    frames = traceback.extract_tb(exc.__traceback__)
    folder = os.path.dirname(os.path.abspath(script)) + os.sep
    own = [
        f
        for f in frames
        if os.path.abspath(f.filename).startswith(folder) and "site-packages" not in f.filename
    ]
    own = own or frames
    if not own:
        return os.path.basename(script)
    f = own[-1]
    path = os.path.abspath(f.filename)
    return f"{path[len(folder) :] if path.startswith(folder) else path}:{f.lineno}"


def _run_script(path: str, argv: list[str]) -> None:
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")


def profile(spec: RunSpec) -> dict:
    """The script's profile (perfloop profile --script's window) and its diagnosis."""
    from perfloop.workflows.script import AUTO, ScriptError, profile_script

    try:
        p = profile_script(
            spec.script,
            spec.argv,
            spec.range or AUTO,
            skip=None,
            steps=spec.steps,
            exit_after=True,
        )
    except ScriptError as exc:  # a profile taken before the script failed still serves
        if exc.profile is None:
            return {"ok": False, "error": str(exc)}
        p = exc.profile
    except (OSError, ValueError) as exc:
        return {"ok": False, "error": str(exc)}
    d = p.diagnose()
    return {
        "ok": True,
        "error": None,
        "findings": [f.to_dict() for f in d.findings],
        "diagnosis": str(d),
        "wall_ms": d.wall_ms,
        "device_ms": d.device_ms,
        "busy_share": d.busy_share,
        "sites": bool(p.sites),
        "warnings": list(p.warnings),
        "step": p.step,  # what a step was: optimizer.step, a range, or step_sources.MODEL_CALL
    }


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        if spec.get("keep"):
            from perfloop.workflows.tune.scratch import keep

            keep(**spec["keep"])
        run = RunSpec.of(spec)
        out = profile(run) if run.mode == "profile" else Child(run).run()
    except BaseException as exc:  # perfloop's own failure: said, never a silent empty result
        out = {"ok": False, "error": f"perfloop tune's runner failed: {type(exc).__name__}: {exc}"}
        out["traceback"] = traceback.format_exc()
    with open(spec["out"], "w") as f:
        json.dump(out, f, default=str)
    sys.stdout.flush()
    os._exit(0)  # the script's threads and atexit handlers are not waited for


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

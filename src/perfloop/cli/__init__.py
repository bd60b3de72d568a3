"""The `perfloop` command: one module per verb, each registering its flags and its `run`.
Every verb has --help; --json where a program reads the output.

Exit codes: 0 success, 1 a check or a regression failed, 2 a usage error, 3 a comparison that
cannot be judged under --strict. Settings committed in `[tool.perfloop]` (perfloop.settings)
are the defaults; a flag on the command line overrides them.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

from perfloop import __version__
from perfloop.cli import notes
from perfloop.cli.args import USAGE_ERROR, UsageError

VERBS = (
    "env",
    "list",
    "check",
    "bench",
    "profile",
    "asm",
    "sweep",
    "report",
    "history",
    "runs",
    "bisect",
    "compare",
    "comm",
    "demo",
    "experiment",
    "tune",
    "completion",
)


EPILOG = """exit status:
  0    success
  1    a check failed, a regression was found (compare --fail-above), or the script failed
  2    a usage error: a bad argument, named, with how to fix it
  3    compare --strict: a row could not be judged (the reason is said)
  130  interrupted (Ctrl-C); what was measured before is kept
  profile --script passes the script's own exit status through, as python would

environment:
  PERFLOOP_DB       the results database: --db wins over it, it wins over
                    [tool.perfloop] db; default: the user data dir
  PERFLOOP_CACHE    where measured ceilings and built kernels are cached
  PERFLOOP_NATIVE   0 turns off the fused ops' C++ autograd path
  PERFLOOP_VERBOSE  1 also shows torch's and Triton's own deprecation notices
  TRITON_INTERPRET  1 runs Triton kernels on the CPU (set by perfloop where no GPU is)

settings: [tool.perfloop] in the nearest pyproject.toml (db, threshold, budget, strict)
"""


def _prepare_triton() -> None:
    # Without a GPU, Triton kernels can only run in its interpreter, and the switch
    # must be set before Triton is imported. Say so rather than fail.
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"


KERNEL_VERBS = ("env", "list", "check", "bench", "profile", "asm", "sweep", "demo", "experiment")


def runs_own_kernels(args) -> bool:
    """Whether the command runs perfloop's Triton kernels (on a CPU: in Triton's interpreter, set
    for it); a user's script (`profile --script`) or command (`bisect`) runs in the environment
    it was given."""
    return args.verb in KERNEL_VERBS and not (
        getattr(args, "script", None) or getattr(args, "trace_file", None)
    )


def build_parser(settings=None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="perfloop",
        description="GPU performance engineering in PyTorch: measure, locate, fix, measure again.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("-V", "--version", action="version", version=f"perfloop {__version__}")
    sub = ap.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name, help_, fn, db=False, js=True):
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn)
        if js:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        if db:
            p.add_argument("--db", help="results database (default: $PERFLOOP_DB or the user data dir)")
        return p

    for name in VERBS:
        importlib.import_module(f"perfloop.cli.{name}").register(verb)
    if settings is not None:
        _settings_as_defaults(sub, settings)
    return ap


def _settings_as_defaults(sub, settings) -> None:
    """[tool.perfloop]'s values as each verb's defaults, so a flag given still wins ($PERFLOOP_DB
    too, over the file's db)."""
    given = {
        "db": None if os.environ.get("PERFLOOP_DB") else settings.db,
        "fail_above": None if settings.threshold is None else f"{settings.threshold:g}",
        "budget": settings.budget,
        "strict": settings.strict or None,
    }
    for p in sub.choices.values():
        dests = {a.dest for a in p._actions}
        p.set_defaults(**{k: v for k, v in given.items() if v is not None and k in dests})


def _refuse_empty(ap: argparse.ArgumentParser, args) -> None:
    """An option given an empty value (`--html ''`, `--shape ''`) is an error naming it, not
    taken as "not given"."""
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices[args.verb]
    for action in sub._actions:
        if action.option_strings and action.default is None and getattr(args, action.dest, None) == "":
            sub.error(f"{action.option_strings[-1]}: an empty value; give one, or leave the option out")


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """`profile --script PATH ARGS...` (or `--script=PATH`): everything after the script's path is
    the script's, as `python PATH ARGS...` would give it; `profile --script PATH OPTIONS -- ARGS`:
    the options before `--` are perfloop's."""
    if argv[:1] == ["bisect"]:  # `bisect GOOD BAD [OPTIONS] -- COMMAND ...`
        return (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    if argv[:1] not in (["profile"], ["tune"]):
        return argv, []
    for i, a in enumerate(argv):
        if a == "--script" or a.startswith("--script="):
            end = i + (1 if "=" in a else 2)
            mine, rest = argv[:end], argv[end:]
            if "--" in rest:
                cut = rest.index("--")
                return mine + rest[:cut], rest[cut + 1 :]
            return mine, rest
        if a == "--":
            break
    return argv, []


def main(argv: list[str] | None = None) -> int:
    from perfloop.settings import SettingsError, load

    try:
        settings = load()
    except SettingsError as exc:
        print(f"perfloop: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    ap = build_parser(settings)
    argv, script_args = _split_script_args([*(sys.argv[1:] if argv is None else argv)])
    args = ap.parse_args(argv)  # unknown verbs/flags: usage + the choices, exit 2
    _refuse_empty(ap, args)
    args.script_args = script_args
    for name in ("calls", "top", "seeds"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            ap.error(f"--{name}: must be >= 1")
    budget = getattr(args, "budget", 1.0)
    if not (math.isfinite(budget) and budget > 0):
        ap.error(f"--budget: must be a finite number of seconds > 0, got {budget}")
    if runs_own_kernels(args):
        _prepare_triton()
    try:
        with notes.recording(getattr(args, "script", None)) as seen:
            try:
                return args.fn(args)
            finally:
                notes.say(seen)
    except UsageError as exc:
        print(f"perfloop {args.verb}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("interrupted: results already stored are kept", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `perfloop runs --json | head`: the reader left; quiet, as cat is
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit must not raise again
        return 0


if __name__ == "__main__":
    sys.exit(main())

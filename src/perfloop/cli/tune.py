"""`perfloop tune --script train.py [its arguments]`: every fix the diagnosis advises tried on
the unchanged script, each checked on the loss against the script's own spread, timed
interleaved with the baseline; the winners combined, the lines to add printed."""

from __future__ import annotations

import os

from perfloop.cli.args import UsageError, open_store, start_run
from perfloop.cli.output import console, emit_json

# a candidate's one search run of 2 steps against the baseline's three runs (6 steps): Mann-
# Whitney's smallest two-sided p is 0.071 there; 3 steps against 9 reach 0.009
MIN_STEPS = 3


def register(verb) -> None:
    p = verb(
        "tune",
        "try every advised fix on your unchanged script (TF32, fused optimizer, pl.patch, "
        "torch.compile modes, channels_last, ...), check the loss, keep what is faster",
        run,
        db=True,
    )
    p.add_argument(
        "--script",
        required=True,
        help="the training script, run unchanged (in child processes); everything after its path goes to it",
    )
    p.add_argument(
        "--budget",
        dest="tune_budget",
        default="10m",
        help="wall time for the whole tune: 600, 90s, 10m, 1h (default 10m); "
        "runs that do not fit are not started",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=20,
        help="steps timed per run, after the warm-up: optimizer steps, or --range occurrences (default 20, "
        "at least 3)",
    )
    p.add_argument(
        "--range",
        metavar="NAME",
        help="a generation script: a step is one occurrence of this range (record_function or "
        "pl.annotate around one token's call), and each candidate is checked on the greedy tokens "
        "(the argmax of the model's outputs) instead of a loss; without it, a script with no "
        "optimizer is stepped so by its model's decode calls",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="steps run first and not timed (compiling happens there; default 5)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each candidate, interleaved with the baseline (default 2)",
    )
    p.add_argument(
        "--try",
        dest="tried",
        action="append",
        metavar="NAME",
        help=f"try this candidate (repeatable), advised or not: {TRY_NAMES}, or package.module:NAME for your "
        "own; default: what the diagnosis advises, and compile",
    )
    p.add_argument(
        "--allow-numerics",
        action="store_true",
        help="also try what changes the model's numerics beyond low bits (autocast to bf16)",
    )


# the candidates' names as their registry lists them (workflows.tune.candidates.CANDIDATES;
# a test holds the two together): written out, since importing it loads numpy on every --help
TRY_NAMES = (
    "tf32, fused-optimizer, patch, channels-last, cudnn-benchmark, pinned-memory, sdpa-no-cudnn, compile, "
    "compile-reduce-overhead, compile-max-autotune, autocast-bf16, bf16-weights"
)


def parse_budget(text: str) -> float:
    from perfloop.errors import ArgumentError
    from perfloop.workflows.tune import budget_seconds

    try:
        return budget_seconds(text)
    except ArgumentError as exc:
        raise UsageError(f"--budget: {exc.detail}") from None


def run(args) -> int:
    from perfloop.workflows.tune.tuner import Options, tune

    if not os.path.isfile(args.script):
        raise UsageError(f"--script: {args.script} is not a file; give the path of the training script")
    if args.steps < MIN_STEPS:
        raise UsageError(
            f"--steps: {args.steps} steps a run cannot tell a speed-up at 95%; give {MIN_STEPS} or more "
            "(one search run's steps against the baseline's)"
        )
    if args.rounds < 1:
        raise UsageError(f"--rounds: must be >= 1, got {args.rounds}")
    if args.warmup < 0:
        raise UsageError(f"--warmup: must be >= 0, got {args.warmup}")
    opts = Options(
        script=args.script,
        argv=list(args.script_args or []),
        budget_s=parse_budget(args.tune_budget),
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        tried=args.tried,
        allow_numerics=args.allow_numerics,
        range=args.range,
    )
    if opts.tried:
        from perfloop.workflows.tune.candidates import get

        for name in opts.tried:
            try:
                get(name)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    store = open_store(args)
    err = console(True)
    say = lambda line: err.print(f"tune: {line}", markup=False)  # on stderr: --json's stdout stays JSON
    try:
        result = tune(opts, say)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from perfloop.workflows.tune.report import payload, text

    data = payload(result)
    run_id = _store(store, result, data)
    if args.json:
        emit_json(data | {"run_id": run_id})
    else:
        out = console()
        for line in text(result):
            out.print(line, markup=False, highlight=False)
        out.print(f"stored as run {run_id}")
    return 130 if result.stopped == "interrupted" else 0  # what was measured is printed and stored


def _store(store, result, data: dict) -> str:
    """Each timed trial as a row (its steady step times), the whole tune as an artifact."""
    from perfloop.device import env_fingerprint
    from perfloop.harness.measurement import Measurement

    run_id = start_run(store)
    name = f"tune:{os.path.basename(result.script)}"
    store.add_artifact(run_id, "tune", data, op=name, variant="tune")
    env = env_fingerprint()
    for t in result.trials:
        samples = [s for s in t.samples(data["warmup"]) if s > 0]
        if len(samples) >= 2:
            m = Measurement(samples_ms=tuple(samples), label=t.label, env=env)
            store.add(run_id, m, op=name, variant=t.label, shape=(), dtype="")
    return run_id

"""`perfloop bisect GOOD BAD -- COMMAND`: the commit between GOOD and BAD that made COMMAND slower,
named from timings of it at the commits in between; or `--key KEY` to take GOOD, BAD and the
step's size from a change point `perfloop history` found."""

from __future__ import annotations

from perfloop.cli.args import UsageError, open_store
from perfloop.cli.output import console, emit_json, status


def register(verb) -> None:
    p = verb("bisect", "name the commit that made a step, timing the commits in between", run, db=True)
    p.add_argument("good", nargs="?", help="a commit before the step (none: from --key's change point)")
    p.add_argument("bad", nargs="?", help="a commit after it (none: from --key's change point)")
    p.add_argument("--key", help="a stored benchmark whose change point gives good, bad and --expect")
    p.add_argument(
        "--change", type=int, default=-1, help="which of --key's change points (default: the last)"
    )
    p.add_argument("--repo", default=".", help="the git repository (default: this folder's)")
    p.add_argument(
        "--metric",
        choices=("wall", "stdout"),
        default="wall",
        help="wall: the command's wall time; stdout: the number (ms) it prints last",
    )
    p.add_argument("--expect", type=float, help="the step's ratio, slow/fast (none: time BAD first)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run of the command")


def _from_change_point(args) -> tuple[str, str, float]:
    from perfloop.results.history import trends

    found = [t for t in trends(open_store(args, writing=False), args.key) if t.changes]
    if len(found) != 1:
        keys = ", ".join("/".join(t.key) for t in found[:5])
        what = (
            f"{len(found)} keys with change points match it: {keys}"
            if found
            else ("none of the keys matching it has a change point")
        )
        raise UsageError(f"--key: {args.key!r}: {what}; see `perfloop history`")
    changes = found[0].changes
    if not -len(changes) <= args.change < len(changes):
        raise UsageError(
            f"--change: {args.change} is not one of the {len(changes)} change point(s) of {args.key!r}"
        )
    c = changes[args.change]
    if not (c.before and c.after):
        raise UsageError(f"--key: the change point {c} has runs with no commit recorded; give GOOD and BAD")
    return c.before, c.after, c.ratio


def run(args) -> int:
    from perfloop.workflows.bisect import BisectError, bisect

    command = args.script_args
    if not command:
        raise UsageError(
            "command: give the command that times the code after `--`, e.g. "
            "perfloop bisect v1 HEAD -- python bench.py"
        )
    good, bad, expect = args.good, args.bad, args.expect
    if args.key:
        if good or bad:
            raise UsageError("good/bad: give them or --key, not both")
        good, bad, ratio = _from_change_point(args)
        expect = expect or ratio
    elif not (good and bad):
        raise UsageError("good and bad: give the commits either side of the step, or --key KEY")
    status(args, f"bisect {good}..{bad}: timing `{' '.join(command)}` in worktrees")
    try:
        b = bisect(
            good, bad, command, repo=args.repo, metric=args.metric, expect=expect, timeout_s=args.timeout
        )
    except BisectError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        emit_json(b.to_dict())
        return 0
    out = console()
    for t in b.timed:
        word = "slow" if t.slow else "fast"
        out.print(
            f"  {t.commit[:12]} {t.ratio:6.3f}x [{t.ci[0]:.3f}, {t.ci[1]:.3f}] {word:<4} "
            f"({t.rounds} rounds)  {t.subject[:60]}",
            markup=False,
            highlight=False,
        )
    c = b.culprit
    out.print(
        f"first slow commit: {c.commit[:12]} {c.subject!r}: {c.ratio:.3f}x "
        f"[{c.ci[0]:.3f}, {c.ci[1]:.3f}] of {b.good[:12]}, {len(b.timed) + 1} commits timed of "
        f"{len(b.candidates) + 1}",
        style="bold",
        markup=False,
    )
    for n in b.notes:
        out.print(f"  {n}", style="yellow", markup=False)
    return 0

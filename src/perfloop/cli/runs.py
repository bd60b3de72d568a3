"""`perfloop runs`: the stored runs, newest first: id, time, commit, device, command and what
each holds -- the ids `compare`, `report --run` and the exports take."""

from __future__ import annotations

from perfloop.cli.args import UsageError, open_store
from perfloop.cli.output import emit_json, table


def register(verb) -> None:
    p = verb("runs", "the stored runs: id, time, commit, device, command, rows", run, db=True)
    p.add_argument("--last", type=int, default=20, help="newest runs shown (default 20)")
    p.add_argument(
        "--import-aside",
        metavar="FILE",
        help="add the rows a run wrote aside while the database was locked (the file it named)",
    )


def run(args) -> int:
    if args.last < 1:
        raise UsageError(f"--last: must be >= 1, got {args.last}")
    if args.import_aside:
        from perfloop.results.store import StoreError

        try:
            n = open_store(args).import_aside(args.import_aside)
        except StoreError as exc:
            raise UsageError(f"--import-aside: {exc}") from None
        print(f"added {n} row(s) from {args.import_aside}")
    runs = open_store(args, writing=False).runs()
    rows = [
        {
            "run_id": r["run_id"],
            "created": r["created"],
            "commit": r["env"].get("git") or "",
            "device": (r["env"].get("device") or {}).get("name") or "",
            "command": r["command"] or "",
            "rows": r["rows"],
            "artifacts": r["artifacts"],
        }
        for r in runs[: args.last]
    ]
    if args.json:
        emit_json({"runs": rows, "total": len(runs)})
        return 0
    table(
        f"{min(len(runs), args.last)} of {len(runs)} run(s), newest first",
        ["run", "time (UTC)", "commit", "device", "command", "rows", "profiles etc."],
        [
            [
                r["run_id"],
                r["created"][:19].replace("T", " "),
                r["commit"][:14] or "-",
                r["device"][:28] or "-",
                r["command"][:48],
                r["rows"],
                r["artifacts"],
            ]
            for r in rows
        ],
    )
    return 0

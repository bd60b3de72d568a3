"""`perfloop list`: ops and their variants, and which can run here."""

from __future__ import annotations

from perfloop.cli.output import emit_json, table


def register(verb) -> None:
    verb("list", "ops and their variants, and which can run here", run)


def run(args) -> int:
    from perfloop import ops
    from perfloop.device import default_device

    out = []
    for name in ops.names():
        op = ops.get(name)
        for vname, v in op.variants.items():
            why = v.why_unavailable(default_device())
            here = "yes" if not why else f"no: {why}"
            if not why and v.interpreted:
                here = "interpreted (correctness only)"
            out.append({"op": name, "variant": vname, "runs_here": here, "what": v.doc})
    if args.json:
        emit_json(out)
    else:
        table("ops and variants", ["op", "variant", "runs here", "what"], [list(r.values()) for r in out])
    return 0

"""What a script's models are, read while they are alive: pl.patch's call sites in them (what
patch would change, said by `profile --script`) and their module trees (where compiled kernels
are placed)."""

from __future__ import annotations

from perfloop.analysis.inductor import ModuleTree, module_trees


def models_seen(roots: dict, warnings: list) -> tuple[dict, list[ModuleTree], dict]:
    """(pl.patch's call sites by module name, the models' ModuleTrees, the bytes a step of theirs
    must read: tokens.model_bytes summed) of `roots` (root name -> weakref, as
    modules.module_ranges keeps them)."""
    return _sites(roots, warnings), module_trees(roots), _bytes(roots)


def _bytes(roots: dict) -> dict:
    from perfloop.analysis.tokens import model_bytes

    out: dict = {"weights": 0, "cache": 0, "batch": None, "dtypes": {}}
    for ref in roots.values():
        model = ref()
        if model is None:
            continue
        got = model_bytes(model)
        out["weights"] += got["weights"]
        out["cache"] += got["cache"]
        out["batch"] = out["batch"] or got["batch"]
        for k, v in got["dtypes"].items():
            out["dtypes"][k] = out["dtypes"].get(k, 0) + v
    return out


def _sites(roots: dict, warnings: list) -> dict:
    """What pl.patch would check in the script's models (nn.plan.plan), by module name."""
    from perfloop.nn.plan import plan

    out: dict = {}
    for root, ref in roots.items():
        model = ref()
        if model is None:
            continue
        try:
            out.update(plan(model, root))
        except Exception as exc:
            warnings.append(f"call sites of {root} not read: {type(exc).__name__}: {exc}")
    return out


def patch_summary(sites: dict) -> list[str]:
    """The plan as lines: each distinct site once, with how many modules it serves."""
    from collections import Counter

    counts = Counter(where for kinds in sites.values() for where in kinds.values())
    return [f"{where}" + (f" (x{n} modules)" if n > 1 else "") for where, n in counts.items()]

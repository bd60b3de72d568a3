"""perfloop tune: the loop closed on an unchanged script (tuner.py says how).

>>> result = pl.tune("train.py", "--batch_size=32", budget="10m")   # doctest: +SKIP
>>> result.best.label, result.best.stats["speedup"]                 # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from perfloop.workflows.tune.tuner import Result


def tune(
    script: str,
    *args: str,
    budget: str | float = "10m",
    steps: int = 20,
    warmup: int = 5,
    rounds: int = 2,
    tried: Sequence[str] | None = None,
    allow_numerics: bool = False,
    range: str | None = None,
    say: Callable[[str], None] | None = print,
) -> Result:
    """`perfloop tune --script SCRIPT ARGS...` from Python: a `tuner.Result` (the trials with
    their verdicts and speed-ups, the best kept, torch.compile alone). `budget`: seconds or
    "90s", "10m", "1h"; `tried`: candidate names (default: what the diagnosis advises, and
    compile); `range`: a generation script's step (one token's call), checked on its greedy
    tokens; `say`: each run's line as it ends (None: quiet). Raises ValueError naming the
    argument for bad input, and where the unchanged script cannot be run or timed."""
    import os

    from perfloop.errors import ArgumentError
    from perfloop.workflows.tune.candidates import get
    from perfloop.workflows.tune.tuner import Options
    from perfloop.workflows.tune.tuner import tune as _tune

    if not os.path.isfile(script):
        raise ArgumentError("script", f"{script} is not a file; give the path of the training script")
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0), ("rounds", rounds, 1)):
        if not isinstance(value, int) or value < least:
            raise ArgumentError(name, f"must be an integer >= {least}, got {value!r}")
    for name in tried or ():
        get(name)  # an unknown name: ValueError with the known ones
    opts = Options(
        script=script,
        argv=[str(a) for a in args],
        budget_s=budget_seconds(budget),
        steps=steps,
        warmup=warmup,
        rounds=rounds,
        tried=list(tried) if tried else None,
        allow_numerics=allow_numerics,
        range=range,
    )
    return _tune(opts, say or (lambda line: None))


def budget_seconds(budget: str | float) -> float:
    """600, "600", "90s", "10m", "1h" -> seconds (> 0), or ArgumentError("budget", ...)."""
    import re

    from perfloop.errors import ArgumentError

    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$", str(budget))
    if not m or float(m.group(1)) <= 0:
        raise ArgumentError(
            "budget", f"cannot read {budget!r}; give seconds or a duration > 0: 600, 90s, 10m, 1h"
        )
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]

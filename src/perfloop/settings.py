"""A team's committed settings: `[tool.perfloop]` in the nearest pyproject.toml above the
working directory. The command line overrides each one.

    [tool.perfloop]
    db = "perf/results.db"      # the results store (relative to the pyproject.toml's folder)
    threshold = 5               # percent: the slowdown `compare` and the pytest plugin fail on
    budget = 2.0                # seconds per bench comparison / sweep point
    reference = "perf/base.json"  # the pytest plugin's baseline (--perfloop-compare)
    strict = true               # "cannot judge" fails (compare exits 3; the plugin fails the test)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


def data_dir() -> Path:
    """Where perfloop keeps results (XDG data dir)."""
    root = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(root) / "perfloop"


KEYS = {
    "db": "a path",
    "threshold": "a percentage >= 0",
    "budget": "seconds > 0",
    "reference": "a path",
    "strict": "true or false",
}


class SettingsError(ValueError):
    """A [tool.perfloop] entry that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Settings:
    source: Path | None = None  # the pyproject.toml read, if any
    db: str | None = None
    threshold: float | None = None
    budget: float | None = None
    reference: str | None = None
    strict: bool = False


def find_pyproject(start: str | Path | None = None) -> Path | None:
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file():
            return folder / "pyproject.toml"
    return None


def _read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomli, a dependency there
        import tomli as tomllib
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"{path}: cannot read it as TOML ({exc}); fix the file") from None


def load(start: str | Path | None = None) -> Settings:
    """The [tool.perfloop] table of the nearest pyproject.toml (none: every setting unset).
    Raises SettingsError naming the file and key for an unknown key or a wrong value."""
    path = find_pyproject(start)
    if path is None:
        return Settings()
    table = _read_toml(path).get("tool", {}).get("perfloop")
    if table is None:
        return Settings(source=path)
    where = f"{path} [tool.perfloop]"
    if not isinstance(table, dict):
        raise SettingsError(f"{where}: must be a table of settings ({', '.join(KEYS)})")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise SettingsError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
    out = {}
    for key in ("db", "reference"):
        if key in table:
            if not isinstance(table[key], str) or not table[key].strip():
                raise SettingsError(f"{where}: {key} must be {KEYS[key]}, got {table[key]!r}")
            out[key] = str(path.parent / table[key])
    for key, low_ok in (("threshold", True), ("budget", False)):
        if key in table:
            v = table[key]
            good = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not good or v < 0 or (v == 0 and not low_ok):
                raise SettingsError(f"{where}: {key} must be {KEYS[key]}, got {v!r}")
            out[key] = float(v)
    if "strict" in table:
        if not isinstance(table["strict"], bool):
            raise SettingsError(f"{where}: strict must be true or false, got {table['strict']!r}")
        out["strict"] = table["strict"]
    return Settings(source=path, **out)

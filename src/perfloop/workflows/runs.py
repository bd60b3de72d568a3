"""A run in the results history: every command that measures opens one and adds its rows."""

from __future__ import annotations

import os

from perfloop.device import env_fingerprint
from perfloop.results.store import Store


def start_run(store: Store, command: str) -> str:
    """A new run in `store` for `command`, with this machine's environment fingerprint.

    >>> run_id = start_run(Store("r.db"), "bench gelu")  # doctest: +SKIP
    """
    return store.new_run(command, env_fingerprint())


def open_store(path: str | os.PathLike | None = None) -> Store:
    """The results store at `path` (default: $PERFLOOP_DB or the user data dir)."""
    return Store(path)

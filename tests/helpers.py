"""Helpers shared by the tests."""

import time


def busy(ms: float):
    """A function that spins for `ms` milliseconds: a workload of known cost."""

    def f():
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass

    return f

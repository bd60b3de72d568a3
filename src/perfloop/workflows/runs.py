"""A run in the results history: every command that measures opens one and adds its rows."""

from __future__ import annotations

from perfloop.device import default_device, env_fingerprint
from perfloop.harness import gate
from perfloop.harness.measurement import Measurement
from perfloop.harness.timing import bench
from perfloop.results.store import Store


def start_run(store: Store, command: str) -> str:
    """A new run in `store` for `command`, with this machine's environment fingerprint.

    >>> run_id = start_run(Store("r.db"), "bench gelu")  # doctest: +SKIP
    """
    return store.new_run(command, env_fingerprint())


def record_reference(store: Store, run_id: str, m: Measurement | None = None) -> None:
    """The reference workload (harness.gate) in the run, once per run -- `m` where it was timed
    interleaved with the candidates, else measured now: the regression gate divides the
    machine's own drift between two runs out with it."""
    if store.has_rows(run_id, op=gate.REFERENCE_OP):
        return
    dev = default_device()
    m = m or bench(gate.reference(dev), budget_s=0.3, label="reference")
    store.add(run_id, m, op=gate.REFERENCE_OP, variant=dev, shape=(gate.REFERENCE_N[dev],), dtype="fp32")

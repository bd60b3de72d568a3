"""What a candidate is: one named change to a script's run, applied from outside it (in the
child process that runs the script: nothing in the user's files changes), with the finding that
advises it, the lines a user adds to keep it, and how far it may move the numerics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.sites import Site


class Numerics(float, Enum):
    """How far a candidate may move the first steps' loss, relative: the floor of the loss
    check's tolerance (the measured run-to-run spread widens it, never narrows it)."""

    EXACT = 1e-6  # the same arithmetic (a setting, a fused optimizer doing the same update)
    REORDERED = 2e-4  # fp32 sums in another order (compiled or fused kernels)
    TF32 = 5e-3  # fp32 matmuls with a 10-bit mantissa
    BF16 = 3e-2  # autocast to bfloat16: opt-in, it changes what the model computes


@dataclass(frozen=True)
class Candidate:
    """`apply(child)` runs in the child before the script starts (`child.on_model(fn)` defers
    work to the first call of the script's model). `advised_by`: the finding kinds whose saving
    predicts this candidate's (it is proposed when one is found); `always`: proposed without a
    finding (torch.compile: the reference every tune is read against). `group`: at most one
    candidate of a group in a combination. `at`: the script's line its lines go beside, where
    the run found it (the model's construction, the optimizer's, the model's first call)."""

    name: str
    what: str
    lines: tuple[str, ...]
    apply: Callable
    numerics: Numerics = Numerics.EXACT
    advised_by: tuple[Kind, ...] = ()
    always: bool = False
    needs_cuda: bool = False
    opt_in: bool = False
    group: str = ""
    at: Site | None = None  # the script's line its lines go beside (sites.py), where found

    def predicted_share(self, findings: Sequence[dict]) -> float | None:
        """The share of the step the diagnosis says this candidate saves (the findings it is
        advised by, summed: the ranking counts no time twice), or None where none was found. A
        share, not ms: the profiled step is slowed by the profiler, the unprofiled one is not."""
        shares = [f["share"] for f in findings if f.get("kind") in {k.value for k in self.advised_by}]
        return min(sum(shares), 1.0) if shares else None

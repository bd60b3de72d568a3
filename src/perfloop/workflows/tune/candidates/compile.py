"""torch.compile on the script's model, in each mode: the reference every tune is read against
(`always`), and the fix for fused chains, tiny ops and launch-bound steps."""

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics
from perfloop.workflows.tune.sites import Site


def _compiling(mode: str | None):
    def apply(child) -> None:
        def compile_model(model, args, kwargs) -> None:
            import torch

            # the forward, in place: the next call runs compiled. (Module.compile() compiles
            # _call_impl, which torch 2.13's Dynamo skips as torch's own file: nothing compiled.)
            model.forward = torch.compile(model.forward, **({"mode": mode} if mode else {}))

        child.on_model(compile_model, order=90)  # after the changes that swap or move modules

    return apply


_FIXES = (Kind.FUSION, Kind.TINY_OPS, Kind.ATTENTION, Kind.LAUNCH, Kind.DTYPE_CAST)

COMPILE = Candidate(
    name="compile",
    what="torch.compile(model)",
    lines=("model = torch.compile(model)  # after the model is built",),
    apply=_compiling(None),
    at=Site.MODEL,
    numerics=Numerics.REORDERED,
    advised_by=_FIXES,
    always=True,
    group="compile",
)

COMPILE_MAX_AUTOTUNE = Candidate(
    name="compile-max-autotune",
    what='torch.compile(model, mode="max-autotune-no-cudagraphs"): kernel configs searched',
    lines=('model = torch.compile(model, mode="max-autotune-no-cudagraphs")',),
    apply=_compiling("max-autotune-no-cudagraphs"),
    at=Site.MODEL,
    numerics=Numerics.REORDERED,
    advised_by=_FIXES,
    needs_cuda=True,
    opt_in=True,  # minutes of compiling (280 s on a small GPT): asked for by name
    group="compile",
)

COMPILE_CUDA_GRAPHS = Candidate(
    name="compile-reduce-overhead",
    what='torch.compile(model, mode="reduce-overhead"): the step replayed as CUDA graphs',
    lines=('model = torch.compile(model, mode="reduce-overhead")',),
    apply=_compiling("reduce-overhead"),
    at=Site.MODEL,
    numerics=Numerics.REORDERED,
    advised_by=(*_FIXES, Kind.HOST, Kind.SYNC),
    needs_cuda=True,
    group="compile",
)

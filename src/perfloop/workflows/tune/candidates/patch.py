"""pl.patch on the script's model: its modules, call sites and patterns that have a fused
perfloop.nn version, each swapped only after it matched on the model's own first batch."""

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics
from perfloop.workflows.tune.sites import Site


def _apply(child) -> None:
    def patch_model(model, args, kwargs) -> None:
        import torch

        from perfloop.nn.patch import patch

        def forward(m, batch):
            return m(*batch, **kwargs)

        with torch.enable_grad():  # the first call may be an evaluation under no_grad
            report = patch(model, tuple(args), loss_fn=forward)  # grads and mode kept as they were
        replaced = ", ".join(report.replaced) or "none"
        child.note(f"pl.patch replaced {len(report.replaced)} of {len(report.swaps)}: {replaced}")

    child.on_model(patch_model, order=10)


PATCH = Candidate(
    name="patch",
    what="pl.patch(model, batch): fused perfloop.nn modules where they check equal",
    lines=(
        "pl.patch(model, batch)  # import perfloop as pl; once, after the model is built, with a first batch",
    ),
    apply=_apply,
    at=Site.MODEL,
    numerics=Numerics.REORDERED,
    advised_by=(Kind.FUSION, Kind.ATTENTION),
)

"""fp32 matmuls and convolutions on TF32 tensor cores (the PRECISION finding: TF32 off)."""

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics


def _apply(child) -> None:
    import torch

    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


TF32 = Candidate(
    name="tf32",
    what="fp32 matmuls and convolutions on TF32 tensor cores",
    lines=('torch.set_float32_matmul_precision("high")', "torch.backends.cudnn.allow_tf32 = True"),
    apply=_apply,
    numerics=Numerics.TF32,
    advised_by=(Kind.PRECISION,),
    needs_cuda=True,
)

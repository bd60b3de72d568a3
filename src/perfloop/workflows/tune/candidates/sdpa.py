"""scaled_dot_product_attention kept off cuDNN's backend (the CUDNN_PLAN finding: cuDNN builds a
plan for each shape it has not seen, so a KV cache that grows a token at a time pays one every
token); flash and memory-efficient attention take the same calls."""

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics


def _apply(child) -> None:
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


SDPA_NO_CUDNN = Candidate(
    name="sdpa-no-cudnn",
    what="scaled_dot_product_attention on its flash or memory-efficient kernels, not cuDNN's",
    lines=("torch.backends.cuda.enable_cudnn_sdp(False)",),
    apply=_apply,
    numerics=Numerics.REORDERED,
    advised_by=(Kind.CUDNN_PLAN,),
    needs_cuda=True,
)

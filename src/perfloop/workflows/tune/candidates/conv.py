"""Convolutions in channels_last (the CONV_LAYOUT finding: cuDNN transposing NCHW around each
kernel), and cuDNN's autotuner picking each convolution's algorithm."""

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics
from perfloop.workflows.tune.sites import Site


def _channels_last(child) -> None:
    def move(model, args, kwargs) -> None:
        import torch

        model.to(memory_format=torch.channels_last)

    child.on_model(move, order=20)


def _benchmark(child) -> None:
    import torch

    torch.backends.cudnn.benchmark = True


CHANNELS_LAST = Candidate(
    name="channels-last",
    what="the model's weights (and so its convolutions' outputs) in channels_last",
    lines=("model = model.to(memory_format=torch.channels_last)",),
    apply=_channels_last,
    at=Site.MODEL,
    numerics=Numerics.REORDERED,
    advised_by=(Kind.CONV_LAYOUT,),
)

CUDNN_BENCHMARK = Candidate(
    name="cudnn-benchmark",
    what="cuDNN times its convolution algorithms once per shape and keeps the fastest",
    lines=("torch.backends.cudnn.benchmark = True",),
    apply=_benchmark,
    numerics=Numerics.REORDERED,
    advised_by=(Kind.CONV_LAYOUT,),
    needs_cuda=True,
)

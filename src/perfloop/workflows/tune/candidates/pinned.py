"""Host-to-device copies from pinned memory, without waiting (the PAGEABLE_COPY finding): a copy
from pageable memory is staged by the driver, which may wait for the stream's earlier work first,
so the host cannot run ahead of the device. Applied from outside the script: DataLoaders pin
their batches (pin_memory=True where the script did not say), and `Tensor.to`/`Tensor.cuda` of an
unpinned CPU tensor to a CUDA device pin it first and copy with non_blocking=True (the pinned
block is kept until its copy is done: PyTorch's host allocator records the copy's stream)."""

from __future__ import annotations

from perfloop.analysis.findings import Kind
from perfloop.workflows.tune.candidates.base import Candidate, Numerics

# DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory)
LOADER_PIN_ARG = 8


def to_cuda(args: tuple, kwargs: dict) -> bool:
    """Whether Tensor.to(*args, **kwargs) copies to a CUDA device and leaves non_blocking to the
    caller's default: a device (str, torch.device, or a tensor's) among its arguments, and no
    positional bool (the old to(device, dtype, non_blocking) form is left as written)."""
    import torch

    if kwargs.get("non_blocking") or any(isinstance(a, bool) for a in args):
        return False
    for a in (kwargs.get("device"), *args):
        if isinstance(a, torch.Tensor):
            a = a.device
        if isinstance(a, (str, torch.device)):
            try:
                return torch.device(a).type == "cuda"
            except RuntimeError:  # a memory format's or dtype's name is not a device
                continue
    return False


def pinning(to, cuda, pin=lambda t: t.pin_memory()):
    """Tensor.to and Tensor.cuda wrapped: an unpinned CPU tensor bound for CUDA is pinned (`pin`)
    and copied without waiting; anything else, and any call inside compiled code, is passed on."""
    import torch

    def pinned_to(self, *args, **kwargs):
        if torch.compiler.is_compiling() or self.device.type != "cpu" or not to_cuda(args, kwargs):
            return to(self, *args, **kwargs)
        src = self if self.is_pinned() else pin(self)
        return to(src, *args, **{**kwargs, "non_blocking": True})

    def pinned_cuda(self, device=None, non_blocking=False, **kwargs):
        if torch.compiler.is_compiling() or non_blocking or self.device.type != "cpu":
            return cuda(self, device, non_blocking, **kwargs)
        src = self if self.is_pinned() else pin(self)
        return cuda(src, device, True, **kwargs)

    return pinned_to, pinned_cuda


def _apply(child) -> None:
    import torch
    import torch.utils.data

    torch.Tensor.to, torch.Tensor.cuda = pinning(torch.Tensor.to, torch.Tensor.cuda)
    init = torch.utils.data.DataLoader.__init__

    def pinned_loader(self, *args, **kwargs):
        if len(args) < LOADER_PIN_ARG:  # not given positionally
            kwargs.setdefault("pin_memory", True)
        init(self, *args, **kwargs)

    torch.utils.data.DataLoader.__init__ = pinned_loader


PINNED_MEMORY = Candidate(
    name="pinned-memory",
    what="batches copied to the GPU from pinned memory with non_blocking=True",
    lines=(
        "DataLoader(..., pin_memory=True)",
        "x = x.pin_memory().to(device, non_blocking=True)  # each host tensor copied in the step",
    ),
    apply=_apply,
    numerics=Numerics.EXACT,
    advised_by=(Kind.PAGEABLE_COPY,),
    needs_cuda=True,
)

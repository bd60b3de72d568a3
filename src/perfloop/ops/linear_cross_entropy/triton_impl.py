"""The output projection and cross entropy together, the logits never whole: the tokens go in
chunks; for each, the chunk's logits (one matmul), then one kernel that reads each row for its
loss and reads it again (from L2, mostly) to write its gradient over it, then dh for the chunk
and its share of dW (two matmuls; dW summed in the weight's dtype by the matmul itself, one
rounding per chunk). Forward does the backward's work too -- the logits are gone by then -- and
the backward only scales dh and dW, in place, by the upstream gradient. Memory: one chunk of
logits, dh, dW, a loss per token.
"""

from __future__ import annotations

from pathlib import Path

import torch

from perfloop.ops.base import check_tensor, next_pow2
from perfloop.ops.cross_entropy.triton_impl import BLOCK, assert_targets, ce_loss_grad_kernel, check_targets
from perfloop.ops.launch import launch
from perfloop.ops.tuning import load_table

TUNED = load_table(Path(__file__).parent)
CHUNK_BYTES, WARPS = TUNED["chunk_bytes"], TUNED["num_warps"]  # a chunk's logits at most this large


def chunk_rows(n: int, v: int, itemsize: int) -> int:
    rows = max(1, CHUNK_BYTES // max(v * itemsize, 1))
    return max(1, min(n, rows // 128 * 128 or rows))


def forward_parts(h, weight, target, ignore_index: int, chunk: int):
    """(mean loss in fp32, its gradient for h, for weight) of (N, H) hidden states: the gradients
    for an upstream gradient of 1."""
    n, _ = h.shape
    v = weight.shape[0]
    h = h if h.is_contiguous() else h.contiguous()
    target = target.contiguous()
    ok = check_targets(target, v, ignore_index)
    n_valid = (target != ignore_index).sum()
    dh = torch.empty_like(h)
    dw = torch.zeros_like(weight)
    losses = torch.empty(n, dtype=torch.float32, device=h.device)
    block = min(BLOCK, next_pow2(v))
    buf = torch.empty((min(chunk, n), v), dtype=h.dtype, device=h.device)  # one chunk's logits, reused
    for s in range(0, n, chunk):
        hc, tc = h[s : s + chunk], target[s : s + chunk]
        logits = torch.mm(hc, weight.t(), out=buf[: hc.shape[0]])
        # each row's loss, then its gradient written over it (the logits are ours alone)
        launch(
            ce_loss_grad_kernel,
            (logits.shape[0],),
            logits,
            tc,
            losses[s:],
            n_valid,
            ok,
            logits.stride(0),
            v,
            ignore_index,
            BLOCK=block,
            num_warps=WARPS,
        )
        torch.mm(logits, weight, out=dh[s : s + chunk])
        dw.addmm_(logits.t(), hc)  # in the matmul's epilogue, in the weight's dtype
    if n:
        assert_targets(ok)
    return losses.sum() / n_valid, dh, dw  # nan with no row counted, as torch


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, ignore_index, chunk):
        loss, dh, dw = forward_parts(h, weight, target, ignore_index, chunk)
        # kept on ctx, not saved: the backward scales them in place and hands them out once
        ctx.grads = dh, dw
        return loss

    @staticmethod
    def backward(ctx, dloss):
        if ctx.grads is None:
            raise RuntimeError(
                "linear_cross_entropy: a second backward through one forward (retain_graph=True?): its "
                "gradients are made in the forward and handed out once; run the forward again"
            )
        (dh, dw), ctx.grads = ctx.grads, None
        return dh.mul_(dloss.to(dh.dtype)), dw.mul_(dloss.to(dw.dtype)), None, None, None


def linear_cross_entropy(h, weight, target, ignore_index: int = -100, chunk: int | None = None):
    check_tensor("h", h, ndim=2)
    check_tensor("weight", weight, ndim=2)
    if weight.shape[1] != h.shape[1] or weight.dtype != h.dtype:
        raise ValueError(
            f"weight: need shape (V, {h.shape[1]}) and dtype {h.dtype}, got "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    if not isinstance(target, torch.Tensor) or target.shape != h.shape[:1]:
        raise ValueError(f"target: need class indices of shape ({h.shape[0]},)")
    chunk = chunk or chunk_rows(h.shape[0], weight.shape[0], h.element_size())
    loss = LinearCrossEntropyFunction.apply(h, weight, target, ignore_index, chunk)
    return loss.to(h.dtype)

"""Batch norm on a split batch, as one device computes it on the whole batch (SyncBatchNorm's
semantics): what generated code calls where a training ``batch_norm`` runs split.

Where the batch (or any dim but the channels) is split over some mesh axes
(``autopar.core.ops.batch_norm.statistics_axes``), each rank's per-channel count, mean and sum of
squared deviations are all-gathered over those axes and combined (Chan et al.'s parallel
variance, stable where a sum of squares less a squared mean is not): every rank normalises by
the whole batch's statistics and updates the running statistics with them. Its backward sums
the two per-channel reductions batch norm's gradient needs (of the output's gradient, and of it
times the normalised input) over the same axes in one all-reduce, as ``torch.nn.SyncBatchNorm``
does; like the ATen op it keeps only its input and per-channel vectors for the backward.
Where the channels are split, a rank updates its channels' part of the running statistics (a
copy), which is all-gathered back into the whole, replicated buffer afterwards (``write_back``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from codegen.runtime import all_reduce, axes_group, full, spans_job

aten = torch.ops.aten


def batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
               momentum: float, eps: float, cudnn_enabled: bool = False, *, mesh: DeviceMesh,
               over: Sequence[int]) -> torch.Tensor:
    """``aten.batch_norm`` of this rank's part ``x``, its statistics those of the whole tensor
    split over mesh axes ``over`` (none, or not training: the ATen op itself). The running
    statistics given are updated in place, as the ATen op updates them."""
    if not training or not over:
        return aten.batch_norm.default(x, weight, bias, running_mean, running_var, training, momentum, eps,
                                       cudnn_enabled)
    y, mean, var, count = _SyncBatchNorm.apply(x, weight, bias, mesh, tuple(over), eps)
    with torch.no_grad():   # the unbiased variance, as the ATen op keeps it
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_((var * count / (count - 1)).to(running_var.dtype), alpha=momentum)
    return y


def _along_channels(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast along dim 1 of a tensor of ``ndim`` dims."""
    return t.view([1, -1] + [1] * (ndim - 2))


class _SyncBatchNorm(torch.autograd.Function):
    """Batch norm by the whole batch's statistics; returns the output and, not differentiable,
    the per-channel mean, biased variance and count the running statistics are updated with."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                mesh: DeviceMesh, over: tuple[int, ...], eps: float) -> tuple[torch.Tensor, ...]:
        accumulate = torch.promote_types(x.dtype, torch.float32)
        mean, var, count = _statistics(x.to(accumulate), mesh, over)
        invstd = torch.rsqrt(var + eps)
        y = (x.to(accumulate) - _along_channels(mean, x.dim())) * _along_channels(invstd, x.dim())
        if weight is not None:
            y = y * _along_channels(weight, x.dim())
        if bias is not None:
            y = y + _along_channels(bias, x.dim())
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.mesh, ctx.over, ctx.bias_dtype = mesh, over, None if bias is None else bias.dtype
        ctx.mark_non_differentiable(mean, var, count)
        return y.to(x.dtype), mean, var, count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd, count = ctx.saved_tensors
        nd, accumulate = x.dim(), mean.dtype
        dims = [0, *range(2, nd)]
        grad_acc = grad.to(accumulate)
        normalised = (x.to(accumulate) - _along_channels(mean, nd)) * _along_channels(invstd, nd)
        local = torch.stack([grad_acc.sum(dims), (grad_acc * normalised).sum(dims)])
        summed = all_reduce(local, ctx.mesh, ctx.over) / count   # the whole batch's means of both
        scale = invstd if weight is None else invstd * weight.to(accumulate)
        grad_x = _along_channels(scale, nd) * (grad_acc - _along_channels(summed[0], nd)
                                               - normalised * _along_channels(summed[1], nd))
        grad_weight = local[1].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = local[0].to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_x.to(x.dtype), grad_weight, grad_bias, None, None, None


def _statistics(x: torch.Tensor, mesh: DeviceMesh, over: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per channel (dim 1): the whole tensor's mean, biased variance and count, from this rank's
    part and the others' over mesh axes ``over`` (one all-gather)."""
    dims = [0, *range(2, x.dim())]
    count = torch.ones_like(x[:1].sum(dims)) * (x.numel() // max(x.shape[1], 1))
    mean = x.sum(dims) / count.clamp(min=1)
    squares = ((x - _along_channels(mean, x.dim())) ** 2).sum(dims)
    parts = _gathered(torch.stack([count, mean, squares]), mesh, over).view(-1, 3, x.shape[1])
    counts, means, sums = parts.unbind(1)
    total = counts.sum(0)
    whole_mean = (counts * means).sum(0) / total
    whole_squares = (sums + counts * (means - whole_mean) ** 2).sum(0)
    return whole_mean, whole_squares / total, total


def _gathered(x: torch.Tensor, mesh: DeviceMesh, axes: tuple[int, ...]) -> torch.Tensor:
    """Every rank's ``x`` over mesh ``axes``, stacked along dim 0 (one collective where the axes
    are one, or span the job; else one per axis)."""
    if len(axes) == 1 or spans_job(mesh, axes):
        return funcol.wait_tensor(funcol.all_gather_single(x, 0, axes_group(mesh, axes)))
    for axis in axes:
        x = funcol.wait_tensor(funcol.all_gather_single(x, 0, (mesh, axis)))
    return x


def write_back(buffer: torch.Tensor, part: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> None:
    """Make ``buffer`` (replicated) whole again after an op updated ``part`` of it in place, this
    rank's part placed ``placements``: every rank's part all-gathered into it."""
    with torch.no_grad():
        buffer.copy_(full(part, mesh, placements, list(buffer.shape)))


def generated_globals() -> dict[str, Any]:
    """What generated code calls from here, by the names it calls them."""
    return {"sync_batch_norm": batch_norm, "write_back": write_back}

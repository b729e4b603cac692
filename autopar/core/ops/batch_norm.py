"""Batch norm (``aten.batch_norm``): split by channels, or (SyncBatchNorm's semantics) by batch,
normalising by the whole batch's statistics in training; the running statistics it updates in
place are replicated buffers, or their channels' part, written back.

Where the batch (or any dim but the channels) is split over some mesh axes (``statistics_axes``),
``sync_batch_norm`` all-gathers each rank's per-channel count, mean and sum of squared deviations
over those axes and combines them (Chan et al.'s parallel variance, stable where a sum of squares
less a squared mean is not): every rank normalises by the whole batch's statistics and updates
the running statistics with them. Its backward sums the two per-channel reductions batch norm's
gradient needs (of the output's gradient, and of it times the normalised input) over the same
axes in one all-reduce, as ``torch.nn.SyncBatchNorm`` does; like the ATen op it keeps only its
input and per-channel vectors for the backward. Where the channels are split, a rank updates its
channels' part of the running statistics (a copy), which is all-gathered back into the whole,
replicated buffer afterwards (``write_back``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.core.capture import flat_tensor_inputs, tensor_val
from autopar.core.collectives import all_reduce, axes_group, full, spans_job
from autopar.core.ops.base import Collective, Emitter, Placed, Site, collectives, emitter, kernel, rule
from autopar.core.placements import Placements, largest_shard_shape, placements_str
from autopar.core.rules import AxisRule, OpView, fits, replicate

aten = torch.ops.aten
BATCH_NORM = torch.ops.aten.batch_norm.default


@rule(BATCH_NORM)
def batch_norm(v: OpView, n: int) -> list[AxisRule]:
    """batch_norm(x, weight, bias, running_mean, running_var, ...): statistics are per channel,
    so splitting the channels (dim 1; the per-channel tensors by their one dim) is exact. Split
    by batch, a training batch norm gathers every rank's statistics over that axis
    (``statistics_axes``: SyncBatchNorm's semantics); in eval mode it reads the running
    statistics, the same for every sample. The running statistics it writes are replicated
    buffers, or their channels' part."""
    x = v.in_shapes[0]
    rules = [replicate(v)]
    if fits(x[0], n, even=False):
        rules.append(AxisRule(Shard(0), (Shard(0),) + (Replicate(),) * (len(v.in_shapes) - 1), "batch"))
    if len(x) > 1 and fits(x[1], n, even=False):
        rules.append(AxisRule(Shard(1), (Shard(1),) + (Shard(0),) * (len(v.in_shapes) - 1), "channels"))
    return rules


def batch_statistics(node: fx.Node) -> bool:
    """Does ``node`` normalise by its input's batch statistics (a batch_norm in training mode)?"""
    if node.target is not BATCH_NORM:
        return False
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs["training"])


def statistics_axes(node: fx.Node, ins: tuple[Placements, ...]) -> tuple[int, ...]:
    """The mesh axes over which a training batch_norm whose inputs are placed ``ins`` gathers the
    statistics of the other ranks' parts (``sync_batch_norm``): those splitting its input on a
    dim other than the channels (dim 1). Empty for any other op, and in eval mode."""
    if not batch_statistics(node):
        return ()
    return tuple(a for a, p in enumerate(ins[0]) if isinstance(p, Shard) and p.dim != 1)


def running_statistics(node: fx.Node) -> list[fx.Node]:
    """The buffers a training batch_norm updates in place (its running mean and variance); its
    schema does not say it writes them, so ``execution.writes_in_place`` does not see these writes."""
    if not batch_statistics(node):
        return []
    return [a for a in node.args[3:5] if isinstance(a, fx.Node)]


@emitter(BATCH_NORM)
def emit(em: Emitter, site: Site) -> bool:
    """Training on a split batch, it normalises by the whole batch's statistics
    (``sync_batch_norm``). Running statistics it reads split (a copy of its channels' part,
    which it updates in place) are all-gathered back into the replicated buffer: a view of the
    buffer would do without, but the op saves them for its backward, which a later write to
    the buffer would invalidate."""
    node, np_ = site.node, site.plan
    text = em.call_text(node, site.reads)
    over = statistics_axes(node, np_.ins)
    if over:
        names = ", ".join(em.axes[a] for a in over)
        em.emit(f"{node.name} = kernels.sync_batch_norm{text[text.index('('):-1]}, mesh=mesh, over={over})",
                f"{site.comment}; the whole batch's statistics: every rank's per-channel count, mean and squares "
                f"all-gathered over {names} (SyncBatchNorm); the backward all-reduces two per-channel sums there")
    else:
        em.emit(f"{node.name} = {text}", site.comment)
    for buffer in running_statistics(node):
        want = np_.ins[site.inputs.index(buffer)]
        split = [em.axes[a] for a, p in enumerate(want) if isinstance(p, Shard)]
        if split:
            em.emit(f"kernels.write_back({buffer.name}, {site.read(buffer)}, mesh, {placements_str(want, code=True)})",
                    f"this rank's channels of the running statistic, updated in place, all-gathered over "
                    f"{', '.join(split)} into the whole buffer")
    return True


@collectives(BATCH_NORM)
def statistics(node: fx.Node, placed: Placed, mesh_shape: Sequence[int], grad: bool,
               loss_with_gradients: str | None) -> list[Collective]:
    """Split by batch in training, it all-gathers each rank's per-channel count, mean and squares
    over those axes, and its backward all-reduces two per-channel sums there; the running
    statistics of its channels, where it splits them, are all-gathered back into the buffer."""
    over = statistics_axes(node, placed.ins)
    whole = (Replicate(),) * len(mesh_shape)
    out = []
    inputs = flat_tensor_inputs(node)
    if over:
        k = math.prod(mesh_shape[a] for a in over)
        channels = largest_shard_shape(tensor_val(inputs[0]).shape, placed.ins[0], mesh_shape)[1]
        split = tuple(Shard(0) if a in over else Replicate() for a in range(len(mesh_shape)))
        out.append(Collective((3 * k, channels), torch.float32, split, whole))
        if grad:
            summed = tuple(Partial() if a in over else Replicate() for a in range(len(mesh_shape)))
            out.append(Collective((2, channels), torch.float32, summed, whole))
    for buffer in running_statistics(node):
        want = placed.ins[inputs.index(buffer)]
        if want != whole:
            val = tensor_val(buffer)
            out.append(Collective(val.shape, val.dtype, want, whole))
    return out


# The runtime: what generated code calls where a training ``batch_norm`` runs split.

@kernel
def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
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


@kernel
def write_back(buffer: torch.Tensor, part: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> None:
    """Make ``buffer`` (replicated) whole again after an op updated ``part`` of it in place, this
    rank's part placed ``placements``: every rank's part all-gathered into it."""
    with torch.no_grad():
        buffer.copy_(full(part, mesh, placements, list(buffer.shape)))

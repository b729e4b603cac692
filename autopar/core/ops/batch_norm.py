"""Batch norm (``aten.batch_norm``): split by channels, or (SyncBatchNorm's semantics) by batch,
normalising by the whole batch's statistics in training (``codegen.batch_norm``); the running
statistics it updates in place are replicated buffers, or their channels' part, written back.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core.capture import flat_tensor_inputs, tensor_val
from autopar.core.ops.base import Collective, Emitter, Placed, Site, collectives, emitter, rule
from autopar.core.placements import Placements, largest_shard_shape, placements_str
from autopar.core.rules import AxisRule, OpView, fits, replicate

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
    statistics of the other ranks' parts (``codegen.batch_norm``): those splitting its input on a
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
        em.emit(f"{node.name} = sync_batch_norm{text[text.index('('):-1]}, mesh=mesh, over={over})",
                f"{site.comment}; the whole batch's statistics: every rank's per-channel count, mean and squares "
                f"all-gathered over {names} (SyncBatchNorm); the backward all-reduces two per-channel sums there")
    else:
        em.emit(f"{node.name} = {text}", site.comment)
    for buffer in running_statistics(node):
        want = np_.ins[site.inputs.index(buffer)]
        split = [em.axes[a] for a, p in enumerate(want) if isinstance(p, Shard)]
        if split:
            em.emit(f"write_back({buffer.name}, {site.read(buffer)}, mesh, {placements_str(want, code=True)})",
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

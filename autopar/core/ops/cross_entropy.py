"""Cross-entropy (``aten.cross_entropy_loss``, and the lean loss ``autopar::cross_entropy`` capture
makes of it) split by batch: exact for uneven splits and ignored targets.

Each rank computes the sum of its targets' losses (``sharded_cross_entropy``, below);
one all-reduce over the axes that split the batch sums them, with the targets' count for a mean.
Where ``train_step`` knows the whole batch's target count (``loss_count``), the local sum is
divided by it and the all-reduce only launched; the mean loss it sums with the gradients
(``loss_with_gradients``) needs none of its own (``codegen.grad_sync.GradSync.carry``).

The lean loss (``autopar::cross_entropy``, ``autopar.core.lean_loss``: capture makes it of each
cross-entropy over class indices, absorbing an upcast of the logits that feeds only it) takes
aten's arguments in their places (and ``dtype=``): the hooks below serve both ops; it keeps its
logits in their own dtype and one log-sum-exp a row (``lean_kept``), and holds two chunks of rows
while it runs (``lean_chunks``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core.capture import tensor_val
from autopar.core.collectives import sum_over_ranks
from autopar.core.lean_loss import CROSS_ENTROPY, LEAN, chunk_rows
from autopar.core.ops.base import (
    Collective,
    Emitter,
    Kept,
    LocalCall,
    Placed,
    Site,
    collectives,
    emitter,
    kernel,
    rule,
    saved,
    timed,
    working,
)
from autopar.core.placements import largest_shard_shape
from autopar.core.rules import AxisRule, OpView, fits, replicate
from autopar.core.sizes import minimum

aten = torch.ops.aten
#: Both losses, registered alike: the lean one takes aten's arguments in their places.
LOSSES = (CROSS_ENTROPY, LEAN)
# ----------------------------------------------------------------------------
# How it splits, runs, and what it costs
# ----------------------------------------------------------------------------


@rule(*LOSSES)
def cross_entropy(v: OpView, n: int) -> list[AxisRule]:
    """Loss over [N, C] logits: split the batch. The runtime sums the local losses (and, for a
    mean, the counts of counted targets) over the split in one all-reduce: the loss is exact for
    uneven splits and ignored targets, and replicated. A sum may also stay a partial sum."""
    logits = v.in_shapes[0]
    rules = [replicate(v)]
    reduction = v.arg(3, "reduction", 1)
    if (len(v.in_shapes) == 2 and fits(logits[0], n, even=False) and reduction in (1, 2)
            and v.arg(5, "label_smoothing", 0.0) == 0.0):
        rules.append(AxisRule(Replicate(), (Shard(0), Shard(0)), "batch"))
        if reduction == 2:
            rules.append(AxisRule(Partial(), (Shard(0), Shard(0)), "batch-partial"))
    return rules


def _split(placed: Placed) -> bool:
    """Does this rank hold part of the batch (the runtime's sharded loss runs)?"""
    return any(isinstance(p, Shard) for p in placed.ins[0])


def summed_axes(placed: Placed) -> tuple[int, ...]:
    """The mesh axes the local losses are summed over: those splitting the batch, the loss whole."""
    return tuple(a for a, (i, o) in enumerate(zip(placed.ins[0], placed.out, strict=True))
                 if isinstance(i, Shard) and isinstance(o, Replicate))


@emitter(*LOSSES)
def emit(em: Emitter, site: Site) -> bool:
    """``sharded_cross_entropy`` where the batch is split; the loss ``train_step`` sums with the
    gradients returns this rank's summand (``loss_summed_over``)."""
    node, np_ = site.node, site.plan
    if not _split(np_):
        return False
    summed = summed_axes(np_)
    args = site.args + (f", dtype=torch.{str(node.kwargs['dtype']).removeprefix('torch.')}" if node.target is LEAN else "")
    over = ", ".join(em.axes[a] for a in summed)
    counted = node.name == em.counted_loss and bool(summed)
    em.counts_loss |= counted
    if counted and em.outputs == "loss" and node.name == em.loss_with_gradients:
        em.loss_summed_over = summed
        em.emit(f"{node.name} = kernels.sharded_cross_entropy({args}, mesh=mesh, summed_over=(), count=loss_count)",
                f"{np_.strategy} -> this rank's summand, divided by the "
                f"batch's target count: train_step sums it over {over} in a gradient bucket's all-reduce")
    else:
        em.emit(f"{node.name} = kernels.sharded_cross_entropy({args}, mesh=mesh, summed_over={summed}"
                f"{', count=loss_count' if counted else ''})",
                site.comment + (f"; one all-reduce over {over} sums the local losses" if summed else "")
                + (", divided by the batch's target count (launched: the gradient does not wait for it)"
                   if counted else ""))
    return True


#: ``sharded_cross_entropy``'s arguments by position, defaults past (logits, target): weight,
#: reduction, ignore_index.
_DEFAULTS = (None, None, None, 1, -100)


@timed(*LOSSES)
def local_loss(call: LocalCall, node: fx.Node, placed: Placed, mesh_shape: Sequence[int],
               grad: Mapping[fx.Node, bool]) -> LocalCall:
    """Split, what the runtime runs on the local logits: the loss with reduction=sum (aten's:
    log_softmax then nll_loss_forward summing the local targets; the lean one's own). Codegen
    passes the node's positional arguments only; the rest take the helper's defaults."""
    if not _split(placed):
        return call
    logits, target, weight, _, ignore_index = call.args[:5] + _DEFAULTS[len(call.args):]
    return LocalCall(call.target, (logits, target, weight, 2, ignore_index), call.kwargs)


@collectives(*LOSSES)
def loss_sum(node: fx.Node, placed: Placed, mesh_shape: Sequence[int], grad: bool,
             loss_with_gradients: str | None) -> list[Collective]:
    """A loss over a split batch made whole sums the local loss and target count over the split
    axes, but for the mean that ``train_step`` sums in a gradient bucket's all-reduce."""
    if node.name == loss_with_gradients:
        return []
    summed = tuple(Partial() if isinstance(i, Shard) and o == Replicate() else o
                   for i, o in zip(placed.ins[0], placed.out, strict=True))
    return [Collective((2,), torch.float32, summed, placed.out)] if summed != tuple(placed.out) else []


@kernel
def sharded_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight=None, reduction: int = 1,
                          ignore_index: int = -100, *, mesh: DeviceMesh, summed_over: Sequence[int],
                          count: float | torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cross-entropy over a batch split across ranks, exact for uneven splits and ignored targets:
    the local sum of losses, summed over the mesh axes ``summed_over`` in one all-reduce. For a
    mean, ``count`` is the whole batch's number of counted targets when the caller knows it
    (``ShardedModule`` counts them on the inputs every rank holds whole): the sum is then only
    launched, and waited for where the loss's value is first read, as the gradient does not need
    it; with no axes to sum over, this rank's summand is returned (``train_step`` sums it with the
    gradients). Without ``count`` the count is summed with the loss.
    Axes where the batch is split but not summed leave this rank's partial sum (reduction='sum'
    only). Sums run in at least fp32 and the result is rounded to the logits' dtype once, as one
    device's kernel does: a bf16 partial sum of a few hundred losses would keep only its integer
    part. ``dtype``: the lean loss's (``autopar::cross_entropy``), which computes the local sum
    and returns the loss in that dtype."""
    if dtype is None:
        accumulate = torch.promote_types(logits.dtype, torch.float32)
        log_probs = torch.log_softmax(logits, dim=-1, dtype=accumulate)
        local_sum = aten.nll_loss_forward.default(log_probs, target, weight, 2, ignore_index)[0]
    else:
        local_sum = LEAN(logits, target, weight, 2, ignore_index, dtype=dtype)
    result = logits.dtype if dtype is None else dtype
    if reduction == 2 or count is not None:
        summand = local_sum if reduction == 2 else local_sum / count
        return (sum_over_ranks(summand, mesh, summed_over) if summed_over else summand).to(result)
    counted = (target != ignore_index).sum().to(local_sum.dtype)
    both = sum_over_ranks(torch.stack([local_sum, counted]), mesh, summed_over)
    return (both[0] / both[1]).to(result)


@saved(LEAN)
def lean_kept(node: fx.Node, flags: tuple[bool, ...]) -> Kept | None:
    """The lean loss keeps its logits (in their own dtype, not upcast), its targets and one
    log-sum-exp a row in the loss's dtype; nothing where the logits need no gradient."""
    if not flags[0]:
        return Kept(frozenset(), False, 0)
    rows = tensor_val(node.args[0]).shape[0]
    return Kept(frozenset({0, 1}), False, rows * node.kwargs["dtype"].itemsize)


@working(LEAN)
def lean_chunks(node: fx.Node, placed: Placed, mesh_shape: Sequence[int]) -> float:
    """Two chunks of rows in the loss's dtype (the upcast chunk and its exponentials, in the
    forward; the softmax being made a gradient, in the backward), on this rank's rows."""
    logits, dtype = tensor_val(node.args[0]), node.kwargs["dtype"]
    rows, vocab = largest_shard_shape(logits.shape, placed.ins[0], mesh_shape)
    chunk = chunk_rows(logits.shape[1], dtype)
    held = minimum(rows, chunk)   # symbolic sizes too
    return 2.0 * held * vocab * dtype.itemsize

"""Cross-entropy (``aten.cross_entropy_loss``, and the lean loss ``autopar::cross_entropy`` capture
makes of it) split by batch: exact for uneven splits and ignored targets.

Each rank computes the sum of its targets' losses (``sharded_cross_entropy``, below);
one all-reduce over the axes that split the batch sums them, with the targets' count for a mean.
Where ``train_step`` knows the whole batch's target count (``loss_count``), the local sum is
divided by it and the all-reduce only launched; the mean loss it sums with the gradients
(``loss_with_gradients``) needs none of its own (``codegen.grad_sync.GradSync.carry``).

The lean loss. A language model's loss is usually its logits upcast to fp32 then cross-entropy
(transformers' ``ForCausalLMLoss``): run as written, it holds an fp32 copy of the logits, the
log-probabilities its backward keeps, and their fp32 gradients, each [tokens, vocabulary]
(15.7 GiB each for 32k tokens of Llama-3's 128k vocabulary). Capture rewrites each cross-entropy
over class indices (no weight, no label smoothing, a mean or a sum) into ``autopar::cross_entropy``
(``lean_losses``), absorbing the upcast where it feeds nothing else: the op reads the logits in
their own dtype and computes each chunk of rows in the loss's dtype (``dtype``, as the upcast
did), keeps the logits and one log-sum-exp a row for its backward, which recomputes the softmax
chunk by chunk and writes the logits' gradient in their dtype (``LeanCrossEntropy``, as Liger's
and torchtune's chunked losses do). Each row's values are those of the upcast then aten's loss;
only the order of the sums over rows differs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core.capture import tensor_val
from autopar.core.collectives import sum_over_ranks
from autopar.core.errors import AutoparError
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

aten = torch.ops.aten
CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default
_MEAN, _SUM = 1, 2   # torch's reduction enum (``torch.nn._reduction``)
#: Bytes of one chunk of rows in the loss's dtype: the lean loss's working memory is two of them.
CHUNK_BYTES = 256 * 2**20


# ----------------------------------------------------------------------------
# The lean loss: the op, its forward and backward
# ----------------------------------------------------------------------------

_LIB = torch.library.Library("autopar", "FRAGMENT")
_LIB.define("cross_entropy(Tensor logits, Tensor target, Tensor? weight=None, int reduction=1, "
            "SymInt ignore_index=-100, *, ScalarType dtype) -> Tensor")


def chunk_rows(vocab: int, dtype: torch.dtype) -> int:
    """Rows of [*, vocab] logits computed at once: one chunk of ``CHUNK_BYTES`` in ``dtype``."""
    return max(1, CHUNK_BYTES // max(1, vocab * dtype.itemsize))


def _step(logits: torch.Tensor, dtype: torch.dtype) -> int | None:
    """Rows a chunk, or None for one chunk: fewer rows than a chunk, or fake tensors (planning:
    the same ops, shapes and kept tensors without a loop over a million rows), or sizes that
    differ by rank (``LocalTensorMode``)."""
    rows = logits.shape[0]
    if is_fake(logits) or logits.device.type == "meta" or not isinstance(rows, int):
        return None
    step = chunk_rows(logits.shape[1], dtype)
    return step if rows > step else None


def _rows(t: torch.Tensor, step: int | None) -> tuple[torch.Tensor, ...]:
    """``t`` as chunks of ``step`` rows (views)."""
    return (t,) if step is None else t.split(step)


class LeanCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits.to(dtype), target, reduction=..., ignore_index=...)`` for [N, C]
    logits, chunk by chunk of rows: keeps the logits (their dtype) and each row's log-sum-exp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int,
                dtype: torch.dtype) -> torch.Tensor:
        step = _step(logits, dtype)
        parts = [torch.logsumexp(chunk.to(dtype), dim=-1) for chunk in _rows(logits, step)]
        lse = parts[0] if len(parts) == 1 else torch.cat(parts)
        valid = target != ignore_index
        picked = logits.gather(1, target.masked_fill(~valid, 0).unsqueeze(1)).squeeze(1).to(dtype)
        loss = (lse - picked).masked_fill(~valid, 0).sum()
        ctx.save_for_backward(logits, target, lse)
        ctx.reduction, ctx.ignore_index, ctx.step = reduction, ignore_index, step
        return loss / valid.sum() if reduction == _MEAN else loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        logits, target, lse = ctx.saved_tensors
        valid = target != ctx.ignore_index
        scale = grad / valid.sum() if ctx.reduction == _MEAN else grad
        row_scale = torch.where(valid, scale, 0).to(lse.dtype).unsqueeze(1)   # ignored rows: no gradient
        safe = target.masked_fill(~valid, 0).unsqueeze(1)
        out = torch.empty_like(logits)
        for x, m, t, r, o in zip(*(_rows(v, ctx.step) for v in (logits, lse.unsqueeze(1), safe, row_scale, out)),
                                 strict=True):
            p = x.to(lse.dtype, copy=True).sub_(m).exp_()   # the softmax
            p.scatter_add_(1, t, torch.full_like(t, -1, dtype=p.dtype))
            o.copy_(p.mul_(r))
        return out, None, None, None, None


def _lean(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None, reduction: int = _MEAN,
          ignore_index: int = -100, *, dtype: torch.dtype) -> torch.Tensor:
    if weight is not None or reduction not in (_MEAN, _SUM) or logits.dim() != 2 or target.dim() != 1:
        raise AutoparError("autopar::cross_entropy takes [N, C] logits and [N] class indices, no weight, and a "
                           f"mean or sum (reduction 1 or 2); got logits {tuple(logits.shape)}, target "
                           f"{tuple(target.shape)}, weight {weight is not None}, reduction {reduction}")
    return LeanCrossEntropy.apply(logits, target, reduction, ignore_index, dtype)


_LIB.impl("cross_entropy", _lean, "CompositeImplicitAutograd")
LEAN = torch.ops.autopar.cross_entropy.default
LOSSES = (CROSS_ENTROPY, LEAN)


# ----------------------------------------------------------------------------
# Capture: each cross-entropy over class indices made lean
# ----------------------------------------------------------------------------

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}
_CASTS = {aten.to.dtype, aten._to_copy.default}
_ASSERT = aten._assert_tensor_metadata.default


def lean_losses(graph: fx.Graph) -> int:
    """Rewrite each ``aten.cross_entropy_loss`` the lean loss can compute (class indices, no weight
    or label smoothing, a mean or a sum, logits [N, C] in fp32 or fp64) into ``autopar::cross_entropy``
    in place (its name, users and value unchanged), absorbing an upcast of the logits that feeds
    only it. Returns how many were rewritten."""
    done = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is CROSS_ENTROPY]:
        logits, target, weight, reduction, ignore_index, smoothing = _loss_args(node)
        lv, tv = tensor_val(logits), tensor_val(target)
        if (weight is not None or smoothing != 0.0 or reduction not in (_MEAN, _SUM) or lv is None or tv is None
                or lv.dim() != 2 or tv.dim() != 1 or tv.dtype.is_floating_point
                or lv.dtype not in (torch.float32, torch.float64)):
            continue
        _absorb_upcast(graph, logits)
        tail = () if (reduction, ignore_index) == (_MEAN, -100) else (None, reduction, ignore_index)
        node.target, node.args, node.kwargs = LEAN, (logits, target, *tail), {"dtype": lv.dtype}
        done += 1
    return done


def _loss_args(node: fx.Node) -> tuple:
    """(logits, target, weight, reduction, ignore_index, label_smoothing) of an aten cross-entropy."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    defaults = (None, _MEAN, -100, 0.0)
    rest = [node.args[2 + i] if len(node.args) > 2 + i else node.kwargs.get(k, d)
            for i, (k, d) in enumerate(zip(names, defaults, strict=True))]
    return (node.args[0], node.args[1], *rest)


def _absorb_upcast(graph: fx.Graph, logits: fx.Node) -> None:
    """Where ``logits`` is (views of) a cast of floating values to a dtype at least as wide, read
    by nothing else, make the views read the cast's input (their values recomputed): the loss
    upcasts chunk by chunk instead."""
    chain, x = [], logits
    while x.op == "call_function" and x.target in _VIEWS and len(x.users) == 1:
        chain.append(x)
        x = x.args[0]
    if not chain or x.op != "call_function" or x.target not in _CASTS or not isinstance(x.args[0], fx.Node):
        return
    source, cast = tensor_val(x.args[0]), tensor_val(x)
    readers = [u for u in x.users if u.target is not _ASSERT]
    extra = set(x.kwargs) - {"dtype", "copy", "non_blocking"} if x.target is aten._to_copy.default else set()
    if (source is None or cast is None or readers != [chain[-1]] or extra or not source.dtype.is_floating_point
            or source.dtype.itemsize > cast.dtype.itemsize):
        return
    chain[-1].replace_input_with(x, x.args[0])
    for view in reversed(chain):
        val = tensor_val(view.args[0])
        with val.fake_mode:
            view.meta["val"] = view.target(val, *view.args[1:], **view.kwargs)
    for check in [u for u in x.users if u.target is _ASSERT]:
        graph.erase_node(check)
    graph.erase_node(x)


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
    return 2.0 * (rows if isinstance(rows, int) and rows < chunk else chunk) * vocab * dtype.itemsize

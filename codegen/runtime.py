"""The few helpers generated code calls. Each one is a named step a Megatron engineer would
recognise: shard an input, redistribute (a collective), run an op on local shards, gather.

Tensors in generated code are DTensors with global shapes. Ops run on each rank's shards
(``local_op``): the plan's rule says which shards make the local result exact, and the output is
declared with exactly the planned placement. Only ops with shape arguments (view, reshape,
expand) go through DTensor's own dispatch, which translates global shapes to local ones.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed._local_tensor import LocalTensor, local_tensor_mode, rank_map
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from autopar.core.errors import AutoparError
from autopar.core.placements import grad_placement

aten = torch.ops.aten


class PlacementMismatchError(AutoparError):
    """An op produced another placement than the plan said (a rule bug; strict mode only)."""


STRICT = os.environ.get("AUTOPAR_STRICT", "0") == "1"


def own_storage(t: DTensor) -> DTensor:
    """Give every rank its own copy of a shard. Under LocalTensorMode (all ranks in one process) a
    replica is one plain tensor shared by all ranks: in-place updates would hit it once per rank,
    and collectives over it would not see per-rank values. A no-op on real processes."""
    local = t.to_local()
    if local_tensor_mode() is None or isinstance(local, LocalTensor):
        return t
    copies = rank_map(lambda _rank: local.clone())
    return DTensor.from_local(copies, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def shard_input(t: Any, mesh: DeviceMesh, placements: Sequence[Placement]) -> Any:
    """Every rank holds the full input: keep this rank's slice, no communication."""
    if not isinstance(t, torch.Tensor):
        return t
    return own_storage(distribute_tensor(t, mesh, list(placements), src_data_rank=None))


def replicated(t: Any, mesh: DeviceMesh) -> Any:
    """A tensor the graph created (arange, ones...) or a buffer: identical on every rank."""
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
        return own_storage(DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False))
    return t


def redistribute(t: DTensor, placements: Sequence[Placement]) -> DTensor:
    """Change placement: all-gather, all-reduce, reduce-scatter or all-to-all (its backward is the dual)."""
    if _same(t.placements, placements):
        return t
    if not t.is_contiguous():  # a gathered shard is contiguous: keep DTensor's stride in step
        t = t.contiguous()
    # Replicate -> Partial is local (DTensor keeps it internal): reach Replicate first, then split.
    to_partial = [isinstance(w, Partial) and not h.is_partial() for h, w in zip(t.placements, placements)]
    first = [Replicate() if p else (h if h.is_partial() and isinstance(w, Partial) else w)
             for h, w, p in zip(t.placements, placements, to_partial)]
    if not _same(t.placements, first):
        t = _contiguous_shards(t.redistribute(t.device_mesh, first))
    return _replicate_to_partial(t, placements) if any(to_partial) else t


def _contiguous_shards(t: DTensor) -> DTensor:
    """Collectives (all-to-all of uneven shards) can return a shard laid out unlike the contiguous
    stride DTensor records; a later view would then fail. Copy the shard into that layout."""
    grad = tuple(Replicate() if p.is_partial() else p for p in t.placements)
    local = _LocalShard.apply(t, grad).contiguous()
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def _replicate_to_partial(t: DTensor, placements: Sequence[Placement]) -> DTensor:
    """Each rank keeps 1/n of a replicated value, so the ranks' sum is the value. Differentiable:
    the gradient reaching the replicated input is partial (its sum over ranks is the true grad)."""
    mesh = t.device_mesh
    n, grad_placements = 1, []
    for h, w, size in zip(t.placements, placements, mesh.shape):
        if isinstance(w, Partial) and not h.is_partial():
            n *= size
            grad_placements.append(Partial())
        else:
            grad_placements.append(Replicate() if h.is_partial() else h)
    local = _LocalShard.apply(t, tuple(grad_placements)) / n
    return DTensor.from_local(local, mesh, list(placements), run_check=False, shape=t.shape, stride=t.stride())


def _same(have: Sequence[Placement], want: Sequence[Placement]) -> bool:
    return all(_same_one(h, w) for h, w in zip(have, want))


def _same_one(h: Placement, w: Placement) -> bool:
    if isinstance(w, Partial):
        return h.is_partial() and getattr(h, "reduce_op", "sum") == w.reduce_op
    return h == w


def as_planned(t: Any, placements: Sequence[Placement], where: str) -> Any:
    """Check a DTensor-dispatched op's output placement against the plan (strict mode: a rule bug)."""
    if not isinstance(t, DTensor) or _same(t.placements, placements):
        return t
    msg = f"{where}: DTensor produced {t.placements}, plan says {tuple(placements)}"
    if STRICT:
        raise PlacementMismatchError(msg)
    warnings.warn(f"autopar: {msg}; redistributing", stacklevel=2)
    return redistribute(t, placements)


def _wrap(out: Any, mesh: DeviceMesh, placements: Sequence[Placement], shape: Any) -> Any:
    """Declare local results as DTensors of the given global shape(s) and planned placement."""
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, mesh, placements, s) for o, s in zip(out, shape))
    out = out.contiguous()  # kernels such as CPU flash attention return permuted layouts
    return DTensor.from_local(out, mesh, list(placements), run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def local_op(op: Any, args: tuple, kwargs: dict, placements: Sequence[Placement], mesh: DeviceMesh,
             shape: Any) -> Any:
    """Run ``op`` on each rank's shards (inputs already placed as the rule needs, so the local
    result is exact) and declare the result with the planned placement and global ``shape``."""
    local_args, local_kwargs = _to_local((args, kwargs), placements)
    return _wrap(op(*local_args, **local_kwargs), mesh, placements, shape)


def _to_local(tree: Any, out_placements: Sequence[Placement]) -> Any:
    """Local shards of every DTensor in ``tree``, each declaring where its gradient will come
    back (a replicated input of a split op receives a partial gradient)."""
    inputs = [d.placements for d in pytree.tree_leaves(tree) if isinstance(d, DTensor)]
    return pytree.tree_map_only(
        DTensor, lambda d: _LocalShard.apply(d, grad_placement(d.placements, inputs, out_placements)), tree)


class _LocalShard(torch.autograd.Function):
    """``DTensor.to_local`` whose backward declares the gradient's global shape and stride instead
    of inferring them from per-rank local shapes (which are symbolic for uneven shards under
    LocalTensorMode)."""

    @staticmethod
    def forward(ctx: Any, t: DTensor, grad_placements: tuple[Placement, ...]) -> torch.Tensor:
        ctx.mesh, ctx.grad_placements, ctx.shape = t.device_mesh, grad_placements, t.shape
        return t._local_tensor.view_as(t._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:
        return DTensor.from_local(grad.contiguous(), ctx.mesh, list(ctx.grad_placements), run_check=False,
                                  shape=ctx.shape, stride=_contiguous_stride(ctx.shape)), None


def sharded_embedding(weight: DTensor, ids: DTensor, padding_idx: int = -1, *, placements: Sequence[Placement],
                      shape: Sequence[int]) -> DTensor:
    """Embedding lookup on shards. Where the table is split by rows (vocabulary parallel), each rank
    looks up the ids it owns and contributes zeros for the rest: the output is a partial sum.
    ``padding_idx`` (a global row; negative: none) as in ``aten.embedding``: its row gets no gradient."""
    mesh = weight.device_mesh
    w, i = _to_local((weight, ids), placements)
    vocab_axes = [a for a, p in enumerate(weight.placements) if p == Shard(0)]
    if not vocab_axes:
        return _wrap(aten.embedding.default(w, i, padding_idx), mesh, placements, shape)
    lo = rank_map(lambda r: torch.tensor(_rows_owned(mesh, r, vocab_axes, weight.shape[0])[0]))
    hi = rank_map(lambda r: torch.tensor(_rows_owned(mesh, r, vocab_axes, weight.shape[0])[1]))
    outside = (i < lo) | (i >= hi)
    out = aten.embedding.default(w, torch.where(outside, 0, i - lo))
    out = out * (~outside).unsqueeze(-1).to(out.dtype)
    if padding_idx >= 0:   # the local row index differs per rank: block its gradient by position
        out = torch.where((i == padding_idx).unsqueeze(-1), out.detach(), out)
    return _wrap(out, mesh, placements, shape)


def _rows_owned(mesh: DeviceMesh, rank: int, axes: Sequence[int], rows: int) -> tuple[int, int]:
    """[start, stop) of the table rows global ``rank`` holds when dim 0 is split over ``axes``
    (DTensor splits like torch.chunk, axis by axis in mesh order)."""
    coords = (mesh.mesh == rank).nonzero()[0].tolist()
    start, size = 0, rows
    for a in axes:
        chunk = math.ceil(size / mesh.shape[a])
        begin = min(coords[a] * chunk, size)
        start, size = start + begin, max(0, min(chunk, size - begin))
    return start, start + size


def sharded_cross_entropy(logits: DTensor, target: DTensor, weight=None, reduction: int = 1,
                          ignore_index: int = -100, label_smoothing: float = 0.0, *,
                          placements: Sequence[Placement]) -> DTensor:
    """Cross-entropy over a batch split across ranks, exact for uneven splits and ignored targets:
    the sum of local losses (a partial sum) divided by the global count of counted targets."""
    mesh = logits.device_mesh
    local_logits, local_target = _to_local((logits, target), placements)
    log_probs = torch.log_softmax(local_logits, dim=-1)
    local_sum = aten.nll_loss_forward.default(log_probs, local_target, weight, 2, ignore_index)[0]
    loss = DTensor.from_local(local_sum, mesh, list(placements), run_check=False, shape=torch.Size([]), stride=())
    if reduction == 2:
        return loss
    count = (local_target != ignore_index).sum().to(local_sum.dtype)
    total = DTensor.from_local(count, mesh, list(placements), run_check=False, shape=torch.Size([]), stride=())
    return loss / total.redistribute(mesh, [Replicate()] * mesh.ndim)


def full(t: Any) -> Any:
    """Gather a DTensor output into the full tensor every rank returns."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def sync_grad_to(param: DTensor) -> None:
    """Gradient synchronisation: reduce a parameter's gradient into the parameter's own placement
    (all-reduce for replicated parameters, reduce-scatter for sharded/ZeRO-3 ones). The collective
    is only launched here (``async_op``): it runs while the backward goes on, and the gradient is
    waited for when first used (the optimizer step)."""
    placements = list(param.placements)
    param.register_hook(lambda g: g.redistribute(g.device_mesh, placements, async_op=True)
                        if isinstance(g, DTensor) and not _same(g.placements, placements) else g)

"""The few helpers generated code calls. Each one is a named step a Megatron engineer would
recognise: shard an input, redistribute (a collective), run an op on local shards, gather.

Tensors in generated code are DTensors: their shapes are global, so shape arguments of views
stay as the model wrote them and DTensor translates them to local ones, uneven shards included.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError

aten = torch.ops.aten


class PlacementMismatchError(AutoparError):
    """An op produced another placement than the plan said (a rule bug; strict mode only)."""


STRICT = os.environ.get("AUTOPAR_STRICT", "0") == "1"


def shard_input(t: Any, mesh: DeviceMesh, placements: Sequence[Placement]) -> Any:
    """Every rank holds the full input: keep this rank's slice, no communication."""
    if not isinstance(t, torch.Tensor):
        return t
    return distribute_tensor(t, mesh, list(placements), src_data_rank=None)


def replicated(t: Any, mesh: DeviceMesh) -> Any:
    """A tensor the graph created (arange, ones...) is identical on every rank."""
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
        return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return t


def redistribute(t: DTensor, placements: Sequence[Placement]) -> DTensor:
    """Change placement: all-gather, all-reduce, reduce-scatter or all-to-all (its backward is the dual)."""
    if _same(t.placements, placements):
        return t
    # Replicate -> Partial is local (DTensor keeps it internal): do the rest first, then split.
    to_partial = [isinstance(w, Partial) and not h.is_partial() for h, w in zip(t.placements, placements)]
    first = [h if p else w for h, w, p in zip(t.placements, placements, to_partial)]
    if not _same(t.placements, first):
        t = t.redistribute(t.device_mesh, first)
    return _replicate_to_partial(t, placements) if any(to_partial) else t


def _replicate_to_partial(t: DTensor, placements: Sequence[Placement]) -> DTensor:
    """Each rank keeps 1/n of a replicated value, so the ranks' sum is the value. Differentiable:
    the gradient reaching this replicated input is partial (its sum over ranks is the true grad)."""
    mesh = t.device_mesh
    grad_placements = [w if isinstance(w, Partial) else h for h, w in zip(t.placements, placements)]
    n = 1
    for h, w, size in zip(t.placements, placements, mesh.shape):
        if isinstance(w, Partial) and not h.is_partial():
            n *= size
    local = t.to_local(grad_placements=grad_placements) / n
    return DTensor.from_local(local, mesh, list(placements), run_check=False, shape=t.shape, stride=t.stride())


def _same(have: Sequence[Placement], want: Sequence[Placement]) -> bool:
    return all(_same_one(h, w) for h, w in zip(have, want))


def _same_one(h: Placement, w: Placement) -> bool:
    if isinstance(w, Partial):
        return h.is_partial() and getattr(h, "reduce_op", "sum") == w.reduce_op
    return h == w


def as_planned(t: Any, placements: Sequence[Placement], where: str) -> Any:
    """Check an op's output placement against the plan; redistribute if DTensor chose otherwise."""
    if not isinstance(t, DTensor) or _same(t.placements, placements):
        return t
    msg = f"{where}: DTensor produced {t.placements}, plan says {tuple(placements)}"
    if STRICT:
        raise PlacementMismatchError(msg)
    warnings.warn(f"autopar: {msg}; redistributing", stacklevel=2)
    return t.redistribute(t.device_mesh, list(placements))


def local_op(op: Any, args: tuple, kwargs: dict, placements: Sequence[Placement], mesh: DeviceMesh,
             shape: Sequence[int]) -> DTensor:
    """Run ``op`` on each rank's shards (inputs already placed so this is exact) and rewrap.

    ``shape`` is the global shape export recorded (uneven shards need it given). The shard is
    made contiguous so the layout DTensor is told matches the one it holds (kernels such as CPU
    flash attention return permuted layouts)."""
    local_args, local_kwargs = pytree.tree_map_only(DTensor, lambda d: d.to_local(), (args, kwargs))
    out = op(*local_args, **local_kwargs).contiguous()
    return DTensor.from_local(out, mesh, list(placements), run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def sharded_cross_entropy(logits: DTensor, target: DTensor, weight=None, reduction: int = 1,
                          ignore_index: int = -100, label_smoothing: float = 0.0, *,
                          placements: Sequence[Placement]) -> DTensor:
    """Cross-entropy over a batch split across ranks, exact for uneven splits and ignored targets:
    the sum of local losses (a partial sum) divided by the global count of counted targets."""
    mesh = logits.device_mesh
    local_sum = aten.cross_entropy_loss.default(logits.to_local(), target.to_local(), weight, 2,
                                                ignore_index, label_smoothing)
    loss = DTensor.from_local(local_sum, mesh, list(placements), run_check=False, shape=torch.Size([]), stride=())
    if reduction == 2:
        return loss
    count = (target.to_local() != ignore_index).sum().to(local_sum.dtype)
    total = DTensor.from_local(count, mesh, list(placements), run_check=False, shape=torch.Size([]), stride=())
    return loss / total.redistribute(mesh, [Replicate()] * mesh.ndim)


def full(t: Any) -> Any:
    """Gather a DTensor output into the full tensor every rank returns."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def sync_grad_to(param: DTensor) -> None:
    """Gradient synchronisation: reduce a parameter's gradient into the parameter's own placement
    (all-reduce for replicated parameters, reduce-scatter for sharded/ZeRO-3 ones)."""
    placements = list(param.placements)
    param.register_hook(lambda g: g.redistribute(g.device_mesh, placements)
                        if isinstance(g, DTensor) and not _same(g.placements, placements) else g)

"""ZeRO-3 parameters gathered as FSDP2 gathers them: in groups, one collective per group.

Parameters stored split over a mesh axis and used whole on it (``codegen.generate.gather_groups``
picks them) are gathered group by group, in the order the forward first uses them: each
group's shards are concatenated and all-gathered in one collective, and the next group's
all-gather is launched as soon as this one is waited for, so it runs while this group computes
(prefetch). In the backward, the gradients of a group's gathered parameters are packed the
same way and reduce-scattered in one collective, launched when the group's last gradient is
ready and waited for when the backward ends (``GradSync.later``), which hands each shard its
gradient. Gathered copies are freed when the backward no longer needs them, as autograd frees
any saved tensor.

A ZeRO-2 group (``GatherSpec.kept``) is gathered the same way but once a step: its gathered copy
is kept and reused while no optimizer has stepped (a global ``torch.optim`` step hook counts the
steps) and its shards' version counters have not moved (an in-place write; simulated ranks do not
count those): microbatches and evaluation forwards reuse it, the first forward after
``optimizer.step()`` gathers again. Its gradients are reduce-scattered as ZeRO-3's: gradients and optimizer states
stay sharded, as in DeepSpeed's ZeRO stage 2.

A ZeRO-1 group (``GatherSpec.accumulated``) is kept as ZeRO-2's, but its packed gradients are
summed on the device over a step's microbatches (``GradSync.sync`` off) and reduce-scattered once,
in the last backward, as Megatron's distributed optimizer does: one reduce-scatter a step for a
whole gradient held all step.

An offloaded group (``GatherSpec.offloaded``) keeps its shards in host memory, where their
gradients and optimizer states follow them (the optimizer steps there): its shards are copied to
the device before the all-gather, and its reduce-scattered gradient is handed to the host shards
once the next offloaded group launches its own (``GradSync.later``), so that one at most waits
on the device, as FSDP2's ``CPUOffloadPolicy`` bounds it.

A parameter split on the same dimension over two axes, gathered over one and read split over the
other (a tensor-parallel weight under ZeRO-3 on the data-parallel axis), is stored as FSDP2 with
tensor parallelism stores it (``stored_as``): each tensor-parallel shard split over the gathered
axis, so that the group's all-gather yields the shard the ops read.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.optim.optimizer import register_optimizer_step_post_hook

from autopar.core.collectives import axes_group
from codegen.grad_sync import GradSync
from codegen.recompute import recomputing


@dataclass(frozen=True)
class GatherSpec:
    """One group: its parameters (FQNs, in first-use order), the mesh axes they are gathered
    over (one, or all of a mesh spanning the job) and, per parameter, the tensor dimension split
    over those axes."""

    fqns: tuple[str, ...]
    axes: tuple[int, ...]
    dims: tuple[int, ...]
    kept: bool = False   # ZeRO-2: gathered once a step, the copy kept until the shards change
    offloaded: bool = False   # shards (their gradients, optimizer states) in host memory: copied to the device to gather
    accumulated: bool = False   # ZeRO-1: gradients summed whole over a step's microbatches, reduce-scattered in the last
    frozen: frozenset[str] = frozenset()   # those that do not train: gathered with the others, no gradient back


def stored_as(storage: Sequence[Placement], spec: GatherSpec, mesh_shape: Sequence[int]) -> list[Placement]:
    """The placements a parameter of group ``spec`` is stored with: as planned, except that a
    dimension also split on a later mesh axis is split on the gathered axis inside each of those
    shards (DTensor's ``_StridedShard``: split right to left, as FSDP2 with TP stores it). Split in
    DTensor's own order (left to right), a gather over the first axis would not give the shard
    the second axis reads."""
    placements = list(storage)
    for a in spec.axes:
        p = storage[a]
        later = [b for b in range(a + 1, len(storage)) if b not in spec.axes and storage[b] == p]
        if isinstance(p, Shard) and later:
            placements[a] = _StridedShard(p.dim, split_factor=math.prod(mesh_shape[b] for b in later))
    return placements


_STEPS = [0]   # optimizer steps taken in this process (any optimizer): kept copies older than one are stale


def _count_step(*_: Any) -> None:
    _STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


class GatheredParams:
    """The groups of one module, gathered on demand (``gather``) with the next one prefetched."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, specs: Sequence[GatherSpec], grad_sync: GradSync,
                 device: torch.device, groups: Sequence[int] | None = None) -> None:
        """``groups``: the indices of ``specs`` this module holds, in forward order (a pipeline
        stage's; default all): each prefetches the next."""
        self.mesh = mesh
        self.device = device
        self.groups = list(range(len(specs))) if groups is None else list(groups)
        self.specs = {k: specs[k] for k in self.groups}
        self.params = {k: [module.get_parameter(f) for f in specs[k].fqns] for k in self.groups}
        self.trains = {k: [f not in specs[k].frozen for f in specs[k].fqns] for k in self.groups}
        self._next = dict(zip(self.groups, self.groups[1:], strict=False))
        self.grad_sync = grad_sync
        for group in self.params.values():
            for p in group:
                p._local_tensor.requires_grad_(p.requires_grad)
        self._prefetched: dict[int, torch.Tensor] = {}
        self._summed: dict[int, torch.Tensor] = {}   # ZeRO-1 group -> its packed gradients of the step so far
        self._kept: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}   # ZeRO-2 group -> (shard versions, copy)

    def gather(self, k: int) -> tuple[torch.Tensor, ...]:
        """Group ``k``'s parameters, whole on the gathered axis; launches group ``k + 1``'s gather."""
        if k == self.groups[0]:   # a new forward: parameters may have changed since the last prefetch
            self._prefetched.clear()
        flat = self._kept_copy(k)
        if flat is None:
            flat = self._prefetched.pop(k, None)
            flat = funcol.wait_tensor(flat if flat is not None else self._launch(k))
            if self.specs[k].kept:
                self._kept[k] = (self._versions(k), flat)
        # a block run again for the backward: no forward follows
        later = self._next.get(k)
        if later is not None and not recomputing() and self._kept_copy(later) is None:
            self._prefetched[later] = self._launch(later)
        locals_ = [p._local_tensor for p in self.params[k]]
        return _Gather.apply(self, k, flat, *locals_)

    def _versions(self, k: int) -> tuple[int, ...]:
        return (_STEPS[0], *[p._local_tensor._version for p in self.params[k]])

    def _kept_copy(self, k: int) -> torch.Tensor | None:
        """ZeRO-2 group ``k``'s gathered copy, if its shards have not changed since it was made (a
        stale one is dropped now, before its replacement is gathered)."""
        kept = self._kept.get(k)
        if kept is not None and kept[0] != self._versions(k):
            del self._kept[k]
            return None
        return kept[1] if kept is not None else None

    def _launch(self, k: int) -> torch.Tensor:
        flat = torch.cat([p._local_tensor.detach().reshape(-1) for p in self.params[k]])
        if self.specs[k].offloaded:
            flat = flat.to(self.device, non_blocking=True)
        return funcol.all_gather_single(flat, 0, axes_group(self.mesh, self.specs[k].axes))

    def _size(self, k: int) -> int:
        return math.prod([self.mesh.size(a) for a in self.specs[k].axes])   # a list: torch.compile traces no generator here


class _Gather(torch.autograd.Function):
    """Unpack a group's all-gathered shards into whole parameters; backward: pack their gradients
    and launch one reduce-scatter, handed to gradient sync (the shards get no autograd gradient).
    Frozen parameters (``GatherSpec.frozen``) come out without a gradient, and none goes back."""

    @staticmethod
    def forward(ctx: Any, owner: GatheredParams, k: int, gathered: torch.Tensor, *shards: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.owner, ctx.k = owner, k
        ctx.shapes = [s.shape for s in shards]
        n = owner._size(k)
        rows = gathered.view(n, -1)   # one row per rank of the axis, in mesh order
        out, offset = [], 0
        for shard, dim in zip(shards, owner.specs[k].dims, strict=True):
            piece = rows[:, offset:offset + shard.numel()].reshape(n, *shard.shape)
            whole = list(shard.shape)
            whole[dim] *= n
            out.append(piece.movedim(0, dim).reshape(whole))
            offset += shard.numel()
        ctx.mark_non_differentiable(*[t for t, trains in zip(out, owner.trains[k], strict=True) if not trains])
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        owner, k = ctx.owner, ctx.k
        n = owner._size(k)
        trains = owner.trains[k]
        trained = _trained(grads, trains)
        packed, like = [], next(g for g in trained if g is not None)
        for g, shape, dim in zip(trained, _trained(ctx.shapes, trains), _trained(owner.specs[k].dims, trains), strict=True):
            whole = list(shape)
            whole[dim] *= n
            if g is None:
                g = like.new_zeros(whole)
            split = g.reshape(*whole[:dim], n, shape[dim], *whole[dim + 1:]).movedim(dim, 0)
            packed.append(split.reshape(n, -1))
        flat = torch.cat(packed, dim=1).reshape(-1)
        if owner.specs[k].accumulated:   # ZeRO-1: summed here until the backward that synchronises
            if k in owner._summed:
                flat = flat + owner._summed.pop(k)
            if not owner.grad_sync.sync:
                owner._summed[k] = flat
                return (None, None, None) + (None,) * len(ctx.shapes)
        reduced = funcol.reduce_scatter_single(owner.grad_sync.wire(flat), "sum", 0,
                                               axes_group(owner.mesh, owner.specs[k].axes))
        owner.grad_sync.later(_trained(owner.params[k], trains), reduced, to_host=owner.specs[k].offloaded)
        return (None, None, None) + (None,) * len(ctx.shapes)


def _trained(items: Sequence[Any], trains: Sequence[bool]) -> list[Any]:
    """The items of a group's parameters that train."""
    return [x for x, t in zip(items, trains, strict=True) if t]



def gather_params(module: nn.Module, k: int) -> tuple[torch.Tensor, ...]:
    """Generated code's call: group ``k`` of ``module``'s ZeRO-3 parameters, whole where used."""
    return module._autopar_gather.gather(k)

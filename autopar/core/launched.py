"""Outputs whose collective is deferred: carried with the gradients, or run when first read.

The loop users write (``loss = model(**batch).loss; loss.backward(); opt.step()``) reads the loss
now and then (``loss.item()`` on rank 0 every few steps) and the logits rarely. The module still
promises one device's outputs on every rank, so the sum of the loss's summands and the gather of
a split output are collectives:

* the loss's sum (a number or two) rides in the gradients' all-reduce of the backward through it
  (``carry_deferred``: a bucket carries it, as ``train_step``'s), so a loop that reads it after
  its backward or never pays no collective of its own for it: that one all-reduce cost a small
  model's plain loop on a shared CPU host about 5% of its step (``benchmarks/RESULTS.md``). Read
  before its backward, it is summed at once on the read groups, and every rank must read it then
  (a rank reading alone is told so after ``READ_TIMEOUT``: its peers sum it in their backward);
* an evenly split output (a language model's logits, batch x sequence x vocabulary) is gathered
  only when first read, on every rank, in the same order (as DTensor's ``full_tensor()``): a loop
  that never reads it pays nothing for it, as DDP's. The gather runs on process groups of its
  own (``prepare_reads``), so a rank waiting for others to read blocks none of the step's
  collectives; a rank whose peers do not read within ``READ_TIMEOUT`` raises an
  ``AutoparError`` that says so, and peers reading different outputs are told so, never handed
  each other's.

``Pending`` is the tensor handed out: a wrapper subclass with the output's shape and dtype whose
every op waits for the value first (as ``AsyncCollectiveTensor`` does); the backward's seed
(``ones_like``) reads only its shape. Its collectives are c10d's, not functional ones: an output
nobody reads drops its work with it, where a functional collective never waited for stays
registered, holding its buffers, and warns at exit ("unwaited collective calls").

No collective launched in a forward stays in flight past its step: every one is waited for
(``settle``) when the backward through the loss ends, when the next step starts, at once where
grad is disabled (an evaluation: no backward follows), and at exit. A process group destroyed
under a collective still running aborts the process (gloo: "terminate called without an active
exception").
"""
from __future__ import annotations

import atexit
import functools
import gc
import itertools
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from autopar.core.errors import AutoparError
from autopar.core.placements import evenly_split, shard_range
from autopar.core.together import one_process

#: ops that read only a tensor's metadata: the backward's seed and its like
_METADATA_ONLY = {torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
                  torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default}


#: the waits of collectives launched into outputs and not waited for yet (``settle``)
_IN_FLIGHT: list[Callable[[], Any]] = []


#: Sums over ranks made but not launched yet, in the order they were made (``_Deferred``)
_DEFERRED: list[_Deferred] = []


def launch_deferred() -> None:
    """Launch every deferred sum, in the order made: before any collective that follows them
    (a gradient bucket, the next step), so that every rank launches them in one order."""
    while _DEFERRED:
        _DEFERRED[0].launch()   # takes itself off the list


def _launch_uncarriable() -> None:
    """Launch the deferred sums no gradient bucket may carry (in order; the others wait for the
    gradient sync's ``carry_deferred`` or ``settle``)."""
    for deferred in [d for d in _DEFERRED if not d.carriable]:
        deferred.launch()


def settle() -> None:
    """Launch what is deferred, then wait for every collective launched into an output so far
    (long done, at a step's end)."""
    launch_deferred()
    while _IN_FLIGHT:
        _IN_FLIGHT.pop()()


@atexit.register
def _settle_at_exit() -> None:
    """Settle, then free what cycles hold before the interpreter tears down: outputs and their
    autograd records freed that late, after the process group, now and then aborted a gloo
    process as it ended ("terminate called without an active exception")."""
    try:
        settle()
    except Exception:  # noqa: BLE001 - its process group is gone: nothing is on its way
        _IN_FLIGHT.clear()
    gc.collect()


def handed_over(values: Sequence[Any]) -> Sequence[Any]:
    """``values``, a forward's outputs (or a step's loss), as handed to the caller: a functional
    collective still on its way into one (the paths ``Pending`` does not take) is waited for with
    the others (``settle``); all of them at once where grad is disabled (no backward follows)."""
    for value in values:
        local = value._local_tensor if isinstance(value, DTensor) else value
        if isinstance(local, funcol.AsyncCollectiveTensor) and not local.completed:
            if one_process():   # simulated ranks: nothing runs in the background (nor outlives this mesh)
                local.trigger_wait()
            else:
                _IN_FLIGHT.append(functools.partial(funcol.wait_tensor, local.elem))
    if not torch.is_grad_enabled():
        settle()
    return values


def _launch(work: Any, make: Callable[[], torch.Tensor]) -> _Cell:
    """The value ``make`` makes once ``work``, a c10d collective just launched, is done; the work
    counted in flight until ``settle``."""
    cell = _Cell(work, make)
    _IN_FLIGHT.append(cell.wait)
    return cell


class _Cell:
    """A value on its way: ``work``'s collective, then ``make`` makes the value, once. The work is
    let go as soon as it is waited for: one kept by an output that outlives the process group
    could abort the process at exit."""

    def __init__(self, work: Any, make: Callable[[], torch.Tensor]) -> None:
        self._work, self._make = work, make
        self._value: torch.Tensor | None = None

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def value(self) -> torch.Tensor:
        if self._make is not None:
            self.wait()
            self._value, self._make = self._make(), None
        return self._value


class _Deferred(_Cell):
    """The sum over ``group`` of ``buffer`` (this rank's summand), made by a forward.

    Where ``read_group`` is given (a module's mesh with ``prepare_reads``' groups), the sum rides
    in the gradients' all-reduce of the backward through it (``carry_deferred``: a gradient bucket
    takes it, as ``train_step``'s loss), so that a loop that reads it after its backward, or never,
    pays no collective for it. A read before that backward sums it on ``read_group`` at once
    (every rank reading it there, as a split output's gather; a rank reading it alone waits
    ``READ_TIMEOUT`` and is told so); one no backward takes (an evaluation forward) is summed there
    at the next step, when grad is disabled, or at exit. Elsewhere (pipeline stages) it is
    launched on ``group`` at the first of those moments or as the backward begins. Every rank
    makes the same choices in the same order (``launch_deferred``)."""

    def __init__(self, buffer: torch.Tensor, group: dist.ProcessGroup, read_group: dist.ProcessGroup | None,
                 mesh: DeviceMesh, axes: tuple[int, ...]) -> None:
        super().__init__(None, lambda: buffer)
        self._buffer, self._group, self._read_group = buffer, group, read_group
        self.mesh, self.axes = mesh, axes
        self._carried: Any = None   # the gradient bucket's ``Carried`` that sums it
        self._read: torch.Tensor | None = None   # the sum, read before the backward (on ``read_group``)
        _DEFERRED.append(self)

    @property
    def summand(self) -> torch.Tensor:
        return self._buffer

    @property
    def carriable(self) -> bool:
        return self._read_group is not None

    def launch(self) -> None:
        """Launch the sum (and every deferred sum made before it, first) unless launched or
        carried: on the read group where it has one (unless summed there already)."""
        if self in _DEFERRED:
            while _DEFERRED[0] is not self:
                _DEFERRED[0].launch()
            _DEFERRED.pop(0)
            if self._read is None:
                self._work = dist.all_reduce(self._buffer, group=self._read_group or self._group, async_op=True)
                _IN_FLIGHT.append(self.wait)

    def carried_by(self, carried: Any) -> None:
        """A gradient bucket sums it (``carried``: its ``Carried``); read from there."""
        _DEFERRED.remove(self)
        self._carried = carried

    def value(self) -> torch.Tensor:
        if self._read is not None:
            return self._read
        if self._carried is not None:
            return self._carried_value()
        if self in _DEFERRED and self.carriable:   # read before its backward: the summand stays to be carried
            total = self._buffer.clone()
            _waited(dist.all_reduce(total, group=self._read_group, async_op=True), *_LOSS_READ)
            self._read = total
            return total
        self.launch()
        return super().value()

    def _carried_value(self) -> torch.Tensor:
        if self._carried.reduced is None:
            raise AutoparError("the loss was read during the backward through it (a hook?): its sum over ranks "
                               "rides in the gradients' all-reduce and is known when the backward ends. "
                               "Read it after backward()")
        return self._carried.value()


def carry_deferred(take: Callable[[_Deferred], Any]) -> None:
    """As a backward begins: offer every deferred sum made so far, in order, to ``take`` (a
    gradient sync's), which returns the ``Carried`` that sums it in a gradient bucket, or None;
    those it does not take are launched."""
    for deferred in list(_DEFERRED):
        carried = take(deferred) if deferred.carriable else None
        if carried is not None:
            deferred.carried_by(carried)
        else:
            deferred.launch()


class Pending(torch.Tensor):
    """An output on its way: shape, dtype and device now, the value when an op first reads it."""

    _cell: _Cell

    @staticmethod
    def __new__(cls, cell: _Cell, like: torch.Tensor, shape: Sequence[int]) -> Pending:
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=like.dtype, device=like.device,
                                                  requires_grad=False)
        out._cell = cell
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA_ONLY:   # no wait: a plain tensor shaped alike (the backward's seed)
            return func(_blank(args[0]), *args[1:], **kwargs)
        if func is torch.ops.aten.detach.default:   # the same value on its way, outside autograd
            return Pending(args[0]._cell, args[0], args[0].shape)
        args, kwargs = pytree.tree_map_only(Pending, lambda p: p._cell.value(), (args, kwargs))
        return func(*args, **kwargs)

    def wait(self) -> torch.Tensor:
        """The value, as a plain tensor (outside autograd)."""
        return self._cell.value()

    def tolist(self) -> Any:
        return self.wait().tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        return self.wait().numpy(*args, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return repr(self.wait())


def _blank(p: Pending) -> torch.Tensor:
    return torch.empty(p.shape, dtype=p.dtype, device=p.device)


class _Launched(torch.autograd.Function):
    """``cell``'s value as a differentiable ``Pending`` output of ``x``; ``backward`` maps the
    gradient of the value to ``x``'s."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cell: _Cell, shape: tuple[int, ...],
                backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.backward_fn = backward
        return Pending(cell, x, shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        _launch_uncarriable()   # a loss sum no gradient bucket may carry: the backward's first collective
        torch.autograd.Variable._execution_engine.queue_callback(settle)   # when this backward ends
        return ctx.backward_fn(grad), None, None, None


def summed(x: torch.Tensor, group: dist.ProcessGroup, mesh: DeviceMesh, axes: Sequence[int]) -> torch.Tensor:
    """The sum over ``group``'s ranks (mesh ``axes``) of every rank's ``x``, deferred
    (``_Deferred``: carried in the gradients' all-reduce, or summed where read first), waited for
    when read. Backward: each summand's gradient is the sum's (Megatron's reduce from the
    model-parallel region)."""
    reads = _read_groups(mesh)
    read_group = None if reads is None else reads[tuple(axes)] if len(axes) == 1 else reads[None]
    cell = _Deferred(x.detach().clone(), group, read_group, mesh, tuple(axes))
    return _Launched.apply(x, cell, tuple(x.shape), lambda grad: grad)


def gatherable(x: torch.Tensor, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int]) -> bool:
    """Can ``gathered`` gather ``x``: ``evenly_split`` on a mesh spanning the job where every axis
    splits it?"""
    split = [a for a, p in enumerate(have) if isinstance(p, Shard)]
    if len(split) > 1 and not (len(split) == mesh.ndim and mesh.size() == dist.get_world_size()):
        return False
    return evenly_split(have, shape, mesh.shape)


#: How long a rank that reads a split output waits for its peers to read it too.
READ_TIMEOUT = timedelta(seconds=300)

#: The process groups outputs are gathered on, per mesh (``prepare_reads``).
_READ_GROUPS: dict[tuple, dict[tuple[int, ...] | None, dist.ProcessGroup]] = {}

#: Split outputs made so far, counted alike on every rank: the tag that checks a gather's peers
#: read the same output.
_MADE = itertools.count()


def prepare_reads(mesh: DeviceMesh) -> None:
    """Make, on every rank at once (``compile``), the process groups split outputs are gathered on
    when read: one per axis of ``mesh`` and one for the job, apart from the step's, so that a rank
    waiting for its peers to read holds up none of the step's collectives. NCCL connects a group's
    ranks at its first collective, gloo's as it is made (once per mesh and process)."""
    key = _mesh_key(mesh)
    groups = _READ_GROUPS.get(key)
    if groups is None or not all(g in dist.distributed_c10d._world.pg_map for g in groups.values()):
        groups = {}
        for a in range(mesh.ndim):
            layout = mesh.mesh.movedim(a, -1).reshape(-1, mesh.shape[a]).tolist()
            groups[(a,)], _ = dist.new_subgroups_by_enumeration(layout, timeout=READ_TIMEOUT,
                                                                group_desc=f"autopar_reads_{a}")
        groups[None] = dist.new_group(timeout=READ_TIMEOUT, group_desc="autopar_reads")
        _READ_GROUPS[key] = groups
    _BY_MESH[id(mesh)] = (weakref.ref(mesh), groups)   # found again per forward without rebuilding the key


def _mesh_key(mesh: DeviceMesh) -> tuple:
    return mesh.device_type, tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()), id(dist.group.WORLD)


#: Each mesh's read groups, by the mesh's ``id`` (building ``_mesh_key`` walks the mesh's layout:
#: about 0.3 ms, once per forward otherwise); not an attribute of the mesh, which ``torch.compile``
#: guards on where a graph redistributes over it (and cannot copy a process group).
_BY_MESH: dict[int, tuple[weakref.ref, dict[tuple[int, ...] | None, dist.ProcessGroup]]] = {}


def _read_groups(mesh: DeviceMesh) -> dict[tuple[int, ...] | None, dist.ProcessGroup] | None:
    """The read groups ``prepare_reads`` made for ``mesh`` (this very mesh), or None."""
    entry = _BY_MESH.get(id(mesh))
    return entry[1] if entry is not None and entry[0]() is mesh else None


def gathered(x: torch.Tensor, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int],
             backward: Callable[[torch.Tensor], torch.Tensor],
             finish: Callable[[torch.Tensor], torch.Tensor] = lambda whole: whole) -> torch.Tensor:
    """The whole tensor of ``shape`` whose part placed ``have`` this rank holds in ``x``, gathered
    when first read (``gatherable`` must hold; launched now where ``prepare_reads`` made no
    groups for ``mesh``: a pipeline's stages, which read every output at once), then passed
    through ``finish`` (a sequence held in the balanced order put back in order). ``backward``
    maps the whole tensor's gradient to this rank's part."""
    split = [a for a, p in enumerate(have) if isinstance(p, Shard)]
    local = x.detach().contiguous()
    groups = _read_groups(mesh)
    if groups is None:
        group = mesh.get_group(split[0]) if len(split) == 1 else dist.group.WORLD
        flat = torch.empty(dist.get_world_size(group) * local.numel(), dtype=local.dtype, device=local.device)
        cell = _launch(dist.all_gather_single(flat, local.view(-1), group=group, async_op=True),
                       lambda: finish(_assembled(flat.view(-1, *local.shape), mesh, have, split, shape)))
    else:
        group = groups[tuple(split)] if len(split) == 1 else groups[None]
        tag = next(_MADE)
        cell = _Cell(None, lambda: finish(_assembled(_read(local, group, tag), mesh, have, split, shape)))
    return _Launched.apply(x, cell, tuple(shape), backward)


def _read(local: torch.Tensor, group: dist.ProcessGroup, tag: int) -> torch.Tensor:
    """Every rank of ``group``'s ``local`` part of the output tagged ``tag``, stacked: first the
    tags (each peer must be reading the same output), then the parts."""
    ranks = dist.get_world_size(group)
    tags = torch.empty(ranks, dtype=torch.int64, device=local.device)
    _waited(dist.all_gather_single(tags, torch.tensor([tag], device=local.device), group=group, async_op=True))
    if (tags != tag).any():
        raise AutoparError(f"the ranks read different outputs of the forward (output numbers {tags.tolist()}): "
                           "a split output is gathered when first read, and every rank must read the same "
                           "outputs in the same order. Read them alike on every rank, or plan with "
                           "gather_outputs=False and read each rank's part (DTensor.to_local())")
    flat = torch.empty(ranks * local.numel(), dtype=local.dtype, device=local.device)
    _waited(dist.all_gather_single(flat, local.view(-1), group=group, async_op=True))
    return flat.view(ranks, *local.shape)


#: What a rank reading alone is told: what it read, and why and how every rank must read it.
_OUTPUT_READ = ("a split output of the forward (the logits, say)",
                "it is gathered when first read, and every rank must read it, in the same order (as DTensor's "
                "full_tensor()). Read it on every rank, or plan with gather_outputs=False and read this rank's part "
                "(DTensor.to_local())")
_LOSS_READ = ("the loss before its backward",
              "its sum over ranks rides in the gradients' all-reduce, so a read before backward() sums it at once, "
              "and every rank must then read it. Read it after loss.backward() (rank 0's log line), or on every rank")


def _waited(work: Any, read: str = _OUTPUT_READ[0], advice: str = _OUTPUT_READ[1]) -> None:
    """Wait for a collective a read launched on the read groups; its peers' not reading alike is
    said so (``read``: what this rank read; ``advice``: why every rank must, and what to do)."""
    try:
        work.wait()
    except RuntimeError as e:
        raise AutoparError(f"rank {dist.get_rank()} read {read} and its peers did not read it within "
                           f"{READ_TIMEOUT.total_seconds():.0f} s: {advice}. ({e})") from None


def _assembled(pieces: torch.Tensor, mesh: DeviceMesh, have: Sequence[Placement], split: Sequence[int],
               shape: Sequence[int]) -> torch.Tensor:
    """The whole tensor from the gathered ``pieces`` (one per rank of the group, in its order:
    mesh order over the ``split`` axes), each put where DTensor's chunking places it
    (``shard_range``)."""
    out = torch.empty(tuple(shape), dtype=pieces.dtype, device=pieces.device)
    for piece, split_coords in zip(pieces, itertools.product(*(range(mesh.shape[a]) for a in split)), strict=True):
        coords = [0] * mesh.ndim
        for a, c in zip(split, split_coords, strict=True):
            coords[a] = c
        region = out
        for d, size in enumerate(shape):
            begin, end = shard_range(size, coords, [a for a in split if have[a].dim == d], mesh.shape)
            region = region.narrow(d, begin, end - begin)
        region.copy_(piece)
    return out

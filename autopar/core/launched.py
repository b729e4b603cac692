"""Outputs whose collective is launched in the forward and waited for when first read.

The loop users write (``loss = model(**batch).loss; loss.backward(); opt.step()``) reads the loss
now and then (``loss.item()`` on rank 0 every few steps) and the logits rarely. The module still
promises one device's outputs on every rank, so the sum of the loss's summands and the gather of
a split output are collectives; they are launched in the forward, on every rank (whatever each
rank later reads, every rank has joined the collective: no rank can wait for another that
never reads), and waited for only where the value is first read. A step that reads nothing waits
for nothing, as DDP's; the backward's seed (``ones_like``) reads only the loss's shape.

``Pending`` is the tensor handed out: a wrapper subclass with the output's shape and dtype whose
every op waits for the value first (as ``AsyncCollectiveTensor`` does). Its collectives are
c10d's asynchronous ops, not functional ones: an output nobody reads drops its work with it,
where a functional collective never waited for stays registered, holding its buffers, and warns
at exit ("unwaited collective calls").

No collective stays in flight past its step: every one launched into an output is waited for
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
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from autopar.core.placements import shard_range
from autopar.core.together import one_process

#: ops that read only a tensor's metadata: the backward's seed and its like
_METADATA_ONLY = {torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
                  torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default}


#: the waits of collectives launched into outputs and not waited for yet (``settle``)
_IN_FLIGHT: list[Callable[[], Any]] = []


def settle() -> None:
    """Wait for every collective launched into an output so far (long done, at a step's end)."""
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
        if func in _METADATA_ONLY:   # no wait: a plain tensor shaped alike
            args, kwargs = pytree.tree_map_only(Pending, _blank, (args, kwargs))
            return func(*args, **kwargs)
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
        torch.autograd.Variable._execution_engine.queue_callback(settle)   # when this backward ends
        return ctx.backward_fn(grad), None, None, None


def summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group``'s ranks of every rank's ``x``, launched now, waited for when read.
    Backward: each summand's gradient is the sum's (Megatron's reduce from the model-parallel
    region)."""
    buffer = x.detach().clone()
    cell = _launch(dist.all_reduce(buffer, group=group, async_op=True), lambda: buffer)
    return _Launched.apply(x, cell, tuple(x.shape), lambda grad: grad)


def gatherable(x: torch.Tensor, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int]) -> bool:
    """Can ``gathered`` launch ``x``'s gather: split on one axis or every axis of a mesh spanning
    the job, evenly, never partial?"""
    split = [a for a, p in enumerate(have) if isinstance(p, Shard)]
    if not split or not all(isinstance(p, (Shard, Replicate)) for p in have):
        return False
    if len(split) > 1 and not (len(split) == mesh.ndim and mesh.size() == dist.get_world_size()):
        return False
    for d, size in enumerate(shape):
        ways = math.prod(mesh.shape[a] for a in split if have[a].dim == d)
        if size % ways:
            return False
    return True


def gathered(x: torch.Tensor, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int],
             backward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The whole tensor of ``shape`` whose part placed ``have`` this rank holds in ``x``: every
    rank's part gathered by one collective launched now (``gatherable`` must hold), assembled
    when first read. ``backward`` maps the whole tensor's gradient to this rank's part."""
    split = [a for a, p in enumerate(have) if isinstance(p, Shard)]
    group = mesh.get_group(split[0]) if len(split) == 1 else dist.group.WORLD
    local = x.detach().contiguous()
    ranks = dist.get_world_size(group)
    flat = torch.empty(ranks * local.numel(), dtype=local.dtype, device=local.device)
    cell = _launch(dist.all_gather_single(flat, local.view(-1), group=group, async_op=True),
                   lambda: _assembled(flat.view(ranks, *local.shape), mesh, have, split, shape))
    return _Launched.apply(x, cell, tuple(shape), backward)


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

"""The few helpers generated code calls. Each one is a named step a Megatron engineer would
recognise: shard an input, move a tensor to another placement (a collective), read a parameter's
shard, gather an output.

Tensors in generated code are plain local tensors: each rank's shard (or summand, for a partial
sum) of the planned placement. Ops are the ATen ops themselves, with shape arguments made local
when the code is generated (``LocalSizes``: this rank's share of an uneven split, fixed when the
module is built). DTensor appears only where the placement changes (``move``: one redistribution
whose backward brings the gradient where the producer needs it) and at the boundary: parameters
stay DTensors (state_dict, optimizers, checkpoints) and the forward reads their local shards. A
plan that replicates every parameter (data parallelism) keeps them plain tensors, as DDP does.
"""
from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._local_tensor import (
    LocalIntNode,
    LocalTensor,
    local_tensor_mode,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from autopar.core.collectives import (
    all_reduce,
    as_dtensor,
    axes_group,
    contiguous_stride,
    planned,
    spans_job,
)
from autopar.core.context_parallel import balance, unbalance
from autopar.core.errors import AutoparError
from autopar.core.placements import for_dtensor, grad_target
from autopar.core.precision import reduce_dtype
from autopar.core.together import rank_map

aten = torch.ops.aten


class PlacementMismatchError(AutoparError):
    """An op's local result has another shape than its planned placement implies (a rule bug;
    strict mode only)."""


STRICT = os.environ.get("AUTOPAR_STRICT", "0") == "1"


def distribute(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``t`` stored as ``placements``, each rank's part in storage of its own. Under LocalTensorMode
    (all ranks in one process) a plain tensor stands for every rank at once: each rank takes its
    own copy first, so that in-place updates hit every rank's part once, collectives see per-rank
    values, and DTensor cuts each rank's part at that rank's coordinates (a split of a plain
    tensor ordered as FSDP2 with TP orders it, ``_StridedShard``, is cut at rank 0's). A plain
    ``distribute_tensor`` on real processes."""
    if local_tensor_mode() is not None and not isinstance(t, LocalTensor):
        t = rank_map(lambda _rank: t.clone())
    return distribute_tensor(t, mesh, for_dtensor(placements))


def rank_inputs(values: Sequence[Any]) -> list[Any]:
    """The inputs as each rank holds them. Under LocalTensorMode (all ranks in one process) a
    plain tensor stands for every rank at once, and cutting it at a per-rank offset falls back to
    one rank's value: each tensor becomes a per-rank tensor. A no-op on real processes."""
    if local_tensor_mode() is None:
        return list(values)
    return [_every_rank(v) if isinstance(v, torch.Tensor) and not isinstance(v, LocalTensor) else v for v in values]


def _every_rank(value: torch.Tensor) -> torch.Tensor:
    """``value`` as every simulated rank's (a LocalTensor)."""
    return rank_map(lambda _rank: value)


def move(x: torch.Tensor, mesh: DeviceMesh, have: Sequence[Placement], want: Sequence[Placement],
         grad: Sequence[Placement], shape: Sequence[int]) -> torch.Tensor:
    """``x``, this rank's part of a tensor of global ``shape`` placed ``have``, placed ``want``
    instead: the collectives ``execution.axis_collective`` names. Its backward takes the gradient
    as the consumer produces it (placed ``grad``: a replicated input of a split op gets a partial
    one) to where the producer keeps its gradient (a partial sum becomes replicated)."""
    if not x.requires_grad and _same(have, want):
        return x
    return _LocalShard.apply(redistribute(as_dtensor(x, mesh, have, shape), want), tuple(grad))


def move_balanced(x: torch.Tensor, mesh: DeviceMesh, have: Sequence[Placement], want: Sequence[Placement],
                  grad: Sequence[Placement], shape: Sequence[int], *, axis: int, held: tuple[int, int] | None,
                  read: tuple[int, int] | None) -> torch.Tensor:
    """``move`` of a value split by sequence over mesh ``axis`` in the balanced order (rank r:
    chunks r and 2n-1-r of 2n, ``context_parallel.balance``) as it is held (``held``: (dim,
    period: the elements one sequence spans), else None) or as it is read (``read``). A
    collective moves the value in the order it holds, so the order changes only where the dim is
    whole on this rank: gathered first, then put back in sequence order (``unbalance``); to split
    it in the balanced order, permuted (``balance``) while whole, then split as ``move`` splits.
    Both are local and differentiable (the backward permutes the gradient back)."""
    n = mesh.shape[axis]
    if held is not None and held == read:
        return move(x, mesh, have, want, grad, shape)   # the same order on both sides
    have = tuple(have)
    if held is not None:
        x, have = _whole_along(x, mesh, have, axis, held[0], shape)
        x = unbalance(x, held[0], n, held[1])
    if read is None:
        return move(x, mesh, have, want, grad, shape)
    x, have = _whole_along(x, mesh, have, axis, read[0], shape)
    return move(balance(x, read[0], n, read[1]), mesh, have, want, grad, shape)


def _whole_along(x: torch.Tensor, mesh: DeviceMesh, have: tuple[Placement, ...], axis: int, dim: int,
                 shape: Sequence[int]) -> tuple[torch.Tensor, tuple[Placement, ...]]:
    """``x`` (placed ``have``) gathered where ``axis`` or any axis splitting ``dim`` splits it, so
    that ``dim`` is whole on this rank (a partial sum stays partial), with its new placement."""
    mid = tuple(Replicate() if isinstance(p, Shard) and (a == axis or p.dim == dim) else p for a, p in enumerate(have))
    return move(x, mesh, have, mid, grad_target(mid), shape), mid


def to_host(p: DTensor) -> DTensor:
    """``p`` placed as it is, its local shard in host memory (pinned where a GPU copies from it):
    an offloaded parameter, whose gradient and optimizer states then live there too."""
    local = p._local_tensor.detach().to("cpu")
    if torch.cuda.is_available() and local.device.type == "cpu":
        local = local.pin_memory()
    return DTensor(local, p._spec, requires_grad=False)


def on_device(p: DTensor, device: torch.device) -> DTensor:
    """Offloaded parameter ``p`` with its local shard copied to the compute ``device`` (itself where
    it is there already, as on a CPU mesh); differentiable: the gradient goes back to host memory."""
    if p._local_tensor.device.type == torch.device(device).type:
        return p
    local = p.to_local().to(device, non_blocking=True)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def whole(p: DTensor, device: torch.device | None = None) -> torch.Tensor:
    """A DTensor whole on every rank (a loss, a full state dict's value), without DTensor's per-rank
    hints about collectives; gathered on the compute ``device`` where it is offloaded."""
    with planned():
        return (on_device(p, device) if device is not None else p).full_tensor()


def replicated(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``t`` as a plain tensor every rank holds alike (rank 0's values, as DDP broadcasts them), for
    a plan that replicates every parameter: the optimizer then steps plain tensors, without
    DTensor's dispatch of each of its ops (0.6 ms a step for gpt-tiny's 29 parameters)."""
    return distribute(t, mesh, [Replicate()] * mesh.ndim).to_local()


#: counts every submodule registered on any module (``held``'s tables are rebuilt after one)
_MODULES_SET = [0]


def _module_set(*_: Any) -> None:
    _MODULES_SET[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_module_set)


def held(module: torch.nn.Module, fqn: str) -> Any:
    """``module``'s parameter or buffer ``fqn`` as registered now: read from its owner's own table,
    so one replaced since (``setattr``, ``load_state_dict(assign=True)``) is the one read. The
    owner is found once (a path such as ``transformer.h.0.attn`` costs 4 us through
    ``nn.Module.__getattr__`` and ``ModuleList``, a dict lookup here), again after any module
    registers a submodule."""
    table = module.__dict__.get("_autopar_held")
    if table is None or table[0] != _MODULES_SET[0]:
        table = module.__dict__["_autopar_held"] = (_MODULES_SET[0], {})
    where = table[1].get(fqn)
    if where is None:
        path, _, leaf = fqn.rpartition(".")
        owner = module.get_submodule(path)
        where = table[1][fqn] = (owner._parameters if leaf in owner._parameters else owner._buffers, leaf)
    return where[0][where[1]]


# id of a plain parameter whose gradient is synchronised -> (a weak reference to it, the leaf its
# gradient accumulates in first, ``gradient_leaf``). Ids, not the tensors, as keys: a lookup costs
# a dict's, once per parameter and step; the entry goes with the parameter.
_LEAVES: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def shard_of(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of parameter ``p``, read without autograd wrapping: its gradient
    accumulates in ``gradient_leaf(p)`` if one was made (gradient sync, ``codegen.grad_sync``,
    hands it to ``p.grad``), else in ``p.grad`` itself (a plain parameter nothing synchronises)."""
    if isinstance(p, DTensor):
        return p._local_tensor
    entry = _LEAVES.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else p


def gradient_leaf(p: torch.Tensor) -> torch.Tensor:
    """Where ``p``'s local gradient accumulates before it is synchronised: a DTensor's local
    tensor; for a plain parameter a leaf sharing its storage, made once (accumulated in ``p.grad``
    itself, a rank's summand would mix with the sums handed over before)."""
    if isinstance(p, DTensor):
        return p._local_tensor
    key = id(p)
    entry = _LEAVES.get(key)
    if entry is None or entry[0]() is not p:
        entry = _LEAVES[key] = (weakref.ref(p, lambda _: _LEAVES.pop(key, None)),
                                p.detach().requires_grad_(p.requires_grad))
    return entry[1]


def param_shard(p: DTensor, want: Sequence[Placement], grad: Sequence[Placement]) -> torch.Tensor:
    """This rank's shard of parameter ``p`` placed ``want``, its gradient flowing back placed
    ``grad`` (partial where the op using it runs split: gradient synchronisation reduces it)."""
    return _LocalShard.apply(redistribute(p, want), tuple(grad))


def uneven_reshape(x: torch.Tensor, shape: Sequence[Any]) -> torch.Tensor:
    """``x.reshape(shape)`` where ranks hold different sizes (an uneven split): input and gradient
    are made contiguous before they are reshaped, a copy that per-rank sizes cannot decide on
    their own (LocalTensorMode runs ``reshape`` of a strided view as a ``view``)."""
    return _UnevenReshape.apply(x, tuple(shape))


class _UnevenReshape(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple) -> torch.Tensor:
        ctx.shape = x.shape
        return x.contiguous().reshape(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.contiguous().reshape(ctx.shape), None


def expect(x: Any, shape: Sequence[Any], where: str) -> Any:
    """Strict mode: the local result must have the shape its planned placement implies."""
    if isinstance(x, torch.Tensor) and list(x.shape) != list(shape):
        raise PlacementMismatchError(f"{where}: the local result has shape {list(x.shape)}, the plan's placement "
                                     f"implies {list(shape)}")
    return x


def redistribute(t: DTensor, placements: Sequence[Placement], reduce_in: str = "fp32") -> DTensor:
    """Change placement: all-gather, all-reduce, reduce-scatter or all-to-all (its backward is the
    dual). ``reduce_in``: a parameter's gradient is summed back in this precision ("bf16": in
    bf16, returned in the parameter's dtype; ``PlanOptions.reduce_precision``)."""
    placements = for_dtensor(placements)
    if _same(t.placements, placements):
        return t
    if (wire := reduce_dtype(reduce_in, t.dtype)) != t.dtype:
        return _ReducedIn.apply(t, tuple(placements), wire)
    if not t.is_contiguous():  # a gathered shard is contiguous: keep DTensor's stride in step
        t = t.contiguous()
    # Replicate -> Partial is local (DTensor keeps it internal): reach Replicate first, then split.
    to_partial = [isinstance(w, Partial) and not h.is_partial() for h, w in zip(t.placements, placements, strict=True)]
    first = [Replicate() if p else (h if h.is_partial() and isinstance(w, Partial) else w)
             for h, w, p in zip(t.placements, placements, to_partial, strict=True)]
    if not _same(t.placements, first):
        with planned():
            t = _contiguous_shards(t.redistribute(t.device_mesh, first))
    return _replicate_to_partial(t, placements) if any(to_partial) else t


class _ReducedIn(torch.autograd.Function):
    """``redistribute`` whose backward moves the gradient in ``wire`` (a ZeRO-3 parameter's
    reduce-scatter in bf16) and hands it back in the input's dtype."""

    @staticmethod
    def forward(ctx: Any, t: DTensor, placements: tuple[Placement, ...], wire: torch.dtype) -> DTensor:
        ctx.have, ctx.wire = tuple(t.placements), wire
        return redistribute(t, placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None, None]:
        return _summed_in(grad, ctx.have, ctx.wire), None, None


def _summed_in(grad: DTensor, placements: Sequence[Placement], wire: torch.dtype) -> DTensor:
    """``grad`` redistributed to ``placements`` in ``wire`` (its sum rounded there), back in its
    own dtype; waits for the collective."""
    with planned():
        return grad.to(wire).redistribute(grad.device_mesh, placements).to(grad.dtype)


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
    for h, w, size in zip(t.placements, placements, mesh.shape, strict=True):
        if isinstance(w, Partial) and not h.is_partial():
            n *= size
            grad_placements.append(Partial())
        else:
            grad_placements.append(Replicate() if h.is_partial() else h)
    local = _LocalShard.apply(t, tuple(grad_placements)) / n
    return DTensor.from_local(local, mesh, list(placements), run_check=False, shape=t.shape, stride=t.stride())


def _same(have: Sequence[Placement], want: Sequence[Placement]) -> bool:
    return all(_same_one(h, w) for h, w in zip(have, want, strict=True))


def _same_one(h: Placement, w: Placement) -> bool:
    if isinstance(w, Partial):
        return h.is_partial() and getattr(h, "reduce_op", "sum") == w.reduce_op
    return h == w


class _LocalShard(torch.autograd.Function):
    """``DTensor.to_local`` whose backward declares the gradient's global shape and stride instead
    of inferring them from per-rank local shapes (which are symbolic for uneven shards under
    LocalTensorMode)."""

    @staticmethod
    def forward(ctx: Any, t: DTensor, grad_placements: tuple[Placement, ...]) -> torch.Tensor:
        ctx.mesh, ctx.grad_placements, ctx.shape = t.device_mesh, for_dtensor(grad_placements), t.shape
        return t._local_tensor.view_as(t._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:
        return DTensor.from_local(grad.contiguous(), ctx.mesh, list(ctx.grad_placements), run_check=False,
                                  shape=ctx.shape, stride=contiguous_stride(ctx.shape)), None


def sum_grad_over(p: torch.Tensor, group: Any) -> None:
    """Sum parameter ``p``'s gradient over the ranks of ``group`` that hold a copy of it (a
    parameter two pipeline stages read: each has the gradient of its own uses). A frozen one has none."""
    if not p.requires_grad:
        return
    local = shard_of(p)
    if p.grad is None:
        grad = torch.zeros_like(local)
    else:
        grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
    dist.all_reduce(grad, group=group)
    if p.grad is None:
        p.grad = DTensor(grad, p._spec, requires_grad=False) if isinstance(p, DTensor) else grad


def rank_value(mesh: DeviceMesh, fn: Any, as_tensor: bool = False) -> Any:
    """``fn(coords)`` for this rank's mesh coordinates, computed once when a module is built: an
    int for shape arguments, or (``as_tensor``) a 0-d tensor for tensor arithmetic. Under
    LocalTensorMode (every rank in this process) a per-rank int or tensor, read rank by rank."""
    lm = local_tensor_mode()
    if lm is None:
        value = fn(mesh.get_coordinate())
        return torch.tensor(value) if as_tensor else value
    with lm.disable():
        values = {r: fn((mesh.mesh == r).nonzero()[0].tolist()) for r in lm.ranks}
    if as_tensor:
        return rank_map(lambda r: torch.tensor(values[r]))
    return torch.SymInt(LocalIntNode(values))


def share_generator() -> None:
    """Give every rank of the default process group rank 0's random generator state (CPU, and
    this rank's GPU), so that random ops (dropout) draw alike on every rank."""
    states = [(torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None)]
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0][0])
    if states[0][1] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(states[0][1])


def once(module: torch.nn.Module, constants: Any, mesh: DeviceMesh, device: torch.device, sizes: Any) -> tuple:
    """The values a generated ``constants`` function computes from shapes alone (``autopar.core.fold``):
    computed at its first call, kept on the module, then reused."""
    cache = module.__dict__.setdefault("_autopar_folded", {})
    if constants not in cache:
        with torch.no_grad():
            cache[constants] = constants(module, mesh, device, sizes)
    return cache[constants]


class Launched:
    """A sum over ranks launched (``sum_in_place``), or a value at hand, read by ``wait``."""

    def __init__(self, tensor: torch.Tensor, work: Any = None, functional: bool = False) -> None:
        self._tensor, self._work, self._functional = tensor, work, functional

    def wait(self) -> torch.Tensor:
        """The sum (waits for it the first time)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._functional:
            self._tensor, self._functional = funcol.wait_tensor(self._tensor), False
        return self._tensor


def sum_in_place(x: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> Launched:
    """Launch the sum of ``x`` over the ranks of mesh ``axes`` into ``x`` itself, as DDP's buckets
    do: c10d's asynchronous all-reduce, not a functional collective (its dispatch costs the
    launching thread about five times as much CPU: 250 against 50 us on gloo). Gradient buckets
    use it; the forward's collectives, which autograd differentiates, stay functional. Axes that
    are neither one axis nor the whole job take the functional path, one axis after another."""
    if len(axes) == 1 or spans_job(mesh, axes):
        return Launched(x, dist.all_reduce(x, group=axes_group(mesh, axes), async_op=True))
    return Launched(all_reduce(x, mesh, axes), functional=True)


def sync_grad_to(param: DTensor, reduce_precision: str = "fp32") -> None:
    """Gradient synchronisation: reduce a parameter's gradient into the parameter's own placement
    (all-reduce for replicated parameters, reduce-scatter for sharded/ZeRO-3 ones). The collective
    is only launched here (``async_op``): it runs while the backward goes on, and the gradient is
    waited for when first used (the optimizer step). A gradient summed in a narrower dtype
    (``reduce_precision``) is cast back at once, which waits for it."""
    placements = list(param.placements)
    wire = reduce_dtype(reduce_precision, param.dtype)

    def reduce(g: Any) -> Any:
        if not isinstance(g, DTensor) or _same(g.placements, placements):
            return g
        if wire != g.dtype:
            return _summed_in(g, placements, wire)
        with planned():
            return g.redistribute(g.device_mesh, placements, async_op=True)

    param.register_hook(reduce)

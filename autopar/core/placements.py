"""Placements per mesh axis, as DTensor's own tiny values: ``Shard(d)``, ``Replicate()``, ``Partial()``.

A node's placement on an N-D mesh is a tuple with one placement per axis. This module holds
the few pure functions on them used by every stage: text form (reports, JSON), local shapes
(uneven shards included) and how much an axis splits the work.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from autopar.core.errors import PlanFileError

Placements = tuple[Placement, ...]


class ShardBlocks(Shard):
    """Dim ``dim`` cut into ``blocks`` equal blocks, each split over the axis's ranks: a rank holds
    its piece of every block, in order. The fused [gate; up] projections of an expert split by
    their intermediate dimension (``autopar.core.ops.moe``): each rank gets matching gate and up
    rows, where a plain ``Shard`` would give one rank the gate and the other the up. A ``Shard``
    to everything that reads only sizes (local shapes, fractions, the collectives a move runs);
    DTensor holds it as ``_StridedShard(dim, split_factor=blocks)`` (``for_dtensor``)."""

    def __init__(self, dim: int, blocks: int = 2) -> None:
        super().__init__(dim)
        self.blocks = blocks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardBlocks) and (other.dim, other.blocks) == (self.dim, self.blocks)

    def __hash__(self) -> int:
        return hash(("blocks", self.dim, self.blocks))

    def __repr__(self) -> str:
        return f"ShardBlocks({self.dim}, {self.blocks})"

    __str__ = __repr__

    def __reduce__(self):   # Shard's own pickles as a plain Shard
        return ShardBlocks, (self.dim, self.blocks)


def for_dtensor(ps: Sequence[Placement]) -> list[Placement]:
    """``ps`` as DTensor takes them: a ``ShardBlocks`` as the ``_StridedShard`` that cuts it so."""
    return [_StridedShard(p.dim, split_factor=p.blocks) if isinstance(p, ShardBlocks) else p for p in ps]

def placement_str(p: Placement, code: bool = False) -> str:
    """``S(d)``, ``S(d:b)`` (``ShardBlocks``), ``R`` or ``P`` (``P(op)`` for a partial other than a
    sum; ``code``: ``Partial('op')``, ``SB(d, b)``, as generated code, which binds ``S``, ``SB``,
    ``R``, ``P`` and ``Partial``, writes it)."""
    if isinstance(p, ShardBlocks):
        return f"SB({p.dim}, {p.blocks})" if code else f"S({p.dim}:{p.blocks})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"Partial({p.reduce_op!r})" if code else f"P({p.reduce_op})"
    raise PlanFileError(f"placement {p!r} is not one autopar plans with (Shard, Replicate, Partial)")


def placements_str(ps: Sequence[Placement], code: bool = False) -> str:
    """A placement per mesh axis, ``(S(0), R)``: in reports and plan files, and (``code``: a Python
    tuple, ``(R,)`` for one axis) in generated code."""
    body = ", ".join(placement_str(p, code) for p in ps)
    return f"({body},)" if code and len(ps) == 1 else f"({body})"


_SHARD = re.compile(r"S\((-?\d+)\)")
_BLOCKS = re.compile(r"S\((-?\d+):(\d+)\)")
_PARTIAL = re.compile(r"P\((\w+)\)")


def parse_placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if m := _SHARD.fullmatch(text):
        return Shard(int(m.group(1)))
    if m := _BLOCKS.fullmatch(text):
        return ShardBlocks(int(m.group(1)), int(m.group(2)))
    if m := _PARTIAL.fullmatch(text):
        return Partial(m.group(1))
    raise PlanFileError(f"cannot read placement {text!r}: expected R, P, P(op), S(dim) or S(dim:blocks)")


def is_split(p: Placement) -> bool:
    """Does this axis divide the work (sharded or partial) rather than repeat it?"""
    return isinstance(p, (Shard, Partial))


def largest_shard_shape(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
                        ) -> tuple[int, ...]:
    """The largest shape any rank holds of a tensor of global ``shape`` placed ``placements``
    (ceil division: the slowest rank's, which the cost model prices; ``shard_shape_at`` gives one
    rank's)."""
    out = list(shape)
    for p, n in zip(placements, mesh_shape, strict=True):
        if isinstance(p, Shard):
            out[p.dim] = -(-out[p.dim] // n)
    return tuple(out)


def shard_fraction(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> float:
    """Fraction of a tensor's elements one rank holds (1.0 = replicated; partial holds all)."""
    frac = 1.0
    for p, n in zip(placements, mesh_shape, strict=True):
        if isinstance(p, Shard):
            frac /= n
    return frac


def grad_placement(placements: Sequence[Placement], op_inputs: Sequence[Sequence[Placement]],
                   op_out: Sequence[Placement]) -> tuple[Placement, ...]:
    """Placement of the gradient w.r.t. an op input placed as ``placements``: on an axis where the
    op runs split (some input sharded or the output sharded/partial), a replicated input gets a
    partial gradient (each rank saw part of the work); a sharded one a sharded gradient; a partial
    input a replicated one (every summand has the same derivative)."""
    out = []
    for a, p in enumerate(placements):
        split = is_split(op_out[a]) or any(is_split(x[a]) for x in op_inputs)
        if isinstance(p, Shard):
            out.append(p)
        elif isinstance(p, Replicate) and split:
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


def read_as_stored(storage: Sequence[Placement], out: Sequence[Placement],
                   uses: Iterable[tuple[Sequence[Placement], Sequence[Placement]]],
                   trains: bool = True) -> tuple[Placement, ...] | None:
    """Where a parameter's local gradient accumulates when the forward reads its shard as it is
    stored (no move, no autograd wrapper): ``uses`` gives, for each op reading it, the placement
    it reads and the gradient's it gives back. Every use reads it as stored (``out`` too) and gives
    one gradient placement, as stored or partial where stored replicated (gradient sync sums
    those); None otherwise. A parameter that does not train (``trains`` false) has no gradient:
    every use reading it as stored is enough, and its storage is returned. The code generator
    reads such parameters directly (``codegen.generate.direct_grad``); the cost model prices a
    plan whose parameters are all replicated and read so as plain tensors
    (``cost_models.schedule.parameter_saving``)."""
    storage = tuple(storage)
    if tuple(out) != storage:
        return None
    grads = set()
    for want, grad in uses:
        if tuple(want) != storage:
            return None
        grads.add(tuple(grad))
    if not trains:
        return storage
    if len(grads) != 1:
        return None
    grad = grads.pop()
    ok = all(g == s or (isinstance(s, Replicate) and isinstance(g, Partial)) for g, s in zip(grad, storage, strict=True))
    return grad if ok else None


def gathered_in_group(storage: Sequence[Placement], out: Sequence[Placement], want: Sequence[Placement],
                      grad: Sequence[Placement], trains: bool = True) -> bool:
    """Does this read of a ZeRO parameter (stored ``storage``, gathered to ``out``) fit its group's
    gather (``codegen.zero3``)? It reads the gathered value (``want`` is ``out``) and, where the
    parameter trains, gives its gradient (``grad``) back partial on the gathered axes, to be
    reduce-scattered with the group's, and as stored on the others. The code generator gathers in
    groups the parameters every read of which fits (``codegen.generate.gather_groups``), the others
    one by one; the cost model prices a read that does not fit as gathered alone."""
    axes = [a for a, (s, o) in enumerate(zip(storage, out, strict=True)) if s != o]
    return tuple(want) == tuple(out) and (not trains or all(
        isinstance(grad[a], Partial) if a in axes else grad[a] == storage[a] for a in range(len(grad))))


def grad_target(out: Sequence[Placement], storage: Sequence[Placement] | None = None) -> tuple[Placement, ...]:
    """Where the gradient of a value placed ``out`` is kept: a parameter's storage placement, else
    the value's own placement, a partial sum's gradient being replicated (every summand has the
    same derivative)."""
    if storage is not None:
        return tuple(storage)
    return tuple(Replicate() if isinstance(p, Partial) else p for p in out)


def split_axes(placements: Sequence[Placement], dim: int) -> tuple[int, ...]:
    """The mesh axes that split tensor dimension ``dim``, in mesh order."""
    return tuple(a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim)


def shard_shape_at(shape: Sequence[int], placements: Sequence[Placement], coords: Sequence[int],
                   mesh_shape: Sequence[int]) -> list[int]:
    """The shape of the part of a tensor of global ``shape`` placed ``placements`` that the rank
    at mesh ``coords`` holds (``shard_range`` per dimension)."""
    out = []
    for d, size in enumerate(shape):
        start, stop = shard_range(int(size), coords, split_axes(placements, d), mesh_shape)
        out.append(stop - start)
    return out


def shard_range(size: int, coords: Sequence[int], axes: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, int]:
    """[start, stop) of a dimension of ``size`` that the rank at mesh ``coords`` holds when it is
    split over mesh ``axes`` (as DTensor splits, like torch.chunk, axis by axis in mesh order)."""
    start, length = 0, size
    for a in axes:
        chunk = math.ceil(length / mesh_shape[a])
        begin = min(coords[a] * chunk, length)
        start, length = start + begin, max(0, min(chunk, length - begin))
    return start, start + length


def evenly_split(have: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Is a tensor of ``shape`` placed ``have`` split evenly on some axis, never partial: an output
    gathered only where read (the planner prices it so: nothing in the step)? A symbolic size
    (``autopar.planning.symbolic``) counts as divisible: the sizes it stands for mostly are."""
    split = [a for a, p in enumerate(have) if isinstance(p, Shard)]
    if not split or not all(isinstance(p, (Shard, Replicate)) for p in have):
        return False
    return all(not isinstance(size, int) or size % math.prod(mesh_shape[a] for a in split if have[a].dim == d) == 0
               for d, size in enumerate(shape))

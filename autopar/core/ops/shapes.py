"""Ops whose argument is their output's shape (view, reshape, expand, ``new_zeros`` and kin): every
op runs on this rank's part, so generated code, and profiling, pass this rank's local shape.

A view of a tensor split unevenly (5 rows of 16 split 3 and 2, flattened) is made by
``codegen.runtime.uneven_reshape``, each rank's sizes differing; views are emitted as reshapes
(redistribution can leave a shard non-contiguous where the model's view assumed contiguity: a
reshape is a view whenever the layout allows, a copy otherwise).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core.capture import tensor_val
from autopar.core.execution import VIEW_OPS
from autopar.core.ops.base import Emitter, LocalCall, Placed, Site, emitter, rule, timed
from autopar.core.placements import largest_shard_shape
from autopar.core.rules import AxisRule, OpView, fits, identity_dims, replicate

aten = torch.ops.aten

#: Views generated code runs as ``aten.reshape`` (see the module docstring).
AS_RESHAPE = {aten.view.default, aten._unsafe_view.default}
RESHAPES = AS_RESHAPE | {aten.reshape.default}
NEW_TENSOR = (aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default)
#: Ops whose second argument is a shape, their output's.
SHAPE_ARG_OPS = {*RESHAPES, aten.expand.default, *NEW_TENSOR}


@rule(*RESHAPES, aten.flatten.using_ints)
def view(v: OpView, n: int) -> list[AxisRule]:
    """Reshape: a dim keeps its shard when it maps to one output dim, or is the outer dim of a
    split/merge group whose division by ``n`` keeps each rank's block contiguous."""
    src, dst = v.in_shapes[0], v.out_shape
    rules = [replicate(v)]
    if v.node.args[0].meta["val"].is_contiguous():  # else reshape copies, and DTensor's copy of a partial reduces it
        rules.append(AxisRule(Partial(), (Partial(),), "partial"))
    for in_dim, out_dim, even in _view_groups(src, dst):
        if fits(src[in_dim], n, even) and (not even or dst[out_dim] % n == 0):
            rules.append(AxisRule(Shard(out_dim), (Shard(in_dim),), "follow"))
    return rules


def _view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, bool]]:
    """(input dim, output dim, needs even split) for the outer dim of each reshape group. Dims of
    size 1 where the other side has none are passed over: a batch of one flattened with its
    sequence keeps the sequence's split."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        if src[i] != dst[j] and 1 in (src[i], dst[j]):
            i, j = (i + 1, j) if src[i] == 1 else (i, j + 1)
            continue
        if src[i] == dst[j]:
            if src[i] != 1:
                groups.append((i, j, False))
            i, j = i + 1, j + 1
            continue
        gi, gj, a, b = i, j, src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                a *= src[i]
            else:
                j += 1
                b *= dst[j]
        groups.append((gi, gj, True))
        i, j = i + 1, j + 1
    return groups


@rule(aten.expand.default)
def expand(v: OpView, n: int) -> list[AxisRule]:
    shape, out = v.in_shapes[0], v.out_shape
    off = len(out) - len(shape)
    return identity_dims(v, n, lambda d: d + off if shape[d] == out[d + off] else None, partial=False)


@rule(*NEW_TENSOR)
def new_tensor(v: OpView, n: int) -> list[AxisRule]:
    """``x.new_ones(size)`` and kin: x gives only dtype and device, so it is taken as it is
    placed, and the output (made at this rank's local size) may be split on any dim."""
    x = v.in_shapes[0]
    given = [Replicate()] + [Shard(d) for d in range(len(x)) if fits(x[d], n, even=False)]
    if tensor_val(v.node.args[0]).dtype.is_floating_point:
        given.append(Partial())
    outs = [Replicate()] + [Shard(d) for d in range(len(v.out_shape)) if fits(v.out_shape[d], n, even=False)]
    return [AxisRule(o, (g,), "replicate" if o == Replicate() and g == Replicate() else "fresh")
            for o in outs for g in given]


@emitter(*SHAPE_ARG_OPS)
def emit(em: Emitter, site: Site) -> bool:
    """The op with this rank's shape; a view of an unevenly split tensor by ``uneven_reshape``."""
    node, np_ = site.node, site.plan
    uneven = node.target in RESHAPES and em.sizes.uneven(tensor_val(node.args[0]).shape, np_.ins[0])
    shape = em.sizes.shape(tensor_val(node).shape, np_.out, infer=node.target in VIEW_OPS, from_uneven=uneven)
    if uneven:
        em.unlike_dtensor.add(node.name)   # (its sizes are not the placement's)
        em.emit(f"{node.name} = uneven_reshape({site.read(node.args[0])}, {shape})", site.comment + "; ranks hold "
                "different sizes")
    else:
        em.emit(f"{node.name} = {em.call_text(node, site.reads, shape)}", site.comment)
    return True


@timed(*SHAPE_ARG_OPS)
def local_shape_arg(call: LocalCall, node: fx.Node, placed: Placed, mesh_shape: Sequence[int],
                    grad: Mapping[fx.Node, bool]) -> LocalCall:
    """The target shape made local, as generated code makes it (the slowest rank's)."""
    shape = list(largest_shard_shape(tensor_val(node).shape, placed.out, mesh_shape))
    return call._replace(args=(call.args[0], shape, *call.args[2:]))

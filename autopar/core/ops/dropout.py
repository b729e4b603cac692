"""Dropout (``aten.dropout``): split, every rank draws the whole tensor's mask as one device draws
it (every rank's generator alike) and keeps its part (``dropout_mask``), so a
split dropout equals one device's; profiling times (and the cost model prices) the whole draw.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.core.capture import tensor_val
from autopar.core.ops.base import Emitter, LocalCall, Placed, Site, emitter, kernel, rule, timed
from autopar.core.placements import Placements
from autopar.core.rules import same_dims

DROPOUT = torch.ops.aten.dropout.default

rule(DROPOUT)(same_dims)


def draws_whole_mask(node: fx.Node, out: Placements) -> bool:
    """Does generated code run this node as a dropout drawing the whole tensor's mask on every
    rank? A training dropout with p > 0 whose output is split."""
    return (node.target is DROPOUT and bool(node.args[2]) and node.args[1] > 0
            and any(isinstance(p, Shard) for p in out))


@emitter(DROPOUT)
def emit(em: Emitter, site: Site) -> bool:
    """The whole mask, cut to this rank's part (a view), times this rank's input."""
    node, np_ = site.node, site.plan
    if not draws_whole_mask(node, np_.out):
        return False
    shape = list(tensor_val(node).shape)
    whole = f"kernels.dropout_mask({site.read(node.args[0])}, {node.args[1]!r}, {shape})"
    order = em.balanced.dim(node.name, np_.out) if em.balanced is not None else None
    if order is not None:   # the sequence held in the balanced order: its mask too
        whole = f"balance({whole}, {order[0]}, {em.balanced.ranks}, {order[1]})"
    em.emit(f"{node.name} = {site.read(node.args[0])} * {em.sizes.part(whole, shape, np_.out)}", site.comment
            + "; the whole tensor's mask, drawn as one device draws it (every rank's generator alike), cut to this "
            "rank's part" + ("" if order is None else " in the balanced order"))
    return True


@timed(DROPOUT)
def whole_draw(call: LocalCall, node: fx.Node, placed: Placed, mesh_shape: Sequence[int],
               grad: Mapping[fx.Node, bool]) -> LocalCall:
    """Drawing the whole mask: timed as a dropout of the whole tensor."""
    if not draws_whole_mask(node, placed.out):
        return call
    whole = tensor_val(node.args[0])
    x = torch.empty(whole.shape, dtype=whole.dtype, device="meta", requires_grad=grad.get(node.args[0], False))
    return LocalCall(node.target, (x, *call.args[1:]), call.kwargs)


@kernel
def dropout_mask(like: torch.Tensor, p: float, shape: Sequence[int]) -> torch.Tensor:
    """Dropout's keep-mask, scaled by 1/(1-p), for the WHOLE tensor of ``shape``: drawn from the
    default generator as ``aten.dropout`` draws it on one CPU device (bernoulli over the full
    shape). Every rank's generator is alike (``share_generator``), so every rank draws the same
    mask and keeps its part: a split dropout equals one device's, at the cost of drawing the
    whole mask on each rank."""
    if p >= 1:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1 - p).div_(1 - p)

"""Embedding lookup (``aten.embedding``): split by batch, by embedding dim, or by vocabulary (the
table's rows: each rank looks up the ids it owns, ``sharded_embedding``, and the
output is a partial sum).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core.capture import tensor_val
from autopar.core.ops.base import Emitter, Site, emitter, kernel, rule
from autopar.core.placements import split_axes
from autopar.core.rules import AxisRule, OpView, fits, replicate

aten = torch.ops.aten
EMBEDDING = torch.ops.aten.embedding.default


@rule(EMBEDDING)
def embedding(v: OpView, n: int) -> list[AxisRule]:
    """weight[V, D] indexed by ids: batch (ids), embedding dim (weight cols), vocab (weight rows -> partial)."""
    w, ids = v.in_shapes
    out_nd = len(v.out_shape)
    rules = [replicate(v)]
    for d in range(len(ids)):
        if fits(ids[d], n, even=False):
            rules.append(AxisRule(Shard(d), (Replicate(), Shard(d)), "batch" if d == 0 else "seq"))
    if fits(w[1], n, even=False):
        rules.append(AxisRule(Shard(out_nd - 1), (Shard(1), Replicate()), "embed-dim"))
    if fits(w[0], n, even=False):
        rules.append(AxisRule(Partial(), (Shard(0), Replicate()), "vocab"))
    return rules


@emitter(EMBEDDING)
def emit(em: Emitter, site: Site) -> bool:
    """Split by vocabulary, ``sharded_embedding`` with the rows this rank holds."""
    node, np_ = site.node, site.plan
    if Shard(0) not in np_.ins[0]:
        return False
    rows = em.sizes.bounds(int(tensor_val(node.args[0]).shape[0]), split_axes(np_.ins[0], 0))
    em.emit(f"{node.name} = kernels.sharded_embedding({site.args}, rows=({rows[0]}, {rows[1]}))", site.comment)
    return True


@kernel
def sharded_embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1, *,
                      rows: tuple[Any, Any] | None = None) -> torch.Tensor:
    """Embedding lookup on shards. Where the table is split by rows (vocabulary parallel), this
    rank holds rows [``rows[0]``, ``rows[1]``): it looks up the ids it owns and contributes zeros
    for the rest, so the output is a partial sum. ``padding_idx`` (a global row; negative: none)
    as in ``aten.embedding``: its row gets no gradient."""
    if rows is None:
        return aten.embedding.default(weight, ids, padding_idx)
    lo, hi = rows
    outside = (ids < lo) | (ids >= hi)
    out = aten.embedding.default(weight, torch.where(outside, 0, ids - lo))
    out = out * (~outside).unsqueeze(-1).to(out.dtype)
    if padding_idx >= 0:   # the local row index differs per rank: block its gradient by position
        out = torch.where((ids == padding_idx).unsqueeze(-1), out.detach(), out)
    return out

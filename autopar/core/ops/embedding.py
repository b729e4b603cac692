"""Embedding lookup (``aten.embedding``): split by batch, by embedding dim, or by vocabulary (the
table's rows: each rank looks up the ids it owns, ``codegen.runtime.sharded_embedding``, and the
output is a partial sum).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core.capture import tensor_val
from autopar.core.ops.base import Emitter, Site, emitter, rule
from autopar.core.placements import split_axes
from autopar.core.rules import AxisRule, OpView, fits, replicate

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
    em.emit(f"{node.name} = sharded_embedding({site.args}, rows=({rows[0]}, {rows[1]}))", site.comment)
    return True

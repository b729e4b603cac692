"""Sharding rules: for one op and ONE mesh axis of size ``n``, the ways it can run split.

Each rule is an ``AxisRule``: the placement every tensor input must have on that axis, the
placement the output then has, and a name a reader knows (``batch``, ``column``, ``row``,
``vocab``, ``heads``, ``seq``...). ``strategies.py`` combines rules across mesh axes.

Rules are autopar's own, written per op family from the op's semantics (the families and the
partial-sum algebra follow DTensor's rules, which the runtime then executes). Every op has at
least the replicate rule; an op no family knows gets only that, with a warning naming it. The
rules of ops with special handling elsewhere (cross-entropy, attention, batch norm, embedding,
dropout, views) are declared with that handling, in ``autopar.core.ops``; the families here are
the ops that run as their ATen call.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.core.capture import tensor_val
from autopar.core.execution import CAST_OPS, writes_in_place

aten = torch.ops.aten
R = Replicate()
P = Partial()


@dataclass(frozen=True)
class AxisRule:
    out: Placement
    ins: tuple[Placement, ...]   # one per flat tensor input of the node
    name: str


@dataclass(frozen=True)
class OpView:
    """What a rule may look at: the node, its tensor inputs' shapes and its output shape,
    already local to the mesh axes applied before this one."""

    node: fx.Node
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]

    def arg(self, i: int, name: str, default=None):
        args, kwargs = self.node.args, self.node.kwargs
        return args[i] if len(args) > i else kwargs.get(name, default)


RuleFn = Callable[[OpView, int], list[AxisRule]]


def replicate(v: OpView) -> AxisRule:
    return AxisRule(R, tuple(R for _ in v.in_shapes), "replicate")


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def fits(size: int, n: int, even: bool) -> bool:
    """Can a dim of ``size`` be split over ``n`` ranks (``even``: in equal parts)?"""
    return size >= n and (not even or size % n == 0)


# ---------------------------------------------------------------- elementwise and friends

PARTIAL_UNARY = {
    aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default, *CAST_OPS,
}
PARTIAL_ADDITIVE = {aten.add.Tensor, aten.sub.Tensor}
PARTIAL_NUMERATOR = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}


def pointwise(v: OpView, n: int) -> list[AxisRule]:
    """Broadcasting elementwise op: shard any output dim; inputs follow (or stay replicated where broadcast)."""
    out = v.out_shape
    rules = [replicate(v)]
    for d in range(len(out)):
        if not fits(out[d], n, even=False):
            continue
        ins = []
        for shape in v.in_shapes:
            di = d - (len(out) - len(shape))
            ins.append(Shard(di) if di >= 0 and shape[di] == out[d] else R)
        rules.append(AxisRule(Shard(d), tuple(ins), "elementwise"))
    rules += partial_rules(v)
    return rules


def partial_rules(v: OpView) -> list[AxisRule]:
    """Partial sums pass through ops linear in their (partial) inputs."""
    target = v.node.target
    k = len(v.in_shapes)
    if target in PARTIAL_UNARY and k == 1:
        return [AxisRule(P, (P,), "partial")]
    if target in PARTIAL_ADDITIVE and k == 2 and len(v.node.args) == 2 and v.node.kwargs.get("alpha", 1) == 1:
        return [AxisRule(P, (P, P), "partial")]
    if target in PARTIAL_NUMERATOR and k >= 1:
        rules = [AxisRule(P, (P,) + (R,) * (k - 1), "partial")]
        if target is aten.mul.Tensor and k == 2:
            rules.append(AxisRule(P, (R, P), "partial"))
        return rules
    return []


def identity_dims(v: OpView, n: int, keep: Callable[[int], int | None], even: bool = False, partial: bool = True) -> list[AxisRule]:
    """Single-input op whose output dim ``keep(d)`` is input dim ``d`` (None: dim cannot be sharded)."""
    rules = [replicate(v)]
    shape = v.in_shapes[0]
    extra = (R,) * (len(v.in_shapes) - 1)
    for d in range(len(shape)):
        od = keep(d)
        if od is not None and fits(shape[d], n, even):
            rules.append(AxisRule(Shard(od), (Shard(d),) + extra, "follow"))
    if partial:
        rules.append(AxisRule(P, (P,) + extra, "partial"))
    return rules


def same_dims(v: OpView, n: int) -> list[AxisRule]:
    return identity_dims(v, n, lambda d: d, partial=v.node.target in PARTIAL_UNARY)


def transpose(v: OpView, n: int) -> list[AxisRule]:
    nd = len(v.in_shapes[0])
    if v.node.target is aten.t.default:
        a, b = 0, 1 if nd == 2 else 0
    else:
        a, b = _norm(v.node.args[1], nd), _norm(v.node.args[2], nd)
    swap = {a: b, b: a}
    return identity_dims(v, n, lambda d: swap.get(d, d))


def permute(v: OpView, n: int) -> list[AxisRule]:
    nd = len(v.in_shapes[0])
    dims = [_norm(d, nd) for d in v.node.args[1]]
    return identity_dims(v, n, lambda d: dims.index(d))


def unsqueeze(v: OpView, n: int) -> list[AxisRule]:
    d0 = _norm(v.node.args[1], len(v.out_shape))
    return identity_dims(v, n, lambda d: d if d < d0 else d + 1)


def squeeze(v: OpView, n: int) -> list[AxisRule]:
    shape = v.in_shapes[0]
    arg = v.arg(1, "dim")
    dims = range(len(shape)) if arg is None else ([arg] if isinstance(arg, int) else arg)
    gone = {_norm(d, len(shape)) for d in dims if shape[_norm(d, len(shape))] == 1}
    return identity_dims(v, n, lambda d: None if d in gone else d - sum(g < d for g in gone))


def along_dim(dim_arg: int, dim_name: str = "dim", default: int = 0, partial: bool = False) -> RuleFn:
    """Ops that work along one dim (slice, select, split, softmax, cat...): shard the others."""

    def rule(v: OpView, n: int) -> list[AxisRule]:
        shape = v.in_shapes[0]
        dim = _norm(v.arg(dim_arg, dim_name, default), len(shape))
        dropped = v.node.target in (aten.select.int, aten.unbind.int)
        return identity_dims(
            v, n, lambda d: None if d == dim else (d - 1 if dropped and d > dim else d), partial=partial
        )

    return rule


def leading_dims(v: OpView, n: int) -> list[AxisRule]:
    """Ops on the last two dims as a matrix (tril, triu): shard the leading (batch) dims; linear,
    so a partial sum stays one."""
    nd = len(v.in_shapes[0])
    return identity_dims(v, n, lambda d: d if d < nd - 2 else None)


#: Ops along an index linear jointly in their float inputs (the index aside): partial sums pass.
LINEAR_INDEXED = {aten.gather.default, aten.scatter.src, aten.scatter_add.default}


def gather_scatter(v: OpView, n: int) -> list[AxisRule]:
    """``gather(x, dim, index)``, ``scatter(x, dim, index, src | value)``, ``scatter_add``: any
    other dim where every tensor input and the output agree is split in all of them; gather,
    scatter of a tensor and scatter_add are linear in x (and src), so partial sums pass."""
    shape = v.in_shapes[0]
    dim = _norm(v.arg(1, "dim"), len(shape))
    rules = [replicate(v)]
    if v.node.target in LINEAR_INDEXED:
        rules.append(AxisRule(P, tuple(R if i == 1 else P for i in range(len(v.in_shapes))), "partial"))
    for d in range(len(shape)):
        agree = all(len(s) == len(shape) and s[d] == shape[d] for s in v.in_shapes) and v.out_shape[d] == shape[d]
        if d != dim and agree and fits(shape[d], n, even=False):
            rules.append(AxisRule(Shard(d), (Shard(d),) * len(v.in_shapes), "follow"))
    return rules


def diff(v: OpView, n: int) -> list[AxisRule]:
    """diff(x, n, dim): along its dim, linear; with prepend/append tensors only replicated."""
    if len(v.in_shapes) > 1:
        return [replicate(v)]
    return along_dim(2, "dim", -1, partial=True)(v, n)


def conv(v: OpView, n: int) -> list[AxisRule]:
    """conv1d/2d/3d(x, weight, bias, stride, padding, dilation, groups): split a batched input's
    samples (weights replicated), or the output channels evenly (weight and bias split by their
    rows, as a column-parallel linear; one group only; conv refuses an empty weight)."""
    x, weight = v.in_shapes[0], v.in_shapes[1]
    rules = [replicate(v)]
    if len(x) != len(weight):   # an unbatched input: no sample dim, and its channels come first
        return rules
    if fits(x[0], n, even=False):
        rules.append(AxisRule(Shard(0), (Shard(0),) + (R,) * (len(v.in_shapes) - 1), "batch"))
    if v.arg(6, "groups", 1) == 1 and fits(weight[0], n, even=True):   # no empty weights
        rules.append(AxisRule(Shard(1), (R,) + (Shard(0),) * (len(v.in_shapes) - 1), "column"))
    return rules


def group_norm(v: OpView, n: int) -> list[AxisRule]:
    """group_norm(x, groups, weight, bias): statistics are per sample, so a batch split is exact."""
    rules = [replicate(v)]
    if fits(v.in_shapes[0][0], n, even=False):
        rules.append(AxisRule(Shard(0), (Shard(0),) + (R,) * (len(v.in_shapes) - 1), "batch"))
    return rules


def constant(v: OpView, n: int) -> list[AxisRule]:
    """Replicated by choice: a tensor the forward makes from a Python constant
    (``torch.tensor(...)``: lift_fresh_copy), tiny and the same on every rank; an in-place write,
    whose target and its aliases stay replicated (``execution.written_aliases``)."""
    return [replicate(v)]


def index(v: OpView, n: int) -> list[AxisRule]:
    """``x[i0, i1, ...]`` with index tensors (None for a dim taken whole): a dim of x no index
    reads is split as it is (indices replicated); a dim of the indices' broadcast shape is split
    in every index tensor that has it (x replicated: each rank picks its indices' elements).
    Linear in x. Boolean masks (data-dependent shapes) stay replicated."""
    x, idx_shapes = v.in_shapes[0], v.in_shapes[1:]
    indexed = [i for i, a in enumerate(v.arg(1, "indices")) if a is not None]
    if not indexed or any(tensor_val(a).dtype == torch.bool for a in v.arg(1, "indices") if a is not None):
        return [replicate(v)]
    nb = max(len(s) for s in idx_shapes)
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    start = indexed[0] if adjacent else 0   # where the broadcast dims land in the output
    kept = [d for d in range(len(x)) if d not in indexed]
    rules = [replicate(v), AxisRule(P, (P,) + (R,) * len(idx_shapes), "partial")]
    for d in kept:
        od = (d if d < start else d - len(indexed) + nb) if adjacent else nb + kept.index(d)
        if fits(x[d], n, even=False):
            rules.append(AxisRule(Shard(od), (Shard(d),) + (R,) * len(idx_shapes), "follow"))
    for j in range(nb):
        size = v.out_shape[start + j]
        ins = [Shard(j - (nb - len(s))) if j >= nb - len(s) and s[j - (nb - len(s))] == size else R for s in idx_shapes]
        if fits(size, n, even=False) and any(isinstance(p, Shard) for p in ins):
            rules.append(AxisRule(Shard(start + j), (R, *ins), "index"))
    return rules




def baddbmm(v: OpView, n: int) -> list[AxisRule]:
    """beta * bias + alpha * (a @ b) on [B, M, K] @ [B, K, N] (BLOOM's ALiBi scores): batch,
    rows, columns (the bias split with the output where it has that dim), or the reduction (a
    partial sum, the bias a partial too so that it is added once)."""
    bias, a, b = v.in_shapes
    off = 3 - len(bias)

    def bias_on(d: int) -> Placement:
        return Shard(d - off) if d >= off and bias[d - off] == v.out_shape[d] and bias[d - off] > 1 else R

    rules = [replicate(v)]
    for d, ins, name in ((0, (Shard(0), Shard(0)), "batch"), (1, (Shard(1), R), "rows"), (2, (R, Shard(2)), "columns")):
        if fits(v.out_shape[d], n, even=False):
            rules.append(AxisRule(Shard(d), (bias_on(d), *ins), name))
    if fits(a[2], n, even=False):
        rules.append(AxisRule(P, (P, Shard(2), Shard(1)), "reduction"))
    return rules


def repeat(v: OpView, n: int) -> list[AxisRule]:
    """``x.repeat(sizes)``: a dim repeated once keeps its split."""
    shape, sizes = v.in_shapes[0], list(v.arg(1, "repeats"))
    off = len(sizes) - len(shape)
    return identity_dims(v, n, lambda d: d + off if sizes[d + off] == 1 else None, partial=False)


def repeat_interleave(v: OpView, n: int) -> list[AxisRule]:
    """``repeat_interleave(x, k, dim)``: the other dims keep their split (no dim: x is flattened)."""
    dim = v.arg(2, "dim")
    if dim is None:
        return [replicate(v)]
    dim = _norm(dim, len(v.in_shapes[0]))
    return identity_dims(v, n, lambda d: None if d == dim else d, partial=False)


def stack(v: OpView, n: int) -> list[AxisRule]:
    """``stack(xs, dim)``: every input split alike on a dim; the new dim is not split."""
    nd = len(v.out_shape)
    dim = _norm(v.arg(1, "dim", 0), nd)
    rules = [replicate(v)]
    for d in range(nd - 1):
        if fits(v.in_shapes[0][d], n, even=False):
            rules.append(AxisRule(Shard(d if d < dim else d + 1), tuple(Shard(d) for _ in v.in_shapes), "follow"))
    return rules


def reverse_dims(v: OpView, n: int) -> list[AxisRule]:
    """``x.T`` (numpy_T): dims reversed."""
    nd = len(v.in_shapes[0])
    return identity_dims(v, n, lambda d: nd - 1 - d)


def histc(v: OpView, n: int) -> list[AxisRule]:
    """A histogram of a split tensor is the sum of the parts' histograms (MoE routing counts),
    given a fixed range (with none, each part's own min and max would set its bins)."""
    shape = v.in_shapes[0]
    if v.arg(2, "min", 0) >= v.arg(3, "max", 0):
        return [replicate(v)]
    return [replicate(v)] + [AxisRule(P, (Shard(d),), "partial-count") for d in range(len(shape))
                             if fits(shape[d], n, even=False)]


def grouped_mm(v: OpView, n: int) -> list[AxisRule]:
    """Mixture-of-experts matmul: tokens [S, K] sorted by expert, weights [E, K, N], offsets
    [E]. Each expert's columns split (column-parallel experts), or the contracted dim (a partial
    sum, row-parallel); linear in the tokens."""
    x, w = v.in_shapes[0], v.in_shapes[1]
    extra = (R,) * (len(v.in_shapes) - 2)
    rules = [replicate(v), AxisRule(P, (P, R) + extra, "partial")]
    if fits(w[2], n, even=False):
        rules.append(AxisRule(Shard(1), (R, Shard(2)) + extra, "column"))
    if fits(x[1], n, even=False):
        rules.append(AxisRule(P, (Shard(1), Shard(1)) + extra, "row"))
    return rules




def unflatten(v: OpView, n: int) -> list[AxisRule]:
    """``x.unflatten(dim, sizes)``: the other dims keep their split (the unflattened one is whole)."""
    nd = len(v.in_shapes[0])
    dim = _norm(v.arg(1, "dim"), nd)
    grown = len(v.arg(2, "sizes")) - 1
    return identity_dims(v, n, lambda d: None if d == dim else (d if d < dim else d + grown))


def cat(v: OpView, n: int) -> list[AxisRule]:
    nd = len(v.out_shape)
    dim = _norm(v.arg(1, "dim", 0), nd)
    rules = [replicate(v)]
    for d in range(nd):
        if d != dim and fits(v.out_shape[d], n, even=False) and all(len(s) == nd for s in v.in_shapes):
            rules.append(AxisRule(Shard(d), tuple(Shard(d) for _ in v.in_shapes), "follow"))
    return rules








def reduction(v: OpView, n: int) -> list[AxisRule]:
    """sum/mean/amax over dims: shard kept dims; sharding a summed dim leaves a partial sum.
    (A mean over a sharded dim is not offered: an average of local means needs even shards and a
    backward that DTensor's Partial("avg") does not scale.)"""
    shape = v.in_shapes[0]
    dims_arg = v.arg(1, "dim")
    keepdim = bool(v.arg(2, "keepdim", False))
    if dims_arg is None or dims_arg == []:
        dims = set(range(len(shape)))
    else:
        dims = {_norm(d, len(shape)) for d in ([dims_arg] if isinstance(dims_arg, int) else dims_arg)}
    rules = identity_dims(
        v, n, lambda d: None if d in dims else (d if keepdim else d - sum(x < d for x in dims)), partial=False
    )
    target = v.node.target
    for d in dims:
        if target in (aten.sum.dim_IntList, aten.sum.default) and fits(shape[d], n, even=False):
            rules.append(AxisRule(P, (Shard(d),), "partial-sum"))
    if target in (aten.sum.dim_IntList, aten.sum.default):
        rules.append(AxisRule(P, (P,), "partial"))
    return rules


# ---------------------------------------------------------------- layers

def linear(v: OpView, n: int) -> list[AxisRule]:
    """y = x W^T + b: batch (any leading dim of x), column (W rows), row (reduction dim -> partial)."""
    x, w = v.in_shapes[0], v.in_shapes[1]
    has_bias = len(v.in_shapes) == 3
    nd = len(x)
    rules = [replicate(v)]
    for d in range(nd - 1):
        if fits(x[d], n, even=False):
            name = "batch" if d == 0 else "seq"
            rules.append(AxisRule(Shard(d), (Shard(d), R) + ((R,) if has_bias else ()), name))
    if fits(w[0], n, even=False):
        rules.append(AxisRule(Shard(nd - 1), (R, Shard(0)) + ((Shard(0),) if has_bias else ()), "column"))
    if fits(w[1], n, even=False):  # each rank adds 1/n of the bias to its partial sum
        rules.append(AxisRule(P, (Shard(nd - 1), Shard(1)) + ((P,) if has_bias else ()), "row"))
    rules.append(AxisRule(P, (P, R) + ((P,) if has_bias else ()), "partial"))
    return rules


def matmul(v: OpView, n: int) -> list[AxisRule]:
    """a @ b with broadcast batch dims: batch, rows of a, columns of b, or the reduction dim."""
    a, b = v.in_shapes
    out = v.out_shape
    na, nb, no = len(a), len(b), len(out)
    rules = [replicate(v)]
    for d in range(no - 2):
        da, db = d - (no - na), d - (no - nb)
        ia = Shard(da) if da >= 0 and a[da] == out[d] else R
        ib = Shard(db) if db >= 0 and b[db] == out[d] else R
        if fits(out[d], n, even=False):
            rules.append(AxisRule(Shard(d), (ia, ib), "batch"))
    if na >= 2 and fits(a[-2], n, even=False):
        rules.append(AxisRule(Shard(no - 2), (Shard(na - 2), R), "rows"))
    if nb >= 2 and fits(b[-1], n, even=False):
        rules.append(AxisRule(Shard(no - 1), (R, Shard(nb - 1)), "columns"))
    if fits(a[-1], n, even=False):
        rules.append(AxisRule(P, (Shard(na - 1), Shard(max(nb - 2, 0))), "reduction"))
    rules += [AxisRule(P, (P, R), "partial"), AxisRule(P, (R, P), "partial")]
    return rules


def addmm(v: OpView, n: int) -> list[AxisRule]:
    """bias + a @ b on 2-D a [M, K], b [K, N] (GPT-2's Conv1D): rows, columns, or reduction."""
    bias, a, b = v.in_shapes
    bias_cols = Shard(len(bias) - 1) if bias and bias[-1] == b[1] and bias[-1] > 1 else R
    rules = [replicate(v)]
    if fits(a[0], n, even=False):
        bias_rows = Shard(0) if len(bias) == 2 and bias[0] == a[0] else R
        rules.append(AxisRule(Shard(0), (bias_rows, Shard(0), R), "batch"))
    if fits(b[1], n, even=False):
        rules.append(AxisRule(Shard(1), (bias_cols, R, Shard(1)), "column"))
    if fits(a[1], n, even=False):
        rules.append(AxisRule(P, (P, Shard(1), Shard(0)), "row"))
    return rules


def pad(v: OpView, n: int) -> list[AxisRule]:
    """Constant padding of the last dims: shard the dims that are not padded."""
    shape = v.in_shapes[0]
    amounts = list(v.arg(1, "pad"))
    padded = {len(shape) - 1 - i // 2 for i, a in enumerate(amounts) if a != 0}
    return identity_dims(v, n, lambda d: None if d in padded else d, partial=False)




def layer_norm(v: OpView, n: int) -> list[AxisRule]:
    """Normalise the last dims; any leading dim (batch, sequence) can be sharded."""
    x = v.in_shapes[0]
    norm_nd = len(v.arg(1, "normalized_shape"))
    params = (R,) * (len(v.in_shapes) - 1)
    rules = [replicate(v)]
    for d in range(len(x) - norm_nd):
        if fits(x[d], n, even=False):
            rules.append(AxisRule(Shard(d), (Shard(d),) + params, "batch" if d == 0 else "seq"))
    return rules


def rms_norm(v: OpView, n: int) -> list[AxisRule]:
    x = v.in_shapes[0]
    norm_nd = len(v.arg(1, "normalized_shape"))
    params = (R,) * (len(v.in_shapes) - 1)
    return [replicate(v)] + [
        AxisRule(Shard(d), (Shard(d),) + params, "batch" if d == 0 else "seq")
        for d in range(len(x) - norm_nd)
        if fits(x[d], n, even=False)
    ]


RULES: dict[object, RuleFn] = {
    aten.linear.default: linear,
    aten.addmm.default: addmm,
    aten.constant_pad_nd.default: pad, aten.pad.default: pad,
    aten.matmul.default: matmul, aten.mm.default: matmul, aten.bmm.default: matmul,
    aten.layer_norm.default: layer_norm,
    aten.rms_norm.default: rms_norm,
    aten.conv1d.default: conv, aten.conv2d.default: conv, aten.conv3d.default: conv,
    aten.group_norm.default: group_norm,
    aten.unflatten.int: unflatten,
    aten.transpose.int: transpose, aten.t.default: transpose,
    aten.permute.default: permute,
    aten.unsqueeze.default: unsqueeze,
    aten.squeeze.dim: squeeze, aten.squeeze.dims: squeeze, aten.squeeze.default: squeeze,
    aten.slice.Tensor: along_dim(1),
    aten.select.int: along_dim(1), aten.unbind.int: along_dim(1),
    aten.split.Tensor: along_dim(2), aten.split_with_sizes.default: along_dim(2), aten.chunk.default: along_dim(2),
    aten.softmax.int: along_dim(1), aten._softmax.default: along_dim(1),
    aten.cumsum.default: along_dim(1, partial=True), aten.diff.default: diff,
    aten.tril.default: leading_dims, aten.triu.default: leading_dims,
    aten.gather.default: gather_scatter, aten.scatter.src: gather_scatter, aten.scatter.value: gather_scatter,
    aten.scatter_add.default: gather_scatter,
    aten.__and__.Tensor: pointwise, aten.__or__.Tensor: pointwise, aten.__xor__.Tensor: pointwise,
    aten.where.ScalarOther: pointwise, aten.where.ScalarSelf: pointwise, aten.where.Scalar: pointwise,
    aten.masked_fill.Tensor: pointwise, aten.floor_divide.default: pointwise,
    aten.index.Tensor: index,
    aten.ones_like.default: same_dims, aten.zeros_like.default: same_dims, aten.full_like.default: same_dims,
    aten.empty_like.default: same_dims,
    aten.lift_fresh_copy.default: constant,
    aten.baddbmm.default: baddbmm,
    aten.repeat.default: repeat, aten.repeat_interleave.self_int: repeat_interleave,
    aten.stack.default: stack, aten.numpy_T.default: reverse_dims,
    aten.topk.default: along_dim(2, "dim", -1), aten.sort.default: along_dim(1, "dim", -1),
    aten.sort.stable: along_dim(2, "dim", -1),
    aten.histc.default: histc,
    aten._grouped_mm.default: grouped_mm,
    aten.log_softmax.int: along_dim(1), aten._log_softmax.default: along_dim(1),
    aten.cat.default: cat,
    aten.sum.dim_IntList: reduction, aten.mean.dim: reduction, aten.sum.default: reduction,
    aten.amax.default: reduction, aten.max.dim: reduction, aten.min.dim: reduction,
    aten.contiguous.default: same_dims, aten.clone.default: same_dims, aten.alias.default: same_dims,
    **{cast: same_dims for cast in CAST_OPS},
    aten.detach.default: same_dims, aten.type_as.default: pointwise,
}

RULES_BY_NAME: dict[str, RuleFn] = {
    "transformers.grouped_mm_fallback.default": grouped_mm,   # HF's experts in float32
}


def family_rule(node: fx.Node) -> RuleFn | None:
    """The rule family of a node, or None when only replication is known (``autopar.core.ops.rule_for``
    looks at the op's own entry first)."""
    if node.target in RULES:
        return RULES[node.target]
    if str(node.target) in RULES_BY_NAME:   # ops of libraries autopar does not import
        return RULES_BY_NAME[str(node.target)]
    if writes_in_place(node):
        return constant
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        return pointwise
    return None


def apply_rule(fn: RuleFn | None, node: fx.Node, in_shapes: tuple[tuple[int, ...], ...], out_shape: tuple[int, ...],
               n: int) -> list[AxisRule]:
    """The rules ``fn`` gives ``node`` on a mesh axis of size ``n``: only replication where it has
    none, on an axis of one or with no tensor input; no partial sums of integers."""
    v = OpView(node, in_shapes, out_shape)
    if fn is None or not in_shapes or n == 1:
        return [replicate(v)]
    rules = fn(v, n)
    if not _floating(node):  # a partial sum of integers (ids, masks) means nothing
        rules = [r for r in rules if not isinstance(r.out, Partial) and not any(isinstance(p, Partial) for p in r.ins)]
    return rules


def _floating(node: fx.Node) -> bool:
    val = tensor_val(node)
    return val is not None and val.dtype.is_floating_point

"""Which values a plan holds in the balanced order: where a causal ring runs balanced
(``ops.attention.BALANCED_RING``), every value split over its mesh axis along the dimension that
meets the ring's sequence holds chunks r and 2n-1-r of 2n on rank r
(``context_parallel.balance``), not chunk r of n.

Such dims are found as DTensor follows a split: an op's inputs and output split over the axis
(by its rule) split one dimension of the op; a value read as it is held keeps its split. So the
(value, dim) pairs split over the axis are joined through ops, and those a balanced ring reaches
hold the balanced order; each with its period, the run of elements one sequence spans along the
dim (a reshape flattening a batch of sequences holds several runs, each permuted alone). Ops
whose result depends on sequence order (slices, shifts, positions built by ``arange``,
cumulative sums) have no rule splitting that dim, so they read it whole: the runtime puts it back in order where a move gathers it, and
permutes it where a move splits it again (``codegen.runtime.move_balanced``), at the inputs
(``balance`` before the split) and at the outputs (``collectives.full_balanced``).

It is refused (``BalancedLayoutError``) where the balanced order cannot hold: a parameter or
buffer reached (tensor parallelism over the ring's axis beside it), a period that 2n does not
divide, Ulysses or a contiguous causal ring reached, a random op other than dropout (drawn in
sequence order), or a pipeline.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.core.capture import CapturedGraph, flat_tensor_inputs, tensor_val
from autopar.core.errors import AutoparError
from autopar.core.execution import IDENTITY_OPS
from autopar.core.ops.attention import SDPA, causal_attention, context_layout, context_of
from autopar.core.ops.shapes import RESHAPES
from autopar.core.placements import Placements

if TYPE_CHECKING:
    from autopar.core.plan import Plan

Element = tuple[str, int]   # (value name, dim)


class BalancedLayoutError(AutoparError):
    """A plan's balanced ring cannot be run in the balanced order (the message says why)."""


@dataclass(frozen=True)
class BalancedLayout:
    """Mesh ``axis`` (of ``ranks`` ranks) holds each (value name, dim) of ``periods`` in the
    balanced order: each run of that many elements along the dim (one sequence; a batch of them
    flattened holds several runs) permuted alone."""

    axis: int
    ranks: int
    periods: dict[Element, int]

    def dim(self, name: str, placements: Placements | None) -> tuple[int, int] | None:
        """(dim, period) of value ``name`` where ``placements`` split it over the axis in the
        balanced order, or None (not split there, or split in the contiguous order)."""
        p = placements[self.axis] if placements is not None else None
        if not isinstance(p, Shard) or (name, p.dim) not in self.periods:
            return None
        return p.dim, self.periods[(name, p.dim)]


def _on_axis(placements: Placements | None, axis: int) -> int | None:
    p = placements[axis] if placements is not None else None
    return p.dim if isinstance(p, Shard) else None


#: An op joining two (value, dim) pairs split over the axis: (from its input, to its output, the
#: op), or two of its inputs (the op None: they meet position by position).
Edge = tuple[Element, Element, "fx.Node | None"]


def _edges(graph: fx.Graph, plan: Mapping, axis: int) -> list[Edge]:
    """Every op's inputs split over ``axis`` joined to its output split there (by its rule)."""
    edges: list[Edge] = []
    for node in graph.nodes:
        np_ = plan.get(node.name)
        if np_ is None and (node.target is operator.getitem or node.target in IDENTITY_OPS):
            source = node.args[0]
            held = _on_axis(plan[source.name].out, axis) if source.name in plan else None
            if held is not None:
                edges.append(((source.name, held), (node.name, held), node))
            continue
        if np_ is None:
            continue
        split = [(inp.name, d) for inp, want in zip(flat_tensor_inputs(node), np_.ins, strict=False)
                 if (d := _on_axis(want, axis)) is not None]
        out = _on_axis(np_.out, axis)
        if out is not None:
            edges += [(e, (node.name, out), node) for e in split]
        else:   # summed over the split (a loss, a contraction): its inputs meet position by position
            edges += [(split[0], e, None) for e in split[1:]]
    return edges


def _scale(node: fx.Node | None, source: Element, target: Element) -> Fraction:
    """How many times ``source``'s period ``target``'s is (an op's input and output dims):
    1 but where a reshape merges the sequence with dims inside it (x their sizes) or splits
    them off (/ their sizes)."""
    if node is None or node.target not in RESHAPES:
        return Fraction(1)
    shape_in, shape_out = list(tensor_val(node.args[0]).shape), list(tensor_val(node).shape)
    i = o = 0
    while i < len(shape_in) or o < len(shape_out):   # runs of dims of equal products
        ins, outs = [i], [o]
        a, b = _size(shape_in, i), _size(shape_out, o)
        while a != b:
            if a < b:
                i += 1
                ins.append(i)
                a *= _size(shape_in, i)
            else:
                o += 1
                outs.append(o)
                b *= _size(shape_out, o)
        if source[1] in ins and target[1] in outs:
            inner_in = math.prod(shape_in[d] for d in ins if d > source[1])
            inner_out = math.prod(shape_out[d] for d in outs if d > target[1])
            return Fraction(int(inner_in), int(inner_out))
        i, o = i + 1, o + 1
    return Fraction(1)


def _size(shape: list, d: int) -> int:
    return int(shape[d]) if d < len(shape) else 1


def _periods(edges: list[Edge], seeds: dict[Element, int]) -> dict[Element, int]:
    """The period of every (value, dim) the ``seeds`` reach through ``edges`` (both ways)."""
    near: dict[Element, list[tuple[Element, fx.Node | None, bool]]] = {}
    for a, b, node in edges:
        near.setdefault(a, []).append((b, node, True))
        near.setdefault(b, []).append((a, node, False))
    periods: dict[Element, Fraction] = {e: Fraction(p) for e, p in seeds.items()}
    todo = list(seeds)
    while todo:
        e = todo.pop()
        for other, node, forward in near.get(e, ()):
            scale = _scale(node, e, other) if forward else 1 / _scale(node, other, e)
            period = periods[e] * scale
            if other in periods and periods[other] != period:
                raise BalancedLayoutError(f"the balanced ring's sequence reaches {other[0]} (dim {other[1]}) in two "
                                          "ways that disagree on where its sequences lie: use load_balance 'contiguous'")
            if other not in periods:
                periods[other] = period
                todo.append(other)
    return {e: int(p) if p.denominator == 1 else -1 for e, p in periods.items()}


def balanced_layout(captured: CapturedGraph, plan: Mapping, mesh_shape: Sequence[int],
                    pipelined: bool = False) -> BalancedLayout | None:
    """Where ``plan`` (node name -> ``NodePlan``) runs a causal ring balanced, the values held
    in the balanced order (checked: ``BalancedLayoutError`` says what stands in the way); None
    where no ring is balanced."""
    graph = captured.graph
    rings = [(node, context_of(plan[node.name])) for node in graph.nodes
             if node.target is SDPA and node.name in plan and context_layout(plan[node.name]) == "balanced"]
    if not rings:
        return None
    if pipelined:
        raise BalancedLayoutError("a balanced ring inside pipeline stages is not supported: plan it with "
                                  "context_parallel's load_balance 'contiguous', or without a pipeline")
    axes = {c[0] for _, c in rings if c is not None}
    if len(axes) != 1:
        raise BalancedLayoutError(f"balanced rings over several mesh axes ({sorted(axes)}) are not supported")
    axis = axes.pop()
    seeds = {(node.name, 2): int(tensor_val(node).shape[2]) for node, _ in rings}
    layout = BalancedLayout(axis, mesh_shape[axis], _periods(_edges(graph, plan, axis), seeds))
    _check(captured, plan, layout)
    return layout


def plan_layout(captured: CapturedGraph, plan: Plan) -> BalancedLayout | None:
    """``balanced_layout`` of a whole ``Plan``: what a planner checks before it keeps a plan."""
    return balanced_layout(captured, {n.name: n for n in plan.nodes}, plan.mesh.shape, pipelined=plan.pipeline is not None)


def _check(captured: CapturedGraph, plan: Mapping, layout: BalancedLayout) -> None:
    """Refuse what the balanced order cannot run exactly (see the module's docstring)."""
    nodes = {n.name: n for n in captured.graph.nodes}
    chunks = 2 * layout.ranks
    for (name, d), period in sorted(layout.periods.items()):
        node, np_ = nodes[name], plan.get(name)
        head = f"the balanced ring's sequence reaches {name} (dim {d})"
        if name in captured.param_of or name in captured.buffer_of:
            raise BalancedLayoutError(f"{head}, a parameter or buffer split over the ring's axis: plan it with "
                                      "context_parallel's load_balance 'contiguous'")
        size = tensor_val(node).shape[d]
        if period < 1 or period % chunks or not isinstance(size, int) or size % period:
            raise BalancedLayoutError(f"{head}, of {size} elements, whose sequences (of {period}) do not cut into "
                                      f"{chunks} equal chunks: pad the sequence, or use load_balance 'contiguous'")
        _check_op(node, np_, head)


def _check_op(node: fx.Node, np_, head: str) -> None:
    """Ops reached that the balanced order cannot run: random ones but dropout (which draws the
    whole mask and permutes it: ``ops.dropout``), Ulysses, a contiguous causal ring."""
    if node.op == "call_function" and "rand" in str(node.target):
        raise BalancedLayoutError(f"{head}, a random op ({node.target}) whose numbers are drawn in sequence order: "
                                  "use load_balance 'contiguous'")
    if node.target is SDPA and np_ is not None and (context := context_of(np_)) is not None:
        if context[1] != "ring" or (causal_attention(node) and context_layout(np_) != "balanced"):
            raise BalancedLayoutError(f"{head}, an attention split by sequence as {context[1]} in the contiguous "
                                      "order, beside a balanced ring: plan every one balanced, or none")


__all__ = ["BalancedLayout", "BalancedLayoutError", "balanced_layout", "plan_layout"]

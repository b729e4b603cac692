"""Gradients that stay partial sums through ops computed from parameters alone.

A position embedding added to a batch-split activation gets a gradient that is partial on the
batch axis (each rank saw its part of the batch). Computed from parameters alone (and from values
with no gradient), replicated, such an op can pass that partial gradient on down to the
parameters, where gradient sync sums it once in its buckets, instead of an all-reduce in the
middle of the backward. Which ops may (``computed_from_parameters``) is decided here once: the
cost model prices their gradient's edge as a queued sync, and the code generator lets the ops of
a plan that do pass it (``partial_passes``).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

from autopar.core.capture import flat_tensor_inputs
from autopar.core.execution import IDENTITY_OPS
from autopar.core.placements import Placements, grad_placement
from autopar.core.plan import NodePlan

#: Op name -> the mesh axes on which it passes its gradient on partial.
Passes = dict[str, tuple[int, ...]]


def computed_from_parameters(nodes: Iterable[fx.Node], is_param: Callable[[fx.Node], bool],
                             has_grad: Callable[[fx.Node], bool],
                             plain: Callable[[fx.Node], bool] = lambda _: True) -> list[fx.Node]:
    """The ops of ``nodes`` (in graph order) whose gradient may stay partial down to the
    parameters: each has a gradient, and each of its inputs is a parameter, such an op, or a
    value with no gradient that is ``plain`` (the cost model, which does not know the plan, asks
    that it not depend on the batch: a batch-dependent value is split with the batch)."""
    found: dict[fx.Node, None] = {}   # (ordered)
    for node in nodes:
        if has_grad(node) and all(is_param(i) or i in found or (not has_grad(i) and plain(i))
                                  for i in node.all_input_nodes):
            found[node] = None
    return list(found)


def partial_passes(graph: fx.Graph, plan: dict[str, NodePlan], with_grad: set[str], params: set[str]) -> Passes:
    """Ops computed whole on every rank of a mesh axis (inputs and output replicated there) whose
    every consumer gives a partial gradient back on that axis, as a batch-split op gives a
    replicated input (position embeddings added to the batch), and whose inputs are parameters
    or such ops (``computed_from_parameters``): the gradient stays partial through them (each
    rank's backward is linear in its summand) and is summed once, in gradient sync's buckets with
    the parameters', instead of all-reduced in the middle of the backward. (Where the gradient
    would meet an activation that needs it whole, it is all-reduced at that edge instead: no gain,
    so no pass.) Op name -> those axes (of ops whose value has a gradient: ``with_grad``;
    ``params``: parameter node names). The greatest such assignment, found by dropping axes."""
    ops = [n for n in graph.nodes if n.op == "call_function" and n.users and plan.get(n.name) is not None]
    nodes = computed_from_parameters(ops, lambda n: n.name in params, lambda n: n.name in with_grad)
    allowed = {n.name: {a for a, o in enumerate(plan[n.name].out) if isinstance(o, Replicate)
                        and all(isinstance(i[a], Replicate) for i in plan[n.name].ins)} for n in nodes}
    while True:
        passes: Passes = {}
        for node in reversed(nodes):
            axes = tuple(a for a in sorted(allowed[node.name]) if all(
                _gives_partial(user, node, a, plan[node.name].out, plan, passes) for user in node.users))
            if axes:
                passes[node.name] = axes
        dropped = False
        for node in nodes:   # an input that keeps its gradient whole would all-reduce it: no pass
            for a in passes.get(node.name, ()):
                if any(i.name in with_grad and i.name not in params and a not in passes.get(i.name, ())
                       for i in node.all_input_nodes):
                    allowed[node.name].discard(a)
                    dropped = True
        if not dropped:
            return passes


def _gives_partial(user: fx.Node, node: fx.Node, axis: int, out: Placements, plan: dict[str, NodePlan],
                   passes: Passes) -> bool:
    """Does ``user`` read ``node`` as placed (no move) and give its gradient back partial on ``axis``?"""
    up = plan.get(user.name)
    if user.op == "call_function" and up is None and user.target not in IDENTITY_OPS | {operator.getitem}:
        return True   # no tensor output (a metadata assert): no gradient
    if user.op != "call_function" or up is None:   # an output, a getitem of a multi-output op
        return False
    return all(want == out and isinstance(given_grad(want, up, passes.get(user.name, ()))[axis], Partial)
               for inp, want in zip(flat_tensor_inputs(user), up.ins, strict=True) if inp is node)


def given_grad(want: Placements, np_: NodePlan, passing: Sequence[int]) -> Placements:
    """The placement of the gradient an op gives back for an input it reads placed ``want``
    (``grad_placement``; partial on the axes where the op passes partial gradients through)."""
    grad = list(grad_placement(want, np_.ins, np_.out))
    for a in passing:
        if isinstance(want[a], Replicate):
            grad[a] = Partial()
    return tuple(grad)

"""The forward of the other training mode: ``module.eval()`` after compiling a model in training
mode (or ``train()`` after compiling it in eval mode) runs the model as captured in that mode,
where batch norm reads its running statistics, dropout passes values through and whatever else
the model does by ``self.training`` happens as it would on one device.

The plan was made for the other capture, whose nodes are named in their order: a node one mode
alone has (the counter of batches a batch norm counts in training) shifts the names of the ones
after it. So each node of the new capture takes the placement of its counterpart in the planned
graph (``counterparts``: the same op on the counterparts of its inputs, with the same output
shape), under its own name (``as_named``); a node without one runs replicated.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch.fx as fx
from torch.distributed.tensor import Replicate

from autopar.core.capture import CapturedGraph, flat_tensor_inputs, is_random, readable_name, tensor_val
from autopar.core.execution import written_aliases
from autopar.core.plan import NodePlan, Plan


def _kind(node: fx.Node) -> tuple:
    val = tensor_val(node)
    return node.target, None if val is None else (tuple(val.shape), val.dtype)


def counterparts(planned: fx.Graph, other: fx.Graph) -> dict[str, str | None]:
    """For each op of ``other``, the op of ``planned`` that computes the same value: the same op,
    output shape and dtype, reading the counterparts of its inputs, the first such after the last
    one of its kind matched (the graphs run in the same order); None where there is none.
    Placeholders (parameters, buffers, inputs) are their own counterparts."""
    names: dict[str, str | None] = {n.name: n.name for n in other.nodes if n.op == "placeholder"}
    candidates: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in planned.nodes:
        if node.op == "call_function":
            candidates[_kind(node)].append(node)
    after: dict[tuple, int] = defaultdict(int)
    for node in other.nodes:
        if node.op != "call_function":
            continue
        kind, inputs = _kind(node), [names.get(i.name) for i in node.all_input_nodes]
        names[node.name] = None
        for j in range(after[kind], len(candidates[kind])):
            if [i.name for i in candidates[kind][j].all_input_nodes] == inputs:
                names[node.name], after[kind] = candidates[kind][j].name, j + 1
                break
    return names


def as_named(plan: Plan, captured: CapturedGraph, names: dict[str, str | None]) -> Plan:
    """``plan`` for ``captured``: each node's counterpart's placement under the node's own name
    (``names``: from ``counterparts``), a node without one replicated, and so is one this mode
    writes in place, or an alias of it, that the plan splits (``execution.written_aliases``)."""
    planned = {n.name: n for n in plan.nodes}
    written = {n.name for n in written_aliases(captured.graph)}
    nodes = []
    for node in captured.graph.nodes:
        counterpart = names.get(node.name, node.name)
        split_write = node.op == "call_function" and node.name in written and not _replicated(planned.get(counterpart))
        if counterpart in planned and not split_write:
            nodes.append(replace(planned[counterpart], name=node.name))
        elif node.op == "call_function" and tensor_val(node) is not None:
            nodes.append(_replicate(node, plan.mesh.ndim))
    return replace(plan, nodes=nodes)


def _replicated(np_: NodePlan | None) -> bool:
    return np_ is not None and all(isinstance(p, Replicate) for ps in (np_.out, *np_.ins) for p in ps)


def _replicate(node: fx.Node, ndim: int) -> NodePlan:
    """A replicated placement for an op the plan has no counterpart of (or must not split here)."""
    whole = (Replicate(),) * ndim
    return NodePlan(node.name, str(node.target), readable_name(node), "replicate (not planned in this mode)",
                    whole, tuple(whole for _ in flat_tensor_inputs(node)), None, None, 0.0, 0.0, 0.0)


def by_mode(graph: fx.Graph) -> list[str]:
    """The ops of a graph captured in training mode that eval mode would run otherwise: dropout's
    (its random mask: eval passes values through) and batch norm's (eval reads the running
    statistics). What a model does by ``self.training`` in Python shows only in another capture."""
    return [n.name for n in graph.nodes if n.op == "call_function"
            and ((is_random(n) and _dropout_p(n) != 0) or "batch_norm" in str(n.target))]


def _dropout_p(node: fx.Node) -> object:
    """The value of a random op's dropout probability argument (``p``, ``dropout_p``: attention's
    dropout of 0 draws nothing), None where it has none."""
    for i, arg in enumerate(node.target._schema.arguments):   # type: ignore[union-attr]
        if arg.name in ("p", "dropout_p"):
            return node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else arg.default_value)
    return None

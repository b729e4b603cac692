"""Values a captured graph computes from sizes alone, computed at planning time on the CPU.

Hugging Face builds its attention mask from positions and sizes (``autopar.core.fold``); generated
code finds out at run time whether it is causal. A sharding rule that needs to know it beforehand
(attention split by sequence: only exact for a causal mask or none) computes the mask here, from
the graph, as the forward would: the same ops on concrete tensors, on the CPU.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

#: Largest value (in elements) computed: a mask of a long sequence is left unknown beyond it.
LIMIT = 2**24
_RANDOM = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)
_CPU = torch.device("cpu")


def _ancestors(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and what it reads, in graph order, stopping at sizes; None where it reads an
    input, parameter, buffer or constant (any placeholder)."""
    found: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        if n.op == "placeholder":
            return None
        found[n] = None
        if not _size(n):
            stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (int, torch.SymInt))


def _computable(node: fx.Node, limit: int) -> bool:
    """An op this module may run: deterministic, of concrete sizes, its value within ``limit``."""
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload) and any(t in node.target.tags for t in _RANDOM):
        return False
    vals = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return all(all(isinstance(s, int) for s in v.shape) and v.numel() <= limit for v in vals)


def value_from_shapes(node: fx.Node, limit: int = LIMIT) -> Any:
    """The value of ``node`` where it depends on sizes alone (no input, parameter or buffer),
    computed on the CPU; None where it does not, a size is symbolic, a value is over ``limit``
    elements, or an op fails."""
    nodes = _ancestors(node)
    if nodes is None:
        return None
    values: dict[fx.Node, Any] = {}
    last_use = {inp: n for n in nodes for inp in n.all_input_nodes}
    for n in nodes:
        if _size(n):
            val = n.meta["val"]
            if not isinstance(val, int):
                return None
            values[n] = val
            continue
        if not _computable(n, limit):
            return None
        args, kwargs = pytree.tree_map(
            lambda a: values[a] if isinstance(a, fx.Node) else _CPU if isinstance(a, torch.device) else a,
            (n.args, dict(n.kwargs)))
        try:
            values[n] = n.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - any failure: the value stays unknown
            return None
        for inp in n.all_input_nodes:   # held no longer than needed: a long sequence's masks are large
            if last_use[inp] is n:
                del values[inp]
    return values[node]

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

from autopar.core.capture import is_random, is_size

#: Largest value (in elements) computed: a mask of a long sequence is left unknown beyond it.
LIMIT = 2**24
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
        if not is_size(n):
            stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _computable(node: fx.Node, limit: int) -> bool:
    """An op this module may run: deterministic, of concrete sizes, its value within ``limit``."""
    if node.op != "call_function":
        return False
    if is_random(node):
        return False
    vals = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    return all(all(isinstance(s, int) for s in v.shape) and v.numel() <= limit for v in vals)


def value_from_shapes(node: fx.Node, limit: int | None = None) -> Any:
    """The value of ``node`` where it depends on sizes alone (no input, parameter or buffer),
    computed on the CPU; None where it does not, a size is symbolic, a value is over ``limit``
    elements, or an op fails."""
    return _evaluate(node, limit, None)


def sampled_from_shapes(node: fx.Node, rows: torch.Tensor, cols: torch.Tensor,
                        limit: int | None = None) -> torch.Tensor | None:
    """``value_from_shapes`` of a ``node`` too large to compute whole (an attention mask of a
    long sequence), at the ``rows`` x ``cols`` grid of its last two dims: exact there, computed
    without the whole, where every op whose value is over ``limit`` elements is elementwise over
    broadcast operands (a comparison of row and column positions) or an ``expand`` of one.
    None where another op is, or the value is not known from sizes alone."""
    value = _evaluate(node, limit, (rows, cols))
    return value if isinstance(value, torch.Tensor) else None


#: Ops taken on a grid of an oversized value's last two dims: elementwise ones, and ``GRID_OPS``.
_aten = torch.ops.aten
_ELEMENTWISE_LIKE = {_aten.to.dtype_layout, _aten.to.dtype, _aten._to_copy.default, _aten.clone.default,
                     _aten.alias.default, _aten.detach.default, _aten.__and__.Tensor, _aten.__or__.Tensor,
                     _aten.__xor__.Tensor}
_EXPAND = _aten.expand.default


def _evaluate(node: fx.Node, limit: int | None, grid: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
    """``value_from_shapes``' walk; ``grid``: (rows, cols) at which values over ``limit`` are taken
    (``sampled_from_shapes``), else None; ``limit`` None: ``LIMIT`` as it is now."""
    limit = LIMIT if limit is None else limit
    nodes = _ancestors(node)
    if nodes is None:
        return None
    values: dict[fx.Node, Any] = {}
    gridded: set[fx.Node] = set()   # values held at the grid only
    last_use = {inp: n for n in nodes for inp in n.all_input_nodes}
    for n in nodes:
        if is_size(n):
            val = n.meta["val"]
            if not isinstance(val, int):
                return None
            values[n] = val
            continue
        reads_grid = any(inp in gridded for inp in n.all_input_nodes)
        if _computable(n, limit) and not reads_grid:
            args, kwargs = pytree.tree_map(
                lambda a: values[a] if isinstance(a, fx.Node) else _CPU if isinstance(a, torch.device) else a,
                (n.args, dict(n.kwargs)))
        elif grid is not None and _on_grid(n):
            args, kwargs = _grid_args(n, values, gridded, grid)
            gridded.add(n)
        else:
            return None
        try:
            values[n] = n.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 - any failure: the value stays unknown
            return None
        for inp in n.all_input_nodes:   # held no longer than needed: a long sequence's masks are large
            if last_use[inp] is n:
                del values[inp]
    return values[node]


def _on_grid(node: fx.Node) -> bool:
    """Can ``node`` be taken at a grid of its last two dims: deterministic, elementwise (or an
    expand or a cast), of concrete sizes, two dims or more?"""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if is_random(node):
        return False
    if not (torch.Tag.pointwise in target.tags or target in _ELEMENTWISE_LIKE or target is _EXPAND):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and all(isinstance(s, int) for s in val.shape)


def _grid_args(node: fx.Node, values: dict, gridded: set, grid: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """``node``'s arguments at the grid: a whole operand taken at the grid's rows and columns
    where it spans the output's last two dims (not broadcast there), an expand's sizes cut to
    the grid."""
    rows, cols = grid
    q, k = node.meta["val"].shape[-2:]

    def at_grid(a: Any) -> Any:
        if isinstance(a, torch.device):
            return _CPU
        if not isinstance(a, fx.Node):
            return a
        v = values[a]
        if a in gridded or not isinstance(v, torch.Tensor):
            return v
        if v.dim() >= 2 and v.shape[-2] == q and q > 1:
            v = v.index_select(-2, rows)
        if v.dim() >= 1 and v.shape[-1] == k and k > 1:
            v = v.index_select(-1, cols)
        return v

    args, kwargs = pytree.tree_map(at_grid, (node.args, dict(node.kwargs)), is_leaf=lambda a: isinstance(a, fx.Node))
    if node.target is _EXPAND:
        sizes = list(args[1])
        sizes[-2:] = [len(rows) if sizes[-2] == q else sizes[-2], len(cols) if sizes[-1] == k else sizes[-1]]
        args = (args[0], sizes, *args[2:])
    return args, kwargs

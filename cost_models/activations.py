"""Which tensors each op keeps for its backward: found from the graph, not guessed.

Each op is run once on fake tensors under ``torch.autograd.graph.saved_tensors_hooks``, with the
inputs that need a gradient in the real model marked ``requires_grad``; every tensor autograd
packs is matched by storage to one of the op's inputs, its output, or neither (an internal
tensor such as layer norm's mean/rstd, a dropout mask, cross-entropy's log-probabilities). The
cost model then prices each kept tensor at the placement the chosen strategy gives it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from autopar.core.capture import flat_tensor_inputs, needs_grad, tensor_val
from autopar.core.execution import VIEW_OPS
from autopar.core.ops import entry_for
from autopar.core.placements import Placements
from autopar.core.strategies import StrategySpace
from cost_models.compute import as_amount


@dataclass(frozen=True)
class Saved:
    inputs: frozenset[int]   # positions in flat_tensor_inputs(node) the backward keeps
    output: bool             # the (first) output is kept
    extra_bytes: float       # bytes of other kept tensors, for the global (unsharded) op
    by_parts: bool = False   # freed part by part in the backward (``autopar.core.ops.base.Kept``)
    share: Callable[[Sequence[Placements], Sequence[int]], float] | None = None   # ``Kept.share``

    @property
    def anything(self) -> bool:
        return bool(self.inputs) or self.output or self.extra_bytes > 0


NOTHING = Saved(frozenset(), False, 0.0)


def gradients(space: StrategySpace) -> dict[fx.Node, bool]:
    """``needs_grad`` of the space's graph: which nodes get a gradient from the parameters that
    train (a frozen one's uses have none, as on one device)."""
    if not space.nodes:
        return {}
    return needs_grad(space.nodes[0].node.graph, {nc.node for nc in space.nodes if nc.kind == "param" and nc.trains})


class SavedTensors:
    """``Saved`` per op, cached by op signature (identical layers are analysed once) and by node
    (the planner asks once per strategy)."""

    def __init__(self, grad: dict[fx.Node, bool]) -> None:
        self.grad = grad
        self._cache: dict[str, Saved] = {}
        self._of: dict[fx.Node, Saved] = {}

    def __call__(self, node: fx.Node) -> Saved:
        if node not in self._of:
            self._of[node] = self._analysed(node)
        return self._of[node]

    def _analysed(self, node: fx.Node) -> Saved:
        inputs = flat_tensor_inputs(node)
        if node.op != "call_function" or node.target in VIEW_OPS or not self.grad.get(node, False):
            return NOTHING
        flags = tuple(self.grad.get(i, False) for i in inputs)
        key = repr((node.target, _signature(node), flags))
        if key not in self._cache:
            self._cache[key] = _analyse(node, flags)
        return self._cache[key]


def _signature(node: fx.Node) -> object:
    return pytree.tree_map_only(fx.Node, lambda n: tuple(tensor_val(n).shape) if tensor_val(n) is not None else n.name,
                                (node.args, node.kwargs))


def _analyse(node: fx.Node, flags: tuple[bool, ...]) -> Saved:
    val = tensor_val(node)
    entry = entry_for(node)
    kept = entry.saved(node, flags) if entry is not None and entry.saved is not None else None
    if kept is not None:   # the op's own account (``autopar.core.ops``): SDPA's fused kernels on meta
        return Saved(kept.inputs, kept.output, as_amount(kept.extra_bytes), kept.by_parts, kept.share)
    inputs = iter(flags)

    def fake(n: fx.Node) -> object:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return v
        wants = next(inputs)
        return v.detach().requires_grad_(wants) if wants else v.detach()

    args, kwargs = pytree.tree_map_only(fx.Node, fake, (node.args, node.kwargs))
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    try:
        with val.fake_mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = node.target(*args, **kwargs)
    except Exception:  # an op fake tensors cannot run: assume it keeps its inputs (a safe overestimate)
        return Saved(frozenset(i for i, f in enumerate(flags) if f), False, 0.0)
    first = out if isinstance(out, torch.Tensor) else next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    flat = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    refs = [StorageWeakRef(a.untyped_storage()) for a in flat]
    out_ref = StorageWeakRef(first.untyped_storage())
    kept_inputs, kept_out, extra, seen = set(), False, 0, set()
    for t in packed:
        ref = StorageWeakRef(t.untyped_storage())
        if ref in seen:
            continue
        seen.add(ref)
        if ref == out_ref:
            kept_out = True
        elif ref in refs:
            kept_inputs.add(refs.index(ref))
        else:
            extra += t.untyped_storage().nbytes()
    return Saved(frozenset(kept_inputs), kept_out, as_amount(extra))

"""Context parallelism as a planning option (``PlanOptions.context_parallel``): "auto" lets the
search weigh attention split by sequence (``autopar.core.ops.attention``'s "context-ring" and
"context-ulysses" strategies) against everything else, False removes those strategies, and a
``ContextChoice`` keeps, for every attention that can be split so, only the strategies splitting
it by sequence with that kind on that mesh axis.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch.fx as fx

from autopar.core.capture import tensor_val
from autopar.core.errors import AutoparError
from autopar.core.ops.attention import CONTEXT_KINDS, SDPA, ContextKind, context_refusal
from autopar.core.strategies import Strategy, StrategySpace

#: A strategy's rule name on the axis that splits attention by sequence.
CONTEXT_RULES = tuple(f"context-{k}" for k in CONTEXT_KINDS)


@dataclass(frozen=True)
class ContextChoice:
    """Attention split by sequence over mesh axis ``axis`` (its name), run as ``kind``."""

    axis: str
    kind: ContextKind = "ring"

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise AutoparError(f"context_parallel's axis is a mesh axis name, got {self.axis!r}")
        if self.kind not in CONTEXT_KINDS:
            raise AutoparError(f"context_parallel's kind is {' or '.join(map(repr, CONTEXT_KINDS))}, got {self.kind!r}")


#: ``PlanOptions.context_parallel``'s values once checked: "auto", False, or a forced choice.
ContextSetting = Literal["auto", False] | ContextChoice


def context_choice(value: Any) -> ContextSetting:
    """``PlanOptions.context_parallel`` checked: "auto", False, or a ``ContextChoice`` (from one,
    or from a dict of its fields: ``{"axis": "cp", "kind": "ring"}``)."""
    if value == "auto" or value is False:
        return value
    if isinstance(value, ContextChoice):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"axis", "kind"})
        if unknown or "axis" not in value:
            raise AutoparError(f"context_parallel as a dict has an 'axis' (a mesh axis name) and a 'kind' ("
                               f"{' or '.join(map(repr, CONTEXT_KINDS))}); got {value!r}")
        return ContextChoice(**value)
    raise AutoparError(f"context_parallel is 'auto', False, or {{'axis': AXIS, 'kind': "
                       f"{' | '.join(map(repr, CONTEXT_KINDS))}}}; got {value!r}")


def context_from_text(text: str) -> ContextSetting:
    """``--context-parallel``: auto, none, or KIND:AXIS (ring:cp, ulysses:cp)."""
    if text in ("auto", "none"):
        return "auto" if text == "auto" else False
    kind, _, axis = text.partition(":")
    if kind not in CONTEXT_KINDS or not axis:
        raise AutoparError(f"--context-parallel is auto, none or KIND:AXIS with KIND one of {', '.join(CONTEXT_KINDS)} "
                           f"(ring:cp), got {text!r}")
    return ContextChoice(axis, kind)  # type: ignore[arg-type]  # checked above


def is_context(s: Strategy) -> bool:
    """Does ``s`` split attention by sequence on some axis?"""
    return any(name in CONTEXT_RULES for name in s.names)


def restrict_context(space: StrategySpace, setting: Any) -> None:
    """Narrow ``space``'s attention strategies as ``setting`` (``PlanOptions.context_parallel``)
    says: "auto" leaves them, False drops every one split by sequence, a ``ContextChoice`` keeps
    only those split so on its axis where an attention has any (refused where none has, saying
    why). Lists shared by identical layers stay shared."""
    setting = context_choice(setting)
    if setting == "auto":
        return
    attention = [nc for nc in space.nodes if nc.kind == "op" and nc.node.target is SDPA]
    if setting is False:
        keep = lambda s: not is_context(s)  # noqa: E731
    else:
        axis = _axis_index(space, setting)
        keep = lambda s: s.names[axis] == f"context-{setting.kind}"  # noqa: E731
    narrowed: dict[int, list[Strategy]] = {}
    for nc in attention:
        if id(nc.strategies) not in narrowed:
            narrowed[id(nc.strategies)] = [s for s in nc.strategies if keep(s)]
        if narrowed[id(nc.strategies)] or setting is False:
            nc.strategies = narrowed[id(nc.strategies)]
    if setting is not False and not any(narrowed.values()):
        raise AutoparError(_why_none(space, attention, setting))


def _axis_index(space: StrategySpace, choice: ContextChoice) -> int:
    """The index of the mesh axis ``choice`` names (refused where there is none, or it has one rank)."""
    names = space.mesh.axis_names
    if choice.axis not in names:
        raise AutoparError(f"context_parallel names mesh axis {choice.axis!r}, but the mesh's axes are "
                           f"{', '.join(map(repr, names))}")
    a = names.index(choice.axis)
    if space.mesh.shape[a] < 2:
        raise AutoparError(f"context_parallel's axis {choice.axis!r} has one rank: nothing to split the sequence over")
    return a


def _why_none(space: StrategySpace, attention: list, choice: ContextChoice) -> str:
    """Why no attention of ``space`` splits by sequence as ``choice`` says."""
    head = f"context_parallel={{'axis': {choice.axis!r}, 'kind': {choice.kind!r}}}: "
    if not attention:
        return head + ("the model has no attention (scaled_dot_product_attention) to split by sequence; plan it with "
                       "context_parallel='auto' or False")
    n = space.mesh.shape[space.mesh.axis_names.index(choice.axis)]
    node = attention[0].node
    q, k, mask, dropout = _shapes(node)
    why = context_refusal(q, k, mask, dropout, n, choice.kind) or (
        "no strategy splits it so on this mesh (an earlier axis splits its sequence or heads)")
    return head + (f"no attention can be split that way; the first ({node.name}) cannot because {why}. Plan it with "
                   "another axis or kind, or with context_parallel='auto' or False")


def _shapes(node: fx.Node) -> tuple[tuple[int, ...], tuple[int, ...], Any, Any]:
    """The query and key shapes, mask and dropout of SDPA ``node``."""
    q, k = (tuple(tensor_val(a).shape) for a in node.args[:2])
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return q, k, mask, dropout


__all__ = ["ContextChoice", "ContextSetting", "context_choice", "context_from_text", "restrict_context",
           "CONTEXT_RULES"]

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
from autopar.core.context_parallel import Layout
from autopar.core.errors import AutoparError
from autopar.core.ops.attention import (
    BALANCED_RING,
    CONTEXT_KINDS,
    SDPA,
    ContextKind,
    causal_attention,
    context_refusal,
)
from autopar.core.strategies import Strategy, StrategySpace

#: A strategy's rule name on the axis that splits attention by sequence.
CONTEXT_RULES = (*(f"context-{k}" for k in CONTEXT_KINDS), BALANCED_RING)
LAYOUTS: tuple[Layout, ...] = ("balanced", "contiguous")


@dataclass(frozen=True)
class ContextChoice:
    """Attention split by sequence over mesh axis ``axis`` (its name), run as ``kind``; a causal
    ring laid out as ``load_balance`` ("balanced": rank r holds chunks r and 2n-1-r of 2n, equal
    causal work; "contiguous": chunk r of n; None: as the search finds faster). ``axis`` None
    forces nothing but the layout: the search weighs context parallelism as under "auto"."""

    axis: str | None
    kind: ContextKind = "ring"
    load_balance: Layout | None = None

    def __post_init__(self) -> None:
        if self.axis is not None and (not isinstance(self.axis, str) or not self.axis):
            raise AutoparError(f"context_parallel's axis is a mesh axis name, got {self.axis!r}")
        if self.kind not in CONTEXT_KINDS:
            raise AutoparError(f"context_parallel's kind is {' or '.join(map(repr, CONTEXT_KINDS))}, got {self.kind!r}")
        if self.load_balance is not None and self.load_balance not in LAYOUTS:
            raise AutoparError(f"context_parallel's load_balance is {' or '.join(map(repr, LAYOUTS))}, "
                               f"got {self.load_balance!r}")
        if self.load_balance == "balanced" and self.kind != "ring":
            raise AutoparError("context_parallel's load_balance 'balanced' lays out a causal ring; "
                               f"{self.kind!r} runs on whole sequences: drop load_balance or use kind 'ring'")

    def keeps(self, name: str, balances: bool) -> bool:
        """Does a strategy whose rule on the chosen axis is ``name`` split attention as chosen?
        ``balances``: the attention may run balanced (a causal ring of 2n equal chunks)."""
        if self.axis is not None and name != f"context-{self.kind}" and not (self.kind == "ring" and name == BALANCED_RING):
            return False
        if self.load_balance == "contiguous":
            return name != BALANCED_RING
        if self.load_balance == "balanced":   # forced on an axis: balanced only; else where it can be
            return name != "context-ring" or (self.axis is None and not balances)
        return True


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
        unknown = sorted(set(value) - {"axis", "kind", "load_balance"})
        if unknown or not ("axis" in value or set(value) == {"load_balance"}):
            raise AutoparError(f"context_parallel as a dict has an 'axis' (a mesh axis name), a 'kind' ("
                               f"{' or '.join(map(repr, CONTEXT_KINDS))}) and optionally a 'load_balance' ("
                               f"{' or '.join(map(repr, LAYOUTS))}), or a 'load_balance' alone; got {value!r}")
        return ContextChoice(**({"axis": None} | value))
    raise AutoparError(f"context_parallel is 'auto', False, or {{'axis': AXIS, 'kind': "
                       f"{' | '.join(map(repr, CONTEXT_KINDS))}}}; got {value!r}")


def context_from_text(text: str) -> ContextSetting:
    """``--context-parallel``: auto, none, or KIND:AXIS[:LOAD_BALANCE] (ring:cp, ulysses:cp,
    ring:cp:balanced)."""
    if text in ("auto", "none"):
        return "auto" if text == "auto" else False
    kind, _, rest = text.partition(":")
    axis, _, layout = rest.partition(":")
    if kind not in CONTEXT_KINDS or not axis or layout not in ("", *LAYOUTS):
        raise AutoparError(f"--context-parallel is auto, none or KIND:AXIS[:LOAD_BALANCE] with KIND one of "
                           f"{', '.join(CONTEXT_KINDS)} and LOAD_BALANCE one of {', '.join(LAYOUTS)} (ring:cp, "
                           f"ring:cp:balanced), got {text!r}")
    return ContextChoice(axis, kind, layout or None)  # type: ignore[arg-type]  # checked above


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
    if setting is not False and setting.axis is not None:
        _axis_index(space, setting)   # a mesh axis of more than one rank
    narrowed: dict[int, list[Strategy]] = {}
    for nc in attention:
        if id(nc.strategies) not in narrowed:
            narrowed[id(nc.strategies)] = [s for s in nc.strategies if _keeps(space, setting, s, nc.strategies)]
        if narrowed[id(nc.strategies)] or setting is False or setting.axis is None:
            nc.strategies = narrowed[id(nc.strategies)]
    if setting is not False and setting.axis is not None and not any(narrowed.values()):
        raise AutoparError(_why_none(space, attention, setting))


def _keeps(space: StrategySpace, setting: Literal[False] | ContextChoice, s: Strategy, among: list[Strategy]) -> bool:
    """Is strategy ``s`` of an attention (one of ``among``) kept under ``setting``: split by
    sequence as it says on its axis (any axis: where ``s`` splits by sequence at all)?"""
    if setting is False:
        return not is_context(s)
    balances = any(BALANCED_RING in t.names for t in among)
    if setting.axis is None:
        return all(setting.keeps(name, balances) for name in s.names if name in CONTEXT_RULES)
    return setting.keeps(s.names[_axis_index(space, setting)], balances)


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
    balance = f", 'load_balance': {choice.load_balance!r}" if choice.load_balance is not None else ""
    head = f"context_parallel={{'axis': {choice.axis!r}, 'kind': {choice.kind!r}{balance}}}: "
    if not attention:
        return head + ("the model has no attention (scaled_dot_product_attention) to split by sequence; plan it with "
                       "context_parallel='auto' or False")
    n = space.mesh.shape[space.mesh.axis_names.index(choice.axis)]
    node = attention[0].node
    q, k, mask, dropout = _shapes(node)
    why = context_refusal(q, k, mask, dropout, n, choice.kind) or _unbalanced(node, q, n, choice) or (
        "no strategy splits it so on this mesh (an earlier axis splits its sequence or heads)")
    return head + (f"no attention can be split that way; the first ({node.name}) cannot because {why}. Plan it with "
                   "another axis or kind, or with context_parallel='auto' or False")


def _unbalanced(node: fx.Node, q: tuple[int, ...], n: int, choice: ContextChoice) -> str | None:
    """Why a ring cannot run balanced on ``n`` ranks (None where it can, or none is asked for)."""
    if choice.load_balance != "balanced":
        return None
    if not causal_attention(node):
        return "it is not causal (the balanced layout evens causal work; an open ring needs none)"
    if q[2] % (2 * n):
        padded = -(-q[2] // (2 * n)) * 2 * n
        return (f"its sequence of {q[2]} does not cut into {2 * n} equal chunks (two a rank): pad it to {padded} "
                "tokens at the end, with labels -100 there, or use load_balance 'contiguous'")
    return None


def _shapes(node: fx.Node) -> tuple[tuple[int, ...], tuple[int, ...], Any, Any]:
    """The query and key shapes, mask and dropout of SDPA ``node``."""
    q, k = (tuple(tensor_val(a).shape) for a in node.args[:2])
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return q, k, mask, dropout


__all__ = ["ContextChoice", "ContextSetting", "context_choice", "context_from_text", "restrict_context",
           "CONTEXT_RULES"]

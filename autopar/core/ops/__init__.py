"""Ops with special handling, one module per op family, each declaring in one place its sharding
rule, how generated code runs it, what profiling times for it and the collectives it runs inside
(``base``: the registry and its decorators; ``docs/ops.md``: how to add one).

The code generator, the cost model and profiling look an op up here (``entry_for``); the planner
takes its rules from here (``rule_for``, ``axis_rules``), falling back on the rule families of
``autopar.core.rules``.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.core.ops import attention, batch_norm, cross_entropy, dropout, embedding, shapes  # noqa: F401 (they register)
from autopar.core.ops.base import REGISTRY, OpEntry
from autopar.core.rules import AxisRule, RuleFn, apply_rule, family_rule

__all__ = ["OpEntry", "axis_rules", "entry_for", "rule_for"]


def entry_for(node: fx.Node) -> OpEntry | None:
    """The special handling of ``node``'s op, or None: an op like any other."""
    return REGISTRY.get(node.target) if node.op == "call_function" else None


def rule_for(node: fx.Node) -> RuleFn | None:
    """The sharding rule of a node: its op's entry's, else its family's, or None when only
    replication is known."""
    entry = entry_for(node)
    if entry is not None and entry.rule is not None:
        return entry.rule
    return family_rule(node)


def axis_rules(node: fx.Node, in_shapes: tuple[tuple[int, ...], ...], out_shape: tuple[int, ...],
               n: int) -> list[AxisRule]:
    """The ways ``node`` can run split on one mesh axis of size ``n`` (``rules.apply_rule``)."""
    return apply_rule(rule_for(node), node, in_shapes, out_shape, n)

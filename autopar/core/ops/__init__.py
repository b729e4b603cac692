"""Ops with special handling, one module per op family, each declaring in one place its sharding
rule, how generated code runs it, what profiling times for it and the collectives it runs inside
(``base``: the registry and its decorators; ``docs/ops.md``: how to add one).

Every module of this package is imported with it, and registers its entries: adding an op's
handling is adding (or editing) one module. The code generator, the cost model and profiling look
an op up here (``entry_for``); the planner takes its rules from here (``rule_for``,
``axis_rules``), falling back on the rule families of ``autopar.core.rules``.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Hashable

import torch.fx as fx

from autopar.core.ops.base import KERNELS, REGISTRY, Kernels, OpEntry
from autopar.core.rules import AxisRule, RuleFn, apply_rule, family_rule

__all__ = ["KERNELS", "Kernels", "OpEntry", "axis_rules", "entry_for", "rule_for", "rule_key_of"]


def _register_all() -> None:
    """Import every op module of this package (each registers its entries with ``base``'s
    decorators; they import ``autopar.core.ops.base``, never this package)."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")


_register_all()


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


def rule_key_of(node: fx.Node) -> Hashable:
    """What ``node``'s rule reads beyond its shapes and arguments (its entry's ``rule_key``), for
    the cache of its strategies; None where nothing."""
    entry = entry_for(node)
    return entry.rule_key(node) if entry is not None and entry.rule_key is not None else None


def axis_rules(node: fx.Node, in_shapes: tuple[tuple[int, ...], ...], out_shape: tuple[int, ...],
               n: int) -> list[AxisRule]:
    """The ways ``node`` can run split on one mesh axis of size ``n`` (``rules.apply_rule``)."""
    return apply_rule(rule_for(node), node, in_shapes, out_shape, n)

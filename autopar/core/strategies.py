"""Candidate strategies of every node on an N-D mesh: per-axis rules (``rules.py``) combined.

The contract handed to the cost model and the solver is ``StrategySpace``: for each graph node
that takes part in the plan, its flat tensor inputs and a list of ``Strategy`` (one placement per
mesh axis for the output and for each input). Parameters also choose a *storage* placement:
stored sharded but used replicated is ZeRO-3/FSDP (all-gather on use, reduce-scatter of grads),
or ZeRO-2 (``Strategy.kept``: all-gathered once a step and the copy kept until the optimizer
changes the shard; gradients and optimizer states stay sharded), or ZeRO-1 (kept as ZeRO-2's, the
gradient accumulated whole over a step's microbatches and reduce-scattered once: optimizer states
sharded).
"""
from __future__ import annotations

import functools
import itertools
import logging
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.core.capture import CapturedGraph, flat_tensor_inputs, output_shape, tensor_val
from autopar.core.execution import writes_in_place, written_aliases
from autopar.core.fold import foldable
from autopar.core.loss_weights import loss_with_gradients
from autopar.core.mesh import MeshSpec
from autopar.core.ops import axis_rules, rule_for, rule_key_of
from autopar.core.placements import Placements, ShardBlocks, largest_shard_shape, placements_str
from autopar.core.rules import AxisRule

log = logging.getLogger(__name__)
R = Replicate()
#: The ZeRO stages a parameter stored split and used whole may run (``Strategy.kept``, ``accumulated``).
ZeroStage = Literal["zero3", "zero2", "zero1"]
ZERO: tuple[ZeroStage, ...] = get_args(ZeroStage)
#: What a graph node is to the planner (``NodeChoices.kind``).
NodeKind = Literal["param", "buffer", "input", "op", "output", "alias"]



@dataclass(frozen=True)
class Strategy:
    """One way a node can run on the mesh: its output's placement, the placement each input must
    be redistributed to first, and (parameters) how it is stored. Made by ``build_space`` from the
    per-axis rules (``autopar.core.rules``); the ILP chooses one per node, the plan records it."""

    out: Placements                     # output placement, one per mesh axis
    ins: tuple[Placements, ...]         # placement each flat tensor input must have
    names: tuple[str, ...]              # rule name per mesh axis, e.g. ("batch", "column")
    storage: Placements | None = None   # parameters only: how the parameter is stored

    @property
    def kept(self) -> bool:
        """ZeRO-1/2: a parameter stored split whose gathered copy is kept from step to step."""
        return "zero2" in self.names or "zero1" in self.names

    @property
    def accumulated(self) -> bool:
        """ZeRO-1: its gradient accumulates whole over a step's microbatches and is reduce-scattered
        once, in the last backward (ZeRO-2's is reduce-scattered in every backward)."""
        return "zero1" in self.names

    def label(self) -> str:
        uniq = [n for n in self.names if n != "replicate"]
        text = " x ".join(uniq) if uniq else "replicate"
        if self.storage is not None and self.storage != self.out:
            text += (f" (stored {placements_str(self.storage)}, " +
                     ("gathered once a step and kept)" if self.kept else "gathered on use)"))
        return text


@dataclass
class NodeChoices:
    """A graph node with its candidate strategies: one decision of the planning problem."""

    node: fx.Node
    kind: NodeKind
    inputs: list[fx.Node]                # flat tensor inputs (edges come from these)
    strategies: list[Strategy]
    fqn: str | None = None               # parameter/buffer name, for params and buffers
    # "alias" nodes pick one output of a multi-output op (getitem of split): not a decision of
    # their own, their i-th strategy is the source's i-th.
    source: fx.Node | None = None
    trains: bool = True                  # a parameter: it trains (``CapturedGraph.trains``), else it has no gradient


@dataclass
class StrategySpace:
    """Every node's candidate strategies on one mesh (``build_space``), with the warnings about
    ops that have no rule and run replicated; what the cost model prices and the planner solves."""

    mesh: MeshSpec
    nodes: list[NodeChoices]
    index: dict[fx.Node, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # the mean cross-entropy ``train_step`` sums with the gradients (``loss_weights.loss_with_gradients``)
    loss_with_gradients: str | None = None
    # the ops computed once, from shapes alone, and cached (``autopar.core.fold``): nothing a step
    folded: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.index = {c.node: i for i, c in enumerate(self.nodes)}

    def edges(self) -> Iterator[tuple[int, int, int]]:
        """(source index, consumer index, input position) of every planned tensor edge. Edges
        into an alias are its source's (the alias only picks one of the source's outputs)."""
        for j, nc in enumerate(self.nodes):
            if nc.kind == "alias":
                continue
            for k, inp in enumerate(nc.inputs):
                i = self.index.get(inp)
                if i is not None:
                    yield i, j, k


def tensor_placements(shape: tuple[int, ...], mesh: MeshSpec) -> list[Placements]:
    """Every Replicate/Shard combination over the mesh axes that leaves each rank >= 1 element."""
    per_axis: list[list[Placement]] = []
    for n in mesh.shape:
        per_axis.append([R] + ([Shard(d) for d in range(len(shape)) if shape[d] >= n] if n > 1 else []))
    out = []
    for combo in itertools.product(*per_axis):
        if all(s > 0 for s in largest_shard_shape(shape, combo, mesh.shape)) and _no_tiny_shards(shape, combo, mesh):
            out.append(tuple(combo))
    return out


def _no_tiny_shards(shape, combo, mesh) -> bool:
    cur = list(shape)
    for p, n in zip(combo, mesh.shape, strict=True):
        if isinstance(p, Shard):
            if cur[p.dim] < n:
                return False
            cur[p.dim] = -(-cur[p.dim] // n)
    return True


@functools.lru_cache(maxsize=None)
def param_strategies(shape: tuple[int, ...], mesh: MeshSpec) -> list[Strategy]:
    """Stored as S and used as S (tensor parallel), stored S used R (ZeRO-3; ZeRO-2: kept
    gathered; ZeRO-1: kept gathered, its gradient accumulated whole over microbatches), or
    replicated; ZeRO stages are not mixed in one parameter.

    Cached (and so shared by parameters of equal shape): callers must not mutate the list."""
    per_axis: list[list[tuple[Placement, Placement, str]]] = []
    for n in mesh.shape:
        opts = [(R, R, "replicate")]
        if n > 1:
            fits = [d for d in range(len(shape)) if shape[d] >= n]
            opts += [(Shard(d), Shard(d), f"shard-dim{d}") for d in fits]
            if fits:  # one ZeRO layout is enough: sharding dim 0 or 1 costs the same
                opts += [(Shard(fits[0]), R, zero) for zero in ZERO]
        per_axis.append(opts)
    out = []
    for combo in itertools.product(*per_axis):
        storage = tuple(c[0] for c in combo)
        use = tuple(c[1] for c in combo)
        names = {c[2] for c in combo}
        if _no_tiny_shards(shape, storage, mesh) and len(names & set(ZERO)) <= 1:
            out.append(Strategy(use, (), tuple(c[2] for c in combo), storage))
    return out


_rule_cache: dict[tuple, list[Strategy]] = {}


def _cache_key(node: fx.Node, in_shapes, out_shape, mesh: MeshSpec) -> tuple:
    args = torch.utils._pytree.tree_map(lambda a: "T" if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
    return (node.target, repr(args), in_shapes, out_shape, mesh.shape, rule_key_of(node))


def op_strategies(node: fx.Node, inputs: list[fx.Node], mesh: MeshSpec) -> list[Strategy]:
    """Cartesian product of per-axis rules; each axis sees shapes already split by earlier axes."""
    in_shapes = tuple(output_shape(i) or () for i in inputs)
    out_shape = output_shape(node) or ()
    key = _cache_key(node, in_shapes, out_shape, mesh)
    if key not in _rule_cache:
        _rule_cache[key] = list(_expand(node, in_shapes, out_shape, mesh.shape, ()))
    return _rule_cache[key]


def _expand(node, in_shapes, out_shape, mesh_shape, chosen: tuple[AxisRule, ...]) -> Iterator[Strategy]:
    axis = len(chosen)
    if axis == len(mesh_shape):
        yield Strategy(
            tuple(r.out for r in chosen),
            tuple(tuple(r.ins[i] for r in chosen) for i in range(len(in_shapes))),
            tuple(r.name for r in chosen),
        )
        return
    for rule in axis_rules(node, in_shapes, out_shape, mesh_shape[axis]):
        n = mesh_shape[axis]
        yield from _expand(
            node,
            tuple(_split(s, p, n) for s, p in zip(in_shapes, rule.ins, strict=True)),
            _split(out_shape, rule.out, n),
            mesh_shape,
            chosen + (rule,),
        )


def _split(shape: tuple[int, ...], p: Placement, n: int) -> tuple[int, ...]:
    if isinstance(p, Shard) and shape:
        s = list(shape)
        s[p.dim] = -(-s[p.dim] // n)
        return tuple(s)
    return shape


def alias_strategies(source: list[Strategy]) -> list[Strategy]:
    """An alias's i-th strategy: the source's i-th output placement, passed through."""
    return [Strategy(s.out, (s.out,), ("follow",) * len(s.out)) for s in source]


def build_space(captured: CapturedGraph, mesh: MeshSpec, with_strategies: bool = True) -> StrategySpace:
    """Classify the graph's nodes and list each one's candidate strategies (``with_strategies=
    False``: classify only, the strategies left empty for the caller to fill: ``autopar.planning.symbolic``)."""
    nodes: list[NodeChoices] = []
    position: dict[fx.Node, int] = {}
    warnings: list[str] = []
    unknown: dict[str, int] = {}
    written = written_aliases(captured.graph)
    for node in captured.graph.nodes:
        if node.op == "placeholder":
            val = tensor_val(node)
            if val is None:
                continue
            shape = tuple(val.shape)
            if node.name in captured.param_of:
                strategies = param_strategies(shape, mesh) if with_strategies else []
                fqn = captured.param_of[node.name]
                nodes.append(NodeChoices(node, "param", [], strategies, fqn, trains=captured.trains(fqn)))
            elif node.name in captured.user_inputs:
                nodes.append(NodeChoices(node, "input", [], input_strategies(shape, mesh) if with_strategies else []))
            else:
                fqn = captured.buffer_of.get(node.name) or captured.constant_of.get(node.name)
                replicated = [Strategy((R,) * mesh.ndim, (), ("replicate",) * mesh.ndim)] if with_strategies else []
                nodes.append(NodeChoices(node, "buffer", [], replicated, fqn))
        elif node.op == "call_function":
            if tensor_val(node) is None:
                continue  # asserts and symbolic-int helpers: no placement to choose
            inputs = flat_tensor_inputs(node)
            if node.target is operator.getitem and inputs and isinstance(inputs[0].meta.get("val"), (list, tuple)):
                aliases = alias_strategies(nodes[position[inputs[0]]].strategies)
                position[node] = len(nodes)
                nodes.append(NodeChoices(node, "alias", inputs, aliases, source=inputs[0]))
                continue
            if rule_for(node) is None and inputs and with_strategies:
                unknown[str(node.target)] = unknown.get(str(node.target), 0) + 1
            strategies = op_strategies(node, inputs, mesh) if with_strategies else []
            if node in written:   # an in-place write and its aliases: one replicated local tensor
                strategies = [s for s in strategies if all_replicated(s)]
            position[node] = len(nodes)
            nodes.append(NodeChoices(node, "op", inputs, strategies))
        elif node.op == "output":
            outs = [a for a in torch.utils._pytree.tree_leaves(node.args) if isinstance(a, fx.Node) and tensor_val(a) is not None]
            rep = (R,) * mesh.ndim
            out = [Strategy(rep, tuple(rep for _ in outs), ("replicate",) * mesh.ndim)] if with_strategies else []
            nodes.append(NodeChoices(node, "output", outs, out))
    if written and with_strategies:
        ops = sorted({str(n.target) for n in written if n.op == "call_function" and writes_in_place(n)})
        msg = (f"in-place writes ({', '.join(ops)}): the {len(written)} values they write or alias run replicated "
               "(a write reaches every alias only in one local tensor)")
        warnings.append(msg)
        log.debug("autopar: %s", msg)
    for op, count in sorted(unknown.items()):
        msg = f"no sharding rule for {op} ({count} node{'s' * (count > 1)}): it runs replicated"
        warnings.append(msg)
        log.warning("autopar: %s", msg)
    if with_strategies:
        _stored_in_blocks(nodes)
    with_gradients = loss_with_gradients(captured)
    folded = foldable(captured, {nc.node.name for nc in nodes}, {n.name for n in written})
    return StrategySpace(mesh, nodes, warnings=warnings, loss_with_gradients=with_gradients, folded=frozenset(folded))


def _stored_in_blocks(nodes: list[NodeChoices]) -> None:
    """Parameters an op reads split block by block (``ShardBlocks``: an expert's fused gate and up
    projections split within it) may also be stored and used so: each strategy splitting that
    dim on that axis as a plain ``Shard`` gets a twin splitting it in blocks (tensor parallel
    weights and gradients, 1/n a rank, read where stored)."""
    wanted: dict[int, set[tuple[int, ShardBlocks]]] = {}
    position = {nc.node: i for i, nc in enumerate(nodes)}
    for nc in nodes:
        for k, inp in enumerate(nc.inputs if nc.kind == "op" else ()):
            i = position.get(inp)
            if i is not None and nodes[i].kind == "param":
                wanted.setdefault(i, set()).update((a, p) for s in nc.strategies for a, p in enumerate(s.ins[k])
                                                   if isinstance(p, ShardBlocks))
    for i, blocks in wanted.items():
        nc = nodes[i]
        twins = [replace(s, out=_put(s.out, a, p), storage=_put(s.storage, a, p),
                         names=_put(s.names, a, f"shard-dim{p.dim}:{p.blocks}"))
                 for a, p in sorted(blocks, key=str) for s in nc.strategies
                 if s.storage is not None and s.out[a] == s.storage[a] == Shard(p.dim)
                 and sum(q == Shard(p.dim) for q in s.storage) == 1]   # the dim split on one axis alone
        if twins:   # else the list stays the one parameters of its shape share
            nc.strategies = nc.strategies + twins


def _put(values: tuple, axis: int, value) -> tuple:
    return tuple(value if a == axis else v for a, v in enumerate(values))


def all_replicated(s: Strategy) -> bool:
    """Is every placement of ``s`` (output, inputs, a parameter's storage) replicated?"""
    return all(isinstance(p, Replicate) for ps in (s.out, s.storage or (), *s.ins) for p in ps)


@functools.lru_cache(maxsize=None)
def input_strategies(shape: tuple[int, ...], mesh: MeshSpec) -> list[Strategy]:
    return [Strategy(p, (), _names(p)) for p in tensor_placements(shape, mesh)]


def _names(p: Placements) -> tuple[str, ...]:
    return tuple("replicate" if isinstance(x, Replicate) else f"shard-dim{x.dim}" for x in p)

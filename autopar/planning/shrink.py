"""Shrink the sharding problem before solving: fewer decisions, same runtime semantics.

A ``Grouping`` says which ILP decision each node of a ``StrategySpace`` follows, and which of the
node's strategies each choice of that decision means. Three reductions build it:

* **aliases** (one output of a split) take their source's choice, strategy for strategy;
* **followers** (views, casts and other one-input elementwise ops) are folded into their
  producer: for each of the producer's strategies the follower takes its own cheapest strategy
  that reads the producer's placement as it is (any, where none can), so it needs no variable
  of its own;
* **stacked siblings** (the parameters a ``stack`` joins, a hand-written list of experts'
  weights) take the first's choice;
* **repeated blocks** (transformer layers, found from the graph's structure, never from names)
  share decisions: the blocks strictly between the first and the last of a run of identical
  blocks are cut into a few contiguous segments, and each block takes its segment's first
  block's choices. The first and last blocks, and everything around the run (embeddings, head,
  loss), keep their own; segments let the plan change along the depth where the costs say so
  (identical layers are not identical in cost: the backward can hide the gradient sync of late
  layers under the compute of earlier ones, but not that of the first).

Any grouping is a restriction of the full problem, never a different one: every choice of every
decision gives each node one of its own candidate strategies, so a plan of the shrunken problem
is a valid plan of the full one.
"""
from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autopar.core.capture import output_shape
from autopar.core.execution import CAST_OPS, VIEW_OPS
from autopar.core.strategies import StrategySpace

# Blocks needed before sharing pays off: first and last stay free, the ones between share.
MIN_BLOCKS = 3
# Segments of inner blocks that choose independently (each shares one set of decisions).
SEGMENTS = 4
# Candidate block lengths tried (the most frequent distances between equal nodes).
_CANDIDATE_PERIODS = 8


@dataclass(frozen=True)
class Grouping:
    """Node -> decision mapping handed from shrinking to the ILP builder."""

    owner: tuple[int, ...]               # space index -> decision index
    choice: tuple[np.ndarray, ...]       # space index -> strategy index per choice of its decision
    sizes: tuple[int, ...]               # decision -> number of choices
    representative: tuple[int, ...]      # decision -> a space index standing for it
    folded: int                          # followers folded into their producers
    shared: int                          # nodes whose decision another block's node makes
    blocks: tuple[int, int, int] | None  # (first node position, nodes per block, blocks) of the run

    def strategies(self, choices: Sequence[int]) -> list[int]:
        """Strategy index of every space node, given one choice per decision."""
        return [int(c[choices[d]]) for d, c in zip(self.owner, self.choice, strict=True)]

    def describe(self, nodes: int) -> str:
        text = f"{nodes} nodes -> {len(self.sizes)} decisions ({self.folded} followers folded"
        if self.blocks is not None:
            text += f", {self.blocks[2]} repeated blocks of {self.blocks[1]} nodes, {self.shared} nodes shared"
        return text + ")"


def is_follower(space: StrategySpace, i: int) -> bool:
    """A view, cast or elementwise op of exactly one planned tensor input."""
    nc = space.nodes[i]
    if nc.kind != "op" or len(nc.inputs) != 1 or nc.inputs[0] not in space.index:
        return False
    target = nc.node.target
    pointwise = isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    return pointwise or target in VIEW_OPS or target == torch.ops.aten._to_copy.default


def group(space: StrategySpace, node_cost: Callable[[int], np.ndarray],
          edge_cost: Callable[[int, int, int], np.ndarray], share_blocks: bool = True) -> Grouping:
    """The grouping of ``space``. ``node_cost(i)``: seconds per strategy of node i;
    ``edge_cost(i, j, k)``: seconds matrix [i's strategy][j's strategy] of input k of j."""
    n = len(space.nodes)
    root = list(range(n))                       # node -> node whose decision it follows
    choice = [np.arange(len(nc.strategies)) for nc in space.nodes]
    folded = 0
    for j, nc in enumerate(space.nodes):        # graph order: producers are settled first
        if nc.kind == "alias":
            src = space.index[nc.source]
            root[j], choice[j] = root[src], choice[src].copy()
        elif is_follower(space, j):
            i = space.index[nc.inputs[0]]
            given = edge_cost(i, j, 0)[choice[i]] + node_cost(j)[None, :]   # [producer choice][own strategy]
            # follow: read the producer's placement as it is where some strategy can (a local slice
            # looks free here, but whoever reads the follower may have to gather it back)
            ids: dict = {}   # placements compared by hash, not pairwise: blocks have thousands of followers
            outs = np.array([ids.setdefault(space.nodes[i].strategies[c].out, len(ids)) for c in choice[i]])
            reads = np.array([ids.get(s.ins[0], -1) for s in nc.strategies])
            same = outs[:, None] == reads[None, :]
            given = np.where(same | ~same.any(axis=1, keepdims=True), given, np.inf)
            root[j], choice[j] = root[i], np.argmin(given, axis=1)
            folded += 1
    rep = _stacked_siblings(space, root)
    blocks = _shared_roots(space, root, rep) if share_blocks else None

    def final(r: int) -> int:
        while r in rep:   # maps only point to earlier nodes: no cycles
            r = rep[r]
        return r

    shared = sum(1 for j in range(n) if final(root[j]) != root[j])
    decision: dict[int, int] = {}
    owner = [decision.setdefault(final(root[j]), len(decision)) for j in range(n)]
    sizes = [0] * len(decision)
    for r, d in decision.items():
        sizes[d] = len(space.nodes[r].strategies)
    return Grouping(tuple(owner), tuple(choice), tuple(sizes), tuple(decision), folded, shared, blocks)


def _merge(space: StrategySpace, root: list[int], rep: dict[int, int], a: int, b: int) -> None:
    """Let decision root a take root b's choice in ``rep`` (followers come along with their roots),
    where a has no other yet and both have the same candidate strategies."""
    if root[a] == a and root[b] == b and a != b and a not in rep \
            and space.nodes[a].strategies == space.nodes[b].strategies:
        rep[a] = b


def _cast_chain(space: StrategySpace, root: list[int], i: int) -> list[int] | None:
    """The decision roots from node ``i`` back through casts to the parameter it reads (None
    where it reads none so)."""
    chain = [root[i]]
    while space.nodes[i].kind != "param":
        nc = space.nodes[i]
        if nc.kind != "op" or nc.node.target not in CAST_OPS or len(nc.inputs) != 1 or nc.inputs[0] not in space.index:
            return None
        i = space.index[nc.inputs[0]]
        chain.append(root[i])
    return chain


def _stacked_siblings(space: StrategySpace, root: list[int]) -> dict[int, int]:
    """Parameters stacked into one tensor (each expert's weight of a hand-written list of experts:
    ``autopar.core.expert_lists``), and their casts, mapped to the first's decisions: siblings used
    alike, which would each be a decision of its own (64 experts of 27 layers: 5184 parameters)."""
    rep: dict[int, int] = {}
    for nc in space.nodes:
        if nc.kind != "op" or nc.node.target is not torch.ops.aten.stack.default or len(nc.inputs) < 2:
            continue
        chains = [_cast_chain(space, root, space.index[u]) for u in nc.inputs if u in space.index]
        found = [c for c in chains if c is not None]
        if len(found) != len(nc.inputs) or len({len(c) for c in found}) != 1:
            continue
        for chain in found[1:]:
            for a, b in zip(chain, found[0], strict=True):
                _merge(space, root, rep, a, b)
    return rep


def _shared_roots(space: StrategySpace, root: list[int], rep: dict[int, int]) -> tuple[int, int, int] | None:
    """The longest run of identical blocks (None where there is none); the decision roots of its
    inner blocks mapped in ``rep`` to their segment's first block's (``_merge``: a root mapped
    already keeps its own)."""
    order = [i for i, nc in enumerate(space.nodes) if nc.kind in ("op", "alias")]
    run = _longest_run(space, order)
    if run is None:
        return None
    start, period, count = run
    merge = functools.partial(_merge, space, root, rep)
    inner = count - 2
    segment_first: dict[int, int] = {}
    for block in range(1, count - 1):
        first = segment_first.setdefault((block - 1) * SEGMENTS // inner, block)
        if first == block:
            continue
        for t in range(period):
            a, b = order[start + block * period + t], order[start + first * period + t]
            merge(a, b)
            for u, v in zip(space.nodes[a].inputs, space.nodes[b].inputs, strict=True):   # the block's own parameters
                iu, iv = space.index.get(u), space.index.get(v)
                if iu is not None and iv is not None and space.nodes[iu].kind == space.nodes[iv].kind == "param":
                    merge(iu, iv)
    return run


def _longest_run(space: StrategySpace, order: list[int]) -> tuple[int, int, int] | None:
    """(start, period, count) of the longest stretch of ``order`` made of ``count`` >= 3 copies of
    one block of ``period`` nodes. Nodes compare by op, arguments, shapes and where their inputs
    come from: the relative position of a producer at most a block back (a parallel-residual
    block, as in GPT-J or GPT-NeoX, adds the previous block's output exactly one block back),
    else the producer itself (a tensor every layer reads, like rotary tables or a mask), or the
    kind and shape of a parameter or input."""
    if len(order) < 2 * MIN_BLOCKS:
        return None
    position = {i: p for p, i in enumerate(order)}
    ops = [_op_signature(space, i) for i in order]
    sources = [[position.get(space.index.get(u), (space.nodes[space.index[u]].kind if u in space.index else "other",
                                                   output_shape(u))) for u in space.nodes[i].inputs] for i in order]
    ids: dict[tuple, int] = {}
    plain = [ids.setdefault(op, len(ids)) for op in ops]
    last: dict[int, int] = {}
    gaps: Counter[int] = Counter()
    for p, s in enumerate(plain):
        if s in last:
            gaps[p - last[s]] += 1
        last[s] = p
    best = None
    for period, _ in gaps.most_common(_CANDIDATE_PERIODS):
        sig = np.array([ids.setdefault((op, tuple(_source(p, u, period) for u in us)), len(ids))
                        for p, (op, us) in enumerate(zip(ops, sources, strict=True))])
        match = np.concatenate([sig[:-period] == sig[period:], [False]])
        # longest stretch of consecutive matches: nodes p with sig[p] == sig[p + period]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], match.astype(np.int8)])))
        starts, ends = edges[::2], edges[1::2]
        if len(starts) == 0:
            continue
        k = int(np.argmax(ends - starts))
        count = (int(ends[k] - starts[k]) + period) // period
        if count >= MIN_BLOCKS and (best is None or (count - 1) * period > (best[2] - 1) * best[1]):
            best = (int(starts[k]), period, count)
    return best


def _source(p: int, u: int | tuple, period: int) -> object:
    """How node ``p`` sees an input: offset to a near producer, a far producer itself, or a leaf."""
    if isinstance(u, tuple):
        return u
    return p - u if p - u <= period else ("far", u)


def _op_signature(space: StrategySpace, i: int) -> tuple:
    nc = space.nodes[i]
    node = nc.node
    args = torch.utils._pytree.tree_map(lambda a: "T" if isinstance(a, torch.fx.Node) else a, (node.args, node.kwargs))
    return (str(node.target), repr(args), output_shape(node), len(nc.strategies))

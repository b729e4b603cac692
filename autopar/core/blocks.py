"""The repeated blocks of a captured model (transformer layers): where activation recomputation
applies.

A block is a module at ``<container>.<index>`` (an ``nn.ModuleList``/``nn.Sequential`` entry)
with at least one sibling of the same class, whose ops form one contiguous run of the graph (the
generated forward can then run them as one checkpointed function). Its nodes are the ops the
module's forward ran, as export's ``nn_module_stack`` records them.

A block's attention core (``attention_core``) is what selective recomputation (Korthikanti et
al., 2022) runs again: the ops from the product of queries and keys, through the softmax, to the
product of the attention probabilities and values, whose attention-matrix-sized activations cost
the most memory per FLOP. A block that computes attention with SDPA has none: its fused kernel
already keeps no attention matrix and recomputes it in its backward.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.fx as fx

aten = torch.ops.aten
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}
_BATCHED_PRODUCTS = {aten.bmm.default, aten.baddbmm.default, aten.matmul.default}
#: ``Plan.recompute``'s modes: what of a block its backward runs again.
RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE: tuple[RecomputeMode, ...] = get_args(RecomputeMode)


@dataclass(frozen=True)
class Block:
    """One repeated block: its module path and its ops' node names, in graph order."""

    path: str
    nodes: tuple[str, ...]


def repeated_blocks(graph: fx.Graph) -> list[Block]:
    """The graph's repeated blocks, in graph order (outermost ones where they nest)."""
    ops = [n for n in graph.nodes if n.op == "call_function"]
    members: dict[str, list[int]] = {}
    kinds: dict[str, str] = {}
    for i, n in enumerate(ops):
        for path, kind in (n.meta.get("nn_module_stack") or {}).values():
            container, _, index = path.rpartition(".")
            if index.isdigit() and container:
                members.setdefault(path, []).append(i)
                kinds[path] = f"{container}:{kind}"
    siblings = Counter(kinds.values())
    blocks: list[Block] = []
    taken: set[str] = set()
    for path in sorted(members, key=lambda p: members[p][0]):
        at = members[path]
        contiguous = at == list(range(at[0], at[-1] + 1))
        nested = any(path.startswith(b + ".") for b in taken)
        if siblings[kinds[path]] >= 2 and contiguous and not nested:
            blocks.append(Block(path, tuple(ops[i].name for i in at)))
            taken.add(path)
    return blocks


def block_of(graph: fx.Graph, blocks: Sequence[Block]) -> dict[fx.Node, int]:
    """The number of the block each op of ``blocks`` belongs to, and of each parameter (or other
    placeholder) whose first reader is one of them: the generated code reads (ZeRO-3: gathers)
    it inside that block."""
    number = {name: b for b, block in enumerate(blocks) for name in block.nodes}
    out: dict[fx.Node, int] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if n.name in number:
            out[n] = number[n.name]
        elif n.op == "placeholder" and n.users:
            first = min(n.users, key=order.__getitem__)
            if first.name in number:
                out[n] = number[first.name]
    return out


def attention_core(graph: fx.Graph, block: Block) -> Block | None:
    """``block``'s attention core (one contiguous run of its ops, named by the block's path), or
    None where it has none: per softmax, the batched product that feeds it (scores) to the one it
    feeds (probabilities times values), and what the graph runs between them."""
    names = set(block.nodes)
    ops = [n for n in graph.nodes if n.name in names]
    index = {n: i for i, n in enumerate(ops)}
    spans = []
    for soft in (n for n in ops if n.target in _SOFTMAX):
        scores = _nearest(soft, index, lambda n: n.all_input_nodes, max)
        weighted = _nearest(soft, index, lambda n: list(n.users), min)
        if scores is not None and weighted is not None:
            spans.append((index[scores], index[weighted]))
    if not spans:
        return None
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    return Block(block.path, tuple(n.name for n in ops[start:end + 1]))


def _nearest(node: fx.Node, index: dict[fx.Node, int], step, pick) -> fx.Node | None:
    """The batched product nearest ``node`` (``pick`` of graph positions) reached through ``step``
    (inputs or users) inside the block, or None."""
    found: list[fx.Node] = []
    todo, seen = [node], {node}
    while todo:
        for nxt in step(todo.pop()):
            if nxt in index and nxt not in seen:
                seen.add(nxt)
                (found if nxt.target in _BATCHED_PRODUCTS else todo).append(nxt)
    return pick(found, key=index.__getitem__) if found else None


def recomputed_regions(graph: fx.Graph, recompute: Mapping[str, RecomputeMode]) -> list[Block]:
    """The runs of ops recomputed in the backward, in graph order: each repeated block ``recompute``
    names whole ("full"), or its attention core ("selective")."""
    regions = []
    for block in repeated_blocks(graph):
        mode = recompute.get(block.path, "none")
        region = block if mode == "full" else attention_core(graph, block) if mode == "selective" else None
        if region is not None:
            regions.append(region)
    return regions


def recompute_modes(graph: fx.Graph, mode: RecomputeMode, blocks: int | None = None) -> dict[str, RecomputeMode]:
    """``Plan.recompute`` of recomputing ``mode`` wherever it applies: every repeated block's path
    (those with an attention core, for "selective"), or the first ``blocks`` of them, -> ``mode``;
    empty for "none". The first blocks are the ones worth it: their activations wait longest for
    their backward."""
    if mode == "none":
        return {}
    paths = [block.path for block in repeated_blocks(graph)
             if mode == "full" or attention_core(graph, block) is not None]
    return {path: mode for path in paths[:blocks]}

"""The repeated blocks of a captured model (transformer layers): where activation recomputation
applies.

A block is a module at ``<container>.<index>`` (an ``nn.ModuleList``/``nn.Sequential`` entry)
with at least one sibling of the same class, whose ops form one contiguous run of the graph (the
generated forward can then run them as one checkpointed function). Its nodes are the ops the
module's forward ran, as export's ``nn_module_stack`` records them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx


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
    blocks, taken = [], set()
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

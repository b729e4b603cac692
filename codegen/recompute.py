"""Activation recomputation in generated code: a block's lines become one checkpointed function.

``checkpointed`` rewrites the lines a repeated block generated (``autopar.core.blocks``) into a
nested function of the values it reads from before (its inputs) that returns the values later
lines read (its outputs), called through ``recompute``: ``torch.utils.checkpoint`` without
reentrance. The forward keeps only the block's inputs; the backward runs the block again to
rebuild what its own backward needs (collectives included, in the same order on every rank, and
dropout with the same random state), then frees it, as Megatron's full recomputation does.

``recomputing()`` tells runtime code that a block is being run again for the backward: ZeRO-3
groups gathered there are not prefetched (no forward follows to use them).
"""
from __future__ import annotations

import ast
import textwrap
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.checkpoint import checkpoint

_STATE = threading.local()


def recompute(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its intermediate values dropped after the forward and rebuilt by running
    ``fn`` again when the backward needs them."""
    calls = [0]

    def run(*a: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        try:
            return fn(*a)
        finally:
            _STATE.depth -= 1

    return checkpoint(run, *args, use_reentrant=False)


def recomputing() -> bool:
    """Is a checkpointed block being run again for the backward?"""
    return getattr(_STATE, "depth", 0) > 0


def checkpointed(lines: Sequence[str], start: int, end: int, defined_before: set[str], name: str,
                 comment: str) -> list[str]:
    """``lines`` (statements of a function body, indented four spaces) with ``lines[start:end]``
    run as the checkpointed function ``name``. ``defined_before``: the function's arguments (the
    names of ``lines[:start]`` are added); a name read in the block and defined before it is an
    input, a name the block assigns and a later line reads an output."""
    region, after = list(lines[start:end]), list(lines[end:])
    before = set(defined_before)
    for line in lines[:start]:
        before.update(statement_names(line)[1])
    inputs: list[str] = []
    assigned: list[str] = []
    deleted: set[str] = set()
    for line in region:
        loads, stores, dels = statement_names(line)
        inputs += [n for n in loads if n in before and n not in assigned and n not in inputs]
        assigned += [n for n in stores if n not in assigned]
        deleted |= dels
    read_later: set[str] = set()
    for line in after:
        read_later.update(statement_names(line)[0])
    outputs = [n for n in assigned if n in read_later and n not in deleted]
    region, outer = _local_deletes(region, set(inputs) | set(assigned))
    args = ", ".join(inputs)
    returned = f"({', '.join(outputs)},)" if outputs else "()"
    definition = [f"    def {name}({args}):  # {comment}"]
    definition += [textwrap.indent(line, "    ") for line in region]
    definition.append(f"        return {returned}")
    wrapped = ["\n".join(definition),   # one statement, as every entry of ``lines``
               f"    {returned} = recompute({name}, {args})" if outputs else f"    recompute({name}, {args})"]
    freed = [n for n in inputs if n in deleted] + outer   # the block's last reads: the caller lets go too
    if freed:
        wrapped.append(f"    del {', '.join(freed)}")
    return [*lines[:start], *wrapped, *after]


def _local_deletes(region: list[str], local: set[str]) -> tuple[list[str], list[str]]:
    """The region with each ``del`` keeping only the function's own names, and the names of the
    enclosing function it deleted (a moved copy's source that the block does not read)."""
    kept, outer = [], []
    for line in region:
        statement = ast.parse(textwrap.dedent(line)).body
        if len(statement) == 1 and isinstance(statement[0], ast.Delete):
            names = [t.id for t in statement[0].targets if isinstance(t, ast.Name)]
            outer += [n for n in names if n not in local]
            mine = [n for n in names if n in local]
            if mine:
                kept.append(f"    del {', '.join(mine)}")
            continue
        kept.append(line)
    return kept, outer


def statement_names(line: str) -> tuple[list[str], list[str], set[str]]:
    """Names one statement reads (in order, before its assignments), assigns (in order: a
    checkpointed block returns them so, whatever the hash seed) and deletes."""
    tree = ast.parse(textwrap.dedent(line))
    loads: list[str] = []
    stores: list[str] = []
    dels: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id not in loads:
                loads.append(node.id)
            elif isinstance(node.ctx, ast.Store) and node.id not in stores:
                stores.append(node.id)
            elif isinstance(node.ctx, ast.Del):
                dels.add(node.id)
    return loads, stores, dels

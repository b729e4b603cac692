"""Values that depend on no input, parameter or buffer, computed once per generated forward.

An exported model computes some tensors from shapes alone: position ids from ``arange``, and
Hugging Face's attention masks (about 40 small ops per model: positions compared, indexed,
combined), which eager Hugging Face skips when the batch has no padding. Generated code puts
these ops in a function of their own, ``constants``, run at the first call of the forward and
cached (``codegen.runtime.once``); the forward starts by reading its results. The cost model
prices them (and the moves of their results) at nothing a step (``StrategySpace.folded``).

A mask computed this way that every rank finds exactly causal (or letting everything through)
is handed to SDPA as ``is_causal=True`` (or no mask), as eager Hugging Face calls it: the mask's
memory and the masked kernel are saved (``autopar.core.ops.attention``'s kernels ``attention_mask`` and ``attention``).
A mask too large to compute when planned, found causal (or all-pass) there at a grid of
positions, is never built: SDPA is told that answer (``unbuilt_masks``).

Not folded: random ops, values written in place or aliasing one, values the model returns, and
values over ``FOLD_BYTES`` that the forward would keep alive between calls (masks excepted: one
that is not causal is the tensor the forward would build each call anyway).
"""
from __future__ import annotations

from collections.abc import Callable, Container, Iterable

import torch
import torch.fx as fx

from autopar.core import from_shapes
from autopar.core.capture import CapturedGraph, is_random, is_size, tensor_val, value_bytes
from autopar.core.ops.attention import CAUSAL, SDPA, planned_mask_kind

aten = torch.ops.aten
FOLD_BYTES = 16 * 2**20


def foldable(captured: CapturedGraph, planned: Container[str], written: Container[str],
             limit: int = FOLD_BYTES) -> set[str]:
    """The nodes computed once: every input folded too (none is an input, parameter or buffer).
    ``planned``: the nodes the plan places; ``written``: values written in place or aliasing one."""
    graph = captured.graph
    output = next(n for n in graph.nodes if n.op == "output")
    folded: set[str] = set()
    for node in graph.nodes:
        if (node.op == "call_function" and node.name in planned and node.name not in written
                and output not in node.users and not is_random(node)
                and isinstance(node.meta.get("val"), torch.Tensor)
                and all(inp.name in folded or is_size(inp) for inp in node.all_input_nodes)):
            folded.add(node.name)
    while True:   # values kept between calls stay small
        large = {n for n in kept(graph, folded) - set(attention_masks(graph, folded)) if value_bytes(graph, n) > limit}
        if not large:
            return folded
        folded -= _descendants(graph, large)


def kept(graph: fx.Graph, folded: set[str]) -> set[str]:
    """The folded values the rest of the forward reads (not its asserts, which generated code
    leaves out: a long sequence's mask checked by one must not be kept whole)."""
    return {inp.name for n in graph.nodes if n.name not in folded and "assert" not in str(n.target)
            for inp in n.all_input_nodes if inp.name in folded}


def attention_masks(graph: fx.Graph, folded: set[str]) -> list[str]:
    """Folded values read by the rest of the forward only as SDPA's attention mask."""
    masks = []
    for node in graph.nodes:
        if node.name in folded:
            users = [u for u in node.users if u.name not in folded]
            if users and all(u.target is SDPA and len(u.args) > 3 and u.args[3] is node
                             and node not in u.args[:3] for u in users):
                masks.append(node.name)
    return masks


def unbuilt_masks(graph: fx.Graph, folded: set[str], splits_rows: Callable[[fx.Node, fx.Node], bool]
                  ) -> tuple[dict[str, str | None], set[str]]:
    """Folded attention masks too large to compute when planned (over ``from_shapes.LIMIT``
    elements: a long sequence's) that planning found causal or all-pass at its grid of positions
    (``planned_mask_kind``), where no SDPA reading one splits its query or key dims
    (``splits_rows(sdpa, mask)``): generated code hands SDPA that answer (``CAUSAL`` or None) and
    never builds the mask (at 262144 tokens, 64 GiB of booleans). Returns each such mask's answer
    and every folded node computed for them alone."""
    answers: dict[str, str | None] = {}
    for name in attention_masks(graph, folded):
        mask = next(n for n in graph.nodes if n.name == name)
        if tensor_val(mask).numel() <= from_shapes.LIMIT or any(splits_rows(u, mask) for u in mask.users if u.name not in folded):
            continue
        kind = planned_mask_kind(mask)
        if kind in ("causal", "none"):
            answers[name] = CAUSAL if kind == "causal" else None
    unbuilt = set(answers)
    for node in reversed(graph.nodes):   # users before what they read
        users = [u for u in node.users if "assert" not in str(u.target)]
        if node.name in folded and users and all(u.name in unbuilt for u in users):
            unbuilt.add(node.name)
    return answers, unbuilt


def _descendants(graph: fx.Graph, names: Iterable[str]) -> set[str]:
    found = set(names)
    for node in graph.nodes:
        if any(inp.name in found for inp in node.all_input_nodes):
            found.add(node.name)
    return found

"""What ties a training step to one forward over the whole batch: buffers the forward writes in
place (a batch norm's running statistics and batch counter, a running average of the model's own)
and batch norms that normalise by the batch's statistics.

Sharded, these are kept as one device keeps them (``autopar.core.execution``: writes land in the
replicated buffer, or in a view of its part that is gathered back; a batch split over ranks
normalises by the whole batch's statistics, ``autopar.core.ops.batch_norm``). Gradient accumulation and
pipelines cannot: they run the forward on parts of the batch, each part normalised by its own
statistics and writing the buffers once more. Such plans are refused by name
(``BufferWriteError``), and the planner's "auto" never makes them for such a model.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.core.capture import CapturedGraph, readable_name
from autopar.core.errors import BufferWriteError
from autopar.core.execution import storage_base, writes_in_place
from autopar.core.ops.batch_norm import batch_statistics, running_statistics


def whole_batch_state(captured: CapturedGraph) -> list[str]:
    """Why a step of ``captured`` must run its forward once on the whole batch, for people: its
    batch norms that normalise by the batch's statistics, the buffers it writes; empty if none."""
    reasons = []
    norms = list(dict.fromkeys(readable_name(n) or n.name for n in captured.graph.nodes if batch_statistics(n)))
    if norms:
        reasons.append(f"its batch norms ({_some(norms)}) normalise by the batch's statistics")
    written = written_buffers(captured.graph, captured.buffer_of)
    if written:
        writes = [f"{fqn} by {op}" for fqn, op in written.items()]
        reasons.append(f"its forward writes buffers in place ({_some(writes)})")
    return reasons


def written_buffers(graph: fx.Graph, buffer_of: dict[str, str]) -> dict[str, str]:
    """The buffers the forward writes in place (FQN -> the op that writes it first): by an op
    whose schema says so (a counter's ``add_``), or a training batch norm's running statistics."""
    out: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        targets = running_statistics(node) or ([storage_base(node.args[0])] if writes_in_place(node) else [])
        for target in targets:
            if target.name in buffer_of:
                out.setdefault(buffer_of[target.name], str(node.target))
    return out


def refuse_split_steps(model_name: str, reasons: list[str], how: str | None, what_to_do: str) -> None:
    """Raise ``BufferWriteError`` where a step runs its forward on parts of the batch (``how``: in
    what parts, None where it does not) and ``reasons`` (``whole_batch_state``) say it must not;
    ``what_to_do``: the way out."""
    if how is not None and reasons:
        raise BufferWriteError(
            f"{model_name}: {'; and '.join(reasons)}; but {how}: each part's forward "
            f"would do so on its part alone, unlike one device's step on the whole batch. {what_to_do}")


def _some(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` names, and how many more."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")

"""Microbatches: a global batch cut into row blocks along dim 0, as gradient accumulation runs it.

The batch is the first tensor input's dim 0; every tensor input with that many rows is cut, the
others (a position table of one row, a scalar, ``use_cache=False``) go to every microbatch as
they are. The planner captures the model at one microbatch's shape (``split``) and the compiled
module's ``train_step`` cuts the batches a training loop feeds the same way, in blocks of the
planned microbatch size (the last one may be smaller).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.core.capture import CapturedGraph, capture
from autopar.core.errors import AutoparError
from autopar.core.precision import Precision


def batch_size(args: tuple, kwargs: dict) -> int:
    """Rows of the batch: dim 0 of the first tensor input (1 if there is no tensor of rank >= 1)."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def captured_rows(captured: CapturedGraph) -> int:
    """Rows of the batch a graph was captured at (``batch_size`` of its user inputs)."""
    values = {n.name: n.meta.get("val") for n in captured.graph.nodes if n.op == "placeholder"}
    return batch_size(tuple(values[name] for name in captured.user_inputs), {})


def split(args: tuple, kwargs: dict, rows: int) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` cut into microbatches of ``rows`` rows (the last one may have fewer)."""
    total = batch_size(args, kwargs)
    if rows >= total:
        return [(args, kwargs)]
    starts = range(0, total, rows)

    def part(start: int):
        return lambda v: v[start:start + rows] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == total else v

    return [pytree.tree_map(part(s), (args, kwargs)) for s in starts]


def microbatch_capture(model: torch.nn.Module, args: tuple, kwargs: dict | None, precision: Precision
                       ) -> Callable[[int], CapturedGraph]:
    """``capture(k)``: the model captured at one of ``k`` equal microbatches of the example batch
    (its first rows); ``k`` must divide the batch."""
    def recapture(k: int) -> CapturedGraph:
        rows = microbatch_rows(batch_size(args, kwargs or {}), k)
        micro_args, micro_kwargs = split(args, kwargs or {}, rows)[0]
        return capture(model, micro_args, micro_kwargs, precision=precision)
    return recapture


def microbatch_rows(total: int, microbatches: int) -> int:
    """Rows of one of ``microbatches`` equal microbatches of a ``total``-row batch; they must divide it."""
    if microbatches < 1 or total % microbatches:
        divisors = [d for d in range(1, total + 1) if total % d == 0]
        raise AutoparError(f"microbatches={microbatches} does not divide the batch of {total} rows into equal "
                           f"microbatches; choose one of {divisors} (or microbatches='auto')")
    return total // microbatches


def candidates(total: int, at_least: float = 1.0) -> list[int]:
    """Microbatch counts to try for a ``total``-row batch, fewest first: the divisors of ``total``
    from ``at_least`` on (fewer microbatches run larger, more efficient kernels)."""
    start = max(1, math.ceil(at_least))
    return [d for d in range(start, total + 1) if total % d == 0]


def fewest_at_least(total: int, count: float) -> int:
    """The fewest microbatches, a divisor of ``total`` rows, that is at least ``count`` (at most ``total``)."""
    return (candidates(total, at_least=count) or [total])[0]


def check_microbatches(value: Any) -> None:
    """``PlanOptions.microbatches``: "auto" or a count >= 1."""
    if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise AutoparError(f"microbatches is 'auto' (the planner chooses) or a count >= 1, got {value!r}")

"""Failing together: a step of ``compile`` that raises on one rank raises on every rank.

Ranks of one job run ``compile`` side by side and meet at collectives (the shared plan, the
weights' scatter). A rank that raises on its own (a bad input, an infeasible budget, a profile it
cannot read) would leave the others waiting at their next collective until the process group
times out, minutes later. ``together`` runs a step, then every rank tells the others whether it
failed (one small all-gather). The error is printed once, by the first rank that failed (the
lowest): a rank that failed the same way raises its error too, of its type, but in one line that
points to that rank and without its traceback; a rank that failed otherwise raises its own, whole
(something else to fix); a rank that did not fail raises a one-line ``RankFailedError``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import local_tensor_mode

from autopar.core.errors import AutoparError, RankFailedError

T = TypeVar("T")
_SAME = "the same error as rank"   # begins the message of a rank that failed as the first did


def one_process() -> bool:
    """Is this job a single process (no process group, one rank, every rank simulated here by
    LocalTensorMode or a fake backend)? Nothing to agree on then."""
    return (local_tensor_mode() is not None or not dist.is_initialized() or dist.get_world_size() == 1
            or dist.get_backend() == "fake")


def rank_map(cb: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A tensor whose value on rank ``r`` is ``cb(r)``: under ``LocalTensorMode`` a LocalTensor of
    every simulated rank's (``run_on_local_tensor_mesh``), in a real process ``cb(its rank)``."""
    try:   # torch 2.13; the GPU machines lent here run 2.11, where only simulated ranks need it
        from torch.distributed._local_tensor import rank_map as torch_rank_map
    except ImportError:   # pragma: no cover
        raise AutoparError("simulated ranks (LocalTensorMode) need torch 2.13 (pip install torch==2.13.0)") from None
    return torch_rank_map(cb)


def first_rank() -> bool:
    """Is this the job's rank 0 (or its only process), the one that tells the user what runs?"""
    return one_process() or dist.get_rank() == 0


def together(step: str, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; if it raised on any rank, raise on all (``step``: what it does, for
    the message). Every rank of the default process group must call it with the same ``step``."""
    if one_process():
        return fn()
    error: Exception | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # any failure: told to the other ranks, then raised here as it was
        error = e
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if error is None else f"{type(error).__name__}: {error}")
    failed = [rank for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return result  # type: ignore[return-value]
    first, me = failed[0], dist.get_rank()
    pointer = _pointer(step, first, reports[first], len(failed))
    if error is None:
        raise RankFailedError(pointer, first)
    if me == first or reports[me] != reports[first]:
        raise error
    error.args = (f"{_SAME} {first}'s: {pointer}",)   # type and attributes kept
    raise error.with_traceback(None) from None


def told_by_another_rank(report: str) -> bool:
    """Is ``report`` (``"Type: message"``) a rank's pointer to another rank's error, not an error of its own?"""
    return report.startswith(f"{RankFailedError.__name__}:") or f": {_SAME} " in report


def _pointer(step: str, first: int, report: str, failures: int) -> str:
    """One line: rank ``first`` failed while ``step`` with ``report``, which it prints in full."""
    headline = report.splitlines()[0] if report.strip() else report
    headline = headline if len(headline) <= 200 else headline[:197] + "..."
    return (f"compile failed on rank {first} while {step} ({failures} rank(s) failed; rank {first} prints the "
            f"error in full): {headline}")

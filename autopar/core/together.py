"""Failing together: a step of ``compile`` that raises on one rank raises on every rank.

Ranks of one job run ``compile`` side by side and meet at collectives (the shared plan, the
weights' scatter). A rank that raises on its own (a bad input, an infeasible budget, a profile it
cannot read) would leave the others waiting at their next collective until the process group
times out, minutes later. ``together`` runs a step, then every rank tells the others whether it
failed (one small all-gather): the failing rank raises its own error, every other rank a
``RankFailedError`` carrying the failing rank's message.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist
from torch.distributed._local_tensor import local_tensor_mode

from autopar.core.errors import RankFailedError

T = TypeVar("T")


def one_process() -> bool:
    """Is this job a single process (no process group, one rank, every rank simulated here by
    LocalTensorMode or a fake backend)? Nothing to agree on then."""
    return (local_tensor_mode() is not None or not dist.is_initialized() or dist.get_world_size() == 1
            or dist.get_backend() == "fake")


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
    if error is not None:
        raise error
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        rank, report = failed[0]
        raise RankFailedError(f"compile failed on rank {rank} while {step} ({len(failed)} rank(s) failed); "
                              f"fix that rank's error and run again. Rank {rank}: {report}", rank)
    return result  # type: ignore[return-value]

"""The solver's own errors: it knows nothing of autopar, which turns them into ``AutoparError``s
with advice for its users (``autopar.planning.planner``)."""
from __future__ import annotations

from dataclasses import dataclass


class SolverError(Exception):
    """A malformed problem, an unknown solver or option, or a solver that failed; says which."""


class SolverTimeout(SolverError):
    """The solver found no solution at all within its time limit."""


@dataclass(frozen=True)
class MemoryHog:
    """One node's share of the least memory any plan needs: its lowest-memory choice, in bytes."""

    label: str
    min_bytes: float


class InfeasibleProblem(SolverError):
    """No choice of every node fits the memory budget. Carries the budget, the least memory
    any choice needs (``min_memory``) and the largest contributors to it, in bytes."""

    def __init__(self, why: str, budget: float, min_memory: float, largest: list[MemoryHog]) -> None:
        super().__init__(f"{why}: memory budget {budget:.6g} B per device, least memory of any choice "
                         f"{min_memory:.6g} B ({', '.join(f'{h.label}: {h.min_bytes:.6g} B' for h in largest)})")
        self.why, self.budget, self.min_memory, self.largest = why, budget, min_memory, largest

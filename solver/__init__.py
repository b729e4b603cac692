"""Sharding-choice optimisation (the ILP), independent of PyTorch and of the rest of autopar:
the lowest layer, which every other package may use and which uses none of them."""

from solver.errors import InfeasibleProblem, MemoryHog, SolverError, SolverTimeout
from solver.ilp import (
    SOLVERS,
    Edge,
    MemoryBounds,
    Problem,
    Row,
    Solution,
    Term,
    evaluate,
    memory_bounds,
    restrict,
    solve,
)

__all__ = ["Edge", "Term", "Row", "Problem", "Solution", "solve", "evaluate", "memory_bounds", "MemoryBounds",
           "restrict", "SOLVERS",
           "SolverError", "SolverTimeout", "InfeasibleProblem", "MemoryHog"]

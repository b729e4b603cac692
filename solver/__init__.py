"""Sharding-choice optimisation (the ILP), independent of PyTorch."""

from solver.ilp import SOLVERS, Edge, Problem, Solution, evaluate, solve

__all__ = ["Edge", "Problem", "Solution", "solve", "evaluate", "SOLVERS"]

"""Sharding-choice optimisation (the ILP), independent of PyTorch."""

from solver.ilp import SOLVERS, Edge, Problem, Row, Solution, evaluate, restrict, solve

__all__ = ["Edge", "Row", "Problem", "Solution", "solve", "evaluate", "restrict", "SOLVERS"]

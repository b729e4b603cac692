"""Sharding-choice optimisation (the ILP), independent of PyTorch."""

from solver.ilp import SOLVERS, Edge, Problem, Row, Solution, Term, evaluate, restrict, solve

__all__ = ["Edge", "Term", "Row", "Problem", "Solution", "solve", "evaluate", "restrict", "SOLVERS"]

"""The planner: the auto plan of a captured graph, chosen against the hand plans.

``plan_captured`` costs the standard strategies (``baselines``), warm-starts the ILP from the best
one that fits (``problem.solve_planning``), and keeps that hand plan unless the solver's plan is
predicted faster by ``PlanOptions.min_gain``.
"""
from __future__ import annotations

import time
from dataclasses import replace

from autopar.core.capture import CapturedGraph
from autopar.core.mesh import MeshSpec
from autopar.core.plan import Plan
from autopar.core.strategies import Strategy
from autopar.core.units import fmt
from autopar.planning.baselines import hand_plans as standard_plans
from autopar.planning.options import PlanOptions
from autopar.planning.problem import prepare, solve_planning


def plan_captured(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions = PlanOptions(), *,
                  timings: dict[str, float] | None = None, forced: dict[str, Strategy] | None = None) -> Plan:
    """Choose one strategy per node (``options``: see ``PlanOptions``). ``forced`` pins named nodes
    to a strategy and skips the hand plans (tests, calibration)."""
    deadline = time.perf_counter() + options.time_limit if options.time_limit is not None else None
    planning = prepare(captured, mesh, options, timings=timings, forced=forced)
    hands = standard_plans(planning, deadline=deadline) if options.hand_plans and not forced else {}
    fitting = [h for h in hands.values() if h[0].feasible]
    best = min(fitting, key=lambda h: h[0].predicted.step_time_s, default=None)
    plan, _ = solve_planning(planning, deadline=deadline, warm_start=best[1] if best else None)
    if best is not None and (not plan.feasible or
                             plan.predicted.step_time_s > (1 - options.min_gain) * best[0].predicted.step_time_s):
        plan = _renamed(best[0], "auto", plan, options.min_gain)
    if hands:
        plan.solver["warm_start"] = best[0].name if best else None
        plan.solver["hand_plans"] = {name: {"step_time_s": h.predicted.step_time_s,
                                            "peak_memory_bytes": h.predicted.peak_memory_bytes,
                                            "feasible": h.feasible} for name, (h, _) in hands.items()}
    plan.timings = dict(planning.timings)
    return plan


def _renamed(hand: Plan, name: str, solved: Plan, min_gain: float) -> Plan:
    """The hand plan, kept as the auto plan because the solver's plan does not fit the budget or
    is not predicted faster by ``min_gain`` under the exact schedule."""
    gain = 1 - solved.predicted.step_time_s / hand.predicted.step_time_s
    why = (f"exceeds the memory budget by {fmt(solved.shortfall_bytes, 'B')}" if not solved.feasible else
           f"({fmt(solved.predicted.step_time_s, 's')}) was predicted {abs(gain):.1%} "
           f"{'faster' if gain > 0 else 'slower'} than {hand.name!r} ({fmt(hand.predicted.step_time_s, 's')}) "
           f"under the exact schedule, not the {min_gain:.0%} (min_gain) worth leaving a standard plan for")
    note = f"the solver's plan {why}: keeping the hand plan {hand.name!r}"
    return replace(hand, name=name, warnings=[*hand.warnings, note], solver={**solved.solver, "kept_hand_plan": hand.name})

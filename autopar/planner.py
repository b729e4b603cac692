"""Planning: capture -> strategies -> costs -> ILP -> ``Plan``. Runs no collective; works on
``meta`` models, so clusters that do not exist here can be planned.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

from autopar.capture import CapturedGraph, readable_name
from autopar.mesh import MeshSpec
from autopar.plan import NodePlan, Plan, Prediction
from autopar.strategies import StrategySpace, Strategy, alias_strategies, build_space
from autopar.units import fmt
from cost_models.estimate import Cost, CostModel, get_optimizer
from cost_models.profile import Profile
from cost_models.schedule import StepPrediction, Timeline, step_costs
from solver import Edge, Problem, solve

log = logging.getLogger("autopar")

# Stop when the plan is provably within 0.1% of the best: far inside the cost model's own error,
# and it spares the solver proving optimality on large problems.
RELATIVE_GAP = 1e-3
DEFAULT_TIME_LIMIT_S = 60.0
# Cut points of the backward at which the ILP checks memory and exposed communication (the plan's
# own prediction checks every position).
CUTS = 8
# Times the planner adds the moment of a predicted peak above the budget and solves again.
MAX_MEMORY_REPAIRS = 4

@contextmanager
def _stage(timings: dict[str, float], name: str) -> Iterator[None]:
    log.info("autopar: %s...", name)
    t0 = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
    log.info("autopar: %s done in %.2f s", name, timings[name])


def plan_captured(captured: CapturedGraph, mesh: MeshSpec, *, memory_budget: float | None = None,
                  time_limit: float | None = DEFAULT_TIME_LIMIT_S, timings: dict[str, float] | None = None,
                  forced: dict[str, Strategy] | None = None, profile: Profile | None = None,
                  optimizer: str = "adamw") -> Plan:
    """Choose one strategy per node. ``forced`` pins named nodes to a strategy (tests, baselines);
    ``profile`` supplies measured costs of this machine (else roofline presets)."""
    timings = dict(timings or {})
    with _stage(timings, "strategies"):
        space = build_space(captured, mesh)
        if forced:
            _force(space, forced)
    with _stage(timings, "costs"):
        model = CostModel(mesh, space, profile=profile, optimizer=get_optimizer(optimizer))
        timeline = Timeline(space, overlap_efficiency=model.overlap_efficiency)
        budget = float(memory_budget) if memory_budget is not None else float(model.hw.memory_bytes)
        cuts = timeline.cuts(CUTS)
        problem, owner, node_costs = _problem(space, model, timeline, budget, cuts)
    deadline = time.perf_counter() + time_limit if time_limit is not None else None
    for attempt in range(MAX_MEMORY_REPAIRS + 1):
        with _stage(timings, "solve"):   # time_limit covers every solve of the repair loop together
            left = max(deadline - time.perf_counter(), 1.0) if deadline is not None else None
            solution = solve(problem, time_limit=left, relative_gap=RELATIVE_GAP)
        chosen = [nc.strategies[solution.choices[owner[i]]] for i, nc in enumerate(space.nodes)]
        plan, sim = _make_plan(captured, space, model, timeline, chosen, budget, solution, timings)
        peak = plan.predicted
        out_of_time = deadline is not None and time.perf_counter() >= deadline
        if peak.peak_memory_bytes <= budget or attempt == MAX_MEMORY_REPAIRS or out_of_time:
            break
        # The ILP checks memory at a few cuts, with a bound on working memory; the schedule found
        # a higher moment. Add that moment as a constraint (or, if it is one already, take the
        # overshoot off the ILP's budget) and solve again.
        log.info("autopar: predicted peak %s at %s exceeds the budget; solving again", peak.peak_memory_bytes,
                 peak.peak_at)
        if sim.peak_position not in cuts:
            cuts = sorted(set(cuts) | {sim.peak_position})
            problem = replace(problem, memory_rows=timeline.memory_rows(owner, node_costs, cuts))
        else:
            problem = replace(problem, memory_budget=solution.memory - (peak.peak_memory_bytes - budget))
    if plan.predicted.peak_memory_bytes > budget:
        plan.warnings.append(f"the plan's predicted peak ({fmt(plan.predicted.peak_memory_bytes, 'B')}) exceeds the "
                             f"budget ({fmt(budget, 'B')}) at {plan.predicted.peak_at}; lower memory_budget a little")
    return plan


def _force(space: StrategySpace, forced: dict[str, Strategy]) -> None:
    """Pin nodes to one strategy. Forcing an alias (getitem of a split) pins its source to the
    strategies that give that output placement; aliases then follow their sources again."""
    by_name = {nc.node.name: nc for nc in space.nodes}
    for name, want in forced.items():
        nc = by_name[name]
        if want not in nc.strategies:
            raise ValueError(f"{want} is not a candidate strategy of {name}")
        if nc.kind == "alias":
            src = space.nodes[space.index[nc.source]]
            src.strategies = [s for s in src.strategies if s.out == want.out]
        else:
            nc.strategies = [want]
    for nc in space.nodes:
        if nc.kind == "alias":
            src = space.nodes[space.index[nc.source]]
            nc.strategies = alias_strategies(src.strategies)


def _problem(space: StrategySpace, model: CostModel, timeline: Timeline, budget: float, cuts: list[int]
             ) -> tuple[Problem, list[int], dict[int, list[Cost]]]:
    """The ILP over decision nodes. Aliases (one output of a split) share their source's variable:
    their edges are priced with their own tensor but attached to the source's choice."""
    decision = {}   # space index -> ILP index
    for i, nc in enumerate(space.nodes):
        if nc.kind != "alias":
            decision[i] = len(decision)
    owner = [decision[i] if nc.kind != "alias" else decision[space.index[nc.source]] for i, nc in enumerate(space.nodes)]
    node_costs = {i: [model.node(nc, s) for s in nc.strategies] for i, nc in enumerate(space.nodes) if i in decision}
    costs = tuple(tuple(c.compute_s + c.comm_s for c in cs) for cs in node_costs.values())
    state = tuple(tuple(c.state_bytes for c in cs) for cs in node_costs.values())
    # Working memory, with room for a collective's buffers on the largest input (the ILP prices
    # redistributions on edges, which carry no memory term).
    transient = tuple(
        tuple(c.transient_bytes + 2 * max(model.input_bytes(space.nodes[i], s, floating_only=True), default=0.0)
              for c, s in zip(cs, space.nodes[i].strategies))
        for i, cs in node_costs.items())
    edges, queued = [], []
    matrices: dict[tuple, tuple] = {}  # identical layers share strategy lists: price each edge kind once
    for i, j, k in space.edges():
        src, nc = space.nodes[i], space.nodes[j]
        val = nc.inputs[k].meta.get("val")
        key = (id(src.strategies), id(nc.strategies), k, nc.kind, src.kind, tuple(val.shape), val.dtype)
        if key not in matrices:
            grid = [[model.edge(src, s, nc, d, k) for d in nc.strategies] for s in src.strategies]
            matrices[key] = (tuple(tuple(c.compute_s + c.comm_s for c in row) for row in grid),
                             tuple(tuple(c.overlap_s for c in row) for row in grid))
        blocking, overlap = matrices[key]
        if any(any(row) for row in overlap):
            queued.append((i, j, overlap))
        edges.append(Edge(owner[i], decision[j], blocking))
    names = tuple(nc.node.name for i, nc in enumerate(space.nodes) if i in decision)
    memory_rows = timeline.memory_rows(owner, node_costs, cuts)
    exposed_rows = timeline.exposed_rows(owner, node_costs, queued, cuts)
    problem = Problem(costs, state, tuple(edges), budget, names, memory_rows=memory_rows, transient=transient,
                      exposed_rows=exposed_rows)
    return problem, owner, node_costs


def _make_plan(captured, space, model, timeline, chosen, budget, solution, timings) -> tuple[Plan, StepPrediction]:
    costs, queued = step_costs(space, model, chosen)
    step_overhead = model.profile.overheads.get("step", 0.0) if model.profile is not None else 0.0
    sim = timeline.simulate(costs, queued, step_overhead)
    nodes, total = [], Cost()
    for nc, s, c in zip(space.nodes, chosen, costs):
        total = total + c
        nodes.append(NodePlan(
            name=nc.node.name,
            op={"param": "parameter", "input": "input", "buffer": "buffer", "output": "output"}.get(nc.kind, str(nc.node.target)),
            layer=readable_name(nc.node),
            strategy=s.label(),
            out=s.out,
            ins=s.ins,
            storage=s.storage,
            fqn=nc.fqn,
            compute_s=c.compute_s,
            comm_s=c.comm_s + c.overlap_s,
            memory_bytes=c.memory_bytes,
            saved_bytes=c.saved_bytes,
            source=_source(c),
        ))
    axes = space.mesh.axis_names
    comm_bytes = {a: (total.comm_bytes[i] if i < len(total.comm_bytes) else 0.0) for i, a in enumerate(axes)}
    predicted = Prediction(step_time_s=sim.step_s, peak_memory_bytes=sim.peak_bytes, comm_bytes=comm_bytes,
                           compute_s=sim.compute_s, comm_s=sim.comm_s, memory_breakdown=sim.at_peak,
                           overlapped_comm_s=sim.overlap_s, exposed_comm_s=sim.exposed_s, peak_at=sim.peak_at,
                           cost_source=_overall_source(costs, model))
    solver_info = {"status": solution.status, "gap": solution.gap, "variables": solution.num_variables,
                   "constraints": solution.num_constraints, "objective_s": solution.objective}
    plan = Plan(mesh=space.mesh, model_name=captured.model_name, fingerprint=captured.fingerprint, nodes=nodes,
                predicted=predicted, memory_budget=budget, solver=solver_info, timings=timings,
                warnings=captured.warnings + space.warnings)
    return plan, sim


def _source(c: Cost) -> str:
    """Where a node's time figures came from: the profile ("measured") or the roofline presets."""
    parts = []
    if c.compute_s > 0:
        parts.append("measured" if "compute" in c.measured else "roofline")
    if c.comm_s + c.overlap_s > 0:
        parts.append("measured comm" if "comm" in c.measured else "roofline comm")
    return ", ".join(parts) or "-"


def _overall_source(costs: list[Cost], model: CostModel) -> str:
    timed = [c for c in costs if c.compute_s > 0]
    measured = sum(c.compute_s for c in timed if "compute" in c.measured)
    total = sum(c.compute_s for c in timed) or 1.0
    comm = [c for c in costs if c.comm_s + c.overlap_s > 0]
    comm_measured = sum(1 for c in comm if "comm" in c.measured)
    profile = "no profile" if model.profile is None else f"profile {model.profile.fingerprint.get('device_name', '?')}"
    return (f"{profile}: {100 * measured / total:.0f}% of compute time measured, the rest roofline "
            f"({model.hw.name}); {comm_measured}/{len(comm)} communicating nodes use measured links")

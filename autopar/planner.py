"""Planning: capture -> strategies -> costs -> ILP -> ``Plan``. Runs no collective; works on
``meta`` models, so clusters that do not exist here can be planned.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Iterator

from autopar.capture import CapturedGraph, readable_name
from autopar.mesh import MeshSpec
from autopar.plan import NodePlan, Plan, Prediction
from autopar.strategies import StrategySpace, Strategy, alias_strategies, build_space
from cost_models.estimate import Cost, CostModel
from solver import Edge, Problem, solve

log = logging.getLogger("autopar")

# Stop when the plan is provably within 0.1% of the best: far inside the cost model's own error,
# and it spares the solver proving optimality on large problems.
RELATIVE_GAP = 1e-3
DEFAULT_TIME_LIMIT_S = 60.0

@contextmanager
def _stage(timings: dict[str, float], name: str) -> Iterator[None]:
    log.info("autopar: %s...", name)
    t0 = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - t0
    log.info("autopar: %s done in %.2f s", name, timings[name])


def plan_captured(captured: CapturedGraph, mesh: MeshSpec, *, memory_budget: float | None = None,
                  time_limit: float | None = DEFAULT_TIME_LIMIT_S, timings: dict[str, float] | None = None,
                  forced: dict[str, Strategy] | None = None) -> Plan:
    """Choose one strategy per node. ``forced`` pins named nodes to a strategy (tests, baselines)."""
    timings = dict(timings or {})
    with _stage(timings, "strategies"):
        space = build_space(captured, mesh)
        if forced:
            _force(space, forced)
    with _stage(timings, "costs"):
        model = CostModel(mesh)
        budget = float(memory_budget) if memory_budget is not None else float(model.hw.memory_bytes)
        problem, edge_index, owner = _problem(space, model, budget)
    with _stage(timings, "solve"):
        solution = solve(problem, time_limit=time_limit, relative_gap=RELATIVE_GAP)
    chosen = [nc.strategies[solution.choices[owner[i]]] for i, nc in enumerate(space.nodes)]
    return _make_plan(captured, space, model, chosen, edge_index, budget, solution, timings)


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


def _problem(space: StrategySpace, model: CostModel, budget: float) -> tuple[Problem, list[tuple[int, int, int]], list[int]]:
    """The ILP over decision nodes. Aliases (one output of a split) share their source's variable:
    their edges are priced with their own tensor but attached to the source's choice."""
    decision = {}   # space index -> ILP index
    for i, nc in enumerate(space.nodes):
        if nc.kind != "alias":
            decision[i] = len(decision)
    owner = [decision[i] if nc.kind != "alias" else decision[space.index[nc.source]] for i, nc in enumerate(space.nodes)]
    costs, memory, edges, edge_index = [], [], [], []
    for i, nc in enumerate(space.nodes):
        if i in decision:
            node_costs = [model.node(nc, s) for s in nc.strategies]
            costs.append(tuple(c.time_s for c in node_costs))
            memory.append(tuple(c.memory_bytes for c in node_costs))
    matrices: dict[tuple, tuple] = {}  # identical layers share strategy lists: price each edge kind once
    for j, nc in enumerate(space.nodes):
        if nc.kind == "alias":
            continue
        for k, inp in enumerate(nc.inputs):
            i = space.index.get(inp)
            if i is None:
                continue
            src = space.nodes[i]
            val = inp.meta.get("val")
            key = (id(src.strategies), id(nc.strategies), k, nc.kind, src.kind, tuple(val.shape), val.dtype)
            if key not in matrices:
                matrices[key] = tuple(tuple(model.edge(src, s, nc, d, k).time_s for d in nc.strategies)
                                      for s in src.strategies)
            edges.append(Edge(owner[i], decision[j], matrices[key]))
            edge_index.append((i, j, k))
    names = tuple(nc.node.name for i, nc in enumerate(space.nodes) if i in decision)
    return Problem(tuple(costs), tuple(memory), tuple(edges), budget, names), edge_index, owner


def _make_plan(captured, space, model, chosen, edge_index, budget, solution, timings) -> Plan:
    incoming: dict[int, Cost] = {}
    for i, j, k in edge_index:
        c = model.edge(space.nodes[i], chosen[i], space.nodes[j], chosen[j], k)
        incoming[j] = incoming.get(j, Cost()) + c
    nodes, total = [], Cost()
    breakdown = {"parameters+gradients+optimizer": 0.0, "activations": 0.0, "inputs": 0.0}
    for idx, (nc, s) in enumerate(zip(space.nodes, chosen)):
        c = model.node(nc, s) + incoming.get(idx, Cost())
        total = total + c
        key = {"param": "parameters+gradients+optimizer", "op": "activations"}.get(nc.kind, "inputs")
        breakdown[key] += c.memory_bytes
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
            comm_s=c.comm_s,
            memory_bytes=c.memory_bytes,
        ))
    axes = space.mesh.axis_names
    comm_bytes = {a: (total.comm_bytes[i] if i < len(total.comm_bytes) else 0.0) for i, a in enumerate(axes)}
    predicted = Prediction(step_time_s=total.time_s, peak_memory_bytes=total.memory_bytes, comm_bytes=comm_bytes,
                           compute_s=total.compute_s, comm_s=total.comm_s, memory_breakdown=breakdown)
    solver_info = {"status": solution.status, "gap": solution.gap, "variables": solution.num_variables,
                   "constraints": solution.num_constraints, "objective_s": solution.objective}
    return Plan(mesh=space.mesh, model_name=captured.model_name, fingerprint=captured.fingerprint, nodes=nodes,
                predicted=predicted, memory_budget=budget, solver=solver_info, timings=timings,
                warnings=captured.warnings + space.warnings)

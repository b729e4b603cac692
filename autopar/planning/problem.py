"""The planning problem of one captured graph on one mesh: strategies -> costs -> ILP
(``prepare``), and solving it, or a restriction of it, into a ``Plan`` (``solve_planning``).
The hand plans (``baselines``) and the auto plan (``planner``) both go through here. Runs no
collective; works on ``meta`` models, so clusters that do not exist here can be planned.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np
import torch.fx as fx

from autopar.core.blocks import RecomputeMode, recompute_modes
from autopar.core.capture import CapturedGraph, readable_name
from autopar.core.errors import AutoparError, InfeasibleError, PlanningTimeout
from autopar.core.mesh import MeshSpec
from autopar.core.microbatch import captured_rows
from autopar.core.ops import moe
from autopar.core.plan import NodePlan, Plan, Prediction, SearchLog
from autopar.core.precision import Precision
from autopar.core.progress import StatusLine, doing
from autopar.core.strategies import Strategy, StrategySpace, alias_strategies, build_space
from autopar.core.units import fmt
from autopar.planning import work
from autopar.planning.clock import HARD_STOP, STAGES, Clock, Deadline, Timed
from autopar.planning.context import restrict_context
from autopar.planning.options import PlanOptions
from autopar.planning.shrink import Grouping, group
from cost_models.confidence import band_of, basis_of, step_flops
from cost_models.estimate import Cost, CostModel, get_optimizer
from cost_models.profile import resolve_profile
from cost_models.schedule import PricedSpace, StepPrediction, Timeline
from solver import (
    Edge,
    InfeasibleProblem,
    MemoryBounds,
    Problem,
    Solution,
    SolverError,
    SolverTimeout,
    Term,
    solve,
)

log = logging.getLogger("autopar")

# Stop when the plan is provably within 1% of the best: far inside the cost model's own error
# (about 10%, ``benchmarks/cost_accuracy.py``) and the 5% a plan must gain to replace a hand
# plan; proving 0.1% took Llama-2 70B on 16x8 twice as long (11 s, not 6 s).
RELATIVE_GAP = 1e-2
# Cut points of the backward at which the ILP checks memory and exposed communication (the plan's
# own prediction checks every position).
CUTS = 8
# Times the planner adds the moment of a predicted peak above the budget and solves again.
MAX_MEMORY_REPAIRS = 4

@contextmanager
def _stage(timings: dict[str, float], name: str, line: StatusLine | None, what: str) -> Iterator[Timed]:
    """Time a stage of a planning problem into ``timings[name]`` (the caller adds them to the
    call's clock) and the yielded ``Timed``, saying ``what`` it does (on ``line``, the call's
    status line, and the log)."""
    timed, t0 = Timed(), time.perf_counter()
    try:
        with doing(f"{STAGES.get(name, name)} {what}", line):
            yield timed
    finally:   # a stage that raised (an infeasible hand plan) took its time too
        timed.seconds = time.perf_counter() - t0
        timings[name] = timings.get(name, 0.0) + timed.seconds


def _subject(microbatches: int, recompute: dict[str, RecomputeMode], offload: bool) -> str:
    """What a problem plans, as progress says it: "of 4 microbatches, 32 blocks recomputed"."""
    said = "of the whole batch" if microbatches == 1 else f"of one of {microbatches} microbatches"
    if recompute:
        said += f", {len(recompute)} blocks recomputed ({next(iter(recompute.values()))})"
    return said + (", optimizer offloaded" if offload else "")


@dataclass
class Planning:
    """What the auto plan and the hand plans (``autopar.planning.baselines``) share: the strategy space,
    its costs and the shrunken ILP (``Problem`` over ``Grouping`` decisions)."""

    captured: CapturedGraph
    space: StrategySpace
    model: CostModel
    timeline: Timeline
    budget: float
    cuts: list[int]
    problem: Problem
    grouping: Grouping
    node_costs: dict[int, list[Cost]]   # per node, its costs per choice of its decision
    priced: PricedSpace                 # every strategy's costs, to price any plan of the space
    timings: dict[str, float]
    microbatches: int = 1               # the graph is one of this many microbatches of the step's batch
    fingerprint: str = ""               # what plans carry: the whole batch's capture's (``Plan.check_matches``)
    recompute: dict[str, RecomputeMode] = field(default_factory=dict)   # recomputed block path -> mode (``Plan.recompute``)
    _bounds: MemoryBounds | None = field(default=None, repr=False)

    def bounds(self) -> MemoryBounds:
        """The problem's ``solver.MemoryBounds``: the least peak any plan (or any hand plan, a
        restriction) needs, and what no plan avoids (state, gradients); validated once (0.4 s on
        Llama-2 70B, asked once per hand plan and several times by the search)."""
        if self._bounds is None:
            self._bounds = MemoryBounds(self.problem)
        return self._bounds


def _skew(options: PlanOptions) -> float | dict[int, float]:
    """``options.expert_skew`` as the cost model takes it: measured already (``autopar.core.routing``)."""
    if options.expert_skew == "measured":
        raise AutoparError("expert_skew='measured' runs the model's router, and only the model's planning call has the "
                           "model: plan with autopar.plan or candidates, or give the skew as a number")
    return options.expert_skew


def prepare(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions = PlanOptions(), *,
            timings: dict[str, float] | None = None, forced: dict[str, Strategy] | None = None,
            microbatches: int = 1, whole: CapturedGraph | None = None, recompute: RecomputeMode | dict[str, RecomputeMode] = "none",
            offload: bool = False, space: StrategySpace | None = None, clock: Clock | None = None) -> Planning:
    """Strategies, costs and the ILP of one captured graph on one mesh (``forced``: pin named
    nodes to a strategy; ``microbatches``: the graph is one microbatch's, run this many times a
    step (see ``CostModel``) of the batch ``whole`` was captured at; ``recompute``: "full"
    recomputes every repeated block in the backward, "selective" their attention cores, a dict
    (block path -> mode) the blocks it names; ``offload``: ZeRO-2/3 parameters keep their
    state in host memory; ``space``: ``build_space(captured, mesh)`` built before, for another
    problem of the same graph (recomputation, offload and the budget do not change it; not with
    ``forced``, which narrows it); ``clock``: the planning call's, whose status line says what
    runs."""
    timings = dict(timings or {})
    blocks = recompute if isinstance(recompute, dict) else recompute_modes(captured.graph, recompute)
    what, line = _subject(microbatches, blocks, offload), clock.line if clock is not None else None
    built = space is None or bool(forced)
    with _stage(timings, "strategies", line, what) as strategies_s:
        if not built:   # its own warnings: the cost model adds to them
            space = replace(space, warnings=list(space.warnings))
        else:
            space = build_space(captured, mesh)
            restrict_context(space, options.context_parallel)
            if forced:
                _force(space, forced)
        space = moe.narrowed(space, options.expert_parallel)
    if clock is not None:
        _afford_pricing(clock, space, what)
    with _stage(timings, "costs", line, what) as costs_s:
        model = CostModel(mesh, space, profile=resolve_profile(options.profile, mesh),
                          optimizer=get_optimizer(options.optimizer), gather_outputs=options.gather_outputs,
                          microbatches=microbatches, recompute=recompute, reduce_precision=options.reduce_precision,
                          offload=offload, expert_skew=_skew(options))
        timeline = Timeline(space, overlap_efficiency=model.overlap_efficiency, block_of=model.block_of,
                            accumulating=microbatches > 1)
        budget = options.device_budget(mesh.hardware)
        cuts = timeline.cuts(CUTS)
    with _stage(timings, "ilp", line, what) as ilp_s:
        problem, grouping, node_costs, priced = _problem(space, model, timeline, budget, cuts, options.share_layers)
        log.debug("autopar: %s", grouping.describe(len(space.nodes)))
    if clock is not None:
        _charge_build(clock, space, problem, built, (strategies_s, costs_s, ilp_s))
    return Planning(captured, space, model, timeline, budget, cuts, problem, grouping, node_costs, priced, timings,
                    microbatches, (whole or captured).fingerprint, blocks)


def _afford_pricing(clock: Clock, space: StrategySpace, what: str) -> None:
    """Refuse (``PlanningTimeout``) to price and build the ILP of ``space`` where the call's
    deadline does not afford their charge by its strategies, at the host's pace: neither can be
    stopped once begun, and the first problem's build has no estimate of its own."""
    charges = {kind: work.seconds(kind, strategies=_strategies(space)) for kind in ("costs", "ilp")}
    wall_s = sum(seconds * clock.pace(kind) for kind, seconds in charges.items())
    if not clock.deadline().affords(sum(charges.values()), wall_s):
        raise PlanningTimeout(f"no time was left to price and build the problem {what} "
                              f"(about {wall_s:.1f} s at this host's pace)")


def _strategies(space: StrategySpace) -> int:
    """The strategies of every node of ``space``: what pricing and the ILP build are charged by."""
    return sum(len(nc.strategies) for nc in space.nodes)


def _charge_build(clock: Clock, space: StrategySpace, problem: Problem, built: bool,
                  walls: tuple[Timed, Timed, Timed]) -> None:
    """Charge a problem's build by its size (``work``), its space's strategies only where it was
    built here; what the whole build was charged is the estimate of the next ("prepare")."""
    size = _size(space, problem)
    charged = clock.charge("strategies", walls[0].seconds, **size) if built else 0.0
    charged += clock.charge("costs", walls[1].seconds, **size)
    charged += clock.charge("ilp", walls[2].seconds, **size)
    clock.took["prepare"] = charged


def _size(space: StrategySpace, problem: Problem) -> dict[str, float]:
    """What a problem's build is charged by: its graph's nodes, their strategies, the ILP's
    choices and the pairs its edges price."""
    return {"graph_nodes": len(space.nodes), "strategies": _strategies(space),
            "choices": sum(len(c) for c in problem.costs),
            "edge_pairs": sum(int(np.size(e.cost)) for e in problem.edges)}


def solve_planning(planning: Planning, *, deadline: Deadline | None = None,
                   allowed: Sequence[Sequence[int] | None] | None = None,
                   warm_start: Sequence[int] | None = None, name: str = "auto", budget: bool = True,
                   stage: str = "solve") -> tuple[Plan, tuple[int, ...]]:
    """Solve (a restriction of) the planning problem: ``allowed[d]`` lists the choices decision
    ``d`` may take (``None``: all); ``budget=False`` drops the memory constraint. Returns the plan
    and its choice per decision of the full problem (a warm start for another solve).

    If the exact schedule (``Timeline.simulate``) finds a moment above the budget that the ILP's
    cuts missed, that moment is added as a constraint (or the overshoot taken off the budget) and
    the problem solved again, up to ``MAX_MEMORY_REPAIRS`` times, all within ``deadline``: a
    repair begins only before it (``Deadline.solve_seconds``), and none where the whole search's
    deadline has passed (``PlanningTimeout``: no solve at all). A solve the time limit stops
    says so on the deadline's clock (``Clock.cut_short``)."""
    full = planning.problem
    limit = planning.budget if budget else None
    problem = replace(full, memory_budget=limit, warm_start=tuple(warm_start) if warm_start is not None else None)
    allowed = list(allowed) if allowed is not None else [None] * len(full.costs)
    cuts = planning.cuts
    for attempt in range(MAX_MEMORY_REPAIRS + 1):
        allowance = deadline.solve_seconds() if deadline is not None else None
        if allowance is not None and allowance <= 0:
            if attempt == 0:
                raise PlanningTimeout(f"no time was left to solve the {name!r} plan")
            break
        said = f"{name!r} " + _subject(planning.microbatches, planning.recompute, planning.model.offload) \
            + (f" (memory repair {attempt})" if attempt else "")
        # the deadline covers every solve of the repair loop together
        with _stage(planning.timings, stage, deadline.clock.line if deadline is not None else None, said) as timed:
            solution = _solve(problem, allowed, planning.bounds(), allowance, deadline, planning.captured.precision)
            choices = tuple(c if a is None else int(a[c]) for c, a in zip(solution.choices, allowed, strict=True))
            plan, sim = _make_plan(planning, choices, solution, name)
        if deadline is not None:
            _charge_solve(deadline.clock, solution, len(planning.space.nodes), timed.seconds, name)
        peak = plan.predicted.peak_memory_bytes
        out_of_time = deadline is not None and deadline.passed()
        if limit is None or peak <= limit or attempt == MAX_MEMORY_REPAIRS or out_of_time:
            if limit is not None and peak > limit and out_of_time and attempt < MAX_MEMORY_REPAIRS:
                deadline.clock.note(f"the {name!r} plan's memory repairs")
            break
        log.debug("autopar: the %r plan's predicted peak %s at %s exceeds the budget; solving again", name,
                  fmt(peak, "B"), plan.predicted.peak_at)
        if sim.peak_position not in cuts:
            cuts = sorted(set(cuts) | {sim.peak_position})
            problem = replace(problem, memory_rows=planning.timeline.memory_rows(planning.grouping.owner,
                                                                                 planning.node_costs, cuts))
        else:
            problem = replace(problem, memory_budget=solution.memory - (peak - limit))
    if limit is not None and plan.shortfall_bytes > 0:
        plan.warnings.append(f"the plan's predicted peak ({fmt(plan.predicted.peak_memory_bytes, 'B')}) exceeds the "
                             f"budget ({fmt(limit, 'B')}) at {plan.predicted.peak_at}; lower memory_budget a little")
    return plan, choices


def _percent(gap: float | None) -> str:
    """A solve's relative gap; one past ``BIG_GAP`` (the bound near 0, nothing proven) said so."""
    if gap is None:
        return "unknown"
    return f"{100 * gap:.2f}%" if gap < BIG_GAP else f"over {BIG_GAP:.0%}: the bound proves nothing yet"


#: A relative gap past which its figure says nothing (the solver's bound still near 0).
BIG_GAP = 10.0


def _charge_solve(clock: Clock, solution: Solution, graph_nodes: int, wall_s: float, name: str) -> None:
    """Charge a solve (and the plan made of it) by its size and counted work; say where a limit
    ended it short of its gap."""
    clock.charge("solve", wall_s, graph_nodes=graph_nodes, variables=solution.num_variables,
                 **work.solve_features(solution.num_choices, solution.simplex_iterations, solution.nodes))
    gap = _percent(solution.gap)
    if solution.stopped_by == "nodes":
        clock.note(f"the {name!r} solve stopped at its share of the time limit (gap {gap})")
    elif solution.stopped_by == "time" and clock.deterministic:
        clock.note(f"the {name!r} solve stopped at the wall clock's hard stop (gap {gap})")
        clock.note(HARD_STOP)
    elif solution.stopped_by == "time":
        clock.note(f"the {name!r} solve stopped at its time limit (gap {gap})")


def _solve(problem: Problem, allowed: Sequence[Sequence[int] | None], bounds: MemoryBounds, allowance: float | None,
           deadline: Deadline | None, precision: Precision) -> Solution:
    """``restrict(problem, allowed)``'s ILP (``bounds``: the planning problem's, whose arrays it
    restricts) within ``allowance`` seconds of the search's time (for a ``deterministic`` search,
    charged: its branch-and-bound nodes, with the wall clock's hard stop past them), its errors
    told in autopar's terms: how much memory any plan needs and what to do (an fp32 plan is told
    that bf16 compute halves activations)."""
    deterministic = deadline is not None and deadline.clock.deterministic
    wall = deadline.clock.wall_left() if deadline is not None else math.inf
    choices = sum(len(c) if a is None else len(a) for c, a in zip(problem.costs, allowed, strict=True))
    nodes = work.node_limit(allowance, choices) \
        if deterministic and allowance is not None else None
    seconds = wall if deterministic or allowance is None else min(allowance, wall)
    try:
        return solve(problem, time_limit=max(seconds, 0.01) if math.isfinite(seconds) else None,
                     relative_gap=RELATIVE_GAP, node_limit=nodes, allowed=allowed, validated=bounds)
    except InfeasibleProblem as e:
        who = ", ".join(f"{h.label}: {fmt(h.min_bytes, 'B')}" for h in e.largest)
        raise InfeasibleError(
            f"{e.why}: the memory budget is {fmt(e.budget, 'B')} per device, but even the lowest-memory choice "
            f"for every node needs {fmt(e.min_memory, 'B')}. Largest contributors to that minimum: {who}. Raise "
            "the budget, use more devices, "
            + ("compute in bf16 (precision='bf16': activations in half the bytes), " if precision == "fp32" else "")
            + "or shrink the model/batch.", min_memory_bytes=e.min_memory) from None
    except SolverTimeout as e:
        raise PlanningTimeout(f"planning ran out of time: {e}") from None
    except SolverError as e:
        raise AutoparError(f"planning failed in the solver: {e}") from None


def _force(space: StrategySpace, forced: dict[str, Strategy]) -> None:
    """Pin nodes to one strategy. Forcing an alias (getitem of a split) pins its source to the
    strategies that give that output placement; aliases then follow their sources again."""
    by_name = {nc.node.name: nc for nc in space.nodes}
    for name, want in forced.items():
        nc = by_name.get(name)
        if nc is None:
            raise AutoparError(f"cannot force node {name!r}: the graph has no such node with strategies "
                               f"(nodes are named as in the captured graph, e.g. {next(iter(by_name), '?')!r})")
        if want not in nc.strategies:
            raise AutoparError(f"cannot force {name} to {want.label()}: not one of its candidate strategies "
                               f"({', '.join(s.label() for s in nc.strategies[:8])}{', ...' if len(nc.strategies) > 8 else ''})")
        if nc.kind == "alias":
            src = space.nodes[space.index[nc.source]]
            src.strategies = [s for s in src.strategies if s.out == want.out]
        else:
            nc.strategies = [want]
    for nc in space.nodes:
        if nc.kind == "alias":
            src = space.nodes[space.index[nc.source]]
            nc.strategies = alias_strategies(src.strategies)


def _problem(space: StrategySpace, model: CostModel, timeline: Timeline, budget: float, cuts: list[int],
             share_layers: bool) -> tuple[Problem, Grouping, dict[int, list[Cost]], PricedSpace]:
    """The ILP over the decisions of the shrunken problem (``autopar.planning.shrink``). Returns it with
    the grouping, each node's costs per choice of its decision (for the repair loop's rows) and the
    priced space (to cost any plan)."""
    priced = PricedSpace(space, model)
    full = priced.nodes
    matrices: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # per shared grid: (blocking, overlap) seconds
    for grid in priced.edges.values():
        if id(grid) not in matrices:
            matrices[id(grid)] = (grid.matrix(lambda c: c.compute_s + c.comm_s), grid.matrix(lambda c: c.overlap_s))
    seconds = {e: matrices[id(grid)] for e, grid in priced.edges.items()}
    grouping = group(space, lambda i: np.array([c.compute_s + c.comm_s for c in full[i]]),
                     lambda i, j, k: seconds[(i, j, k)][0] + seconds[(i, j, k)][1], share_blocks=share_layers)
    owner, choice = grouping.owner, grouping.choice
    node_costs = {i: [full[i][c] for c in choice[i]] for i in range(len(space.nodes))}
    per_decision: list[list[list[Cost]]] = [[] for _ in grouping.sizes]
    for i, cs in node_costs.items():
        per_decision[owner[i]].append(cs)
    costs = tuple(tuple(sum(c[x].compute_s + c[x].comm_s for c in members) for x in range(k))
                  for members, k in zip(per_decision, grouping.sizes, strict=True))
    state = tuple(tuple(sum(c[x].state_bytes for c in members) for x in range(k))
                  for members, k in zip(per_decision, grouping.sizes, strict=True))
    # Working memory, with room for a collective's buffers on the largest input (the ILP prices
    # redistributions on edges, which carry no memory term); the largest member's counts.
    work = [(np.array([c.transient_bytes for c in full[i]]) + 2 * priced.largest_input[i])[choice[i]]
            for i in range(len(space.nodes))]
    transient = [np.zeros(k) for k in grouping.sizes]
    for i, w in enumerate(work):
        transient[owner[i]] = np.maximum(transient[owner[i]], w)
    edges, queued = [], []
    for (i, j, k), (blocking, overlap) in seconds.items():
        sub = np.ix_(choice[i], choice[j])
        if overlap.any():
            queued.append((i, j, overlap[sub].tolist()))
        # An edge's blocking seconds are its moves' (it computes nothing), a sum over mesh axes
        # that each see one axis of the placements: the ILP pairs those few classes.
        terms = tuple(Term(np.asarray(t.rows)[choice[i]], np.asarray(t.cols)[choice[j]], t.core)
                      for t in priced.edges[(i, j, k)].blocking_terms())
        edges.append(Edge(owner[i], owner[j], blocking[sub], terms))
    names = tuple(_described(space.nodes[r].node) for r in grouping.representative)
    memory_rows = timeline.memory_rows(owner, node_costs, cuts)
    exposed_rows = timeline.exposed_rows(owner, node_costs, queued, cuts)
    problem = Problem(costs, state, tuple(edges), budget, names, memory_rows=memory_rows,
                      transient=tuple(tuple(t.tolist()) for t in transient), exposed_rows=exposed_rows)
    return problem, grouping, node_costs, priced


def _make_plan(planning: Planning, choices: Sequence[int], solution: Solution, name: str
               ) -> tuple[Plan, StepPrediction]:
    space, model, timeline, captured = planning.space, planning.model, planning.timeline, planning.captured
    strategy = planning.grouping.strategies(choices)
    chosen = [nc.strategies[x] for nc, x in zip(space.nodes, strategy, strict=True)]
    costs, queued = planning.priced.step_costs(strategy)
    sim = timeline.simulate(costs, queued, model.step_overhead())
    nodes, total = [], Cost()
    for nc, s, c in zip(space.nodes, chosen, costs, strict=True):
        total = total + c
        nodes.append(NodePlan(
            name=nc.node.name,
            op={"param": "parameter", "input": "input", "buffer": "buffer", "output": "output"}.get(nc.kind, str(nc.node.target)),
            layer=readable_name(nc.node),
            strategy=s.label(),
            out=s.out,
            ins=s.ins,
            storage=s.storage,
            kept=s.kept and s.storage != s.out,
            accumulated=s.accumulated and s.storage != s.out,
            offloaded=model.offloads(s),
            fqn=nc.fqn,
            compute_s=c.compute_s,
            comm_s=c.comm_s + c.overlap_s,
            sync_s=c.overlap_s,
            memory_bytes=c.memory_bytes,
            saved_bytes=c.saved_bytes,
            source=_source(c),
        ))
    axes = space.mesh.axis_names
    comm_bytes = {a: (total.comm_bytes[i] if i < len(total.comm_bytes) else 0.0) for i, a in enumerate(axes)}
    predicted = Prediction(step_time_s=sim.step_s, peak_memory_bytes=sim.peak_bytes, comm_bytes=comm_bytes,
                           compute_s=sim.compute_s, comm_s=sim.comm_s, memory_breakdown=sim.at_peak,
                           overlapped_comm_s=sim.overlap_s, exposed_comm_s=sim.exposed_s, peak_at=sim.peak_at,
                           cost_source=_overall_source(costs, model), **_confidence(costs, model, captured.precision))
    solver_info: SearchLog = {"status": solution.status, "gap": solution.gap, "variables": solution.num_variables,
                   "constraints": solution.num_constraints, "objective_s": solution.objective,
                   "problem": planning.grouping.describe(len(space.nodes))}
    plan = Plan(mesh=space.mesh, model_name=captured.model_name, fingerprint=planning.fingerprint, nodes=nodes,
                predicted=predicted, memory_budget=planning.budget, solver=solver_info, timings=planning.timings,
                warnings=captured.warnings + space.warnings, name=name, gather_outputs=model.gather_outputs,
                precision=captured.precision, reduce_precision=model.reduce_precision,
                batch_size=captured_rows(captured) * planning.microbatches, microbatches=planning.microbatches,
                recompute=dict(planning.recompute), expert_parallel=moe.expert_parallel_of(space, chosen, model.skew_on),
                feasible=sim.peak_bytes <= planning.budget,
                shortfall_bytes=max(0.0, sim.peak_bytes - planning.budget))
    return plan, sim


def _described(node: fx.Node) -> str:
    """A node as the solver's messages name it: its name and layer (``mul_20 in model.layers.0.mlp``)."""
    layer = readable_name(node)
    return f"{node.name} in {layer}" if layer else node.name


def _source(c: Cost) -> str:
    """Where a node's time figures came from: the profile ("measured": most of its compute time,
    op times or the runtime's overheads, ``Cost.timed_s``) or the roofline presets."""
    parts = []
    if c.compute_s > 0:
        parts.append("measured" if c.timed_s >= c.compute_s / 2 else "roofline")
    if c.comm_s + c.overlap_s > 0:
        parts.append("measured comm" if "comm" in c.measured else "roofline comm")
    return ", ".join(parts) or "-"


def _measured_share(costs: list[Cost]) -> float:
    """The share of the nodes' compute time the profile measured: ops' times and the runtime's
    overheads per parameter and per move, most of a small model's step (the per-step overhead
    is the timeline's, in no node's cost)."""
    return sum(c.timed_s for c in costs) / (sum(c.compute_s for c in costs) or 1.0)


def _overall_source(costs: list[Cost], model: CostModel) -> str:
    comm = [c for c in costs if c.comm_s + c.overlap_s > 0]
    comm_measured = sum(1 for c in comm if "comm" in c.measured)
    profile = "no profile" if model.profile is None else f"profile {model.profile.fingerprint.get('device_name', '?')}"
    rest = "the preset's efficiency tables" if model.efficiency is not None else "roofline"
    return (f"{profile}: {100 * _measured_share(costs):.0f}% of compute time measured, the rest {rest} "
            f"({model.hw.name}); {comm_measured}/{len(comm)} communicating nodes use measured links")


def _confidence(costs: list[Cost], model: CostModel, precision: Precision) -> dict:
    """The prediction's basis, band and FLOPs (``cost_models.confidence``)."""
    basis = basis_of(_measured_share(costs), model.hw, model.profile)
    low, high = band_of(basis)
    return {"basis": basis, "band_low": low, "band_high": high, **step_flops(model, precision)}

"""Tests for the sharding ILP (solver/ilp.py): optimality against brute force, reductions,
memory budget, infeasibility reporting, time limits and input validation."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from solver import (
    Edge,
    InfeasibleProblem,
    MemoryBounds,
    Problem,
    Row,
    Solution,
    SolverError,
    Term,
    evaluate,
    ilp,
    memory_bounds,
    restrict,
    solve,
)
from solver.apart import solve_apart
from tests.tiers import slow_except

GIB = float(1 << 30)


def _matrix(rng: random.Random, ks: int, kd: int) -> tuple[tuple[float, ...], ...]:
    """A random edge matrix; sometimes zero, constant or separable to exercise the folding."""
    kind = rng.random()
    if kind < 0.1:
        return tuple(tuple(0.0 for _ in range(kd)) for _ in range(ks))
    if kind < 0.2:
        c = rng.uniform(0, 1)
        return tuple(tuple(c for _ in range(kd)) for _ in range(ks))
    if kind < 0.3:
        a = [rng.uniform(0, 1) for _ in range(ks)]
        b = [rng.uniform(0, 1) for _ in range(kd)]
        return tuple(tuple(a[s] + b[d] for d in range(kd)) for s in range(ks))
    return tuple(tuple(rng.uniform(0, 2) for _ in range(kd)) for _ in range(ks))


def random_problem(seed: int, n: int, num_edges: int, kmax: int = 4, budget_frac: float | None = None) -> Problem:
    rng = random.Random(seed)
    k = [rng.randint(1, kmax) for _ in range(n)]
    costs = tuple(tuple(rng.uniform(0, 1) for _ in range(ki)) for ki in k)
    memory = tuple(tuple(rng.uniform(0, 4) * GIB for _ in range(ki)) for ki in k)
    edges = []
    for _ in range(num_edges):
        u, v = rng.randrange(n), rng.randrange(n)  # may repeat pairs, reverse them, or loop
        edges.append(Edge(u, v, _matrix(rng, k[u], k[v])))
    budget = None
    if budget_frac is not None:
        lo = sum(min(m) for m in memory)
        hi = sum(max(m) for m in memory)
        budget = lo + budget_frac * (hi - lo)
    return Problem(costs, memory, tuple(edges), budget)


def brute_force(problem: Problem) -> tuple[float, tuple[int, ...]]:
    best = (float("inf"), ())
    for choices in itertools.product(*(range(len(c)) for c in problem.costs)):
        obj, mem = evaluate(problem, choices)
        if problem.memory_budget is not None and mem > problem.memory_budget:
            continue
        best = min(best, (obj, choices))
    return best


def check_solution(problem: Problem, sol: Solution) -> None:
    assert isinstance(sol, Solution)
    assert len(sol.choices) == len(problem.costs)
    assert all(0 <= c < len(problem.costs[i]) for i, c in enumerate(sol.choices))
    obj, mem = evaluate(problem, sol.choices)
    assert sol.objective == pytest.approx(obj, rel=1e-12, abs=1e-12)
    assert sol.memory == pytest.approx(mem, rel=1e-12)
    if problem.memory_budget is not None:
        assert sol.memory <= problem.memory_budget * (1 + 1e-9)
    assert sol.status in ("optimal", "feasible")
    assert sol.solve_time_s >= 0


@pytest.mark.parametrize("solver", ["highs", "scip"])
@pytest.mark.parametrize("budget_frac", [None, 0.15, 0.5])
@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force(seed: int, budget_frac: float | None, solver: str) -> None:
    problem = random_problem(seed, n=6, num_edges=9, budget_frac=budget_frac)
    want, _ = brute_force(problem)
    sol = solve(problem, solver=solver)
    check_solution(problem, sol)
    assert sol.status == "optimal" and sol.gap == 0.0
    assert sol.objective == pytest.approx(want, rel=1e-6, abs=1e-9)


def step_problem(seed: int, budget_frac: float | None) -> Problem:
    """A random problem with moments of the step, transients and exposed-communication rows
    (signed: queued communication minus the compute that can hide it)."""
    rng = random.Random(seed)
    base = random_problem(seed, n=5, num_edges=7, kmax=3)
    k = [len(c) for c in base.costs]
    memory_rows = tuple(Row(nodes=tuple((i, tuple(rng.uniform(-1, 3) * GIB for _ in range(k[i])))
                                        for i in rng.sample(range(5), 3))) for _ in range(2))
    transient = tuple(tuple(rng.uniform(0, 2) * GIB for _ in range(ki)) for ki in k)
    exposed = tuple(Row(nodes=tuple((i, tuple(rng.uniform(-1, 2) for _ in range(k[i]))) for i in rng.sample(range(5), 3)),
                        constant=rng.uniform(-1, 1)) for _ in range(2))
    problem = Problem(base.costs, base.memory, base.edges, None, memory_rows=memory_rows, transient=transient,
                      exposed_rows=exposed)
    if budget_frac is None:
        return problem
    peaks = sorted(evaluate(problem, c)[1] for c in itertools.product(*(range(ki) for ki in k)))
    return Problem(base.costs, base.memory, base.edges, peaks[int(budget_frac * (len(peaks) - 1))],
                   memory_rows=memory_rows, transient=transient, exposed_rows=exposed)


@pytest.mark.parametrize("budget_frac", [None, 0.1, 0.5])
@pytest.mark.parametrize("seed", range(8))
def test_step_rows_match_brute_force(seed: int, budget_frac: float | None) -> None:
    problem = step_problem(seed, budget_frac)
    want, _ = brute_force(problem)
    sol = solve(problem)
    check_solution(problem, sol)
    assert sol.objective == pytest.approx(want, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_memory_bounds_of_a_restriction_need_no_new_problem(seed: int) -> None:
    """``MemoryBounds.least(allowed)`` (hand plans' feasibility check) equals the bound of the
    restricted problem, and no allowed assignment peaks below it."""
    problem = step_problem(seed, None)
    rng = random.Random(seed)
    bounds = MemoryBounds(problem)
    assert bounds.least() == pytest.approx(memory_bounds(problem)[0])
    for _ in range(4):
        allowed = [None if rng.random() < 0.3 else sorted(rng.sample(range(len(c)), rng.randint(1, len(c))))
                   for c in problem.costs]
        least = bounds.least(allowed)
        assert least == pytest.approx(memory_bounds(restrict(problem, allowed))[0])
        options = [range(len(c)) if a is None else a for c, a in zip(problem.costs, allowed, strict=True)]
        assert least <= min(evaluate(problem, c)[1] for c in itertools.product(*options)) * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_a_restriction_solved_on_validated_arrays_is_the_restricted_problems_solve(seed: int) -> None:
    """``solve(problem, allowed=..., validated=MemoryBounds(...))`` (hand plans, memory repairs)
    gives what solving ``restrict(problem, allowed)`` gives, with another budget, warm start and
    memory rows than the validated problem's; a problem with other node data is validated anew."""
    rng = random.Random(seed)
    base = step_problem(seed, None)
    bounds = MemoryBounds(base)
    k = [len(c) for c in base.costs]
    for trial in range(4):
        allowed = [None if rng.random() < 0.3 else sorted(rng.sample(range(ki), rng.randint(1, ki))) for ki in k]
        rows = base.memory_rows if trial % 2 else base.memory_rows[:1]
        budget = None if trial == 0 else evaluate(replace(base, memory_rows=rows), [0] * len(k))[1] * rng.uniform(0.8, 1.5)
        problem = replace(base, memory_budget=budget, memory_rows=rows, warm_start=tuple(rng.randrange(ki) for ki in k))
        try:
            want = solve(restrict(problem, allowed))
        except InfeasibleProblem:
            with pytest.raises(InfeasibleProblem):
                solve(problem, allowed=allowed, validated=bounds)
            continue
        got = solve(problem, allowed=allowed, validated=bounds)
        assert (got.choices, got.objective, got.memory) == (want.choices, pytest.approx(want.objective), pytest.approx(want.memory))
    other = replace(base, costs=tuple(tuple(2 * c for c in cs) for cs in base.costs))
    assert bounds.data_of(other) is None
    assert solve(other, validated=bounds).objective == pytest.approx(solve(other).objective)


def test_peak_and_exposed_semantics() -> None:
    # Two nodes, no choice: peak = always-live + worst moment + largest transient;
    # exposed = max(0, worst row).
    problem = Problem(costs=((1.0,), (2.0,)), memory=((10.0,), (20.0,)), edges=(Edge(0, 1, ((0.5,),)),),
                      memory_rows=(Row(nodes=((0, (5.0,)),)), Row(nodes=((1, (7.0,)), (0, (-1.0,))))),
                      transient=((3.0,), (4.0,)),
                      exposed_rows=(Row(nodes=((0, (0.25,)), (1, (1.0,))), constant=-0.5),
                                    Row(constant=-2.0)))
    assert evaluate(problem, (0, 0)) == (1.0 + 2.0 + 0.5 + 0.75, 30.0 + 6.0 + 4.0)


def test_infeasible_blames_what_is_held_at_the_worst_moment() -> None:
    """A weight always live (5 B, one choice) beside an activation that is small when made but kept
    for the backward (1 B always, 100 B more at the backward's start): the activation sets the
    least peak, so it is named first, with what it holds then."""
    problem = Problem(costs=((0.0,), (0.0,)), memory=((5.0,), (1.0,)), edges=(), memory_budget=50.0,
                      names=("weight", "activation"), memory_rows=(Row(nodes=((1, (100.0,)),)),))
    with pytest.raises(InfeasibleProblem) as info:
        solve(problem)
    assert info.value.min_memory == pytest.approx(106.0)
    assert "activation" in info.value.largest[0].label and info.value.largest[0].min_bytes == pytest.approx(101.0)


def test_deterministic_and_warm_start() -> None:
    problem = random_problem(42, n=6, num_edges=10, budget_frac=0.4)
    first = solve(problem)
    assert solve(problem).choices == first.choices
    hinted = Problem(problem.costs, problem.memory, problem.edges, problem.memory_budget,
                     warm_start=tuple(0 for _ in problem.costs))
    assert solve(hinted).objective == pytest.approx(first.objective, rel=1e-6)


def test_infeasible_budget_reports_minimum() -> None:
    problem = random_problem(3, n=5, num_edges=4)
    min_mem = sum(min(m) for m in problem.memory)
    names = tuple(f"op{i}" for i in range(5))
    problem = Problem(problem.costs, problem.memory, problem.edges, min_mem * 0.9, names=names)
    with pytest.raises(InfeasibleProblem) as info:
        solve(problem)
    assert info.value.min_memory == pytest.approx(min_mem)
    assert info.value.budget == pytest.approx(min_mem * 0.9)
    biggest = max(range(5), key=lambda i: min(problem.memory[i]))
    assert names[biggest] in info.value.largest[0].label and names[biggest] in str(info.value)
    assert info.value.largest[0].min_bytes == pytest.approx(min(problem.memory[biggest]))
    # A budget exactly at the minimum is feasible: every node takes its lowest-memory choice.
    tight = Problem(problem.costs, problem.memory, problem.edges, min_mem)
    sol = solve(tight)
    assert sol.choices == tuple(min(range(len(m)), key=m.__getitem__) for m in problem.memory)


def test_infeasible_does_not_call_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("solver must not be called")

    monkeypatch.setattr(ilp.mathopt, "solve", boom)
    problem = Problem(costs=((1.0, 2.0),), memory=((3.0, 4.0),), edges=(), memory_budget=2.0)
    with pytest.raises(InfeasibleProblem) as info:
        solve(problem)
    assert info.value.min_memory == 3.0


def test_chain_forces_consistent_choice() -> None:
    # Each node slightly prefers a different choice, but switching along the chain costs a lot:
    # the optimum is the single choice with the lowest total node cost (choice 1 here).
    n, k = 10, 3
    costs = tuple(tuple(1.0 + 0.1 * ((i + c) % k) for c in range(k)) for i in range(n))
    costs = tuple(tuple(cost - (0.05 if c == 1 else 0.0) for c, cost in enumerate(row)) for row in costs)
    reshard = tuple(tuple(0.0 if s == d else 10.0 for d in range(k)) for s in range(k))
    edges = tuple(Edge(i, i + 1, reshard) for i in range(n - 1))
    problem = Problem(costs, tuple((1.0,) * k for _ in range(n)), edges)
    for solver in ("highs", "scip"):
        sol = solve(problem, solver=solver)
        assert sol.choices == (1,) * n
        check_solution(problem, sol)


def _chain() -> Problem:
    """Three nodes in a chain whose LP relaxation is integral: the optimum is (0, 0, 0)."""
    return Problem(((1.0, 1.2), (1.1, 1.0), (1.0, 1.3)), ((1.0, 1.0),) * 3,
                   tuple(Edge(i, i + 1, ((0.0, 5.0), (5.0, 0.0))) for i in range(2)))


def _frustrated_triangle() -> Problem:
    """Three nodes each wanting another choice than both neighbours: a fractional relaxation
    (every choice at one half costs nothing), an optimum of 1."""
    same = ((1.0, 0.0), (0.0, 1.0))
    return Problem(((0.0, 0.0),) * 3, ((1.0, 1.0),) * 3, (Edge(0, 1, same), Edge(1, 2, same), Edge(0, 2, same)))


def test_a_tight_relaxation_is_the_optimum_and_a_loose_one_goes_to_the_mip(monkeypatch: pytest.MonkeyPatch) -> None:
    """The relaxation is solved first. A chain's is integral: that is the answer, with no branch
    and bound. An odd cycle of nodes that each want another choice than their neighbours (a
    frustrated triangle) has a fractional relaxation (every choice at one half costs nothing):
    decoding it would put every node on one choice (cost 3, the hint here, so that it cannot
    cover for it); the MIP finds a cost of 1."""
    chain = _chain()
    sol = solve(chain)
    assert sol.choices == (0, 0, 0) and sol.status == "optimal" and sol.gap == 0.0 and sol.nodes == 0
    triangle = _frustrated_triangle()
    monkeypatch.setattr(ilp, "_hint", lambda problem, data, red: [0, 0, 0])
    sol = solve(triangle)
    check_solution(triangle, sol)
    assert sol.objective == pytest.approx(brute_force(triangle)[0]) == 1.0 and sol.status == "optimal"


def test_the_relaxation_is_skipped_where_the_budget_binds_and_limited_to_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """A binding memory budget made every relaxation tried fractional: the MIP alone runs. Under
    a time limit the relaxation gets its share of it, the rest left to the MIP."""
    limits: dict[str, list[float]] = {"lp": [], "mip": []}
    solve_proto = ilp.solve_proto

    def spy(model, solver_type, params, model_params):
        lp = not any(model.variables.integers)
        limits["lp" if lp else "mip"].append(params.time_limit.seconds + params.time_limit.nanos / 1e9)
        return solve_proto(model, solver_type, params, model_params)

    monkeypatch.setattr(ilp, "solve_proto", spy)
    problem = random_problem(3, n=6, num_edges=9, budget_frac=0.15)
    assert solve(problem).status == "optimal" and limits == {"lp": [], "mip": [0.0]}
    free = replace(problem, memory_budget=None)
    sol = solve(free, time_limit=100.0)
    assert sol.objective == pytest.approx(brute_force(free)[0])
    assert len(limits["lp"]) == 1 and limits["lp"][0] == pytest.approx(100.0 * ilp._RELAXATION_SHARE, rel=0.05)


def test_memory_budget_changes_choice() -> None:
    # Choice 0 is fast but memory-hungry; under a tight budget some nodes must switch.
    n = 4
    problem = Problem(costs=((1.0, 2.0),) * n, memory=((4.0, 1.0),) * n, edges=(), memory_budget=10.0)
    sol = solve(problem)
    assert sol.memory <= 10.0
    assert sorted(sol.choices) == [0, 0, 1, 1]
    assert sol.objective == pytest.approx(6.0)


def test_single_choice_nodes_and_zero_edges() -> None:
    costs = ((1.0,), (3.0, 1.0), (2.0,), (0.5, 0.7, 0.1))
    memory = ((1.0,), (1.0, 1.0), (1.0,), (1.0, 1.0, 1.0))
    edges = (
        Edge(0, 1, ((0.0, 5.0),)),  # fixed -> free: folded into node 1
        Edge(0, 2, ((4.0,),)),  # fixed -> fixed: a constant
        Edge(1, 3, ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0))),  # all zero: skipped
        Edge(3, 2, ((1.0,), (0.0,), (2.0,))),  # free -> fixed: folded into node 3
        Edge(3, 3, ((1.0, 9.0, 9.0), (9.0, 1.0, 9.0), (9.0, 9.0, 1.0))),  # self-loop: its diagonal
    )
    problem = Problem(costs, memory, edges)
    sol = solve(problem)
    check_solution(problem, sol)
    want, choices = brute_force(problem)
    assert sol.objective == pytest.approx(want)
    assert sol.choices == choices == (0, 0, 0, 1)
    assert sol.num_variables == 5  # only the one-hot binaries of nodes 1 and 3
    # All nodes fixed: nothing to solve.
    fixed = Problem(((1.0,), (2.0,)), ((1.0,), (1.0,)), (Edge(0, 1, ((3.0,),)),))
    sol = solve(fixed)
    assert sol.choices == (0, 0) and sol.objective == 6.0 and sol.num_variables == 0
    # No nodes at all.
    assert solve(Problem((), (), ())).choices == ()


def test_separable_and_parallel_edges_need_no_pair_variables() -> None:
    sep = ((1.0, 2.0, 3.0), (2.0, 3.0, 4.0))  # a[s] + b[d]
    problem = Problem(
        costs=((0.0, 0.5), (0.3, 0.0, 0.2)),
        memory=((0.0, 0.0), (0.0, 0.0, 0.0)),
        edges=(Edge(0, 1, sep), Edge(1, 0, ((7.0, 7.0),) * 3)),
    )
    sol = solve(problem)
    assert sol.num_variables == 5
    assert sol.objective == pytest.approx(brute_force(problem)[0])
    # Two parallel edges whose sum is not separable do get pair variables (2 x 3 of them).
    swap = Problem(problem.costs, problem.memory, (Edge(0, 1, sep), Edge(1, 0, ((0.0, 5.0), (5.0, 0.0), (1.0, 1.0)))))
    sol = solve(swap)
    assert sol.num_variables == 5 + 6
    assert sol.objective == pytest.approx(brute_force(swap)[0])


def placement_problem(seed: int, budget_frac: float | None) -> tuple[Problem, int]:
    """Nodes with several choices per placement: an edge's cost depends only on the classes of
    its ends' choices (the placement each puts the tensor in), plus per-choice parts. Returns
    the problem and the pair variables a class-level model needs."""
    rng = random.Random(seed)
    k = [rng.randint(3, 6) for _ in range(5)]
    classes = [[rng.randrange(2) for _ in range(ki)] for ki in k]   # two placements per node
    for c in classes:
        c[:2] = [0, 1]   # both occur
    costs = tuple(tuple(rng.uniform(0, 1) for _ in range(ki)) for ki in k)
    memory = tuple(tuple(rng.uniform(0, 4) * GIB for _ in range(ki)) for ki in k)
    edges = []
    for u, v in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0), (1, 3)]:
        core = [[rng.uniform(0, 2) for _ in range(2)] for _ in range(2)]
        a = [rng.uniform(0, 1) for _ in range(k[u])]
        edges.append(Edge(u, v, tuple(tuple(core[classes[u][s]][classes[v][d]] + a[s] for d in range(k[v]))
                                      for s in range(k[u]))))
    budget = None
    if budget_frac is not None:
        lo, hi = sum(min(m) for m in memory), sum(max(m) for m in memory)
        budget = lo + budget_frac * (hi - lo)
    return Problem(costs, memory, tuple(edges), budget), sum(k) + 4 * len(edges)


@pytest.mark.parametrize("budget_frac", [None, 0.3])
@pytest.mark.parametrize("seed", range(6))
def test_pair_variables_over_placement_classes_match_brute_force(seed: int, budget_frac: float | None) -> None:
    """Choices that put a tensor in the same placement share their edge's pair variables (2 x 2
    per edge here, not k_src x k_dst), and the optimum is still brute force's."""
    problem, variables = placement_problem(seed, budget_frac)
    sol = solve(problem)
    check_solution(problem, sol)
    assert sol.num_variables == variables
    assert sol.objective == pytest.approx(brute_force(problem)[0], rel=1e-6, abs=1e-9)


def axis_problem(seed: int, budget_frac: float | None) -> tuple[Problem, int]:
    """Edges whose cost is a sum over two mesh axes, each seeing only that axis of the ends'
    placements (three per axis, nine per node): given as terms, the ILP pairs 3 x 3 classes per
    axis instead of the 9 x 9 placements. Returns the problem and that model's variable count."""
    rng = random.Random(seed)
    k = [9] * 4
    axis = [[(c // 3, c % 3) for c in range(9)] for _ in k]   # choice -> placement per axis
    costs = tuple(tuple(rng.uniform(0, 1) for _ in range(ki)) for ki in k)
    memory = tuple(tuple(rng.uniform(0, 4) * GIB for _ in range(ki)) for ki in k)
    edges = []
    for u, v in [(0, 1), (1, 2), (2, 3), (3, 0), (1, 3)]:
        terms = tuple(Term([axis[u][s][a] for s in range(k[u])], [axis[v][d][a] for d in range(k[v])],
                           [[rng.uniform(0, 2) for _ in range(3)] for _ in range(3)]) for a in range(2))
        dense = tuple(tuple(sum(t.core[t.rows[s]][t.cols[d]] for t in terms) for d in range(k[v])) for s in range(k[u]))
        edges.append(Edge(u, v, dense, terms))
    budget = None
    if budget_frac is not None:
        lo, hi = sum(min(m) for m in memory), sum(max(m) for m in memory)
        budget = lo + budget_frac * (hi - lo)
    return Problem(costs, memory, tuple(edges), budget), sum(k) + 2 * 9 * len(edges)


@pytest.mark.parametrize("budget_frac", [None, 0.3])
@pytest.mark.parametrize("seed", slow_except(range(4), 0))
def test_edge_terms_pair_classes_per_axis_and_match_brute_force(seed: int, budget_frac: float | None) -> None:
    """An edge given as a sum of terms gets pair variables per term over its classes (two axes
    of 3 x 3 here), and the optimum is still brute force's, also restricted (as a hand plan is)."""
    problem, variables = axis_problem(seed, budget_frac)
    sol = solve(problem)
    check_solution(problem, sol)
    assert sol.num_variables == variables
    assert sol.objective == pytest.approx(brute_force(problem)[0], rel=1e-6, abs=1e-9)
    dense = solve(replace(problem, edges=tuple(Edge(e.src, e.dst, e.cost) for e in problem.edges)))
    assert dense.num_variables > sum(len(c) for c in problem.costs) + 81 * len(problem.edges) // 2
    assert sol.objective == pytest.approx(dense.objective, rel=1e-6)
    allowed = [None, [0, 4, 8], [1, 2, 5, 7], [3]]
    small = restrict(replace(problem, memory_budget=None), allowed)
    assert solve(small).objective == pytest.approx(brute_force(small)[0], rel=1e-6, abs=1e-9)


def test_time_limit_returns_incumbent() -> None:
    rng = random.Random(7)
    n, k = 300, 6
    costs = tuple(tuple(rng.uniform(0, 1) for _ in range(k)) for _ in range(n))
    memory = tuple(tuple(rng.uniform(1, 2) * GIB for _ in range(k)) for _ in range(n))
    edges = tuple(
        Edge(rng.randrange(i), i, tuple(tuple(rng.uniform(0, 1) for _ in range(k)) for _ in range(k)))
        for i in itertools.chain(range(1, n), (rng.randrange(1, n) for _ in range(n // 2)))
    )
    budget = 1.4 * GIB * n
    problem = Problem(costs, memory, edges, budget)
    sol = solve(problem, time_limit=1.0)
    check_solution(problem, sol)
    if sol.status == "feasible":
        assert sol.gap is None or sol.gap >= 0
    assert sol.num_variables <= n * k + len(edges) * k * k


@pytest.mark.parametrize(
    "problem, match",
    [
        (Problem(((1.0, 2.0),), ((1.0,),), ()), "memory entries"),
        (Problem(((1.0,), (2.0,)), ((1.0,),), ()), "memory has 1"),
        (Problem(((1.0, 2.0), (1.0,)), ((1.0, 1.0), (1.0,)), (Edge(0, 1, ((1.0, 2.0),)),)), "expected \\(2, 1\\)"),
        (Problem(((1.0, 2.0), (1.0,)), ((1.0, 1.0), (1.0,)), (Edge(0, 1, ((1.0,), (2.0, 3.0))),)), "rectangular"),
        (Problem(((1.0, -2.0),), ((1.0, 1.0),), ()), "negative"),
        (Problem(((1.0, 2.0),), ((1.0, float("nan")),), ()), "NaN"),
        (Problem(((1.0, 2.0),), ((1.0, 1.0),), (Edge(0, 3, ((1.0, 1.0),)),)), "node 3"),
        (Problem(((),), ((),), ()), "non-empty"),
        (Problem(((1.0, 2.0),), ((1.0, 1.0),), (), memory_budget=-1.0), "memory_budget"),
        (Problem(((1.0, 2.0),), ((1.0, 1.0),), (), warm_start=(2,)), "warm_start"),
        (Problem(((1.0, 2.0),), ((1.0, 1.0),), (), names=("a", "b")), "names"),
        (Problem(((1.0, 2.0), (1.0,)), ((1.0, 1.0), (1.0,)),
                 (Edge(0, 1, ((1.0,), (2.0,)), (Term([0], [0], ((1.0,),)),)),)), "a class per choice"),
        (Problem(((1.0, 2.0), (1.0,)), ((1.0, 1.0), (1.0,)),
                 (Edge(0, 1, ((1.0,), (2.0,)), (Term([0, 2], [0], ((1.0,), (2.0,))),)),)), "outside its core"),
    ],
)
def test_invalid_input(problem: Problem, match: str) -> None:
    with pytest.raises(SolverError, match=match):
        solve(problem)


def test_invalid_solver_and_time_limit() -> None:
    problem = Problem(((1.0, 2.0),), ((1.0, 1.0),), ())
    with pytest.raises(SolverError, match="highs.*scip"):
        solve(problem, solver="gurobi")
    with pytest.raises(SolverError, match="time_limit"):
        solve(problem, time_limit=0)


def _all_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every timed model counts as large: straight to its MIP, solved apart."""
    monkeypatch.setattr(ilp, "APART_VARIABLES", 0)
    monkeypatch.setattr(ilp, "RELAX_HERE_VARIABLES", 0)


def test_a_large_model_is_solved_apart_as_it_would_be_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``APART_VARIABLES`` (here: every model) a timed solve runs in a process of its own,
    and gives what the same solve gives in this one."""
    problem = step_problem(3, 0.7)
    here = solve(problem, time_limit=60.0)
    started = []
    _all_apart(monkeypatch)
    monkeypatch.setattr(ilp, "solve_apart", lambda *a: started.append(1) or solve_apart(*a))
    apart = solve(problem, time_limit=60.0)
    assert started and apart.choices == here.choices and apart.status == here.status == "optimal"
    assert apart.objective == pytest.approx(brute_force(problem)[0], rel=1e-6, abs=1e-9)


def test_a_mid_sized_model_relaxes_here_and_solves_its_mip_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between ``APART_VARIABLES`` and ``RELAX_HERE_VARIABLES`` a timed solve tries its relaxation
    in this process; where that is fractional (a frustrated triangle) the MIP, which HiGHS may
    not stop at its limit, runs apart; where it is integral (a chain) nothing is started."""
    monkeypatch.setattr(ilp, "APART_VARIABLES", 0)
    started: list[int] = []
    monkeypatch.setattr(ilp, "solve_apart", lambda *a: started.append(1) or solve_apart(*a))
    chain = _chain()
    assert solve(chain, time_limit=30.0).choices == (0, 0, 0) and not started
    triangle = _frustrated_triangle()
    monkeypatch.setattr(ilp, "_hint", lambda problem, data, red: [0, 0, 0])
    sol = solve(triangle, time_limit=30.0)
    assert started == [1] and sol.objective == pytest.approx(1.0) and sol.status == "optimal"


def test_a_solver_that_overruns_its_time_limit_is_stopped_and_the_hint_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiGHS may run far past its limit on large models (checks far apart): solved apart, it is
    stopped at the limit, and the solve returns its hint (a feasible plan), saying time stopped it."""
    import time

    from solver.apart import STALL_ENV

    problem = step_problem(3, 0.7)
    _all_apart(monkeypatch)
    monkeypatch.setenv(STALL_ENV, "30")
    start = time.perf_counter()
    sol = solve(problem, time_limit=1.0)
    assert time.perf_counter() - start < 1.0 + ilp.APART_GRACE_S + 0.5
    assert (sol.status, sol.stopped_by, sol.gap, sol.nodes) == ("feasible", "time", None, 0)
    check_solution(problem, sol)


def test_a_failing_solver_process_is_a_solver_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _all_apart(monkeypatch)
    monkeypatch.setenv("AUTOPAR_SOLVE_APART_STALL_S", "not a number")
    with pytest.raises(SolverError, match="(?s)the solver's process failed .*not a number"):
        solve(step_problem(3, 0.7), time_limit=30.0)


def test_without_an_interpreter_to_start_a_large_model_is_solved_here(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    problem = step_problem(3, 0.7)
    _all_apart(monkeypatch)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert solve(problem, time_limit=30.0).objective == pytest.approx(brute_force(problem)[0], rel=1e-6, abs=1e-9)

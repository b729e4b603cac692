"""The sharding ILP: pick one choice per node to minimise node + resharding cost.

This is an abstract problem (no PyTorch): ``costs[node][choice]`` are linear costs,
``Edge.cost[src_choice][dst_choice]`` are pairwise costs, and an optional per-device
memory budget bounds ``sum(memory[node][choice])``.

Formulation (Alpa-style): one-hot binaries ``x[i, c]`` per node and, per edge, continuous
``e[s, d]`` in [0, 1] with ``sum_d e[s, d] = x_src[s]`` and ``sum_s e[s, d] = x_dst[d]``.
With integral ``x`` the marginals force ``e`` to be the outer product. The LP relaxation is
tight on typical sharding problems, so the MIP usually closes at the root; it is not on
random dense cost matrices, where large instances end at the time limit with the incumbent
(at worst the local-search hint built here, see ``_hint``).

Before building the model we shrink it: parallel edges are merged; edges touching a
single-choice node, and edges whose matrix is additively separable
(``M[s, d] = a[s] + b[d]``, which covers constant and all-zero matrices), are folded into
the endpoints' linear costs, so only genuinely pairwise edges get ``e`` variables.
Single-choice nodes get no variables at all.

The model is built as a ``ModelProto`` and loaded with ``mathopt.Model.from_model_proto``:
adding ~10^5 variables one at a time through the Python API takes seconds, this takes
a fraction of that. (We use math_opt rather than pywraplp because pywraplp drops the HiGHS
incumbent when the time limit is hit.)
"""

from __future__ import annotations

import datetime
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.math_opt import model_pb2
from ortools.math_opt.python import mathopt

__all__ = ["Edge", "Problem", "Solution", "solve", "evaluate", "SOLVERS"]

#: Accepted values of ``solve(..., solver=...)``.
SOLVERS: dict[str, mathopt.SolverType] = {
    "highs": mathopt.SolverType.HIGHS,
    "scip": mathopt.SolverType.GSCIP,
}

# An edge whose matrix minus its best separable fit is below this (relative to the matrix's
# largest entry) is folded into linear costs: the difference is far below solver tolerances.
_SEPARABLE_RTOL = 1e-12
# Local search sweeps used to polish the solution hint (each sweep visits every node once).
_MAX_SWEEPS = 50


@dataclass(frozen=True)
class Edge:
    """A pairwise (resharding) cost between two nodes' choices."""

    src: int  # node index
    dst: int  # node index
    cost: tuple[tuple[float, ...], ...]  # cost[src_choice][dst_choice], seconds (resharding cost)


@dataclass(frozen=True)
class Problem:
    """One choice per node; minimise node costs + edge costs subject to the memory budget."""

    costs: tuple[tuple[float, ...], ...]  # costs[node][choice]: seconds (compute+comm of that node under that choice)
    memory: tuple[tuple[float, ...], ...]  # memory[node][choice]: bytes per device contributed to the peak
    edges: tuple[Edge, ...]
    memory_budget: float | None = None  # bytes per device; None = unconstrained
    names: tuple[str, ...] | None = None  # node names, for error messages
    warm_start: tuple[int, ...] | None = None  # optional hint: one choice per node


@dataclass(frozen=True)
class Solution:
    """The chosen plan; objective and memory are recomputed from the problem's own data."""

    choices: tuple[int, ...]  # one per node
    objective: float  # seconds: sum of chosen node costs + chosen edge costs
    memory: float  # bytes: sum of chosen node memory
    status: str  # "optimal" or "feasible" (time limit hit, incumbent returned)
    gap: float | None  # relative optimality gap reported by the solver (0 when optimal)
    solve_time_s: float
    num_variables: int
    num_constraints: int


# --------------------------------------------------------------------------- validation


def _error(message: str) -> Exception:
    """An ``AutoparError``, imported late: ``autopar/__init__`` imports the planner, which imports
    this package, so importing ``autopar.errors`` at module level breaks ``import solver``."""
    from autopar.errors import AutoparError

    return AutoparError(message)


@dataclass
class _Data:
    """The problem as validated numpy arrays."""

    costs: list[np.ndarray]  # per node, shape (k,)
    memory: list[np.ndarray]  # per node, shape (k,)
    edges: list[np.ndarray]  # per edge, shape (k_src, k_dst)

    @property
    def k(self) -> list[int]:
        return [len(c) for c in self.costs]

    def min_memory(self) -> float:
        return float(sum(m.min() for m in self.memory))


def _label(problem: Problem, i: int) -> str:
    return f"node {i} ({problem.names[i]!r})" if problem.names is not None else f"node {i}"


def _array(values: object, what: str) -> np.ndarray:
    """Convert to float array; reject NaN, inf and negatives (the model assumes costs >= 0)."""
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise _error(f"{what} must be a (rectangular) sequence of numbers: {exc}") from None
    if not np.isfinite(arr).all():
        raise _error(f"{what} contains NaN or inf; use a large finite value or drop the choice")
    if (arr < 0).any():
        raise _error(f"{what} contains a negative value ({arr.min()}); costs and memory must be >= 0")
    return arr


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _validate(problem: Problem) -> _Data:
    """Raise AutoparError on malformed input, so that solver errors never surface raw."""
    n = len(problem.costs)
    if len(problem.memory) != n:
        raise _error(f"costs has {n} nodes but memory has {len(problem.memory)}")
    if problem.names is not None and len(problem.names) != n:
        raise _error(f"costs has {n} nodes but names has {len(problem.names)}")
    costs, memory = [], []
    for i in range(n):
        c = _array(problem.costs[i], f"costs of {_label(problem, i)}")
        m = _array(problem.memory[i], f"memory of {_label(problem, i)}")
        if c.ndim != 1 or c.size == 0:
            raise _error(f"costs of {_label(problem, i)} must be a non-empty list of per-choice costs")
        if m.shape != c.shape:
            raise _error(f"{_label(problem, i)} has {c.size} cost entries but {m.size} memory entries")
        costs.append(c)
        memory.append(m)
    edges = []
    for j, edge in enumerate(problem.edges):
        for end in (edge.src, edge.dst):
            if not _is_int(end) or not 0 <= end < n:
                raise _error(f"edge {j} refers to node {end!r}; valid node indices are 0..{n - 1}")
        what = f"cost matrix of edge {j} ({_label(problem, edge.src)} -> {_label(problem, edge.dst)})"
        m = _array(edge.cost, what)
        want = (costs[edge.src].size, costs[edge.dst].size)
        if m.shape != want:
            raise _error(f"{what} has shape {m.shape}; expected {want} (src choices x dst choices)")
        edges.append(m)
    budget = problem.memory_budget
    if budget is not None and (
        not isinstance(budget, numbers.Real) or isinstance(budget, bool) or math.isnan(budget) or budget < 0
    ):
        raise _error(f"memory_budget must be a non-negative number of bytes or None, got {budget!r}")
    if problem.warm_start is not None:
        if len(problem.warm_start) != n:
            raise _error(f"warm_start has {len(problem.warm_start)} entries for {n} nodes")
        for i, c in enumerate(problem.warm_start):
            if not _is_int(c) or not 0 <= c < costs[i].size:
                raise _error(
                    f"warm_start gives choice {c!r} for {_label(problem, i)}, which has {costs[i].size} choices"
                )
    return _Data(costs, memory, edges)


def _infeasible(problem: Problem, data: _Data, why: str) -> Exception:
    """The ``InfeasibleError`` that says how far off the budget is and which nodes are to blame."""
    from autopar.errors import InfeasibleError  # late, see _error
    from autopar.units import fmt

    floor = data.min_memory()
    top = sorted(range(len(data.memory)), key=lambda i: (-data.memory[i].min(), i))[:3]
    who = ", ".join(f"{_label(problem, i)}: {fmt(float(data.memory[i].min()), 'B')}" for i in top)
    return InfeasibleError(
        f"{why}: the memory budget is {fmt(float(problem.memory_budget), 'B')} per device, but even the "
        f"lowest-memory choice for every node needs {fmt(float(floor), 'B')}. Largest contributors to that "
        f"minimum: {who}. Raise the budget, use more devices, or shrink the model/batch.",
        min_memory_bytes=floor,
    )


# --------------------------------------------------------------------------- reduction


@dataclass
class _Reduced:
    """The objective after folding everything that does not need pair variables."""

    linear: list[np.ndarray]  # per node: linear cost per choice (may be negative after folding)
    offset: float  # constant term
    pairs: dict[tuple[int, int], np.ndarray]  # (u, v), u < v, both free -> matrix [u_choice, v_choice]


def _reduce(problem: Problem, data: _Data) -> _Reduced:
    k = data.k
    linear = [c.copy() for c in data.costs]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for edge, m in zip(problem.edges, data.edges):
        u, v = edge.src, edge.dst
        if u == v:  # self-loop: both ends take the node's single choice
            linear[u] += np.diag(m)
            continue
        if u > v:
            u, v, m = v, u, m.T
        merged[(u, v)] = merged[(u, v)] + m if (u, v) in merged else m

    pairs: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), m in sorted(merged.items()):
        # m = a[s] + b[d] + r[s, d]; when r vanishes the edge is purely linear.
        a = m[:, 0]
        b = m[0, :] - m[0, 0]
        r = m - a[:, None] - b[None, :]
        if k[u] == 1 or k[v] == 1 or np.abs(r).max() <= _SEPARABLE_RTOL * np.abs(m).max():
            linear[u] = linear[u] + a
            linear[v] = linear[v] + b
        else:
            pairs[(u, v)] = m
    offset = sum(float(linear[i][0]) for i in range(len(k)) if k[i] == 1)
    return _Reduced(linear, offset, pairs)


# --------------------------------------------------------------------------- model building


@dataclass
class _Model:
    proto: model_pb2.ModelProto
    x_ids: dict[int, range]  # free node -> ids of its one-hot variables
    e_ids: dict[tuple[int, int], int]  # pair edge -> id of e[0, 0] (row-major block)


def _build(problem: Problem, data: _Data, red: _Reduced) -> _Model:
    k = data.k
    free = [i for i in range(len(k)) if k[i] > 1]
    proto = model_pb2.ModelProto(name="autopar_sharding")

    x_ids: dict[int, range] = {}
    nxt = 0
    for i in free:
        x_ids[i] = range(nxt, nxt + k[i])
        nxt += k[i]
    num_x = nxt
    e_ids: dict[tuple[int, int], int] = {}
    for u, v in red.pairs:
        e_ids[(u, v)] = nxt
        nxt += k[u] * k[v]

    var = proto.variables
    var.ids.extend(range(nxt))
    var.lower_bounds.extend([0.0] * nxt)
    var.upper_bounds.extend([1.0] * nxt)
    var.integers.extend([True] * num_x + [False] * (nxt - num_x))

    # Objective. Each node's linear costs are shifted by their minimum (folding separable
    # edges can make them negative) and everything is scaled so the largest coefficient is 1:
    # keeps solver tolerances meaningful whether costs are microseconds or seconds.
    offset = red.offset
    blocks: list[tuple[range, np.ndarray]] = []
    for i in free:
        lo = float(red.linear[i].min())
        offset += lo
        blocks.append((x_ids[i], red.linear[i] - lo))
    for (u, v), m in red.pairs.items():
        blocks.append((range(e_ids[(u, v)], e_ids[(u, v)] + m.size), m.ravel()))
    scale = max((float(vals.max()) for _, vals in blocks), default=0.0) or 1.0
    obj = proto.objective.linear_coefficients
    for ids, vals in blocks:
        nz = np.flatnonzero(vals)
        obj.ids.extend([ids[j] for j in nz.tolist()])
        obj.values.extend((vals[nz] / scale).tolist())
    proto.objective.offset = offset / scale
    proto.objective.maximize = False

    # Constraints, emitted row by row with increasing column ids (as the proto requires).
    rows: list[int] = []
    cols: list[int] = []
    coefs: list[float] = []
    lbs: list[float] = []
    ubs: list[float] = []

    def add_row(ids: Sequence[int], vals: Sequence[float], lb: float, ub: float) -> None:
        rows.extend([len(lbs)] * len(ids))
        cols.extend(ids)
        coefs.extend(vals)
        lbs.append(lb)
        ubs.append(ub)

    for i in free:  # one-hot
        add_row(x_ids[i], [1.0] * k[i], 1.0, 1.0)
    for (u, v), base in e_ids.items():  # marginals of the pair variables (x ids < e ids)
        ku, kv = k[u], k[v]
        for s in range(ku):
            add_row([x_ids[u][s], *range(base + s * kv, base + (s + 1) * kv)], [-1.0] + [1.0] * kv, 0.0, 0.0)
        for d in range(kv):
            add_row([x_ids[v][d], *range(base + d, base + ku * kv, kv)], [-1.0] + [1.0] * ku, 0.0, 0.0)

    budget = problem.memory_budget
    if budget is not None and math.isfinite(budget):
        # Only memory above each node's minimum competes for the slack; skip the row when
        # even the most memory-hungry choices fit.
        slack = budget - data.min_memory()
        excess = {i: data.memory[i] - data.memory[i].min() for i in free}
        if sum(float(ex.max()) for ex in excess.values()) > slack:
            mscale = max(float(ex.max()) for ex in excess.values())
            ids: list[int] = []
            vals: list[float] = []
            for i, ex in excess.items():
                nz = np.flatnonzero(ex)
                ids.extend([x_ids[i][j] for j in nz.tolist()])
                vals.extend((ex[nz] / mscale).tolist())
            add_row(ids, vals, -math.inf, slack / mscale)

    proto.linear_constraints.ids.extend(range(len(lbs)))
    proto.linear_constraints.lower_bounds.extend(lbs)
    proto.linear_constraints.upper_bounds.extend(ubs)
    mat = proto.linear_constraint_matrix
    mat.row_ids.extend(rows)
    mat.column_ids.extend(cols)
    mat.coefficients.extend(coefs)
    return _Model(proto, x_ids, e_ids)


# --------------------------------------------------------------------------- hint


def _hint(problem: Problem, data: _Data, red: _Reduced) -> list[int]:
    """A feasible assignment to hand the solver as its first incumbent.

    Start from the warm start (if it fits the budget), else the cheapest choice per node (or
    the lowest-memory one if that breaks the budget), then improve it by coordinate descent:
    move one node at a time to its best choice given its neighbours, within the budget.
    Cheap, and it is what the caller gets back if the solver runs out of time before beating it.
    """
    budget = problem.memory_budget if problem.memory_budget is not None else math.inf
    k = data.k

    def mem(ch: Sequence[int]) -> float:
        return float(sum(data.memory[i][c] for i, c in enumerate(ch)))

    choices = list(problem.warm_start) if problem.warm_start is not None else []
    if not choices or mem(choices) > budget:
        choices = [int(np.argmin(c)) for c in data.costs]
    if mem(choices) > budget:
        choices = [int(np.argmin(m)) for m in data.memory]

    adjacency: dict[int, list[tuple[np.ndarray, int, bool]]] = {i: [] for i in range(len(k)) if k[i] > 1}
    for (u, v), m in red.pairs.items():
        adjacency[u].append((m, v, True))
        adjacency[v].append((m, u, False))
    used = mem(choices)
    for _ in range(_MAX_SWEEPS):
        moved = False
        for i, nbrs in adjacency.items():
            local = red.linear[i].copy()
            for m, j, i_is_src in nbrs:
                local += m[:, choices[j]] if i_is_src else m[choices[j], :]
            fits = used - data.memory[i][choices[i]] + data.memory[i] <= budget
            best = int(np.argmin(np.where(fits, local, np.inf)))
            if local[best] < local[choices[i]] - 1e-12 * abs(local[choices[i]]):
                used += data.memory[i][best] - data.memory[i][choices[i]]
                choices[i] = best
                moved = True
        if not moved:
            break
    return choices


# --------------------------------------------------------------------------- solve


def evaluate(problem: Problem, choices: Sequence[int]) -> tuple[float, float]:
    """(objective seconds, memory bytes) of an assignment, computed from the original data."""
    obj = sum(problem.costs[i][c] for i, c in enumerate(choices))
    obj += sum(e.cost[choices[e.src]][choices[e.dst]] for e in problem.edges)
    mem = sum(problem.memory[i][c] for i, c in enumerate(choices))
    return float(obj), float(mem)


def solve(problem: Problem, time_limit: float | None = None, solver: str = "highs",
          relative_gap: float = 1e-6) -> Solution:
    """Solve the sharding ILP, to within ``relative_gap`` of the optimum.

    ``time_limit`` (seconds) covers the whole call, model building included; the solver may
    overrun it by a second or so on very large models. When it is hit, the best solution
    found so far is returned with ``status="feasible"`` and the solver's gap. Solves that
    finish within the limit are deterministic (fixed seed, deterministic hint).
    """
    start = time.perf_counter()
    if solver not in SOLVERS:
        raise _error(f"unknown solver {solver!r}; valid choices are {sorted(SOLVERS)}")
    if time_limit is not None and not (
        isinstance(time_limit, numbers.Real) and not isinstance(time_limit, bool) and time_limit > 0
    ):
        raise _error(f"time_limit must be a positive number of seconds or None, got {time_limit!r}")
    data = _validate(problem)
    budget = problem.memory_budget
    if budget is not None and data.min_memory() > budget:
        raise _infeasible(problem, data, "No sharding plan fits in memory")

    red = _reduce(problem, data)
    built = _build(problem, data, red)
    hint = _hint(problem, data, red)
    if not built.x_ids:  # every node has a single choice: nothing to decide
        obj, mem = evaluate(problem, hint)
        return Solution(tuple(hint), obj, mem, "optimal", 0.0, time.perf_counter() - start, 0, 0)

    model = mathopt.Model.from_model_proto(built.proto)
    variables = list(model.variables())  # in id order
    # HiGHS (through math_opt) uses a hint only if it sets every variable, pair variables
    # included; a partial hint is silently dropped. SCIP accepts either.
    hint_values = np.zeros(len(variables))
    for i, ids in built.x_ids.items():
        hint_values[ids[hint[i]]] = 1.0
    k = data.k
    for (u, v), base in built.e_ids.items():
        hint_values[base + hint[u] * k[v] + hint[v]] = 1.0
    x_vars = [variables[j] for ids in built.x_ids.values() for j in ids]

    params = mathopt.SolveParameters(
        random_seed=0,  # fixed seed: same problem, same plan
        relative_gap_tolerance=relative_gap,
        absolute_gap_tolerance=1e-9,
    )
    if time_limit is not None:
        remaining = max(time_limit - (time.perf_counter() - start), 0.01)
        params.time_limit = datetime.timedelta(seconds=remaining)
    model_params = mathopt.ModelSolveParameters(
        solution_hints=[mathopt.SolutionHint(variable_values=dict(zip(variables, hint_values.tolist())))],
        variable_values_filter=mathopt.SparseVectorFilter(filtered_items=x_vars),
    )
    result = mathopt.solve(model, SOLVERS[solver], params=params, model_params=model_params)

    reason = result.termination.reason
    TR = mathopt.TerminationReason
    if reason in (TR.INFEASIBLE, TR.INFEASIBLE_OR_UNBOUNDED):
        raise _infeasible(problem, data, f"The {solver} solver reports the problem infeasible")
    if not result.has_primal_feasible_solution():
        if reason == TR.NO_SOLUTION_FOUND:
            raise _error(
                f"The {solver} solver found no sharding plan within time_limit={time_limit} s "
                f"({result.termination.detail or reason.name}); raise time_limit."
            )
        raise _error(f"The {solver} solver failed ({reason.name}): {result.termination.detail}")

    values = result.variable_values()
    choices = list(hint)
    for i, ids in built.x_ids.items():
        # argmax rounds away solver tolerances; first index wins ties.
        choices[i] = int(np.argmax([values[variables[j]] for j in ids]))
    obj, mem = evaluate(problem, choices)
    # The hint fits the budget exactly (checked in floating point, not within a solver
    # tolerance), so fall back to it if the solver's plan is worse or overshoots the budget.
    hint_obj, hint_mem = evaluate(problem, hint)
    if hint_obj < obj or (budget is not None and mem > budget):
        choices, obj, mem = hint, hint_obj, hint_mem

    # "optimal" means within relative_gap of the optimum; the gap reported is the proven one.
    status = "optimal" if reason == TR.OPTIMAL else "feasible"  # else: a limit hit, incumbent in hand
    bounds = result.termination.objective_bounds
    primal, dual = bounds.primal_bound, bounds.dual_bound
    gap = 0.0 if reason == TR.OPTIMAL else None
    if math.isfinite(primal) and math.isfinite(dual):
        gap = abs(primal - dual) / abs(primal) if abs(primal) > 1e-12 else 0.0
        gap = 0.0 if gap < 1e-9 else gap  # float noise of a closed gap
    return Solution(
        choices=tuple(choices),
        objective=obj,
        memory=mem,
        status=status,
        gap=gap,
        solve_time_s=time.perf_counter() - start,
        num_variables=len(built.proto.variables.ids),
        num_constraints=len(built.proto.linear_constraints.ids),
    )

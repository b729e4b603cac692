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

Two optional refinements make the model follow a training step rather than a sum:
``memory_rows`` are moments of the step (end of forward, points of the backward, the optimizer
step), each adding its live bytes on top of ``memory`` (what is live throughout), and
``transient`` is each node's short-lived working memory, of which the largest counts once (an
auxiliary variable ``T``): the peak is ``memory + max(0, max_r row_r) + max_i transient_i``.
``exposed_rows`` model communication that runs under compute: the objective adds
``max(0, max_r row_r)`` (an auxiliary variable ``E``), where a row is queued communication minus
the compute left to hide it.

Before building the model we shrink it: parallel edges are merged; edges touching a
single-choice node, and edges whose matrix is additively separable
(``M[s, d] = a[s] + b[d]``, which covers constant and all-zero matrices), are folded into
the endpoints' linear costs, so only genuinely pairwise edges get ``e`` variables. Those are
over classes of choices, not choices: choices whose rows (columns) of the remaining matrix are
equal share one class (many strategies of an op put a tensor in the same placement, and the
edge only sees the placement), with marginals ``sum_d e[p, d] = sum_{s in p} x_src[s]``. This
is exact for integral ``x`` as before, has the same LP relaxation, and needs 2.5x fewer
variables on 3-D meshes. An edge may also come as a sum of ``Term``s, each seeing only a class of
each end's choice (a move along one mesh axis sees that axis of the placements); each term then
gets its own pair variables over its own classes. Still exact for integral ``x`` (each term's
marginals force its outer product), with a weaker LP relaxation but far fewer variables: GPT 13B
on a 4x2x8 mesh goes from 0.61M pair variables to 29k. An edge is paired term by term only where
that saves at least ``_TERMS_MIN_SAVING``x the variables (3-D meshes); elsewhere (2-D, ~2.5x) the
tighter whole-edge pairing proves optimality sooner.
Single-choice nodes get no variables at all.

The relaxation is solved first (``_relaxed``): where its one-hot variables come out integral,
that is the optimum, in about half the MIP's time; else the MIP runs.

The model is built as a ``ModelProto`` with numpy and handed to math_opt's solver as is (``_run``):
its Python ``Model`` adds, exports and hints ~10^5 variables one at a time, seconds per solve. (We use math_opt rather than pywraplp because pywraplp drops the HiGHS
incumbent when the time limit is hit.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
from ortools.math_opt import model_parameters_pb2, model_pb2, result_pb2, solution_pb2
from ortools.math_opt.python import mathopt
from pybind11_abseil.status import StatusNotOk

from solver.apart import solve_apart, solve_proto
from solver.errors import InfeasibleProblem, MemoryHog, SolverError, SolverTimeout

__all__ = ["Edge", "Term", "Row", "Problem", "Solution", "solve", "evaluate", "restrict", "SOLVERS", "SolverName"]

#: Accepted values of ``solve(..., solver=...)``.
SolverName = Literal["highs", "scip"]
SOLVERS: dict[SolverName, mathopt.SolverType] = {
    "highs": mathopt.SolverType.HIGHS,
    "scip": mathopt.SolverType.GSCIP,
}

# An edge whose matrix minus its best separable fit is below this (relative to the matrix's
# largest entry) is folded into linear costs: the difference is far below solver tolerances.
_SEPARABLE_RTOL = 1e-12
# An edge given as terms is paired term by term only when that needs this many times fewer
# variables than pairing its whole matrix: the per-term LP relaxation is weaker (measured: 2-D
# meshes, 2.5x fewer variables per term, proved optimality slower; 3-D, 21x fewer, far faster).
_TERMS_MIN_SAVING = 4
# Local search sweeps used to polish the solution hint (each sweep visits every node once).
_MAX_SWEEPS = 50
#: A MIP of this many variables or more, solved under a time limit, is solved in a process of its
#: own and stopped at the limit (``solver.apart``): HiGHS overran an 11 s limit by 34 s at 0.7M, and
#: a 13 s limit by 15 s at 103k (Mixtral 8x7B on 8x8).
APART_VARIABLES = 50_000
#: Under a time limit, a model of this many variables or more goes straight to its MIP apart: its
#: root LP is most of that solve's time, and a relaxation tried here first could not be stopped.
RELAX_HERE_VARIABLES = 200_000
#: Seconds a solve apart may take past its time limit before it is stopped (the child's start, the
#: solver's own stop).
APART_GRACE_S = 0.5
#: The share of a limited solve's time its relaxation may take: where it is fractional or cut
#: short, the MIP has the rest (a fractional one took 1.3 of the 2.7 s llama-tiny's auto plan had
#: on 2x2 at 4 x 16 tokens, whose MIP needs minutes to close).
_RELAXATION_SHARE = 0.25
#: How far from 0 or 1 a one-hot variable of the LP relaxation may be and still count as integral
#: (HiGHS's own integrality tolerance is 1e-6).
_INTEGRAL_TOL = 1e-7


@dataclass(frozen=True)
class Term:
    """A summand of an edge's cost that depends only on a class of each end's choice:
    ``core[rows[s], cols[d]]`` (e.g. the move along one mesh axis, which sees one axis of the
    placements)."""

    rows: Sequence[int] | np.ndarray  # per source choice: its class
    cols: Sequence[int] | np.ndarray  # per destination choice: its class
    core: Sequence[Sequence[float]] | np.ndarray  # [row class][column class], seconds

    def transposed(self) -> "Term":
        """The same summand seen from the other end of the edge."""
        return Term(self.cols, self.rows, np.asarray(self.core).T)


@dataclass(frozen=True)
class Edge:
    """A pairwise (resharding) cost between two nodes' choices."""

    src: int  # node index
    dst: int  # node index
    cost: Sequence[Sequence[float]] | np.ndarray  # cost[src_choice][dst_choice], seconds (resharding cost)
    # Optionally ``cost`` as a sum of terms; the solver then pairs each term's few classes, not
    # the choices (``cost`` itself still prices plans).
    terms: tuple[Term, ...] | None = None


@dataclass(frozen=True)
class Row:
    """A linear function of the choices: per-choice node terms and a constant."""

    nodes: tuple[tuple[int, tuple[float, ...]], ...] = ()  # (node, value per choice)
    constant: float = 0.0


@dataclass(frozen=True)
class Problem:
    """One choice per node; minimise node costs + edge costs (+ exposed communication) subject to
    the memory budget holding at every moment of the step (see the module docstring)."""

    costs: tuple[tuple[float, ...], ...]  # costs[node][choice]: seconds (compute+comm of that node under that choice)
    memory: tuple[tuple[float, ...], ...]  # memory[node][choice]: bytes per device contributed to the peak
    edges: tuple[Edge, ...]
    memory_budget: float | None = None  # bytes per device; None = unconstrained
    names: tuple[str, ...] | None = None  # node names, for error messages
    warm_start: tuple[int, ...] | None = None  # optional hint: one choice per node
    memory_rows: tuple[Row, ...] = ()  # bytes live at moments of the step, on top of memory (node terms only)
    transient: tuple[tuple[float, ...], ...] | None = None  # per node per choice: working bytes; max counts
    exposed_rows: tuple[Row, ...] = ()  # seconds; objective += max(0, max over rows)


@dataclass(frozen=True)
class Solution:
    """The chosen plan; objective and memory are recomputed from the problem's own data."""

    choices: tuple[int, ...]  # one per node
    objective: float  # seconds: chosen node costs + chosen edge costs + exposed communication
    memory: float  # bytes: the peak (see the module docstring)
    status: str  # "optimal" or "feasible" (a limit hit, incumbent returned)
    gap: float | None  # relative optimality gap reported by the solver (0 when optimal)
    solve_time_s: float
    num_variables: int
    num_constraints: int
    num_choices: int = 0  # choices over all nodes: the problem's size
    simplex_iterations: int = 0  # the solver's work, counted: the same problem and limits give the same counts
    nodes: int = 0  # branch-and-bound nodes explored
    stopped_by: Literal["nodes", "time", None] = None  # the limit that ended a solve short of the gap


# --------------------------------------------------------------------------- validation


@dataclass
class _Data:
    """The problem as validated numpy arrays."""

    costs: list[np.ndarray]  # per node, shape (k,)
    memory: list[np.ndarray]  # per node, shape (k,)
    edges: list[np.ndarray]  # per edge, shape (k_src, k_dst)
    terms: list[list[Term]]  # per edge: its terms as arrays (one term of the whole matrix if none given)
    memory_rows: list[dict[int, np.ndarray]]  # per row: node -> extra bytes per choice
    transient: list[np.ndarray] | None  # per node, shape (k,)
    exposed: list[tuple[dict[int, np.ndarray], float]]  # (node terms, constant)

    @property
    def k(self) -> list[int]:
        return [len(c) for c in self.costs]

    def moment(self, r: int, i: int) -> np.ndarray:
        """Bytes node ``i`` holds per choice at moment ``r`` (0: always-live memory only)."""
        extra = self.memory_rows[r - 1].get(i) if r else None
        return self.memory[i] if extra is None else self.memory[i] + extra

    def least_at_worst_moment(self, allowed: Sequence[Sequence[int] | None] | None = None) -> list[float]:
        """Each node's least bytes at the moment whose least total is largest: the moment that
        sets ``min_memory``, and what each node holds then (activations kept for the backward
        count at the backward's start, not only at their op). ``allowed``: as ``restrict``'s."""
        keep = _kept(allowed, len(self.memory))
        moments = [[float(self.moment(r, i)[keep[i]].min()) for i in range(len(self.memory))]
                   for r in range(len(self.memory_rows) + 1)]
        return max(moments, key=sum)

    def min_memory(self, allowed: Sequence[Sequence[int] | None] | None = None) -> float:
        """A lower bound of the peak over all assignments (exact without rows and transients),
        or over those ``allowed`` permits (``restrict``)."""
        keep = _kept(allowed, len(self.memory))
        work = max((float(t[keep[i]].min()) for i, t in enumerate(self.transient)), default=0.0) \
            if self.transient else 0.0
        return sum(self.least_at_worst_moment(allowed)) + work

    def peak(self, choices: Sequence[int]) -> float:
        moments = [sum(float(self.moment(r, i)[c]) for i, c in enumerate(choices))
                   for r in range(len(self.memory_rows) + 1)]
        work = max((float(t[c]) for t, c in zip(self.transient, choices, strict=True)), default=0.0) if self.transient else 0.0
        return max(moments) + work

    def restricted(self, keep: list[np.ndarray], ends: Sequence[tuple[int, int]]) -> "_Data":
        """These arrays limited to node ``i``'s choices ``keep[i]``, renumbered as ``restrict``
        does (``ends``: each edge's source and destination); terms keep their cores."""
        def row(nodes: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
            return {i: v[keep[i]] for i, v in nodes.items()}

        return _Data(
            costs=[c[keep[i]] for i, c in enumerate(self.costs)],
            memory=[m[keep[i]] for i, m in enumerate(self.memory)],
            edges=[m[keep[u]][:, keep[v]] for m, (u, v) in zip(self.edges, ends, strict=True)],
            terms=[[Term(np.asarray(t.rows)[keep[u]], np.asarray(t.cols)[keep[v]], t.core) for t in ts]
                   for ts, (u, v) in zip(self.terms, ends, strict=True)],
            memory_rows=[row(r) for r in self.memory_rows],
            transient=None if self.transient is None else [t[keep[i]] for i, t in enumerate(self.transient)],
            exposed=[(row(nodes), constant) for nodes, constant in self.exposed],
        )

    def as_problem(self, like: Problem) -> Problem:
        """``like`` (its edges' ends, names, budget, warm start) over these arrays."""
        def row(nodes: dict[int, np.ndarray], constant: float = 0.0) -> Row:
            return Row(tuple((i, cast(tuple, v)) for i, v in nodes.items()), constant)

        return dataclasses.replace(
            like, costs=cast(tuple, tuple(self.costs)), memory=cast(tuple, tuple(self.memory)),
            edges=tuple(Edge(e.src, e.dst, m, tuple(ts)) for e, m, ts in zip(like.edges, self.edges, self.terms, strict=True)),
            memory_rows=tuple(row(r) for r in self.memory_rows),
            transient=None if self.transient is None else cast(tuple, tuple(self.transient)),
            exposed_rows=tuple(row(nodes, constant) for nodes, constant in self.exposed))

    def exposed_time(self, choices: Sequence[int]) -> float:
        """max(0, max over exposed rows) for an assignment."""
        return max([0.0, *(constant + sum(float(v[choices[i]]) for i, v in nodes.items())
                           for nodes, constant in self.exposed)])


def _kept(allowed: Sequence[Sequence[int] | None] | None, n: int) -> list[slice | np.ndarray]:
    """Per node, the index of its allowed choices (all where ``allowed`` is None)."""
    if allowed is None:
        return [slice(None)] * n
    return [slice(None) if a is None else np.asarray(a, dtype=int) for a in allowed]


class MemoryBounds:
    """Lower bounds of a problem's memory, over all assignments or over a restriction of them,
    from one validation (hand plans restrict one problem many times)."""

    def __init__(self, problem: Problem) -> None:
        self._problem = problem
        self._data = _validate(problem)

    def data_of(self, problem: Problem) -> _Data | None:
        """``problem``'s validated arrays from these, where it shares this problem's node and edge
        data (``dataclasses.replace`` of it: another budget, warm start or memory rows), else None."""
        mine = self._problem
        if not (problem.costs is mine.costs and problem.memory is mine.memory and problem.edges is mine.edges
                and problem.transient is mine.transient):
            return None
        _validate_budget_and_start(problem, self._data.costs)
        if problem.memory_rows is mine.memory_rows and problem.exposed_rows is mine.exposed_rows:
            return self._data
        memory_rows, exposed = _validated_rows(problem, self._data.k)
        return dataclasses.replace(self._data, memory_rows=memory_rows, exposed=exposed)

    def least(self, allowed: Sequence[Sequence[int] | None] | None = None) -> float:
        """The least peak any assignment (``allowed``: as ``restrict``'s) needs: ``solve``
        refuses a budget below it."""
        return self._data.min_memory(allowed)

    def quietest(self) -> float:
        """The quietest moment of the memory rows: the state, and what every moment of the step
        holds on top of it (the state alone without rows)."""
        data = self._data
        return min(sum(float(data.moment(r, i).min()) for i in range(len(data.memory)))
                   for r in range(min(1, len(data.memory_rows)), len(data.memory_rows) + 1))


def memory_bounds(problem: Problem) -> tuple[float, float]:
    """``MemoryBounds``' least peak and quietest moment of ``problem``."""
    bounds = MemoryBounds(problem)
    return bounds.least(), bounds.quietest()


def _label(problem: Problem, i: int) -> str:
    return f"node {i} ({problem.names[i]!r})" if problem.names is not None else f"node {i}"


def _array(values: object, what: str, signed: bool = False) -> np.ndarray:
    """Convert to float array; reject NaN, inf and (unless ``signed``) negatives."""
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise SolverError(f"{what} must be a (rectangular) sequence of numbers: {exc}") from None
    if not np.isfinite(arr).all():
        raise SolverError(f"{what} contains NaN or inf; use a large finite value or drop the choice")
    if not signed and (arr < 0).any():
        raise SolverError(f"{what} contains a negative value ({arr.min()}); costs and memory must be >= 0")
    return arr


def _row(problem: Problem, row: Row, what: str, k: list[int]) -> tuple[dict[int, np.ndarray], float]:
    """A row's node terms (summed per node, signed) and constant, validated."""
    nodes: dict[int, np.ndarray] = {}
    for i, values in row.nodes:
        if not _is_int(i) or not 0 <= i < len(k):
            raise SolverError(f"{what} refers to node {i!r}; valid node indices are 0..{len(k) - 1}")
        v = _array(values, f"{what}, {_label(problem, i)}", signed=True)
        if v.shape != (k[i],):
            raise SolverError(f"{what} gives {v.size} values for {_label(problem, i)}, which has {k[i]} choices")
        nodes[i] = nodes[i] + v if i in nodes else v
    return nodes, float(row.constant)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _validate(problem: Problem) -> _Data:
    """Raise AutoparError on malformed input, so that solver errors never surface raw."""
    costs, memory = _validated_nodes(problem)
    edges, terms = _validated_edges(problem, costs)
    _validate_budget_and_start(problem, costs)
    k = [c.size for c in costs]
    memory_rows, exposed = _validated_rows(problem, k)
    return _Data(costs, memory, edges, terms, memory_rows, _validated_transient(problem, k), exposed)


def _validated_rows(problem: Problem, k: list[int]
                    ) -> tuple[list[dict[int, np.ndarray]], list[tuple[dict[int, np.ndarray], float]]]:
    """The memory rows' node terms and the exposed rows (node terms, constant), validated."""
    memory_rows = []
    for r, row in enumerate(problem.memory_rows):
        nodes, constant = _row(problem, row, f"memory row {r}", k)
        if constant:
            raise SolverError(f"memory row {r} may only have node terms")
        memory_rows.append(nodes)
    return memory_rows, [_row(problem, row, f"exposed row {r}", k) for r, row in enumerate(problem.exposed_rows)]


def _validated_nodes(problem: Problem) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each node's per-choice costs and memory, as arrays of one shape."""
    n = len(problem.costs)
    if len(problem.memory) != n:
        raise SolverError(f"costs has {n} nodes but memory has {len(problem.memory)}")
    if problem.names is not None and len(problem.names) != n:
        raise SolverError(f"costs has {n} nodes but names has {len(problem.names)}")
    costs, memory = [], []
    for i in range(n):
        c = _array(problem.costs[i], f"costs of {_label(problem, i)}")
        m = _array(problem.memory[i], f"memory of {_label(problem, i)}")
        if c.ndim != 1 or c.size == 0:
            raise SolverError(f"costs of {_label(problem, i)} must be a non-empty list of per-choice costs")
        if m.shape != c.shape:
            raise SolverError(f"{_label(problem, i)} has {c.size} cost entries but {m.size} memory entries")
        costs.append(c)
        memory.append(m)
    return costs, memory


def _validated_edges(problem: Problem, costs: list[np.ndarray]) -> tuple[list[np.ndarray], list[list[Term]]]:
    """Each edge's cost matrix (src choices x dst choices) and its terms."""
    n = len(costs)
    edges, terms = [], []
    for j, edge in enumerate(problem.edges):
        for end in (edge.src, edge.dst):
            if not _is_int(end) or not 0 <= end < n:
                raise SolverError(f"edge {j} refers to node {end!r}; valid node indices are 0..{n - 1}")
        what = f"cost matrix of edge {j} ({_label(problem, edge.src)} -> {_label(problem, edge.dst)})"
        m = _array(edge.cost, what)
        want = (costs[edge.src].size, costs[edge.dst].size)
        if m.shape != want:
            raise SolverError(f"{what} has shape {m.shape}; expected {want} (src choices x dst choices)")
        edges.append(m)
        terms.append([_term(t, want, f"term {n} of the {what}") for n, t in enumerate(edge.terms)]
                     if edge.terms is not None else [Term(np.arange(want[0]), np.arange(want[1]), m)])
    return edges, terms


def _validate_budget_and_start(problem: Problem, costs: list[np.ndarray]) -> None:
    budget = problem.memory_budget
    if budget is not None and (
        not isinstance(budget, numbers.Real) or isinstance(budget, bool) or math.isnan(budget) or budget < 0
    ):
        raise SolverError(f"memory_budget must be a non-negative number of bytes or None, got {budget!r}")
    if problem.warm_start is None:
        return
    if len(problem.warm_start) != len(costs):
        raise SolverError(f"warm_start has {len(problem.warm_start)} entries for {len(costs)} nodes")
    for i, c in enumerate(problem.warm_start):
        if not _is_int(c) or not 0 <= c < costs[i].size:
            raise SolverError(f"warm_start gives choice {c!r} for {_label(problem, i)}, which has {costs[i].size} choices")


def _validated_transient(problem: Problem, k: list[int]) -> list[np.ndarray] | None:
    if problem.transient is None:
        return None
    if len(problem.transient) != len(k):
        raise SolverError(f"costs has {len(k)} nodes but transient has {len(problem.transient)}")
    transient = [_array(t, f"transient of {_label(problem, i)}") for i, t in enumerate(problem.transient)]
    for i, t in enumerate(transient):
        if t.shape != (k[i],):
            raise SolverError(f"transient of {_label(problem, i)} has {t.size} entries for {k[i]} choices")
    return transient


def _term(term: Term, shape: tuple[int, int], what: str) -> Term:
    core = _array(term.core, what, signed=True)
    rows, cols = np.asarray(term.rows, dtype=np.intp), np.asarray(term.cols, dtype=np.intp)
    if core.ndim != 2 or rows.shape != (shape[0],) or cols.shape != (shape[1],):
        raise SolverError(f"{what}: expected a class per choice ({shape[0]} rows, {shape[1]} columns) and a 2-D core")
    if rows.min() < 0 or rows.max() >= core.shape[0] or cols.min() < 0 or cols.max() >= core.shape[1]:
        raise SolverError(f"{what}: a class number is outside its core of shape {core.shape}")
    return Term(rows, cols, core)


def _infeasible(problem: Problem, data: _Data, why: str) -> InfeasibleProblem:
    """Say how far off the budget is and which nodes are to blame: the largest holders at the
    moment that sets the least peak."""
    held = data.least_at_worst_moment()
    top = sorted(range(len(held)), key=lambda i: (-held[i], i))[:3]
    return InfeasibleProblem(why, float(problem.memory_budget), float(data.min_memory()),
                             [MemoryHog(_label(problem, i), held[i]) for i in top])


# --------------------------------------------------------------------------- reduction


@dataclass(frozen=True)
class _Pair:
    """A genuinely pairwise term of the edge (u, v), its separable part folded away, over classes
    of the choices: one pair variable per (row class, column class)."""

    u: int
    v: int
    rows: np.ndarray  # per u choice: its row class
    cols: np.ndarray  # per v choice: its column class
    core: np.ndarray  # [row class, column class]

    @classmethod
    def of(cls, u: int, v: int, term: Term, classes: dict[int | tuple, tuple] | None = None) -> "_Pair":
        """Classes of the term's own classes whose rows (columns) are equal to within the
        folding tolerance (rounding noise of one placement's cost is one placement), unused
        ones dropped. ``classes``: those of each core already seen (identical layers' edges
        share their cores), by the core's id, with the core kept so that the id stays its."""
        term_rows, term_cols, core = _arrays(term)
        whole_key = (id(term.core), term_rows.tobytes(), term_cols.tobytes())
        if classes is not None and whole_key in classes:
            _, rows, cols, core = classes[whole_key]
            return cls(u, v, rows, cols, core)
        cached = classes.get(id(term.core)) if classes is not None else None
        if cached is None:
            cached = (term.core, *_core_classes(core))
            if classes is not None:
                classes[id(term.core)] = cached
        _, first_rows, row_of, first_cols, col_of = cached
        used_rows, rows = np.unique(row_of.ravel()[term_rows], return_inverse=True)
        used_cols, cols = np.unique(col_of.ravel()[term_cols], return_inverse=True)
        pair = cls(u, v, rows.ravel(), cols.ravel(), core[np.ix_(first_rows[used_rows], first_cols[used_cols])])
        if classes is not None:
            classes[whole_key] = (term.core, pair.rows, pair.cols, pair.core)
        return pair

    def column(self, d: int) -> np.ndarray:
        """Cost per u choice with v at choice ``d``."""
        return self.core[self.rows, self.cols[d]]

    def row(self, s: int) -> np.ndarray:
        """Cost per v choice with u at choice ``s``."""
        return self.core[self.rows[s], self.cols]


#: ``_core_classes`` of the cores seen, by content: the hand plans and repairs solve restrictions of
#: one problem, whose cores are new arrays of the same values (bounded: cleared when full)
_CORE_CLASSES: dict[tuple, tuple[np.ndarray, ...]] = {}
_CORE_CLASSES_MAX = 1 << 14


def _core_classes(core: np.ndarray) -> tuple[np.ndarray, ...]:
    """A core's row classes and column classes (rows, columns equal to within the folding
    tolerance: rounding noise of one placement's cost is one placement), as ``np.unique`` gives
    them: (first row of each, class of each row, first column of each, class of each column)."""
    key = np.round(core / (np.abs(core).max() * _SEPARABLE_RTOL * 10), 0)
    content = (key.shape, key.tobytes())
    found = _CORE_CLASSES.get(content)
    if found is None:
        _, first_rows, row_of = np.unique(key, axis=0, return_index=True, return_inverse=True)
        _, first_cols, col_of = np.unique(key, axis=1, return_index=True, return_inverse=True)
        if len(_CORE_CLASSES) >= _CORE_CLASSES_MAX:
            _CORE_CLASSES.clear()
        found = _CORE_CLASSES[content] = (first_rows, row_of, first_cols, col_of)
    return found


@dataclass
class _Reduced:
    """The objective after folding everything that does not need pair variables."""

    linear: list[np.ndarray]  # per node: linear cost per choice (may be negative after folding)
    offset: float  # constant term
    pairs: list[_Pair]  # both ends free, u < v


def _reduce(problem: Problem, data: _Data) -> _Reduced:
    k = data.k
    linear = [c.copy() for c in data.costs]
    merged: dict[tuple[int, int], dict[tuple, Term]] = {}   # per edge: its terms, by class partition
    for edge, m, terms in zip(problem.edges, data.edges, data.terms, strict=True):
        u, v = edge.src, edge.dst
        if u == v:  # self-loop: both ends take the node's single choice
            linear[u] += np.diag(m)
            continue
        if u > v:
            u, v, terms = v, u, [t.transposed() for t in terms]
        same = merged.setdefault((u, v), {})
        for t in terms:   # parallel edges' terms over the same classes add up
            rows, cols, core = _arrays(t)
            key = (core.shape, rows.tobytes(), cols.tobytes())
            same[key] = Term(rows, cols, np.asarray(same[key].core) + core) if key in same else t

    pairs: list[_Pair] = []
    classes: dict[int | tuple, tuple] = {}   # per residual core: its row and column classes (``_Pair.of``)
    split: dict[tuple[int, int, int], tuple] = {}   # per (core, anchor): its split, the core kept (its id stays its)
    for (u, v), by_classes in sorted(merged.items()):
        residuals = []
        for t in by_classes.values():
            # core = a[p] + b[q] + r[p, q], anchored at the first choices' classes; when r
            # vanishes the term is purely linear. Identical layers' edges share cores and anchors.
            rows, cols, core = _arrays(t)
            r0, c0 = int(rows[0]), int(cols[0])
            anchor = (id(core), r0, c0)
            if anchor not in split:
                a = core[:, c0]
                b = core[r0, :] - core[r0, c0]
                r = core - a[:, None] - b[None, :]
                split[anchor] = (core, a, b, r, np.abs(r).max() > _SEPARABLE_RTOL * np.abs(core).max())
            _, a, b, r, pairwise = split[anchor]
            linear[u] = linear[u] + a[rows]
            linear[v] = linear[v] + b[cols]
            if k[u] > 1 and k[v] > 1 and pairwise:
                residuals.append(Term(rows, cols, r))
        pairs.extend(_pairs(u, v, residuals, classes))
    offset = sum(float(linear[i][0]) for i in range(len(k)) if k[i] == 1)
    return _Reduced(linear, offset, pairs)


def _arrays(t: Term) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A term's rows, columns and core as arrays: within the solver they are already (``_Data.terms``),
    and ``np.asarray`` returns the same objects, whose ids key the caches of cores."""
    return np.asarray(t.rows), np.asarray(t.cols), np.asarray(t.core)


def _pairs(u: int, v: int, residuals: list[Term], classes: dict[int | tuple, tuple]) -> list[_Pair]:
    """Pair variables for an edge's non-separable terms: per term, unless pairing their sum
    needs at most ``_TERMS_MIN_SAVING`` times as many variables (its LP relaxation is tighter)."""
    split = [_Pair.of(u, v, t, classes) for t in residuals]
    if len(split) < 2:
        return split
    whole = cast(np.ndarray, sum(core[np.ix_(rows, cols)] for rows, cols, core in map(_arrays, residuals)))
    if np.abs(whole).max() <= _SEPARABLE_RTOL * max(np.abs(t.core).max() for t in residuals):
        return []   # the terms' residuals cancel
    pair = _Pair.of(u, v, Term(np.arange(whole.shape[0]), np.arange(whole.shape[1]), whole))
    return [pair] if pair.core.size <= _TERMS_MIN_SAVING * sum(p.core.size for p in split) else split


# --------------------------------------------------------------------------- model building


@dataclass
class _Model:
    proto: model_pb2.ModelProto
    x_ids: dict[int, range]  # free node -> ids of its one-hot variables
    e_ids: list[int]  # per pair (``_Reduced.pairs``): id of e[0, 0] (row-major block over its classes)
    t_id: int | None  # largest transient, in units of t_scale bytes
    t_scale: float
    exposed_id: int | None  # exposed communication, seconds
    budget_binds: bool = False  # memory rows were added: some moment's worst case exceeds the budget


class _Builder:
    """The ILP as a math_opt model proto, added part by part (as autoparallel's optimizer adds its
    variables and constraints). Variables are numbered in the order added and constraint rows
    written with increasing column ids, as the proto requires, so the parts go in this order:
    ``add_node_choices``, ``add_edge_costs``, ``add_memory_constraint``,
    ``add_exposed_communication``; then ``add_objective`` and ``model``.

    Costs are shifted and scaled (``scale``: the largest coefficient becomes 1) so that solver
    tolerances mean the same whether costs are microseconds or seconds; memory likewise by
    ``mscale``.
    """

    def __init__(self, problem: Problem, data: _Data, red: _Reduced) -> None:
        self.problem, self.data, self.red = problem, data, red
        self.proto = model_pb2.ModelProto(name="autopar_sharding")
        self.free = [i for i in range(len(data.k)) if data.k[i] > 1]
        self.x_ids: dict[int, range] = {}
        self.e_ids: list[int] = []
        self.t_id: int | None = None
        self.exposed_id: int | None = None
        self.budget_binds = False
        self.mscale = 1.0
        self.offset = red.offset   # the objective's constant, before scaling
        self.costs: list[tuple[range, np.ndarray]] = []   # (variable ids, their costs), before scaling
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.coefs: list[float] = []
        self.lbs: list[float] = []
        self.ubs: list[float] = []

    # ------------------------------------------------------------------ low-level

    def _variables(self, count: int, upper: float, integer: bool) -> int:
        """Add ``count`` variables in [0, ``upper``]; the id of the first."""
        var = self.proto.variables
        first = len(var.ids)
        var.ids.extend(range(first, first + count))
        var.lower_bounds.extend([0.0] * count)
        var.upper_bounds.extend([upper] * count)
        var.integers.extend([integer] * count)
        return first

    def _row(self, ids: Sequence[int], vals: Sequence[float], lb: float, ub: float) -> None:
        """Add the constraint ``lb <= sum(vals * x[ids]) <= ub`` (``ids`` increasing)."""
        self.rows.extend([len(self.lbs)] * len(ids))
        self.cols.extend(ids)
        self.coefs.extend(vals)
        self.lbs.append(lb)
        self.ubs.append(ub)

    def _sparse(self, terms: dict[int, float], lb: float, ub: float) -> None:
        """``_row`` of the nonzero ``{id: coefficient}`` terms, in id order."""
        ids = sorted(j for j, c in terms.items() if c != 0.0)
        self._row(ids, [terms[j] for j in ids], lb, ub)

    @property
    def scale(self) -> float:
        """The largest node or pair cost (1 if none): costs are divided by it."""
        return max((float(vals.max()) for _, vals in self.costs), default=0.0) or 1.0

    # ------------------------------------------------------------------ parts

    def add_node_choices(self) -> None:
        """One binary per choice of each free node, exactly one of them set. Each node's linear
        costs are shifted by their minimum (folding separable edges can make them negative)."""
        for i in self.free:
            first = self._variables(self.data.k[i], 1.0, True)
            self.x_ids[i] = range(first, first + self.data.k[i])
        for i in self.free:
            lo = float(self.red.linear[i].min())
            self.offset += lo
            self.costs.append((self.x_ids[i], self.red.linear[i] - lo))
        for i in self.free:
            self._row(self.x_ids[i], [1.0] * self.data.k[i], 1.0, 1.0)

    def add_edge_costs(self) -> None:
        """Per pair of an edge's classes (``_Reduced.pairs``) a variable in [0, 1] with the pair's
        cost, whose marginals equal the classes' choice variables (x ids < e ids)."""
        for pair in self.red.pairs:
            self.e_ids.append(self._variables(pair.core.size, 1.0, False))
        for pair, base in zip(self.red.pairs, self.e_ids, strict=True):
            self.costs.append((range(base, base + pair.core.size), pair.core.ravel()))
        for pair, base in zip(self.red.pairs, self.e_ids, strict=True):
            self._pair_marginals(pair, base)

    def _pair_marginals(self, pair: _Pair, base: int) -> None:
        """Row ``p`` of the pair block sums to the source's class ``p``; column ``q`` to the destination's."""
        nu, nv = pair.core.shape
        for p in range(nu):
            xs = [self.x_ids[pair.u][c] for c in np.flatnonzero(pair.rows == p).tolist()]
            self._row([*xs, *range(base + p * nv, base + (p + 1) * nv)], [-1.0] * len(xs) + [1.0] * nv, 0.0, 0.0)
        for q in range(nv):
            xs = [self.x_ids[pair.v][c] for c in np.flatnonzero(pair.cols == q).tolist()]
            self._row([*xs, *range(base + q, base + nu * nv, nv)], [-1.0] * len(xs) + [1.0] * nu, 0.0, 0.0)

    def add_memory_constraint(self) -> None:
        """Per moment whose worst case could exceed the budget: the memory above each node's
        minimum, plus the largest transient ``T``, within the slack the minimums leave."""
        binding = _binding_moments(self.problem, self.data)
        if not binding:
            return
        self.budget_binds = True
        data = self.data
        # Only memory above each node's minimum competes for the slack of each moment.
        self.mscale = max(float(data.moment(r, i).max()) for r in binding for i in range(len(data.k))) or 1.0
        if data.transient is not None:
            self.t_id = self._variables(1, math.inf, False)   # largest transient (bytes)
            self._add_largest_transient(self.t_id)
        budget = self.problem.memory_budget
        for r in binding:
            terms: dict[int, float] = {}
            floor = 0.0
            for i in range(len(data.k)):
                vec = data.moment(r, i)
                floor += float(vec.min())
                if i in self.x_ids:
                    excess = (vec - vec.min()) / self.mscale
                    terms.update((self.x_ids[i][c], float(excess[c])) for c in np.flatnonzero(excess).tolist())
            if self.t_id is not None:
                terms[self.t_id] = 1.0
            self._sparse(terms, -math.inf, (budget - floor) / self.mscale)

    def _add_largest_transient(self, t_id: int) -> None:
        """``T`` (variable ``t_id``) >= the transient of each free node's chosen strategy, and of
        every fixed node."""
        fixed_work = 0.0
        for i in range(len(self.data.k)):
            transient = self.data.transient[i]
            if i in self.x_ids:
                self._sparse({**dict(zip(self.x_ids[i], (transient / self.mscale).tolist(), strict=True)), t_id: -1.0},
                             -math.inf, 0.0)
            else:
                fixed_work = max(fixed_work, float(transient[0]))
        self.proto.variables.lower_bounds[t_id] = fixed_work / self.mscale

    def add_exposed_communication(self) -> None:
        """``E`` (seconds, in the objective) >= each row's queued communication minus the compute
        that hides it."""
        if not self.data.exposed:
            return
        self.exposed_id = exposed_id = self._variables(1, math.inf, False)
        scale = self.scale
        for nodes, constant in self.data.exposed:
            terms: dict[int, float] = {}
            for i, v in nodes.items():
                if i in self.x_ids:
                    terms.update(zip(self.x_ids[i], v.tolist(), strict=True))
                else:
                    constant += float(v[0])
            terms[exposed_id] = -1.0
            self._sparse({j: c / scale for j, c in terms.items()}, -math.inf, -constant / scale)

    def add_objective(self) -> None:
        """Minimise the node and pair costs plus ``E``, scaled."""
        scale = self.scale
        obj = self.proto.objective.linear_coefficients
        for ids, vals in self.costs:
            nz = np.flatnonzero(vals)
            obj.ids.extend([ids[j] for j in nz.tolist()])
            obj.values.extend((vals[nz] / scale).tolist())
        if self.exposed_id is not None:
            obj.ids.append(self.exposed_id)
            obj.values.append(1.0 / scale)
        self.proto.objective.offset = self.offset / scale
        self.proto.objective.maximize = False

    def model(self) -> _Model:
        """The proto with the constraints added so far, and where its variables are."""
        proto = self.proto
        proto.linear_constraints.ids.extend(range(len(self.lbs)))
        proto.linear_constraints.lower_bounds.extend(self.lbs)
        proto.linear_constraints.upper_bounds.extend(self.ubs)
        mat = proto.linear_constraint_matrix
        mat.row_ids.extend(self.rows)
        mat.column_ids.extend(self.cols)
        mat.coefficients.extend(self.coefs)
        return _Model(proto, self.x_ids, self.e_ids, self.t_id, self.mscale, self.exposed_id, self.budget_binds)


def _build(problem: Problem, data: _Data, red: _Reduced) -> _Model:
    """The model proto of the reduced problem (``_Builder``'s parts in order)."""
    builder = _Builder(problem, data, red)
    builder.add_node_choices()
    builder.add_edge_costs()
    builder.add_memory_constraint()
    builder.add_exposed_communication()
    builder.add_objective()
    return builder.model()


def _binding_moments(problem: Problem, data: _Data) -> list[int]:
    """Moments (0: always-live memory, r: memory row r) whose worst case could exceed the budget."""
    budget = problem.memory_budget
    if budget is None or not math.isfinite(budget):
        return []
    work = max((float(t.max()) for t in data.transient), default=0.0) if data.transient else 0.0
    return [r for r in range(len(data.memory_rows) + 1)
            if sum(float(data.moment(r, i).max()) for i in range(len(data.k))) + work > budget]


# --------------------------------------------------------------------------- hint


def _hint(problem: Problem, data: _Data, red: _Reduced) -> list[int]:
    """A feasible assignment to hand the solver as its first incumbent.

    Start from the warm start (if it fits the budget), else the cheapest choice per node (or
    the lowest-memory one if that breaks the budget), then improve it by coordinate descent:
    move one node at a time to its best choice given its neighbours, within the budget (checked
    at every moment of the step; the largest transient is only allowed to grow). Exposed
    communication is left to the solver. Cheap, and it is what the caller gets back if the
    solver runs out of time before beating it.
    """
    budget = problem.memory_budget if problem.memory_budget is not None else math.inf
    k = data.k
    moments = range(len(data.memory_rows) + 1)
    per_node = [np.stack([data.moment(r, i) for r in moments]) for i in range(len(k))]  # (moments, k)

    choices = list(problem.warm_start) if problem.warm_start is not None else []
    if not choices or data.peak(choices) > budget:
        choices = [int(np.argmin(c)) for c in data.costs]
    if data.peak(choices) > budget:
        choices = [int(np.argmin(m.max(axis=0))) for m in per_node]

    adjacency: dict[int, list[tuple[_Pair, bool]]] = {i: [] for i in range(len(k)) if k[i] > 1}
    for pair in red.pairs:
        adjacency[pair.u].append((pair, True))
        adjacency[pair.v].append((pair, False))
    used = cast(np.ndarray, sum(m[:, c] for m, c in zip(per_node, choices, strict=True))) if k else np.zeros(len(moments))
    work = max((float(t[c]) for t, c in zip(data.transient, choices, strict=True)), default=0.0) if data.transient else 0.0
    for _ in range(_MAX_SWEEPS):
        moved = False
        for i, nbrs in adjacency.items():
            local = red.linear[i].copy()
            for pair, i_is_src in nbrs:
                local += pair.column(choices[pair.v]) if i_is_src else pair.row(choices[pair.u])
            after = (used[:, None] - per_node[i][:, [choices[i]]] + per_node[i]).max(axis=0)
            if data.transient is not None:
                after = after + np.maximum(work, data.transient[i])
            best = int(np.argmin(np.where(after <= budget, local, np.inf)))
            if local[best] < local[choices[i]] - 1e-12 * abs(local[choices[i]]):
                used += per_node[i][:, best] - per_node[i][:, choices[i]]
                if data.transient is not None:
                    work = max(work, float(data.transient[i][best]))
                choices[i] = best
                moved = True
        if not moved:
            break
    return choices


# --------------------------------------------------------------------------- restriction


def restrict(problem: Problem, allowed: Sequence[Sequence[int] | None]) -> Problem:
    """The same problem with node ``i`` limited to choices ``allowed[i]`` (``None``: all of them),
    renumbered ``0..len(allowed[i]) - 1``: a sub-problem whose choice ``c`` of node ``i`` is
    ``allowed[i][c]`` of the original (hand plans as pinned versions of the planner's problem)."""
    if all(a is None for a in allowed):
        return problem
    keep = _keep([len(c) for c in problem.costs], allowed)

    def pick(values, i):
        return tuple(np.asarray(values, dtype=float)[keep[i]].tolist())

    def row(r: Row) -> Row:
        return Row(tuple((i, pick(v, i)) for i, v in r.nodes), r.constant)

    warm = _restricted_start(problem.warm_start, keep)
    return Problem(
        costs=tuple(pick(c, i) for i, c in enumerate(problem.costs)),
        memory=tuple(pick(m, i) for i, m in enumerate(problem.memory)),
        edges=tuple(Edge(e.src, e.dst, np.asarray(e.cost, dtype=float)[np.ix_(keep[e.src], keep[e.dst])],
                         None if e.terms is None else tuple(Term(np.asarray(t.rows)[keep[e.src]],
                                                                 np.asarray(t.cols)[keep[e.dst]], t.core)
                                                            for t in e.terms))
                    for e in problem.edges),
        memory_budget=problem.memory_budget,
        names=problem.names,
        warm_start=warm,
        memory_rows=tuple(row(r) for r in problem.memory_rows),
        transient=None if problem.transient is None else tuple(pick(t, i) for i, t in enumerate(problem.transient)),
        exposed_rows=tuple(row(r) for r in problem.exposed_rows),
    )


def _keep(k: Sequence[int], allowed: Sequence[Sequence[int] | None]) -> list[np.ndarray]:
    """Per node of ``k[i]`` choices, the index of those ``allowed[i]`` keeps (all where None)."""
    keep = [np.arange(ki) if a is None else np.asarray(a, dtype=int) for ki, a in zip(k, allowed, strict=True)]
    if any(len(c) == 0 for c in keep):
        raise SolverError("restrict: every node needs at least one allowed choice")
    return keep


def _restricted_start(warm_start: tuple[int, ...] | None, keep: list[np.ndarray]) -> tuple[int, ...] | None:
    """A warm start renumbered into the choices ``keep`` kept (None where one of them is not kept)."""
    if warm_start is None or not all(c in k for c, k in zip(warm_start, keep, strict=True)):
        return None
    return tuple(int(np.flatnonzero(k == c)[0]) for c, k in zip(warm_start, keep, strict=True))


def _prepared(problem: Problem, allowed: Sequence[Sequence[int] | None] | None,
              validated: MemoryBounds | None) -> tuple[Problem, _Data]:
    """``restrict(problem, allowed)`` and its validated arrays: ``validated``'s restricted where
    ``problem`` shares their node and edge data (``MemoryBounds.data_of``), without converting
    or validating them again (hand plans restrict one problem many times)."""
    base = validated.data_of(problem) if validated is not None else None
    if base is None:
        problem = restrict(problem, allowed) if allowed is not None else problem
        return problem, _validate(problem)
    if allowed is None or all(a is None for a in allowed):
        return problem, base
    keep = _keep(base.k, allowed)
    data = base.restricted(keep, [(e.src, e.dst) for e in problem.edges])
    return data.as_problem(dataclasses.replace(problem, warm_start=_restricted_start(problem.warm_start, keep))), data


# --------------------------------------------------------------------------- solve


def evaluate(problem: Problem, choices: Sequence[int]) -> tuple[float, float]:
    """(objective seconds, peak memory bytes) of an assignment, computed from the original data."""
    return _evaluate(problem, _validate(problem), choices)


def _evaluate(problem: Problem, data: _Data, choices: Sequence[int]) -> tuple[float, float]:
    obj = sum(float(data.costs[i][c]) for i, c in enumerate(choices))
    obj += sum(float(m[choices[e.src], choices[e.dst]]) for e, m in zip(problem.edges, data.edges, strict=True))
    return obj + data.exposed_time(choices), data.peak(choices)


def solve(problem: Problem, time_limit: float | None = None, solver: SolverName = "highs",
          relative_gap: float = 1e-6, node_limit: int | None = None, *,
          allowed: Sequence[Sequence[int] | None] | None = None, validated: MemoryBounds | None = None) -> Solution:
    """Solve the sharding ILP, to within ``relative_gap`` of the optimum.

    ``time_limit`` (seconds) covers the whole call, model building included; the solver may
    overrun it by a second or so on very large models. ``node_limit`` bounds the branch and bound
    after the root (0: the hint, presolved, is returned). When either is hit, the best solution
    found so far is returned with ``status="feasible"``, the solver's gap and the limit that
    stopped it. Solves that end by the gap or the node limit are deterministic (fixed seed,
    deterministic hint; HiGHS's branch and bound is deterministic, and math_opt refuses
    ``threads`` for it); one the time limit stops ends where the machine's speed let it get.

    ``allowed``: solve ``restrict(problem, allowed)`` (its choices numbered so); ``validated``:
    a ``MemoryBounds`` of ``problem`` before a ``replace`` of its budget, warm start or memory
    rows, whose arrays are then restricted instead of converted and validated again.
    """
    start = time.perf_counter()
    _check_arguments(solver, time_limit)
    problem, data = _prepared(problem, allowed, validated)
    budget = problem.memory_budget
    if budget is not None and data.min_memory() > budget:
        raise _infeasible(problem, data, "No sharding plan fits in memory")

    red = _reduce(problem, data)
    built = _build(problem, data, red)
    hint = _hint(problem, data, red)
    if not built.x_ids:  # every node has a single choice: nothing to decide
        obj, mem = _evaluate(problem, data, hint)
        return Solution(tuple(hint), obj, mem, "optimal", 0.0, time.perf_counter() - start, 0, 0)

    params, hard_stop = _parameters(relative_gap, time_limit, start, node_limit)
    hinted = _hint_values(built, red, data, hint)
    result = _relaxed(built, SOLVERS[solver], params) if _relax_first(built, solver, hard_stop, node_limit) else None
    if result is None:   # not tried, not integral or cut short: the MIP, in what the time leaves
        params, hard_stop = _parameters(relative_gap, time_limit, start, node_limit)
        result = _run(built, hinted, SOLVERS[solver], params, hard_stop)
    if result is None:   # stopped at the limit before it answered: the hint stands
        reason, values = mathopt.TerminationReason.FEASIBLE, hinted
    else:
        reason, values = _check_result(result, problem, data, solver, time_limit)
    choices, obj, mem = _choices(problem, data, built, values, hint)
    # "optimal" means within relative_gap of the optimum; the gap reported is the proven one.
    status = "optimal" if reason == mathopt.TerminationReason.OPTIMAL else "feasible"  # else: a limit hit
    stats = result.solve_stats if result is not None else None
    return Solution(
        choices=tuple(choices),
        objective=obj,
        memory=mem,
        status=status,
        gap=_gap(result, reason) if result is not None else None,
        solve_time_s=time.perf_counter() - start,
        num_variables=len(built.proto.variables.ids),
        num_constraints=len(built.proto.linear_constraints.ids),
        num_choices=sum(data.k),
        simplex_iterations=int(stats.simplex_iterations) if stats is not None else 0,
        nodes=int(stats.node_count) if stats is not None else 0,
        stopped_by=None if status == "optimal" else _stopped_by(result) if result is not None else "time",
    )


def _parameters(relative_gap: float, time_limit: float | None, start: float,
                node_limit: int | None) -> tuple[mathopt.SolveParameters, float | None]:
    """The solver's parameters (its time limit: what is left of ``time_limit`` since ``start``),
    and the seconds from now at which a solve apart is stopped (None: no limit)."""
    params = mathopt.SolveParameters(
        random_seed=0,  # fixed seed: same problem, same plan
        relative_gap_tolerance=relative_gap,
        absolute_gap_tolerance=1e-9,
    )
    hard_stop = None
    if time_limit is not None:
        remaining = max(time_limit - (time.perf_counter() - start), 0.01)
        params.time_limit = datetime.timedelta(seconds=remaining)
        hard_stop = remaining + APART_GRACE_S
    if node_limit is not None:
        params.node_limit = max(int(node_limit), 0)
    return params, hard_stop


def _stopped_by(result: result_pb2.SolveResultProto) -> Literal["nodes", "time", None]:
    """Which limit ended a solve short of its gap."""
    stopped: dict[int, Literal["nodes", "time"]] = {mathopt.Limit.NODE.value: "nodes", mathopt.Limit.TIME.value: "time"}
    return stopped.get(result.termination.limit)


def _check_arguments(solver: str, time_limit: float | None) -> None:
    """``solve``'s solver name and time limit, checked."""
    if solver not in SOLVERS:
        raise SolverError(f"unknown solver {solver!r}; valid choices are {sorted(SOLVERS)}")
    if time_limit is not None and not (
        isinstance(time_limit, numbers.Real) and not isinstance(time_limit, bool) and time_limit > 0
    ):
        raise SolverError(f"time_limit must be a positive number of seconds or None, got {time_limit!r}")


def _hint_values(built: _Model, red: _Reduced, data: _Data, hint: list[int]) -> np.ndarray:
    """The hint as a value of every variable. HiGHS (through math_opt) uses a hint only if it sets
    every variable, pair variables included; a partial hint is silently dropped. SCIP accepts
    either."""
    values = np.zeros(len(built.proto.variables.ids))
    for i, ids in built.x_ids.items():
        values[ids[hint[i]]] = 1.0
    for pair, base in zip(red.pairs, built.e_ids, strict=True):
        values[base + pair.rows[hint[pair.u]] * pair.core.shape[1] + pair.cols[hint[pair.v]]] = 1.0
    if built.t_id is not None:  # HiGHS rejects a hint that breaks a constraint
        values[built.t_id] = max(float(t[c]) for t, c in zip(data.transient, hint, strict=True)) / built.t_scale
    if built.exposed_id is not None:
        values[built.exposed_id] = data.exposed_time(hint)
    return values


def _check_result(result: result_pb2.SolveResultProto, problem: Problem, data: _Data, solver: str,
                  time_limit: float | None) -> tuple[mathopt.TerminationReason, np.ndarray]:
    """Why the solver stopped, and its best solution's variable values; raises where it found none."""
    reason = mathopt.TerminationReason(result.termination.reason)
    TR = mathopt.TerminationReason
    if reason in (TR.INFEASIBLE, TR.INFEASIBLE_OR_UNBOUNDED):
        raise _infeasible(problem, data, f"The {solver} solver reports the problem infeasible")
    values = _primal_values(result)
    if values is None:
        if reason == TR.NO_SOLUTION_FOUND:
            raise SolverTimeout(
                f"The {solver} solver found no sharding plan within time_limit={time_limit} s "
                f"({result.termination.detail or reason.name}); raise time_limit."
            )
        raise SolverError(f"The {solver} solver failed ({reason.name}): {result.termination.detail}")
    return reason, values


def _choices(problem: Problem, data: _Data, built: _Model, values: np.ndarray,
             hint: list[int]) -> tuple[list[int], float, float]:
    """(choices, objective, memory) of the solver's solution, or of the hint where the solver's is
    worse or overshoots the budget (checked in floating point, not within a solver tolerance), as
    long as the hint itself fits."""
    choices = list(hint)
    for i, ids in built.x_ids.items():
        # argmax rounds away solver tolerances; first index wins ties.
        choices[i] = int(np.argmax(values[ids.start:ids.stop]))
    obj, mem = _evaluate(problem, data, choices)
    hint_obj, hint_mem = _evaluate(problem, data, hint)
    budget = problem.memory_budget
    fits = (lambda m: budget is None or m <= budget)
    if fits(hint_mem) and (hint_obj < obj or not fits(mem)):
        return hint, hint_obj, hint_mem
    return choices, obj, mem


def _gap(result: result_pb2.SolveResultProto, reason: mathopt.TerminationReason) -> float | None:
    """The proven relative gap between the solution and the bound (None where unknown)."""
    optimal = reason == mathopt.TerminationReason.OPTIMAL
    primal, dual = result.termination.objective_bounds.primal_bound, result.termination.objective_bounds.dual_bound
    gap = 0.0 if optimal else None
    if math.isfinite(primal) and math.isfinite(dual):
        gap = abs(primal - dual) / abs(primal) if abs(primal) > 1e-12 else 0.0
        gap = 0.0 if gap < 1e-9 else gap  # float noise of a closed gap
    return gap


def _run(built: _Model, hint: np.ndarray, solver: mathopt.SolverType, params: mathopt.SolveParameters,
         hard_stop: float | None = None) -> result_pb2.SolveResultProto | None:
    """Solve the model proto as built, with a hint for every variable and only the one-hot
    variables' values returned. math_opt's Python ``Model`` is bypassed: importing, exporting
    and hinting it goes variable by variable, seconds per solve on 3-D meshes' 0.6M variables.
    A model of ``APART_VARIABLES`` or more with a time limit is solved in a process of its own,
    stopped ``hard_stop`` seconds from now (None: it did not answer by then; ``solver.apart``)."""
    model_params = _one_hot_values_only(built)
    values = model_params.solution_hints.add().variable_values
    values.ids.extend(built.proto.variables.ids)
    values.values.extend(hint.tolist())
    try:
        if _timed_and_at_least(built, hard_stop, APART_VARIABLES):
            with contextlib.suppress(OSError):   # (no interpreter to start: solved here, unstoppable)
                return solve_apart(built.proto, solver.value, params.to_proto(), model_params, hard_stop)
        return solve_proto(built.proto, solver.value, params.to_proto(), model_params)
    except StatusNotOk as e:
        raise SolverError(f"the solver rejected the model: {e}") from None
    except RuntimeError as e:   # (its process failed)
        raise SolverError(str(e)) from None


def _one_hot_values_only(built: _Model) -> model_parameters_pb2.ModelSolveParametersProto:
    """Model parameters asking the solver for the one-hot variables' values only: the choices."""
    model_params = model_parameters_pb2.ModelSolveParametersProto()
    model_params.variable_values_filter.filter_by_ids = True
    model_params.variable_values_filter.filtered_ids.extend(i for ids in built.x_ids.values() for i in ids)
    return model_params


def _relax_first(built: _Model, solver: str, hard_stop: float | None, node_limit: int | None) -> bool:
    """Whether to solve the LP relaxation before the MIP: with HiGHS, where no memory budget
    binds (with one, every relaxation tried was fractional), where the branch and bound may run
    at all (``node_limit=0`` asks for the hint), and, under a time limit, on models under
    ``RELAX_HERE_VARIABLES`` (the relaxation runs in this process, within its share of the limit;
    a MIP after it may still be solved apart)."""
    return (solver == "highs" and node_limit != 0 and not built.budget_binds
            and not _timed_and_at_least(built, hard_stop, RELAX_HERE_VARIABLES))


def _timed_and_at_least(built: _Model, hard_stop: float | None, variables: int) -> bool:
    """Is the solve under a time limit (a hard stop) and the model of ``variables`` or more?"""
    return hard_stop is not None and len(built.proto.variables.ids) >= variables


def _relaxed(built: _Model, solver: mathopt.SolverType,
             params: mathopt.SolveParameters) -> result_pb2.SolveResultProto | None:
    """The LP relaxation's optimum by dual simplex, where its one-hot variables come out integral:
    then it is the ILP's optimum (its bound is the relaxation's), found without the MIP's
    presolve, heuristics and cuts, in about half HiGHS's time on the planner's problems, whose
    relaxation is mostly tight where no memory budget binds (every hand plan of gpt2-tiny and
    llama-tiny on 2x2 at 16 x 64 tokens, and their auto plans). Without presolve, which took
    2-4x the simplex's own time on these problems (tiny models and published sizes alike). None
    where it is fractional or was cut short (``_RELAXATION_SHARE`` of a limited solve's time):
    the MIP solves it."""
    relaxed = model_pb2.ModelProto()
    relaxed.CopyFrom(built.proto)
    relaxed.variables.ClearField("integers")
    relaxed.variables.integers.extend([False] * len(built.proto.variables.ids))
    # most of a limited solve's time stays the MIP's, should it be needed
    time_limit = params.time_limit * _RELAXATION_SHARE if params.time_limit is not None else None
    lp = dataclasses.replace(params, node_limit=None, time_limit=time_limit,
                             lp_algorithm=mathopt.LPAlgorithm.DUAL_SIMPLEX, presolve=mathopt.Emphasis.OFF)
    try:
        result = solve_proto(relaxed, solver.value, lp.to_proto(), _one_hot_values_only(built))
    except StatusNotOk as e:
        raise SolverError(f"the solver rejected the model: {e}") from None
    if mathopt.TerminationReason(result.termination.reason) != mathopt.TerminationReason.OPTIMAL:
        return None
    values = _primal_values(result)
    return result if values is not None and np.all(np.abs(values - np.round(values)) <= _INTEGRAL_TOL) else None


def _primal_values(result: result_pb2.SolveResultProto) -> np.ndarray | None:
    """The best feasible solution's variable values (dense by id, unreturned ones 0), if any."""
    for sol in result.solutions:
        primal = sol.primal_solution
        if primal.feasibility_status == solution_pb2.SOLUTION_STATUS_FEASIBLE:
            ids = np.asarray(primal.variable_values.ids, dtype=np.int64)
            dense = np.zeros(int(ids.max()) + 1 if len(ids) else 0)
            dense[ids] = primal.variable_values.values
            return dense
    return None

"""The planner's deterministic time (``PlanOptions.deterministic``): the seconds each piece of
planning work is charged, from its size.

The search decides what to try next (another microbatch count, recomputation mode, hand plan,
pipeline layout or schedule) by what the time limit leaves. Read off the wall clock, that made the
plan follow the machine's load: the same call gave another plan beside another job. So every
piece of work is charged an estimate of its seconds computed from its size alone (graph nodes,
strategies, ILP choices, the solver's simplex iterations and nodes, a schedule's actions), and
the search reads only that sum (``Clock.spent``): the same call makes the same decisions on any
machine, at any load. A solve is bounded the same way, by branch-and-bound nodes
(``node_limit``), not seconds. The wall clock stays a hard stop (``Clock.wall_left``): where it
comes first, the search ends there and the plan says so.

The rates are least-squares fits, scaled up by ``MARGIN``, of the work's seconds on the host named
in ``FITTED_ON``: ``python benchmarks/planner_work.py`` logs every piece of work of the planning
benchmarks (``AUTOPAR_WORK_LOG``) and fits them. A slower host reaches the hard stop first.
"""
from __future__ import annotations

import json
import os
from typing import Literal

WorkKind = Literal["capture", "strategies", "costs", "ilp", "solve", "simulation"]

#: Where the rates were fitted (``benchmarks/planner_work.py``; figures in benchmarks/RESULTS.md).
FITTED_ON = "2-core x86 VM, torch 2.13 CPU, OR-Tools' HiGHS (2026-11-26)"
#: How much slower than the fit each charge is taken to be: a host this much slower, or as
#: loaded, still ends its search by the work budget, not the hard stop. The fit's calls were
#: charged 0.74-1.60x their wall seconds (median 1.08): at 1.75 the least-charged call still ends
#: by its budget at 1.3x the fit host's time, and a search uses about half to two thirds of its
#: limit. At 1.4 (more of the limit) the same plan twice failed once in the benchmarks, and a
#: solve's root running past its share left Llama-2 70B on 128x8 no time to simulate a pipeline.
MARGIN = 1.75
#: Seconds per unit of size, per kind of work: (fixed seconds, seconds per unit of each feature).
#: A solve's nodes past the root are ``PINNED``: the fit's solves almost all end at the root.
RATES: dict[WorkKind, tuple[float, dict[str, float]]] = {
    "capture": (0.30, {"graph_nodes": 8.4e-4}),
    "strategies": (0.042, {"strategies": 5.6e-7}),
    "costs": (0.058, {"strategies": 4.1e-7}),
    "ilp": (0.36, {"edge_pairs": 8.3e-8, "strategies": 1.75e-5}),
    "solve": (0.18, {"choices": 1.7e-4, "iteration_choices": 3.2e-8, "node_choices": 3.0e-8, "graph_nodes": 4.9e-5}),
    "simulation": (0.045, {"actions": 2.6e-5}),
}
#: Rates measured apart, not fitted: HiGHS's branch-and-bound nodes past the root, 0.4 ms each on
#: a GPT-3 13B problem of 15,455 choices on 4x2x8 (3,755 nodes in 1.4 s past a 9.3 s root).
PINNED = {("solve", "node_choices")}
#: Environment variable naming a file each piece of work is logged to (kind, features, seconds):
#: what ``benchmarks/planner_work.py`` fits ``RATES`` on.
LOG_ENV = "AUTOPAR_WORK_LOG"


def seconds(kind: WorkKind, **features: float) -> float:
    """The seconds ``kind`` of work of this size is charged (``RATES`` times ``MARGIN``)."""
    fixed, per = RATES[kind]
    return MARGIN * (fixed + sum(rate * float(features.get(name, 0.0)) for name, rate in per.items()))


def solve_features(choices: int, iterations: int = 0, nodes: int = 0) -> dict[str, float]:
    """A solve's size: its choices, and its counted work (simplex iterations and branch-and-bound
    nodes, each costing in proportion to the problem's size)."""
    return {"choices": choices, "iteration_choices": iterations * choices, "node_choices": nodes * choices}


def node_limit(allowance_s: float, choices: int) -> int:
    """Branch-and-bound nodes a solve of ``choices`` may explore in ``allowance_s`` charged
    seconds, after its root (whose work is charged as it comes): 0 where the allowance is spent
    before the tree would begin (the solver returns the hint, presolved), else at least 1."""
    fixed, per = RATES["solve"]
    root = MARGIN * (fixed + per["choices"] * choices)
    if allowance_s <= root:
        return 0
    per_node = MARGIN * per["node_choices"] * max(choices, 1)
    return max(1, int((allowance_s - root) / per_node))


def log(call: str, kind: WorkKind, wall_s: float, charged_s: float, **features: float) -> None:
    """Append one piece of ``call``'s work to the file ``AUTOPAR_WORK_LOG`` names, if any."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"call": call, "kind": kind, "wall_s": wall_s, "charged_s": charged_s,
                                **features}) + "\n")

"""``PlanOptions.time_limit`` bounds the whole ``autopar.plan`` call (issue 39, item 6): capture,
microbatch recaptures, hand plans, pipeline layouts and every solve; the plan's timings add up to
the call's wall time; what the limit cut short is said in the plan; and the search decides on
the seconds its work is charged by size (``autopar.planning.work``), not on the wall clock, so
that a call gives the same plan whatever the machine's speed or load, cut short or not, unless
the wall clock's hard stop comes first (and the plan then says so)."""
from __future__ import annotations

import json
import time

import pytest

import autopar
from autopar.core.errors import PlanningTimeout
from autopar.core.mesh import MeshSpec
from autopar.planning.clock import HARD_STOP, MIN_SOLVE_S, Clock, Once
from tests.equivalence import meta_model
from tests.tiers import slow

#: The call may end this far past its limit (the issue's bound).
OVER = 0.05


class FakeTime:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_deadlines_share_the_call_and_grant_the_least_solve_time_only_before_its_end():
    fake = FakeTime()
    clock = Clock(100.0, now=fake, deterministic=True)
    whole = clock.deadline()
    assert whole.end == pytest.approx(94.0)                     # the reserve kept for the last plan
    half = whole.share(0.5)
    assert half.end == pytest.approx(47.0) and half.share(0.5).end == pytest.approx(23.5)
    fake.now = 90.0                                             # the wall clock moves: no decision does
    assert not half.passed() and half.solve_seconds() == pytest.approx(47.0)
    clock.spent = 47.0                                          # the work charged does
    assert half.passed() and half.solve_seconds() == MIN_SOLVE_S   # past its share: the least time once
    clock.spent = 94.0
    assert whole.passed() and half.solve_seconds() == 0.0           # past the call's end: no solve
    assert not whole.affords(0.1) and clock.reproducible


def test_the_wall_clock_is_a_hard_stop_that_the_plan_owns_up_to():
    fake = FakeTime()
    clock = Clock(10.0, now=fake, deterministic=True)
    whole = clock.deadline()
    assert whole.affords(5.0) and whole.solve_seconds() == pytest.approx(9.4)
    fake.now = 9.4                                              # a slow host: the wall reaches the end first
    assert whole.passed() and not whole.affords(0.1) and whole.solve_seconds() == 0.0
    assert not clock.reproducible and clock.cut_short == [HARD_STOP]


def test_work_is_begun_only_where_the_wall_clock_affords_it_at_the_hosts_pace():
    """A host running its captures at a quarter of their charges' speed: a capture the search's
    time still affords is refused where, at that pace, it would end past the hard stop (GPT-3
    175B captured in 13 of 15 s on a slow host, then began an ILP build of 2.6 s); work of
    another kind is judged at its own pace (none seen: its charge)."""
    fake = FakeTime()
    clock = Clock(10.0, now=fake, deterministic=True)
    clock.charge("capture", 2.0, graph_nodes=0)          # charged 0.525 s, took 2 s of wall
    whole = clock.deadline()
    assert clock.pace("capture") == pytest.approx(2.0 / 0.525) and clock.pace("ilp") == 1.0
    fake.now = 7.0                                       # 2.4 s of wall left, 8.9 s of charged time
    assert whole.affords_kind("capture") and clock.reproducible
    fake.now = 8.0                                       # 1.4 s: a capture of 2 s no longer fits
    assert whole.affords(1.0) and not whole.affords_kind("capture")
    assert not clock.reproducible and clock.cut_short == [HARD_STOP]


def test_a_capture_stops_at_its_first_module_call_past_the_hard_stop():
    """``torch.export`` cannot be stopped from outside: the capture is stopped from inside, at
    the first module it calls past the hard stop, and only while the block runs."""
    import torch

    fake = FakeTime()
    clock = Clock(10.0, now=fake)
    layer = torch.nn.Linear(2, 2)
    with clock.stops_capture("capturing the model"):
        layer(torch.ones(2))                                 # 9.4 s to the hard stop
        fake.now = 9.5
        with pytest.raises(PlanningTimeout, match="capturing the model ran past the time limit"):
            layer(torch.ones(2))
    layer(torch.ones(2))


class _Graph:
    def __init__(self, nodes: int) -> None:
        self.graph = type("G", (), {"nodes": range(nodes)})()


def test_a_capture_is_begun_only_where_the_deadline_affords_its_charge():
    fake = FakeTime()
    clock = Clock(10.0, now=fake, deterministic=True)

    def capture(k: int) -> _Graph:
        fake.now += 1.0
        return _Graph(1000 * k)

    once = Once(capture, clock, "capture")
    first = once(2, clock.deadline())
    assert clock.timings["capture"] == 1.0 and clock.spent == clock.took["capture"] > 0   # charged by its size
    assert once(2, clock.deadline()) is first and fake.now == 1.0                         # once per count
    clock.spent = clock.end - 0.9 * clock.took["capture"]        # less left than the last capture was charged
    with pytest.raises(PlanningTimeout, match="no time was left"):
        once(4, clock.deadline())
    assert fake.now == 1.0


def _planned_within(model, args, kwargs, mesh: MeshSpec, limit: float, **options) -> tuple[autopar.Plan | None, float]:
    start = time.perf_counter()
    try:
        plan = autopar.plan(model, mesh, args, kwargs, time_limit=limit, **options)
    except PlanningTimeout:   # no plan in the time: honest, but the call must still keep its word
        plan = None
    return plan, time.perf_counter() - start


@slow
def test_time_limit_bounds_the_whole_call_on_a_model_that_hits_it():
    """GPT-3 175B at 1536 x 2048 on 128x8 A100 (bf16), whose search takes minutes unbounded: a
    30 s limit is kept within 5%, capture and recaptures included (before: the pipeline's
    recapture and schedule simulations ran uncounted past the limit, 14% over at 60 s; on a host
    where the capture alone took 13 s of 15, an ILP build begun at the hard stop, 9% over). 30 s:
    that capture took 26 s on a loaded host, and a search must be left to cut short. No absolute
    slack: 5% of 30 s is 1.5 s, more than the plan built after the last solve takes."""
    model, args, kwargs = meta_model("gpt-175b", 1536, 2048)
    mesh = MeshSpec((128, 8), hardware="a100-80gb")
    limit = 30.0
    plan, wall = _planned_within(model, args, kwargs, mesh, limit, precision="bf16", gather_outputs=False)
    assert wall <= (1 + OVER) * limit, f"planning took {wall:.1f} s under a {limit:.0f} s limit"
    if plan is not None:
        # the call's wall time, broken down; Python's collection of the 175B graph's cycles (0.6 s)
        # may come after the call's last reading, within the limit's 5%
        assert sum(plan.timings.values()) == pytest.approx(wall, abs=OVER * limit)
        assert plan.solver["time_limit"]["cut_short"], "a 175B model in 30 s: the limit must have cut something"
        assert "Time limit" in plan.report() and "cut short" in plan.report()


def _decisions(plan: autopar.Plan) -> dict:
    """The plan without what records how long it took."""
    d = json.loads(plan.to_json())
    d.pop("timings")
    d["solver"].pop("time_limit", None)
    return d


def test_a_search_its_limit_cut_short_is_the_same_on_a_slower_and_uneven_machine(monkeypatch):
    """A limit that cuts the search short (hand plans left out, solves stopped at their share),
    planned on this machine and on one 1.5x slower whose every step takes a different time (a
    clock running fast by a varying amount, as a loaded host's): the same plan, the same things
    cut short, and both say another run gives the same plan. A search deciding on measured
    seconds would stop elsewhere on the slow machine. What the charged time decides is under
    test, so the wall clock's hard stop is moved out to 4x the limit: on this 2-core host,
    loaded, it stopped the unslowed run's last solve first (the hard stop: the tests above)."""
    import random

    from autopar.planning import clock as clock_module

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    mesh = MeshSpec((2, 2), hardware="h100-80gb")
    monkeypatch.setattr(clock_module.Clock, "wall_left", lambda self: 4 * self.end - self.wall())
    fast = autopar.plan(model, mesh, args, kwargs, time_limit=5.0, deterministic=True)
    real, jitter = time.perf_counter, random.Random(0)
    origin, skew = real(), [0.0]

    def uneven() -> float:
        skew[0] += jitter.uniform(0.0, 0.01)
        return origin + 1.5 * (real() - origin) + skew[0]
    monkeypatch.setattr(clock_module.Clock, "now", staticmethod(uneven))
    slow = autopar.plan(model, mesh, args, kwargs, time_limit=5.0, deterministic=True)
    limits = fast.solver["time_limit"], slow.solver["time_limit"]
    assert limits[0]["cut_short"] and limits[0]["cut_short"] == limits[1]["cut_short"]
    assert limits[0]["reproducible"] and limits[1]["reproducible"]
    assert _decisions(fast) == _decisions(slow)


@slow
def test_a_plan_nothing_was_cut_short_of_is_the_same_on_a_slower_machine(monkeypatch):
    """The default (wall-clock) search, on a machine 4x slower (a clock running 4x fast): nothing
    is cut short in either, so the plans are the same; a search whose steps depended on the time
    measured would stop earlier on the slow machine."""
    from autopar.planning import clock as clock_module

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    mesh = MeshSpec((2, 2), hardware="h100-80gb")
    fast = autopar.plan(model, mesh, args, kwargs, time_limit=60.0)
    real = time.perf_counter
    origin = real()
    monkeypatch.setattr(clock_module.Clock, "now", staticmethod(lambda: origin + 4 * (real() - origin)))
    slow = autopar.plan(model, mesh, args, kwargs, time_limit=60.0)
    assert fast.solver["time_limit"]["cut_short"] == slow.solver["time_limit"]["cut_short"] == []
    assert _decisions(fast) == _decisions(slow)


def test_each_planning_problem_is_built_once_in_a_call(monkeypatch):
    """A pipeline is weighed (the first axis of 2x8 H100 crosses nodes) for each recomputation
    mode of its layout: every (graph, mesh, microbatches, recomputation, offload) problem is built
    once in the call, and a stage plan, whose microbatches are fixed, builds no problem of the
    whole batch on its sub-mesh (before: one per attempt, for its memory bound alone; 2.5-5 s each
    on GPT-3 175B)."""
    from autopar.planning import planner

    built = []
    real = planner.prepare

    def prepare(captured, mesh, options, **kw):
        recompute = kw.get("recompute", "none")
        built.append((id(captured), mesh.shape, kw.get("microbatches", 1),
                      recompute if isinstance(recompute, str) else tuple(sorted(recompute.items())),
                      kw.get("offload", False)))
        return real(captured, mesh, options, **kw)

    monkeypatch.setattr(planner, "prepare", prepare)
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    plan = autopar.plan(model, MeshSpec((2, 8), hardware="h100-80gb"), args, kwargs, time_limit=None)
    stages = [b for b in built if b[1] != (2, 8)]                   # on a stage's sub-mesh
    assert "pipeline" in plan.solver and stages, "the pipeline was not weighed"
    assert len(built) == len(set(built)), f"problems built twice: {sorted(built, key=str)}"
    assert not [b for b in stages if b[2] == 1], "a stage plan built the whole batch's problem"


def test_a_shared_strategy_space_gives_the_problem_a_fresh_build_gives():
    """``prepare(space=...)`` reuses another problem's strategy space (recomputation does not
    change it) and prices the same problem, with warnings of its own."""
    from autopar.core.capture import capture
    from autopar.planning.options import PlanOptions
    from autopar.planning.problem import prepare

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    captured = capture(model, args, kwargs)
    mesh = MeshSpec((2, 2), hardware="h100-80gb")
    plain = prepare(captured, mesh, PlanOptions(), recompute="none")
    shared = prepare(captured, mesh, PlanOptions(), recompute="full", space=plain.space)
    fresh = prepare(captured, mesh, PlanOptions(), recompute="full")
    assert shared.space.nodes is plain.space.nodes and shared.space.warnings is not plain.space.warnings
    assert shared.problem.costs == fresh.problem.costs and shared.problem.memory == fresh.problem.memory
    assert shared.problem.memory_rows == fresh.problem.memory_rows


def test_a_search_with_a_plan_in_hand_builds_only_what_its_own_deadline_can_also_solve():
    """No plan yet: a new problem is begun while the call's deadline affords its capture and build
    (a plan is what the call needs first). With one: only where the search's own deadline (its
    share) affords the capture, the build and a solve as long as the build; before, a 175B search
    under load built a 6-microbatch problem it then had 0.25 s to solve, and the pipeline, which
    follows the search, was not weighed for want of that time."""
    from autopar.planning.clock import Deadline
    from autopar.planning.options import PlanOptions
    from autopar.planning.planner import Problems, _Search

    fake = FakeTime()
    clock = Clock(100.0, now=fake)                       # the call's end: 94 s
    clock.took.update(prepare=10.0, capture=5.0)
    search = _Search(None, None, PlanOptions(), clock, None, None, 8, Problems(), Deadline(22.0, clock))
    search._affords_build(2, captured=False)             # 15 s by 94 s: begun
    search.planned = True
    search._affords_build(2, captured=True)              # build and solve: 20 s by 22 s
    with pytest.raises(PlanningTimeout, match="no time was left"):
        search._affords_build(2, captured=False)         # 25 s: not by 22 s


def test_a_layout_whose_pipeline_does_not_fit_is_tried_with_recomputation_before_the_next_layout():
    """The pipeline search's attempts: each layout without recomputation, first; a layout none of
    whose plans fit is retried at once with full recomputation (its microbatch is captured
    already), the next layout's capture after; those that fit are retried last. Before, every
    layout came first, and Hugging Face's GPT-2 175B on 128x8 A100 (32 stages over the budget)
    ended its 60 s on the next layout's capture, 40x slower for it."""
    from autopar.planning.pipeline import _attempts

    a, b = MeshSpec((32, 4, 8), ("pp", "dp", "tp")), MeshSpec((16, 8, 8), ("pp", "dp", "tp"))
    fitted: set[int] = set()
    order = []
    for n, _, _, m, mode in _attempts([(a, 0, [384]), (b, 0, [192])], ["auto", "full"], fitted):
        order.append((m, mode))
        if (m, mode) == (192, "auto"):
            fitted.add(n)                                # the second layout fits without recomputation
    assert order == [(384, "auto"), (384, "full"), (192, "auto"), (192, "full")]
    order = [(m, mode) for n, _, _, m, mode in _attempts([(a, 0, [384]), (b, 0, [192])], ["auto", "full"], {0, 1})]
    assert order == [(384, "auto"), (192, "auto"), (384, "full"), (192, "full")]

"""Symbolic costs: the plan's costs as expressions of batch B and sequence S.

The proof: evaluated at the planned size they are the plan's own prediction, and at another size
they are what the numeric cost model and the planner give on a fresh capture at that size with
the same placements, without tracing again.
"""
from __future__ import annotations

import pytest
import sympy
import torch

from autopar import AutoparError, MeshSpec
from autopar.api import plan as make_plan
from autopar.core.capture import capture
from autopar.core.execution import VIEW_OPS
from autopar.core.plan import Plan
from autopar.core.strategies import build_space
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.zoo import get_model
from autopar.planning.planner import plan_captured
from autopar.planning.symbolic import B, GraphMismatchError, S, align_plan, closed_forms, symbolic_plan_costs
from cost_models.estimate import CostModel
from cost_models.schedule import Timeline, step_costs
from tests.tiers import slow

# name: (zoo model, mesh, planned (batch, seq), re-costed (batch, seq))
CASES = {
    "gpt-tiny-1d": ("gpt-tiny", (2,), (64, 32), (24, 64)),
    "gpt2-tiny-1d": ("gpt2-tiny", (2,), (8, 32), (20, 48)),
    "gpt-tiny-2d": ("gpt-tiny", (2, 2), (64, 64), (24, 48)),
}
REL = 1e-9


def _close(a: float, b: float, rel: float = REL) -> bool:
    return a == pytest.approx(b, rel=rel, abs=1e-12)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    name, mesh, planned, other = CASES[request.param]
    entry = get_model(name)
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(*planned, device="meta")
    plan = make_plan(model, MeshSpec(mesh), args, kwargs)
    plan = Plan.from_json(plan.to_json())   # costed from the plan file's placements
    costs = symbolic_plan_costs(model, plan, args, kwargs)
    return entry, model, plan, costs, planned, other


def _numeric(entry, model, plan: Plan, batch: int, seq: int, picks=None):
    """A fresh capture at (batch, seq) with the plan's placements: the planner's prediction (all
    nodes forced) and the numeric per-node costs with their closed forms."""
    args, kwargs = entry.example(batch, seq, device="meta")
    captured = capture(model, args, kwargs)
    space = build_space(captured, plan.mesh)
    chosen, _, _ = align_plan(plan, space)
    forced = {}
    for nc, want in zip(space.nodes, chosen, strict=True):
        if nc.kind == "alias":
            continue
        same = [s for s in nc.strategies if (s.out, s.ins, s.storage) == (want.out, want.ins, want.storage)]
        assert same, f"{nc.node.name}: the plan's placement is no candidate at {batch}x{seq}"
        forced[nc.node.name] = same[0]
    replanned = plan_captured(captured, plan.mesh, forced=forced)
    assert [(n.out, n.ins, n.storage) for n in replanned.nodes] == [(n.out, n.ins, n.storage) for n in plan.nodes]
    model_costs = CostModel(plan.mesh, space)
    costs, queued = step_costs(space, model_costs, chosen)
    forms = closed_forms(costs, queued, Timeline(space), plan.mesh.axis_names, picks)
    # over every synchronisation, the closed form of the exposed time is the schedule's own
    exact = closed_forms(costs, queued, Timeline(space), plan.mesh.axis_names)["exposed_comm_s"]
    assert _close(exact, replanned.predicted.exposed_comm_s)
    flops = sum(model_costs.flops(nc.node) for nc in space.nodes if nc.kind == "op" and nc.node.target not in VIEW_OPS)
    return replanned, forms, flops


def _check_schedule(costs, plan: Plan, batch: int, seq: int) -> None:
    sim, p = costs.simulate(batch, seq), plan.predicted
    for got, want in ((sim.step_s, p.step_time_s), (sim.compute_s, p.compute_s), (sim.comm_s, p.comm_s),
                      (sim.overlap_s, p.overlapped_comm_s), (sim.exposed_s, p.exposed_comm_s),
                      (sim.peak_bytes, p.peak_memory_bytes)):
        assert _close(got, want), (got, want)
    assert sim.at_peak == pytest.approx(p.memory_breakdown, rel=REL)
    assert sim.peak_at == p.peak_at


@slow
def test_planned_size_is_the_plans_prediction(case):
    _, _, plan, costs, (b, s), _ = case
    assert costs.planned == (b, s)
    at, p = costs.at(b, s), plan.predicted
    assert _close(at["compute_s"], p.compute_s)
    assert _close(at["comm_s"], p.comm_s)
    assert _close(at["overlapped_comm_s"], p.overlapped_comm_s)
    assert _close(at["exposed_comm_s"], p.exposed_comm_s)     # the closed form is exact at the planned size
    assert _close(at["step_time_s"], p.step_time_s)
    for axis, sent in p.comm_bytes.items():
        assert _close(at[f"comm_bytes_{axis}"], sent)
    assert _close(at["activation_bytes"], sum(n.saved_bytes for n in plan.nodes))
    held = at["state_bytes"] + at["activation_bytes"] + at["gradient_bytes"]
    assert _close(held, sum(n.memory_bytes for n in plan.nodes))
    _check_schedule(costs, plan, b, s)


def test_other_size_is_the_numeric_cost_model_on_a_fresh_capture(case):
    entry, model, plan, costs, _, (b, s) = case
    replanned, forms, flops = _numeric(entry, model, plan, b, s, costs.exposed_picks)
    at = costs.at(b, s)
    for key, value in forms.items():
        if key == "comm_bytes":
            for axis, sent in value.items():
                assert _close(at[f"comm_bytes_{axis}"], sent), axis
        else:
            assert _close(at[key], value), (key, at[key], value)
    assert _close(at["flops"], flops)
    _check_schedule(costs, replanned, b, s)
    assert at["exposed_comm_s"] <= replanned.predicted.exposed_comm_s * (1 + REL)   # elsewhere a lower bound


def test_the_case_communicates(case):
    """The cases are chosen so that communication terms are exercised, not all zero."""
    _, _, plan, costs, (b, s), _ = case
    assert costs.at(b, s)["overlapped_comm_s"] > 0 or costs.at(b, s)["comm_s"] > 0


def test_growth_in_batch_and_sequence(case):
    _, _, _, costs, (_, s), _ = case
    # ~linear in B: each op's roofline max(compute, memory) is linear in B once past its crossover
    compute = [costs.at(b, s)["compute_s"] for b in (256, 512, 768, 1024)]
    steps = [y - x for x, y in zip(compute, compute[1:], strict=False)]
    assert steps[0] > 0 and steps == pytest.approx([steps[0]] * 3, rel=1e-3)
    assert 1.5 < compute[1] / compute[0] <= 2.0
    flops = sympy.Poly(sympy.expand(costs.flops), B, S).as_dict()
    assert max(k[0] for k in flops) == 1        # FLOPs linear in B
    assert flops.get((1, 2), 0) > 0             # attention: B*S**2 (meta runs SDPA's math, counted)
    assert costs.compute_s.has(S ** 2)
    assert costs.activation_bytes.free_symbols == {B, S}
    assert costs.state_bytes.free_symbols <= {B, S}   # token inputs are state
    assert not costs.gradient_bytes.free_symbols      # parameters do not grow with the batch


def test_describe_and_limits(case):
    entry, _, _, costs, _, _ = case
    text = costs.describe()
    assert "step time" in text and "peak memory" in text and "B*S" in text
    assert len(text.splitlines()) <= 13 and max(len(line) for line in text.splitlines()) < 400
    if any(size == B for size, _ in costs.sharded):   # the batch is split: one sample is too few
        with pytest.raises(AutoparError, match="some device gets none"):
            costs.at(1, 32)
    if entry.name == "gpt-tiny":   # block_size 64: export found the limit
        assert costs.limits["S"] == (1, 64)
        with pytest.raises(AutoparError, match="S <= 64"):
            costs.at(8, 65)


def test_graph_mismatch_is_a_clear_error():
    entry = get_model("gpt-tiny")
    with torch.device("meta"):
        two = entry.build()
        one = GPT(GPTConfig(n_layer=1))
    args, kwargs = entry.example(4, 16, device="meta")
    plan = make_plan(two, MeshSpec((2,)), args, kwargs)
    with pytest.raises(GraphMismatchError, match="differs from the one plan"):
        symbolic_plan_costs(one, plan, args, kwargs)
    with torch.device("meta"):
        other = get_model("llama-tiny").build()
    with pytest.raises(GraphMismatchError, match="another model"):
        symbolic_plan_costs(other, plan, *get_model("llama-tiny").example(4, 16, device="meta"))


def test_batch_of_one_is_still_symbolic():
    """Export fixes a dim of size 1; the capture uses size 2 instead, so B stays a symbol."""
    entry = get_model("gpt-tiny")
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(1, 16, device="meta")
    plan = make_plan(model, MeshSpec((2,)), args, kwargs)
    costs = symbolic_plan_costs(model, plan, args, kwargs)
    assert B in costs.compute_s.free_symbols and costs.planned == (1, 16)
    _check_schedule(costs, plan, 1, 16)

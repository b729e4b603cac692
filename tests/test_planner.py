"""Planning behaviour: plans move as the costs say, errors are clear, plans round-trip and repeat."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

import autopar
from autopar import MeshSpec
from tests.equivalence import meta_model
from tests.tiers import slow


def test_large_batch_small_model_is_data_parallel():
    # Enough tokens that compute, not collective latency, dominates on an H100.
    model, args, kwargs = meta_model("gpt-tiny", 1024, 64)
    plan = autopar.plan(model, MeshSpec((4,), hardware="h100-80gb"), args, kwargs)
    linears = [n for n in plan.nodes if n.op == "aten.linear.default"]
    assert linears and all(n.strategy == "batch" for n in linears), [(n.name, n.strategy) for n in linears]
    replicated = autopar.plan(model, MeshSpec((1,), hardware="h100-80gb"), args, kwargs)
    assert plan.predicted.step_time_s < 0.5 * replicated.predicted.step_time_s


def test_small_budget_shards_parameters_and_fits():
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    replicated = autopar.plan(model, MeshSpec((1,)), args, kwargs).predicted.peak_memory_bytes
    budget = 0.45 * replicated
    plan = autopar.plan(model, MeshSpec((4,)), args, kwargs, memory_budget=budget)
    sharded = [n for n in plan.parameters.values() if n.storage != (Replicate(),)]
    assert sharded, "a budget below replication must shard parameters (tensor parallel or ZeRO-3)"
    assert plan.predicted.peak_memory_bytes <= budget


def test_infeasible_budget_states_minimum(monkeypatch):
    from autopar.planning import planner

    def costed(*args, **kwargs):
        raise AssertionError("hand plans costed for a budget that no plan can fit")

    monkeypatch.setattr(planner, "standard_plans", costed)   # the bound says so before any plan is costed
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    with pytest.raises(autopar.InfeasibleError) as info:
        autopar.plan(model, MeshSpec((2,)), args, kwargs, memory_budget=1000)
    assert info.value.min_memory_bytes > 1000
    message = str(info.value)
    from autopar.core.units import fmt

    assert "budget is 1000 B per device" in message, message
    assert f"needs {fmt(info.value.min_memory_bytes, 'B')}" in message and "Largest contributors" in message, message
    assert "linear_2 in transformer.h.0.mlp.c_fc" in message, message   # activations kept for the backward, by layer
    assert "precision='bf16'" in message, message


@slow
def test_plan_is_deterministic_and_json_round_trips(tmp_path):
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    a = autopar.plan(model, MeshSpec((2, 2)), args, kwargs)
    b = autopar.plan(model, MeshSpec((2, 2)), args, kwargs)
    assert [(n.name, n.out, n.ins, n.storage) for n in a.nodes] == [(n.name, n.out, n.ins, n.storage) for n in b.nodes]
    path = tmp_path / "plan.json"
    a.to_json(str(path))
    back = autopar.Plan.from_json(str(path))
    assert back.to_json() == a.to_json()
    assert back.nodes == a.nodes and back.predicted == a.predicted
    report = a.report()
    assert "GPT" in report


@slow
def test_plan_predictions_are_in_seconds_and_bytes_per_axis():
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    plan = autopar.plan(model, MeshSpec((2, 2), ("dp", "tp"), hardware="h100-80gb"), args, kwargs)
    p = plan.predicted
    assert p.step_time_s > 0 and p.peak_memory_bytes > 0
    assert set(p.comm_bytes) == {"dp", "tp"}
    assert abs(p.step_time_s - (p.compute_s + p.comm_s + p.exposed_comm_s)) < 1e-12


def test_foreign_and_stale_plan_files_are_refused(tmp_path):
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    plan = autopar.plan(model, MeshSpec((2,)), args, kwargs)
    other = autopar.plan(model, MeshSpec((2,)), *meta_model("gpt-tiny", 8, 16)[1:])
    with pytest.raises(autopar.PlanFileError, match="another model or input shapes"):
        other.check_matches(plan.fingerprint, plan.mesh)
    with pytest.raises(autopar.PlanFileError, match="mesh_dim_names"):
        plan.check_matches(plan.fingerprint, MeshSpec((2,), ("tp",)))
    with pytest.raises(autopar.PlanFileError, match="costed for cpu"):
        plan.check_matches(plan.fingerprint, MeshSpec((2,), hardware="h100-80gb"))
    d = json.loads(plan.to_json())
    d["version"] = 999
    with pytest.raises(autopar.PlanFileError, match="version"):
        autopar.Plan.from_json(json.dumps(d))
    with pytest.raises(autopar.PlanFileError, match="not an autopar plan"):
        autopar.Plan.from_json(json.dumps({"hello": 1}))
    bad = tmp_path / "x.json"
    bad.write_text("not json")
    with pytest.raises(autopar.PlanFileError, match="not valid JSON"):
        autopar.Plan.from_json(str(bad))


def test_mesh_must_be_devicemesh_or_meshspec():
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    with pytest.raises(autopar.MeshError, match="DeviceMesh or an autopar.MeshSpec"):
        autopar.plan(model, (2, 2), args, kwargs)
    with pytest.raises(autopar.MeshError):
        MeshSpec((2, 0))


def test_inputs_that_do_not_match_forward():
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    with pytest.raises(autopar.InputMismatchError, match="forward"):
        autopar.plan(model, MeshSpec((2,)), args + (args[0], args[0]), kwargs)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: cannot be captured
            return self.lin(x)
        return x


def test_untraceable_model_names_the_line():
    with pytest.raises(autopar.CaptureError, match=r"test_planner.py:\d+.*x.sum\(\) > 0.*control flow on tensor values"):
        autopar.plan(DataDependent(), MeshSpec((2,)), (torch.randn(2, 4),))


class MissingAttribute(nn.Module):
    def forward(self, x):
        return x * self.scale   # never set: fails eagerly too


def test_a_model_failing_eagerly_is_not_blamed_on_control_flow():
    with pytest.raises(autopar.CaptureError, match=r"AttributeError.*runs eagerly") as info:
        autopar.plan(MissingAttribute(), MeshSpec((2,)), (torch.randn(2, 4),))
    assert "control flow" not in str(info.value)


class Flip(nn.Module):
    """``torch.flip``: an op no rule covers yet."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.flip(self.lin(x), dims=[1]).sum()


def test_unknown_op_falls_back_to_replication_with_warning(caplog):
    plan = autopar.plan(Flip(), MeshSpec((2,)), (torch.randn(6, 4),))
    assert any("aten.flip" in w for w in plan.warnings), plan.warnings
    node = next(n for n in plan.nodes if "flip" in n.op)
    assert node.out == (Replicate(),) and node.strategy == "replicate"


def test_unknown_op_still_trains_correctly():
    from autopar.profiling.launch import per_rank, run_on_local_tensor_mesh

    torch.manual_seed(0)
    x = torch.randn(6, 4)
    ref = Flip()
    model = Flip()
    model.load_state_dict(ref.state_dict())
    ref(x).backward()

    def body(mesh):
        pm = autopar.compile(model, mesh, (x,))
        loss = pm(x)
        loss.backward()
        whole = {k: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for k, p in pm.named_parameters()}
        return [float(v) for v in per_rank(loss)], {k: per_rank(g)[0].clone() for k, g in whole.items()}

    losses, grads = run_on_local_tensor_mesh(body, (2,))
    assert all(abs(v - ref(x).item()) < 1e-5 for v in losses)
    for k, p in ref.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-5)


def test_options_are_declared_once_and_checked():
    """``PlanOptions`` is what plan, compile and the hand plans take: the keyword form and the
    object form are the same plan, and a misspelt or out-of-range option says what is allowed."""
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    mesh = MeshSpec((2,), hardware="h100-80gb")
    by_keyword = autopar.plan(model, mesh, args, kwargs, memory_budget=2**30, hand_plans=False)
    by_object = autopar.plan(model, mesh, args, kwargs, options=autopar.PlanOptions(memory_budget=2**30,
                                                                                     hand_plans=False))
    assert by_keyword.nodes == by_object.nodes and "hand_plans" not in by_keyword.solver
    with pytest.raises(autopar.AutoparError, match="memory_budgte.*the options are memory_budget, time_limit"):
        autopar.plan(model, mesh, args, kwargs, memory_budgte=2**30)
    with pytest.raises(autopar.AutoparError, match="unknown optimizer 'lamb'"):
        autopar.PlanOptions(optimizer="lamb")
    with pytest.raises(autopar.AutoparError, match="time_limit"):
        autopar.PlanOptions(time_limit=0)


def test_forcing_a_node_that_is_not_there_or_a_strategy_it_lacks_is_refused():
    from autopar.core.capture import capture
    from autopar.core.strategies import build_space
    from autopar.planning.planner import plan_captured

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    captured = capture(model, args, kwargs)
    mesh = MeshSpec((2,), hardware="h100-80gb")
    space = build_space(captured, mesh)
    linear = next(nc for nc in space.nodes if nc.kind == "op" and "linear" in str(nc.node.target))
    with pytest.raises(autopar.AutoparError, match="cannot force node 'no_such_node'"):
        plan_captured(captured, mesh, forced={"no_such_node": linear.strategies[0]})
    foreign = next(s for nc in space.nodes for s in nc.strategies if s not in linear.strategies)
    with pytest.raises(autopar.AutoparError, match=f"cannot force {linear.node.name} to .*not one of its candidate"):
        plan_captured(captured, mesh, forced={linear.node.name: foreign})


def test_an_op_whose_flops_cannot_be_counted_is_named_in_the_plan(monkeypatch):
    """The FLOP counter failing on an op is not silent: the plan's warnings name the op and say
    it is costed as memory-bound."""
    import cost_models.estimate as estimate

    class Broken:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            raise RuntimeError("no fake kernel")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(estimate, "FlopCounterMode", Broken)
    monkeypatch.setattr(estimate, "_FLOP_COUNTS", {})   # counted afresh, and the failures forgotten after
    plan = autopar.plan(Flip(), MeshSpec((2,)), (torch.randn(6, 4),), profile=None, hand_plans=False)
    flop_warnings = [w for w in plan.warnings if "cannot count the FLOPs" in w]
    assert any("aten.linear" in w and "no fake kernel" in w and "memory-bound" in w for w in flop_warnings), plan.warnings


def _made_partial_for_nothing(captured, plan) -> list[str]:
    """Inputs a plan moves from replicated to partial on an axis where every other input of the
    op is replicated there: the op's result is then partial only because of the move, and is
    all-reduced back to where it came from, moving data for nothing. (Where another input is
    split or partial on the axis, as a residual added to a row-parallel output, the sum is owed
    anyway and the move is free.)"""
    from torch.distributed.tensor import Partial

    from autopar.core.capture import flat_tensor_inputs

    placed = {n.name: n for n in plan.nodes}
    found = []
    for node in captured.graph.nodes:
        np_ = placed.get(node.name)
        for i, (inp, want) in enumerate(zip(flat_tensor_inputs(node), np_.ins if np_ else (), strict=False)):
            have = placed[inp.name].out if inp.name in placed else ()
            for a, (h, w) in enumerate(zip(have, want, strict=False)):
                others = [ins[a] for j, ins in enumerate(np_.ins) if j != i]
                if isinstance(h, Replicate) and isinstance(w, Partial) and all(isinstance(o, Replicate) for o in others):
                    found.append(f"{inp.name} -> {node.name} on axis {a}")
    return found


@slow
def test_demo_plan_moves_no_value_back_where_it_came_from():
    """The issue-17 demo plan (gpt-tiny 32 x 64 on 2x2) made a replicated value partial and
    all-reduced it back: a collective that returns data where it came from. Neither the demo's
    auto plan nor any hand plan does."""
    from dataclasses import replace

    from torch.distributed.tensor import Partial

    from autopar.core.capture import capture, flat_tensor_inputs
    from autopar.models.zoo import get_model
    from autopar.planning.baselines import candidates

    entry = get_model("gpt-tiny")
    model = entry.build()
    args, kwargs = entry.example(32, 64, device="cpu")
    captured = capture(model, args, kwargs)
    plans = {"auto": autopar.plan(model, MeshSpec((2, 2)), args, kwargs, profile=None),
             **candidates(model, MeshSpec((2, 2)), args, kwargs, profile=None)}
    for name, plan in plans.items():
        assert _made_partial_for_nothing(captured, plan) == [], name
    # the check finds one: an op of the tensor-parallel plan reading an activation replicated on
    # tp (as its other inputs are), made to read it partial there
    tp = plans["dp(dp) x tp(tp)"]
    placed = {n.name: n for n in tp.nodes}
    node, i = next((node, i) for node in captured.graph.nodes if node.name in placed
                   for i, inp in enumerate(flat_tensor_inputs(node))
                   if inp.name in placed and placed[inp.name].out[1] == Replicate()
                   and all(ins[1] == Replicate() for ins in placed[node.name].ins))
    ins = list(placed[node.name].ins)
    ins[i] = (ins[i][0], Partial())
    wasteful = replace(tp, nodes=[replace(n, ins=tuple(ins)) if n.name == node.name else n for n in tp.nodes])
    assert len(_made_partial_for_nothing(captured, wasteful)) == 1


def test_a_plan_says_whether_a_profile_priced_it():
    """The demo's hint to run `autopar profile` and the symbolic costs' warning both read this."""
    from dataclasses import replace

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    predicted = autopar.plan(model, MeshSpec((2,)), args, kwargs, profile=None).predicted
    assert predicted.cost_source.startswith("no profile") and not predicted.profiled
    assert replace(predicted, cost_source="profile AMD EPYC: 90% of compute time measured").profiled


def test_warnings_that_say_the_same_of_each_layer_are_one_line():
    from autopar.core.report import grouped_warnings

    said = ["h.0.mlp: no rule, runs replicated", "aten.foo has no rule", "h.2.mlp: no rule, runs replicated",
            "h.1.mlp: something else", "h.1.mlp: no rule, runs replicated", "embed: no rule, runs replicated"]
    assert grouped_warnings(said) == ["h.[0-2].mlp (3): no rule, runs replicated", "aten.foo has no rule",
                                      "h.1.mlp: something else", "embed: no rule, runs replicated"]

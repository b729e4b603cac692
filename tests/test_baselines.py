"""Hand plans (``autopar.planning.baselines``): the standard strategies, costed like the auto plan, run
exactly like any plan, never beat it, and say when they do not fit."""
from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar import MeshSpec
from autopar.core.errors import AutoparError
from autopar.planning.baselines import candidates
from tests.equivalence import build, check_training, local_runner, make_batches, meta_model
from tests.tiers import slow

R = Replicate()


@slow
def test_standard_strategies_are_what_they_say():
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    plans = candidates(model, MeshSpec((2, 2), axis_names=("dp", "tp"), hardware="h100-80gb"), args, kwargs)
    assert {"ddp", "fsdp", "dp(dp) x tp(tp)", "dp(dp) x tp+sp(tp)", "fsdp(dp) x tp(tp)", "dp(dp) x fsdp(tp)"} <= set(plans)
    params = {name: plan.parameters for name, plan in plans.items()}
    assert all(p.storage == (R, R) and p.out == (R, R) for p in params["ddp"].values())
    for kind, kept in (("fsdp", False), ("zero2", True)):   # ZeRO-3 gathers on use, ZeRO-2 keeps the gathered copy
        assert all(p.out == (R, R) and all(isinstance(s, Shard) for s in p.storage) and p.kept == kept
                   for p in params[kind].values() if p.storage != (R, R))   # tiny 1-D params may not split 4 ways
    megatron = params["dp(dp) x tp(tp)"]
    for fqn in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"):
        assert megatron[fqn].out[0] == R and isinstance(megatron[fqn].out[1], Shard), (fqn, megatron[fqn])
    # Megatron's pairs: the MLP's first matrix split by output features, its second by input features
    fc, proj = megatron["transformer.h.0.mlp.c_fc.weight"], megatron["transformer.h.0.mlp.c_proj.weight"]
    assert (fc.out[1], proj.out[1]) == (Shard(0), Shard(1))
    # sequence parallel: the residual stream is split along the sequence on the tensor axis
    sp = plans["dp(dp) x tp+sp(tp)"]
    adds = [n for n in sp.nodes if n.op == "aten.add.Tensor" and n.out[1] == Shard(1)]
    assert len(adds) >= 4, [(n.name, n.out) for n in sp.nodes if n.op == "aten.add.Tensor"]
    # costed like the auto plan: it is never worse than any of them
    auto = autopar.plan(model, MeshSpec((2, 2), axis_names=("dp", "tp"), hardware="h100-80gb"), args, kwargs)
    assert auto.predicted.step_time_s <= min(p.predicted.step_time_s for p in plans.values()) * (1 + 1e-9)
    # the pipeline plans over the first axis (Megatron 3-D) are candidates too; on one node the
    # planner weighs none (its solver lists the plans without a pipeline)
    piped = {name for name, p in plans.items() if p.pipeline is not None}
    assert piped and all(name.startswith("pp(dp, ") for name in piped)
    assert set(auto.solver["hand_plans"]) == set(plans) - piped


def test_data_parallel_hand_plans_never_split_attention_by_sequence():
    """'dp', 'fsdp' and ZeRO split the batch; attention run as a ring over their axis (split by
    sequence, keys and values passed round) is context parallelism, which only the "cp" plans
    are. On llama-tiny at 2x2, rings tie with the batch split here and 'ddp' once ran one."""
    model, args, kwargs = meta_model("llama-tiny", 6, 16)
    names = ["ddp", "fsdp", "zero1", "dp(dp) x fsdp(tp)", "fsdp(dp) x fsdp+cp(tp)"]
    plans = candidates(model, MeshSpec((2, 2)), args, kwargs, names=names)
    assert set(plans) == set(names)
    assert [n for n, p in plans.items() if p.context_parallel is not None] == ["fsdp(dp) x fsdp+cp(tp)"]


@slow
def test_hand_plan_that_does_not_fit_is_kept_with_its_shortfall():
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    mesh = MeshSpec((4,), hardware="h100-80gb")
    free = candidates(model, mesh, args, kwargs)
    ddp, fsdp = free["ddp"].predicted.peak_memory_bytes, free["fsdp"].predicted.peak_memory_bytes
    assert fsdp < ddp
    budget = (ddp + fsdp) / 2
    plans = candidates(model, mesh, args, kwargs, memory_budget=budget)
    assert not plans["ddp"].feasible
    assert plans["ddp"].shortfall_bytes == pytest.approx(plans["ddp"].predicted.peak_memory_bytes - budget)
    assert plans["fsdp"].feasible and plans["fsdp"].predicted.peak_memory_bytes <= budget
    auto = autopar.plan(model, mesh, args, kwargs, memory_budget=budget)
    assert auto.feasible and auto.solver["hand_plans"]["ddp"]["feasible"] is False


@pytest.mark.parametrize("mesh", [(4,), (2, 2)], ids=["4", "2x2"])
@slow
def test_every_hand_plan_trains_exactly(mesh):
    batch, seq = 6, 16
    args, kwargs = make_batches("gpt-tiny", batch, seq, steps=1)[0]
    plans = candidates(build("gpt-tiny"), MeshSpec(mesh), args, kwargs)
    piped = {name for name, p in plans.items() if p.pipeline is not None}   # trained in tests/test_pipeline.py
    assert len(plans) - len(piped) == (7 if len(mesh) == 1 else 14)   # FSDP x CP (and x TP) among them
    # 1F1B over the first axis (the 1-D mesh cut in two: pp=2 x 2), each stage one of the other axis's 6 plans
    assert len(piped) == 6 and all(n.startswith("pp(pp=2, 1F1B)" if len(mesh) == 1 else "pp(dp, 1F1B)") for n in piped)
    for name, plan in plans.items():
        if name in piped:
            continue
        got = check_training("gpt-tiny", batch, seq, mesh, local_runner, {"plan": plan})
        assert got.name == name


def test_a_fitting_hand_plan_replaces_a_solver_plan_that_does_not_fit(monkeypatch):
    """After its memory repairs the solver's plan may still overshoot the budget (a time limit, the
    ILP's cuts); a hand plan that fits is then returned instead, saying why."""
    from dataclasses import replace

    import autopar.planning.planner as planner

    solve = planner.solve_planning

    def overshooting(planning, **kwargs):
        plan, choices = solve(planning, **kwargs)
        return replace(plan, feasible=False, shortfall_bytes=1e6), choices

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    monkeypatch.setattr(planner, "solve_planning", overshooting)   # the auto solve only: hand plans import theirs
    plan = autopar.plan(model, MeshSpec((4,), hardware="h100-80gb"), args, kwargs)
    fastest = min((name for name, h in plan.solver["hand_plans"].items() if h["feasible"]),
                  key=lambda name: plan.solver["hand_plans"][name]["step_time_s"])
    assert plan.feasible and plan.solver["kept_hand_plan"] == fastest and plan.name == "auto"
    assert any("exceeds the memory budget" in w for w in plan.warnings)


def test_a_solver_plan_must_beat_the_best_hand_plan_by_min_gain(monkeypatch):
    """A solver plan predicted only 2% faster than the best fitting hand plan is inside the cost
    model's error: the hand plan is returned, saying by how much; with ``min_gain=0`` the solver's
    plan is. A min_gain outside [0, 1) is refused."""
    from dataclasses import replace

    import autopar.planning.planner as planner

    solve = planner.solve_planning
    best: dict[str, float] = {}

    def slightly_faster(planning, **kwargs):
        plan, choices = solve(planning, **kwargs)
        return replace(plan, predicted=replace(plan.predicted, step_time_s=0.98 * best["s"])), choices

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    mesh = MeshSpec((4,), hardware="h100-80gb")
    hands = autopar.plan(model, mesh, args, kwargs).solver["hand_plans"]
    fastest = min((n for n, h in hands.items() if h["feasible"]), key=lambda n: hands[n]["step_time_s"])
    best["s"] = hands[fastest]["step_time_s"]
    monkeypatch.setattr(planner, "solve_planning", slightly_faster)   # the auto solve only
    kept = autopar.plan(model, mesh, args, kwargs)
    assert kept.solver["kept_hand_plan"] == fastest and kept.predicted.step_time_s == pytest.approx(best["s"])
    assert any("2.0% faster" in w and "min_gain" in w for w in kept.warnings)
    solved = autopar.plan(model, mesh, args, kwargs, min_gain=0.0)
    assert "kept_hand_plan" not in solved.solver and solved.predicted.step_time_s == pytest.approx(0.98 * best["s"])
    with pytest.raises(AutoparError, match="min_gain"):
        autopar.plan(model, mesh, args, kwargs, min_gain=1.5)


@slow
def test_hand_plans_together_keep_to_their_share_of_the_deadline(monkeypatch):
    """All hand plans together may take ``share`` of the time left, split evenly; the rest is the
    auto plan's. (Before: each took ``share`` of what the earlier ones left, 75% in all on 3-D.)
    Each fake solve uses all of its time, on a fake clock; once the share is spent, no hand plan
    is solved past it (each used to get the least solve time again), and the clock says which."""

    from types import SimpleNamespace

    from autopar.core.capture import capture
    from autopar.planning import baselines
    from autopar.planning.clock import Clock
    from autopar.planning.problem import prepare

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    planning = prepare(capture(model, args, kwargs), MeshSpec((2, 2, 2), hardware="h100-80gb"))
    given = []

    def fake_solve(planning, *, deadline, **kwargs):   # each solve is charged all its part
        given.append(deadline.left())
        deadline.clock.spent = deadline.end
        return SimpleNamespace(context_parallel=None), ()   # a plan with no ring to check

    monkeypatch.setattr(baselines, "solve_planning", fake_solve)
    clock = Clock(100.0, deterministic=True)
    plans = baselines.hand_plans(planning, deadline=clock.deadline(), share=0.4)
    left = clock.deadline().end
    assert len(plans) == len(given) == 22   # 20, and torchtitan's FSDP x CP and FSDP x TP x CP
    assert clock.spent == pytest.approx(0.4 * left)            # all within 40% of the time left
    assert given == pytest.approx([0.4 * left / 22] * 22)      # an even part each

    def overrunning(planning, *, deadline, **kwargs):           # the first solve is charged the whole share
        deadline.clock.spent = deadline.end + 0.4 * left
        return SimpleNamespace(context_parallel=None), ()

    monkeypatch.setattr(baselines, "solve_planning", overrunning)
    clock = Clock(100.0, deterministic=True)
    assert len(baselines.hand_plans(planning, deadline=clock.deadline(), share=0.4)) == 1
    assert len(clock.cut_short) == 21 and all("not costed" in c for c in clock.cut_short)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-tiny"])
@slow
def test_ddp_hand_plan_communicates_as_ddp_does(name):
    """Pure data parallelism: position ids and their embedding (no batch) are computed on every
    rank, their gradient stays partial to the parameter, and the generated forward communicates
    nothing (its only moves cut a replicated attention mask to this rank's samples): the only
    collectives are the loss's single all-reduce and gradient sync's buckets."""
    from autopar.core.capture import capture
    from codegen.generate import generate

    args, kwargs = make_batches(name, 8, 16, steps=1)[0]
    model = build(name)
    plan = candidates(model, MeshSpec((4,)), args, kwargs, names=["ddp"])["ddp"]
    code = generate(capture(model, args, kwargs), plan)
    moves = [line for line in code.source.splitlines() if "move(" in line]
    assert all("# local slice on x; backward: all-gather" in line for line in moves), moves
    assert "param_shard(" not in code.source and "redistribute(" not in code.source
    assert code.source.count("summed_over=(0,)") == 1
    assert all(isinstance(g[0], type(Partial())) for g in code.direct.values())


def test_candidates_cost_only_the_plans_named():
    """``names`` costs the plans asked for (a pipeline by its full name too) and no other, each as
    the whole list costs it; a name the mesh has no plan of is refused with the names it has."""
    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    mesh = MeshSpec((2, 2), hardware="h100-80gb")
    every = candidates(model, mesh, args, kwargs, profile=None, deterministic=True)
    pipeline = next(name for name in every if name.startswith("pp("))
    asked = ["fsdp(dp) x tp(tp)", pipeline]
    some = candidates(model, mesh, args, kwargs, profile=None, deterministic=True, names=asked)
    assert list(some) == asked
    for name in asked:
        assert some[name].parameters == every[name].parameters
        assert some[name].predicted.step_time_s == pytest.approx(every[name].predicted.step_time_s)
    with pytest.raises(AutoparError, match=r"no hand plan named 'tp\(dp\)'.*'fsdp\(dp\) x tp\(tp\)'"):
        candidates(model, mesh, args, kwargs, profile=None, names=["tp(dp)"])

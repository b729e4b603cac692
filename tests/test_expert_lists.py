"""A hand-written mixture of experts (``autopar/models/moe.py``: a ModuleList of SwiGLU experts, each
picking its tokens with ``torch.where``) found in the graph and run as one op
(``autopar.core.expert_lists``): trained exactly with its experts split by expert, on gloo
processes and a simulated 2x2 mesh, with uneven routing; a loop that computes anything else is
refused, saying why."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.core.capture import capture
from autopar.core.errors import AutoparError, CaptureError
from autopar.core.mesh import MeshSpec
from autopar.core.ops.moe import MOE
from autopar.models import moe as hand_moe
from autopar.planning.options import PlanOptions
from tests.equivalence import (
    build,
    check_training,
    expert_parallel_plan,
    gloo_runner,
    local_runner,
    make_batches,
    recording_dispatch,
)
from tests.tiers import slow

NAME = hand_moe.NAME
TINY = hand_moe.TINY
BATCHES = make_batches(NAME, 2, 4)   # 8 tokens a step: some rank sends some expert none


def _plan(mesh_shape: tuple[int, ...], axis: str, hand: str | None = None) -> autopar.Plan:
    return expert_parallel_plan(NAME, BATCHES, mesh_shape, axis, hand)


def test_the_loop_over_experts_is_captured_as_one_op_on_their_weights_stacked():
    args, kwargs = BATCHES[0]
    captured = capture(build(NAME), args, kwargs)
    moes = [n for n in captured.graph.nodes if n.target is MOE]
    assert len(moes) == TINY.layers
    gate_up, down = moes[0].args[3:]
    assert tuple(gate_up.meta["val"].shape) == (TINY.experts, 2 * TINY.intermediate, TINY.hidden)
    gate, up = (captured.param_of[p.name] for p in gate_up.args[0])   # cat([gate, up], 1): each a stacked parameter
    assert (gate, up) == ("blocks.0.moe.experts.w1_weight", "blocks.0.moe.experts.w3_weight")
    assert captured.param_of[down.name] == "blocks.0.moe.experts.w2_weight"
    assert captured.stacked[gate] == tuple(f"blocks.0.moe.experts.{e}.w1.weight" for e in range(TINY.experts))
    assert captured.stacked["blocks.1.moe.experts.w2_weight"] == tuple(
        f"blocks.1.moe.experts.{e}.w2.weight" for e in range(TINY.experts))
    assert not any(n.target is torch.ops.aten.stack.default for n in captured.graph.nodes)
    assert not any(n.target is torch.ops.aten.where.default for n in captured.graph.nodes)
    assert sum("hand-written list of 4 experts (gated silu MLPs)" in w for w in captured.warnings) == TINY.layers


class _Tutorial(nn.Module):
    """A MoE as tutorials write it: ``nn.Sequential`` experts with biases, an indexed ``+=``."""

    def __init__(self) -> None:
        super().__init__()
        h = TINY.hidden
        self.router = nn.Linear(h, TINY.experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
                                     for _ in range(TINY.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(TINY.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out[token] += weights[token, slot, None] * expert(x[token])
        return out


def test_sequential_experts_with_biases_are_captured_with_their_biases_stacked():
    captured = capture(_Tutorial(), (torch.randn(8, TINY.hidden),))
    (moe,) = [n for n in captured.graph.nodes if n.target is MOE]
    assert moe.args[5] == "gelu" and [tuple(a.meta["val"].shape) for a in moe.args[3:5] + moe.args[6:]] == [
        (4, 4 * TINY.hidden, TINY.hidden), (4, TINY.hidden, 4 * TINY.hidden), (4, 4 * TINY.hidden), (4, TINY.hidden)]
    assert captured.stacked[captured.param_of[moe.args[7].name]] == tuple(f"experts.{e}.2.bias" for e in range(4))


@pytest.mark.parametrize("name, choice", [
    ("autopar.models.moe:build_gelu", {"axis": "dp", "within": "tp"}),
    ("autopar.models.moe:build_relu_biased", {"axis": "tp"}),
])
def test_plain_experts_train_exactly_split_by_expert_and_within(name, choice):
    """Experts of two linears (``down(act(up x))``) run as the op with their activation (and their
    biases): split by expert over one axis and within (by their intermediate rows) over the other
    (not with biases: each rank of the partial sum would add the down projection's)."""
    batches = make_batches(name, 2, 4)
    args, kwargs = batches[0]
    options = PlanOptions(expert_parallel=choice, hand_plans=False, time_limit=None,
                          profile=None, pipeline=False, microbatches=1, recompute="none")
    plan = autopar.plan(build(name), MeshSpec((2, 2)), args, kwargs, options=options)
    assert plan.expert_parallel == {**choice, "experts_per_rank": 2, "layers": 2, "of": 2}
    captured = capture(build(name), args, kwargs)
    moes = [n for n in captured.graph.nodes if n.target is MOE]
    assert [n.args[5] for n in moes] == [name.split("_")[1]] * 2
    assert captured.param_of[moes[0].args[3].name] == "blocks.0.moe.experts.w1_weight"
    check_training(name, 0, 0, (2, 2), local_runner, {"plan": plan}, batches=batches)


@pytest.mark.parametrize("mesh_shape, runner, axis, hand", [
    ((2,), gloo_runner, "x", None),
    pytest.param((4,), gloo_runner, "x", None, marks=slow),
    ((2, 2), local_runner, "tp", None),
    ((2, 2), local_runner, "dp", "dp(dp) x tp(tp)"),   # Megatron's EP over the data axis, attention split by tp
])
def test_a_hand_written_moe_trains_exactly_with_its_experts_split_by_expert(mesh_shape, runner, axis, hand,
                                                                            monkeypatch):
    seen = recording_dispatch(monkeypatch)
    plan = _plan(mesh_shape, axis, hand)
    ways = MeshSpec(mesh_shape).shape[MeshSpec(mesh_shape).axis_names.index(axis)]
    assert plan.expert_parallel == {"axis": axis, "experts_per_rank": TINY.experts // ways,
                                    "layers": TINY.layers, "of": TINY.layers}
    check_training(NAME, 0, 0, mesh_shape, runner, {"plan": plan}, batches=BATCHES)
    if runner is local_runner:   # (gloo's ranks dispatch in their own processes)
        assert any(0 in per_expert for counts in seen for per_expert in counts), seen


class _Overwriting(hand_moe.SparseMoe):
    """Each expert's rows written over the tokens' outputs, not added: a token's first expert is lost."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(F.softmax(self.gate(hidden), dim=1), TINY.top_k, dim=-1)
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out[token] = expert(hidden[token]) * weights[token, slot, None]
        return out


class _Normed(hand_moe.SparseMoe):
    """Experts with a norm inside (``nn.Sequential(nn.Linear, nn.LayerNorm, nn.GELU, nn.Linear)``)."""

    def __init__(self) -> None:
        super().__init__()
        h = TINY.hidden
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, h))
                                     for _ in range(TINY.experts))


@pytest.mark.parametrize("layer, shape, why", [
    (_Overwriting, (8, TINY.hidden), "its result and the stacked experts' differ by"),
    (_Normed, (2, 4, TINY.hidden), "not all one kind of MLP"),
])
def test_a_loop_over_experts_that_computes_something_else_is_refused_saying_why(layer, shape, why):
    """Found by its shape, the loop is replaced only where it computes what the op does: checked
    on random routing (the overwrite matches every structural test), else refused by name."""
    hidden = torch.randn(shape)
    with pytest.raises(CaptureError, match="aten.where.default in its own forward") as info:
        capture(layer(), (hidden,))
    assert why in str(info.value)
    assert layer()(hidden).shape == hidden.shape   # (each runs eagerly)


def test_the_report_counts_each_layers_experts_in_one_row_per_choice():
    """Each layer's experts' weights, stacked, share a row per choice with the other layers',
    counted; one that differs gets its own row, by name."""
    from dataclasses import replace

    plan = _plan((4,), "x")
    rows = [line.split() for line in plan.report().splitlines() if "experts.w2_weight" in line]
    assert [r[:2] for r in rows] == [["blocks.*.moe.experts.w2_weight", "x2"]], rows
    odd = "blocks.1.moe.experts.w2_weight"
    plan.nodes = [replace(n, strategy="odd one out") if n.fqn == odd else n for n in plan.nodes]
    rows = [line.split() for line in plan.report().splitlines() if "experts.w2_weight" in line]
    assert [r[:2] for r in rows] == [["blocks.0.moe.experts.w2_weight", "shard-dim0"], [odd, "odd"]], rows


def test_the_report_says_what_every_layers_list_runs_as_once():
    """Each layer's note is kept in the plan; the report names the layers in one line."""
    plan = _plan((2,), "x")
    said = [w for w in plan.warnings if "hand-written list" in w]
    assert [w.split(":")[0] for w in said] == ["blocks.0.moe.experts", "blocks.1.moe.experts"]
    lines = [line for line in plan.report().splitlines() if "hand-written list" in line]
    assert lines == [f"  - blocks.[0-1].moe.experts (2): {said[0].partition(': ')[2]}"], lines


def test_experts_with_biases_are_not_split_within():
    name = "autopar.models.moe:build_relu_biased"
    args, kwargs = make_batches(name, 2, 4)[0]
    with pytest.raises(AutoparError, match="experts have biases, so they cannot split within"):
        autopar.plan(build(name), MeshSpec((2, 2)), args, kwargs, expert_parallel={"within": "tp"}, profile=None)


def test_a_model_built_on_meta_is_checked_on_random_weights():
    """Planned for a cluster, the model has no weights: the loop is checked on random ones of
    their shapes, its ops' tensors made on the CPU (not on ``meta``, where nonzero cannot run)."""
    with torch.device("meta"):   # (captured under it, as benchmarks/cost_accuracy.py does)
        model = hand_moe.build()
        ids = torch.zeros(2, 4, dtype=torch.long)
        captured = capture(model, (ids,), {"labels": ids})
    assert sum(n.target is MOE for n in captured.graph.nodes) == TINY.layers
    assert not any("not checked" in w for w in captured.warnings)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_repeated_moe_modules_are_exported_once_into_the_same_graph(monkeypatch, precision):
    """Every layer's MoE module alike runs the folded graph of the first, exported alone: the
    whole model's graph and notes are those of exporting each loop in place (under a precision
    policy too, whose casts the whole model's capture makes once)."""
    from collections import Counter

    from autopar.core import moe_modules

    args, kwargs = BATCHES[0]
    exported = []
    real = moe_modules.folded
    monkeypatch.setattr(moe_modules, "folded", lambda module, *rest: exported.append(module) or real(module, *rest))
    once = capture(build(NAME), args, kwargs, precision=precision)
    monkeypatch.setattr(moe_modules, "repeated_moe_modules", lambda model: [])
    each = capture(build(NAME), args, kwargs, precision=precision)
    assert len(exported) == 1 and type(exported[0]) is hand_moe.SparseMoe
    assert Counter(str(n.target) for n in once.graph.nodes) == Counter(str(n.target) for n in each.graph.nodes)
    assert once.warnings == each.warnings and len(once.warnings) == TINY.layers


def test_a_folded_module_computes_its_forward_and_runs_it_on_other_shapes():
    from autopar.core.moe_modules import folded_once

    model = build(NAME)
    args, kwargs = BATCHES[0]
    layer = model.blocks[1].moe
    x, other = torch.randn(*args[0].shape, TINY.hidden), torch.randn(3, 5, TINY.hidden)
    with folded_once(model, args, kwargs):
        assert "forward" in vars(layer)
        fast, slow = layer(x), layer(other)
    assert "forward" not in vars(layer)
    torch.testing.assert_close(fast, layer(x))
    torch.testing.assert_close(slow, layer(other), rtol=0, atol=0)


def test_a_list_whose_experts_train_unlike_keeps_its_stack_as_one_decision():
    """Experts' weights that do not all train alike (one expert frozen) stay parameters of their
    own, stacked in the graph; each role's share one decision of the solver (with their casts
    under a precision policy), as the experts are used alike. The other layer's are stored stacked."""
    import numpy as np

    from autopar.core.strategies import build_space
    from autopar.planning.shrink import group

    args, kwargs = BATCHES[0]
    model = build(NAME)
    model.blocks[0].moe.experts[1].requires_grad_(False)
    captured = capture(model, args, kwargs, precision="bf16")
    assert sorted(captured.stacked) == [f"blocks.1.moe.experts.{w}_weight" for w in ("w1", "w2", "w3")]
    space = build_space(captured, MeshSpec((2, 2)))
    grouping = group(space, lambda i: np.zeros(len(space.nodes[i].strategies)),
                     lambda i, j, k: np.zeros((len(space.nodes[i].strategies), len(space.nodes[j].strategies))))
    stacks = [nc for nc in space.nodes if nc.node.target is torch.ops.aten.stack.default]
    assert len(stacks) == 3
    for nc in stacks:
        params = [space.index[u.args[0]] for u in nc.inputs]   # (each input a cast of a parameter)
        assert len({grouping.owner[i] for i in params}) == 1 and len({grouping.owner[space.index[u]] for u in nc.inputs}) == 1


def test_microbatches_captured_again_on_a_fake_copy_fold_once_too(monkeypatch):
    """``compile`` captures a fake copy of the model again for each new input shape (here the
    microbatch's): its repeated MoE modules are folded once there too, and train exactly."""
    from autopar.core import moe_modules

    found: list[bool] = []
    real = moe_modules._folded_first
    monkeypatch.setattr(moe_modules, "_folded_first", lambda *a: (r := real(*a), found.append(r is not None))[0])
    batches = make_batches(NAME, 4, 4)
    options = PlanOptions(expert_parallel={"axis": "dp"}, hand_plans=False, time_limit=None, profile=None,
                          pipeline=False, microbatches=2, recompute="none")
    plan = autopar.plan(build(NAME), MeshSpec((2, 2)), *batches[0], options=options)
    check_training(NAME, 0, 0, (2, 2), local_runner, {"plan": plan}, batches=batches)
    assert len(found) >= 3 and all(found), found


def _held_then_resumed(mesh, root, plans, batches):
    """Compiled by expert (``plans["ep"]``), two steps, saved; compiled by the other plan, loaded,
    one step. What each rank holds of the first layer's experts, the losses and the whole state."""
    from autopar.core.plan import Plan
    from tests.equivalence import EPS, LR

    args, kwargs = batches[0]
    losses, held = [], {}
    for name, steps, load, save in (("ep", batches[:2], False, True), ("other", batches[2:3], True, False)):
        pmodel = autopar.compile(build(NAME), mesh, args, kwargs, plan=Plan.from_json(plans[name]))
        opt = torch.optim.AdamW(pmodel.parameters(), lr=LR, eps=EPS)
        if load:
            autopar.load(pmodel, opt, root)
        experts = pmodel.blocks[0].moe.experts
        held[name] = ([tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape) for p in
                       (experts.w1_weight, experts.w2_weight)], [e.w1.weight is None for e in experts],
                      "stack(" in pmodel.code)
        for a, k in steps:
            losses.append(float(pmodel.train_step(*a, **k)))
            opt.step()
            opt.zero_grad()
        if save:
            autopar.save(pmodel, opt, root)
    return losses, held, autopar.full_state_dict(pmodel)


def test_experts_split_by_expert_are_stored_by_expert_and_checkpoint_into_another_plan(tmp_path):
    """Split by expert over two ranks, each rank holds its two experts' weights alone (stacked,
    the per-expert parameters gone from the module), and no stack is made in the step; a
    checkpoint of that plan resumes in the data-parallel one exactly, and the whole state has each
    expert's weights under their own names."""
    from autopar.profiling.launch import run_on_gloo_mesh
    from tests.equivalence import ATOL, RTOL, train_reference

    batches = make_batches(NAME, 2, 4, steps=3)
    args, kwargs = batches[0]
    plans = {"ep": _plan((2,), "x").to_json(),
             "other": autopar.plan(build(NAME), MeshSpec((2,)), args, kwargs, expert_parallel=False,
                                   profile=None, time_limit=None).to_json()}
    ref_losses, ref_state = train_reference(NAME, batches)
    results = run_on_gloo_mesh(_held_then_resumed, (2,), tmp_path / "ckpt", plans, batches, start_method="forkserver")
    i, h = TINY.intermediate, TINY.hidden
    for losses, held, state in results:
        assert held["ep"] == ([(2, i, h), (2, h, i)], [True] * TINY.experts, False), held
        assert held["other"][0] == [(TINY.experts, i, h), (TINY.experts, h, i)], held   # (replicated there)
        assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m, key=key: f"{key}: {m}")


@slow
def test_experts_split_by_expert_train_exactly_zero_sharded_over_the_other_axis():
    """A memory budget that replicating cannot meet: the list's stacked weights, split by expert
    over tp, are sharded over dp as well (ZeRO: what Megatron's distributed optimizer does with
    the expert parameters over the data axis that does not hold them)."""
    from tests.equivalence import tight_budget

    args, kwargs = BATCHES[0]
    options = PlanOptions(expert_parallel={"axis": "tp"}, hand_plans=False, time_limit=None, profile=None,
                          pipeline=False, microbatches=1, recompute="none",
                          memory_budget=0.7 * tight_budget(NAME, 0, 0, (2, 2), batches=BATCHES))
    plan = autopar.plan(build(NAME), MeshSpec((2, 2)), args, kwargs, options=options)
    experts = [n for n in plan.nodes if n.fqn is not None and ".moe.experts." in n.fqn]
    assert experts and all(n.storage[1] == Shard(0) for n in experts), [(n.fqn, n.storage) for n in experts]
    assert any(n.storage[0] != Replicate() for n in experts), [(n.fqn, n.storage) for n in experts]
    check_training(NAME, 0, 0, (2, 2), local_runner, {"plan": plan}, batches=BATCHES)


@pytest.mark.parametrize("recompute, precision", [("full", "fp32"), ("none", "bf16")])
def test_experts_split_by_expert_train_exactly_recomputed_and_in_bf16(recompute, precision):
    """Split by expert over tp beside data parallelism: each block recomputed in the backward
    (the dispatch and combine run again), or under the bf16 policy (against one device's)."""
    args, kwargs = BATCHES[0]
    options = PlanOptions(expert_parallel={"axis": "tp"}, hand_plans=False, time_limit=None, profile=None,
                          pipeline=False, microbatches=1, recompute=recompute, precision=precision)
    plan = autopar.plan(build(NAME), MeshSpec((2, 2)), args, kwargs, options=options)
    assert plan.expert_parallel["axis"] == "tp" and plan.precision == precision
    assert plan.recompute_mode == recompute
    check_training(NAME, 0, 0, (2, 2), local_runner, {"plan": plan}, batches=BATCHES)


@slow
def test_experts_split_by_expert_train_exactly_in_pipeline_stages():
    """Two pipeline stages (1F1B, a block each) whose experts split by expert over the other axis."""
    from autopar.profiling.launch import run_on_gloo_mesh
    from tests.equivalence import ATOL, RTOL, train_reference
    from tests.test_pipeline import _train_each

    batches = make_batches(NAME, 4, 4)
    args, kwargs = batches[0]
    mesh = MeshSpec((2, 2), ("pp", "ep"))
    options = PlanOptions(expert_parallel={"axis": "ep"}, hand_plans=False, time_limit=None, profile=None,
                          pipeline={"axis": "pp", "schedule": "Schedule1F1B", "microbatches": 2}, recompute="none")
    plan = autopar.plan(build(NAME), mesh, args, kwargs, options=options)
    assert plan.pipeline is not None and plan.expert_parallel["axis"] == "ep"
    ref_losses, ref_state = train_reference(NAME, batches)
    results = run_on_gloo_mesh(_train_each, mesh.shape, NAME, [plan.to_json()], batches, axis_names=mesh.axis_names,
                               start_method="forkserver", timeout_s=600)
    for r, ((losses, state, _),) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), f"rank {r}"
        for key, want in ref_state.items():
            torch.testing.assert_close(state[key], want, rtol=RTOL, atol=ATOL, msg=lambda m, key=key: f"{key}: {m}")

"""Mixture-of-experts layers as the planner sees them (``autopar.core.ops.moe``): transformers'
experts captured as one op, the option that steers expert parallelism, the plan that records it,
and the zoo's Mixtral trained with its experts split by expert against one device, on 2 gloo
processes and a simulated 2x2 mesh (routing uneven: some ranks send some experts no token)."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
import autopar.core.expert_parallel as ep
import tests.equivalence as equivalence
from autopar.core.capture import capture
from autopar.core.diff import plan_diff
from autopar.core.errors import AutoparError
from autopar.core.execution import written_aliases
from autopar.core.mesh import MeshSpec
from autopar.core.ops.moe import MOE
from autopar.core.placements import ShardBlocks
from autopar.core.plan import Plan
from autopar.planning.options import PlanOptions
from autopar.profiling.launch import run_on_local_tensor_mesh
from tests.equivalence import (
    build,
    check_training,
    expert_parallel_plan,
    gloo_runner,
    local_runner,
    make_batches,
    meta_model,
    recording_dispatch,
)
from tests.tiers import slow

NAME = "mixtral-tiny"   # 4 experts, top-2, 2 layers
BATCHES = make_batches(NAME, 2, 4)   # 8 tokens a step: few per rank, so some experts get none from some rank


def _plan(mesh_shape: tuple[int, ...], axis: str, hand: str | None = None) -> Plan:
    """The auto plan with the experts forced over ``axis``, or the hand plan ``hand`` made so."""
    return expert_parallel_plan(NAME, BATCHES, mesh_shape, axis, hand)


@pytest.mark.parametrize("mesh_shape, runner, axis, hand", [
    ((2,), gloo_runner, "x", None), ((4,), gloo_runner, "x", None), ((2, 2), local_runner, "tp", None),
    ((2, 2), local_runner, "dp", "dp(dp) x tp(tp)"),   # Megatron's EP over the data axis, attention split by tp
])
def test_mixtral_trains_exactly_with_its_experts_split_by_expert(mesh_shape, runner, axis, hand, monkeypatch):
    """On 2 and 4 gloo processes (real all-to-alls) and on a simulated 2x2 mesh (beside data or
    tensor parallelism on the other axis), where the dispatches are recorded: some rank sends some
    expert no token. (A simulated mesh of 2 runs the strategy in tests/strategy_cases.py.)"""
    seen = recording_dispatch(monkeypatch)
    plan = _plan(mesh_shape, axis, hand)
    spec = MeshSpec(mesh_shape)
    ways = spec.shape[spec.axis_names.index(axis)]
    assert plan.expert_parallel == {"axis": axis, "experts_per_rank": 4 // ways, "layers": 2, "of": 2}
    per_rank = "2 experts" if ways == 2 else "1 expert"
    if hand is not None:   # attention's projections split over the other axis, as Megatron's tensor parallelism
        q = next(n for n in plan.nodes if n.fqn == "model.layers.0.self_attn.q_proj.weight")
        assert q.out[-1] == Shard(0), q.out
    check_training(NAME, 0, 0, mesh_shape, runner, {"plan": plan}, batches=BATCHES)
    if runner is local_runner:
        assert seen and any(0 in per_expert for counts in seen for per_expert in counts), seen
    assert f"split by expert over {axis}: {per_rank} per rank" in plan.report()
    saved = json.loads(plan.to_json())
    assert Plan.from_json(json.dumps(saved)).expert_parallel == plan.expert_parallel
    del saved["expert_parallel"]   # a plan written before the field
    older = Plan.from_json(json.dumps(saved))
    assert older.expert_parallel is None
    assert f"expert parallelism: over {axis}, {per_rank} per rank -> none" in plan_diff(plan, older)


def _forced(mesh_shape: tuple[int, ...], choice: dict[str, str]) -> Plan:
    """The auto plan with the experts' layout forced to ``choice`` (``PlanOptions.expert_parallel``)."""
    args, kwargs = BATCHES[0]
    options = PlanOptions(expert_parallel=choice, hand_plans=False, time_limit=None, profile=None, pipeline=False,
                          microbatches=1, recompute="none")
    return autopar.plan(build(NAME), MeshSpec(mesh_shape), args, kwargs, options=options)


@pytest.mark.parametrize("mesh_shape, runner, choice", [
    pytest.param((2,), gloo_runner, {"within": "x"}, marks=slow),   # (2 simulated ranks: tests/strategy_cases.py)
    ((2, 2), local_runner, {"axis": "dp", "within": "tp"}),   # Megatron's EP x expert-TP
])
def test_mixtral_trains_exactly_with_each_expert_split_within(mesh_shape, runner, choice, monkeypatch):
    """Each expert's intermediate dimension split over an axis (its gate and up rows alike, its
    down columns; the output a partial sum), alone on 2 gloo processes and beside the experts
    split by expert on the other axis of a simulated 2x2 mesh (uneven routing: recorded)."""
    seen = recording_dispatch(monkeypatch)
    plan = _forced(mesh_shape, choice)
    within = MeshSpec(mesh_shape).axis_names.index(choice["within"])
    record = {"within": choice["within"], "layers": 2, "of": 2}
    if "axis" in choice:
        record |= {"axis": choice["axis"], "experts_per_rank": 2}
    assert plan.expert_parallel == record
    gate_up = next(n for n in plan.nodes if n.fqn == "model.layers.0.mlp.experts.gate_up_proj")
    assert gate_up.storage[within] == gate_up.out[within] == ShardBlocks(1, 2)   # 1/n of its weights a rank
    check_training(NAME, 0, 0, mesh_shape, runner, {"plan": plan}, batches=BATCHES)
    if "axis" in choice:
        assert any(0 in per_expert for counts in seen for per_expert in counts), seen
    assert f"each expert split within over {choice['within']}" in plan.report()
    again = Plan.from_json(plan.to_json())
    assert again.expert_parallel == plan.expert_parallel and again.nodes == plan.nodes   # S(1:2) read back


@slow
def test_experts_split_within_train_exactly_with_their_weights_zero_sharded_over_the_other_axis():
    """A memory budget that replicating cannot meet: the experts split within over tp are stored
    ZeRO-3-sharded over dp as well (S(0) x S(1:2)), gathered over dp on use."""
    from tests.equivalence import tight_budget

    args, kwargs = BATCHES[0]
    options = PlanOptions(expert_parallel={"within": "tp"}, hand_plans=False, time_limit=None, profile=None,
                          pipeline=False, microbatches=1, recompute="none",
                          memory_budget=0.7 * tight_budget(NAME, 0, 0, (2, 2), batches=BATCHES))
    plan = autopar.plan(build(NAME), MeshSpec((2, 2)), args, kwargs, options=options)
    gate_up = next(n for n in plan.nodes if n.fqn == "model.layers.0.mlp.experts.gate_up_proj")
    assert gate_up.storage == (Shard(0), ShardBlocks(1, 2)) and gate_up.out == (Replicate(), ShardBlocks(1, 2))
    check_training(NAME, 0, 0, (2, 2), local_runner, {"plan": plan}, batches=BATCHES)


def _step(pmodel, opt, batch) -> None:
    pmodel.train_step(*batch[0], **batch[1])
    opt.step()
    opt.zero_grad()


def _checkpoint_worker(mesh, plans: dict[str, str], root) -> dict[str, float]:
    """Trained a step under plan "within", saved, trained on: the largest difference from it of
    the whole state after loading into each plan and training the same step."""
    args, kwargs = BATCHES[0]
    pmodel = autopar.compile(build(NAME), mesh, args, kwargs, plan=Plan.from_json(plans["within"]))
    opt = torch.optim.AdamW(pmodel.parameters(), lr=equivalence.LR, eps=equivalence.EPS)
    _step(pmodel, opt, BATCHES[0])
    autopar.save(pmodel, opt, root)
    _step(pmodel, opt, BATCHES[1])
    want = autopar.full_state_dict(pmodel)
    out = {}
    for name, text in plans.items():
        other = autopar.compile(build(NAME), mesh, args, kwargs, plan=Plan.from_json(text))
        other_opt = torch.optim.AdamW(other.parameters(), lr=equivalence.LR, eps=equivalence.EPS)
        autopar.load(other, other_opt, root)
        _step(other, other_opt, BATCHES[1])
        got = autopar.full_state_dict(other)
        out[name] = max(float((got[k] - want[k]).abs().max()) for k in want)
    return out


@slow
def test_a_checkpoint_of_experts_split_within_loads_into_that_plan_and_another(tmp_path):
    """DCP records a rank's shard as one chunk, which a split in blocks is not: saved as a plain
    split and put back, the experts' weights and AdamW states load into the same plan and into
    one that splits no expert within (2 gloo processes), training on as if never stopped."""
    from autopar.profiling.launch import run_on_gloo_mesh

    plans = {"within": _forced((2,), {"within": "x"}).to_json(), "plain": _forced((2,), {"axis": "x"}).to_json()}
    for per_plan in run_on_gloo_mesh(_checkpoint_worker, (2,), plans, tmp_path / "checkpoint",
                                     start_method="forkserver"):
        assert per_plan["within"] == 0 and per_plan["plain"] < 1e-6, per_plan


def test_experts_split_within_are_candidates_priced_as_their_slice():
    """The planner sees the split within like any strategy: on each axis the op may run it
    (output partial: its sum priced as the all-reduce it is), the experts' weights may be stored
    so (half a rank's memory on 2), the GEMMs cost half of every expert whole, no all-to-all,
    and a rank keeps its share of the intermediate rows (the token rows whole)."""
    from autopar.core.capture import tensor_val
    from autopar.core.ops.moe import DOWN, GATE_UP, WITHIN, within_axis
    from autopar.core.strategies import build_space
    from cost_models.comm import collective_time
    from cost_models.estimate import CostModel

    space = build_space(_captured(), MeshSpec((2, 2), hardware="cpu"))
    costs = CostModel(space.mesh, space)
    nc = next(nc for nc in space.nodes if nc.node.target is MOE)
    for axis in (0, 1):
        s = next(s for s in nc.strategies if within_axis(s) == axis and s.names[1 - axis] == "replicate")
        whole = next(s for s in nc.strategies if s.names == ("replicate", "replicate"))
        assert s.names[axis] == WITHIN and s.out[axis] == Partial() and s.ins[DOWN][axis] == Shard(2)
        split, full = costs.node(nc, s), costs.node(nc, whole)
        assert split.compute_s == pytest.approx(full.compute_s / 2, rel=0.01) and split.comm_s == 0   # + launches
        hidden, inner = tensor_val(nc.node.args[0]).shape[1], tensor_val(nc.node.args[DOWN]).shape[2]
        kept, kept_whole = (costs._kept(nc, x, tensor_val(nc.node))[1] for x in (s, whole))
        assert kept == pytest.approx(kept_whole * (2 * hidden + 4 * inner / 2) / (2 * hidden + 4 * inner))
    param = next(p for p in space.nodes if p.node is nc.inputs[GATE_UP])
    stored = next(s for s in param.strategies if s.storage == (ShardBlocks(1, 2), Replicate()))
    whole_param = next(s for s in param.strategies if s.storage == (Replicate(), Replicate()))
    assert costs.node(param, stored).state_bytes == costs.node(param, whole_param).state_bytes / 2
    out = tensor_val(nc.node)
    link = costs.links[0]   # no profile: the preset's
    assert costs.redistribute(out.shape, out.dtype, (Partial(), Replicate()), (Replicate(), Replicate())).comm_s == \
        pytest.approx(collective_time("all_reduce", out.numel() * 4, 2, link))


def test_a_skewed_router_is_priced_on_the_busiest_rank_and_recorded():
    """``expert_skew``: the experts split by expert cost that many times more on the busiest rank
    (GEMMs and all-to-alls), the plan records and reports it; below 1 is refused."""
    args, kwargs = BATCHES[0]
    options = dict(expert_parallel={"axis": "x"}, hand_plans=False, time_limit=None, profile=None, pipeline=False,
                   microbatches=1, recompute="none")
    even, skewed = (autopar.plan(build(NAME), MeshSpec((2,)), args, kwargs, expert_skew=skew, **options)
                    for skew in (1.0, 1.5))
    experts = [(a, b) for a, b in zip(even.nodes, skewed.nodes, strict=True) if a.op == str(MOE)]
    assert len(experts) == 2
    for a, b in experts:
        assert b.compute_s == pytest.approx(1.5 * a.compute_s) and b.comm_s > a.comm_s   # its all-to-alls; moves into it alike
    assert "skew" not in even.expert_parallel and skewed.expert_parallel["skew"] == 1.5
    assert "busiest rank receiving 1.5x the mean" in skewed.report()
    assert Plan.from_json(skewed.to_json()).expert_parallel == skewed.expert_parallel
    with pytest.raises(AutoparError, match="expert_skew is the busiest rank's routed rows over the mean"):
        PlanOptions(expert_skew=0.5)


def _meta_moe(config: str, implementation: str) -> tuple:
    """A 2-layer transformers MoE model of ``config`` on meta, its experts run as ``implementation``."""
    import transformers

    sizes = {"MixtralConfig": {"num_local_experts": 4}, "Qwen2MoeConfig": {"num_experts": 4, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 32}, "OlmoeConfig": {"num_experts": 4, "eos_token_id": 0}}[config]
    cfg = getattr(transformers, config)(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                        intermediate_size=128, vocab_size=256, num_experts_per_tok=2, **sizes)
    cfg._experts_implementation = implementation
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.empty(2, 4, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids.clone(), "use_cache": False}


@pytest.mark.parametrize("config, implementation", [("MixtralConfig", "grouped_mm"), ("MixtralConfig", "eager"),
                                                    ("Qwen2MoeConfig", "batched_mm"), ("OlmoeConfig", "grouped_mm")])
def test_transformers_experts_are_captured_as_one_op_and_the_registry_restored(config, implementation):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model, args, kwargs = _meta_moe(config, implementation)
    before = dict(ALL_EXPERTS_FUNCTIONS._local_mapping)
    graph = capture(model, args, kwargs).graph
    assert [n.args[3].name for n in graph.nodes if n.target is MOE] == [
        f"p_model_layers_{i}_mlp_experts_gate_up_proj" for i in range(2)]
    assert not any("grouped_mm" in str(n.target) for n in graph.nodes)
    assert ALL_EXPERTS_FUNCTIONS._local_mapping == before
    # the router renormalises its top-k weights in place, a write nothing else sees: captured out
    # of place, so that the routing may stay split by token (written values are kept replicated)
    assert not written_aliases(graph)


@pytest.mark.parametrize("choice, error", [
    ({"axis": "ep"}, "names mesh axis 'ep', which the mesh ('dp', 'tp') lacks"),
    ({"axis": "tp"}, "has 4 experts, which cannot split evenly over mesh axis 'tp' of 3 ranks"),
    ({"mesh": "tp"}, "expert_parallel is 'auto', False, or {'axis': name}"),
    ({"within": "tp"}, "experts have an intermediate size of 128, which cannot split evenly over mesh axis 'tp' of 3"),
    ({"axis": "tp", "within": "tp"}, "or both (two different axes); got {'axis': 'tp', 'within': 'tp'}"),
    ({"within": "pp"}, "names mesh axis 'pp', which the mesh ('dp', 'tp') lacks"),
])
def test_expert_parallel_the_mesh_cannot_give_is_refused(choice, error):
    model, args, kwargs = meta_model(NAME, 3, 4)
    with pytest.raises(AutoparError, match=error.replace("(", r"\(").replace(")", r"\)")):
        autopar.plan(model, MeshSpec((1, 3)), args, kwargs, expert_parallel=choice, profile=None)


def test_the_op_differentiates_as_its_kernel():
    """``autopar::moe_experts`` (what an exported program runs) gives the outputs and gradients
    of ``routed_experts`` under autograd, zero ids included."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([[0, 2], [2, 1], [0, 0], [1, 2], [2, 0]])
    for routing in (ids, torch.zeros_like(ids)):
        inputs = [torch.randn(5, 4, generator=gen), routing, torch.rand(5, 2, generator=gen),
                  torch.randn(3, 6, 4, generator=gen), torch.randn(3, 4, 3, generator=gen)]
        grads = []
        for fn in (torch.ops.autopar.moe_experts, ep.routed_experts):
            leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
            out = fn(*leaves)
            floats = [t for t in leaves if t.is_floating_point()]
            grads.append((out, *torch.autograd.grad(out, floats, torch.ones_like(out))))
        for got, want in zip(*grads, strict=True):
            torch.testing.assert_close(got, want)


def test_hand_plans_may_split_the_experts_by_expert_over_a_data_axis():
    """Megatron's expert x data parallelism: on a data-parallel axis a hand plan keeps weights
    whole, except the experts', which it may split by expert (stored and used so)."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.core.strategies import build_space
    from autopar.planning.baselines import _obeys, _traits

    model, args, kwargs = meta_model(NAME, 2, 4)
    space = build_space(capture(model, args, kwargs), MeshSpec((2, 2)))
    by_expert = (Shard(0), Replicate())
    for fqn, allowed in (("model.layers.0.mlp.experts.gate_up_proj", True), ("model.layers.0.mlp.experts.down_proj", True),
                         ("model.layers.0.self_attn.q_proj.weight", False)):
        nc = next(nc for nc in space.nodes if nc.fqn == fqn)
        split = [s for s in nc.strategies if s.out == s.storage == by_expert]
        assert split and all(_obeys(space.mesh, "param", _traits(space, nc, False), s, ("dp", "tp")) == allowed
                             for s in split), fqn


def test_hand_plans_split_experts_by_expert_or_within_on_a_tensor_axis_never_within_on_a_data_axis():
    """Megatron's layouts: on a tensor-parallel axis the experts' weights are used split, by
    expert or within each expert (EP x TP with the data axis: expert tensor parallelism); on a
    data axis whole or by expert, never within."""
    from autopar.core.ops.moe import EXPERTS, WITHIN
    from autopar.core.strategies import build_space
    from autopar.planning.baselines import _obeys, _traits

    model, args, kwargs = meta_model(NAME, 2, 4)
    space = build_space(capture(model, args, kwargs), MeshSpec((2, 2)))
    nc = next(nc for nc in space.nodes if nc.node.target is MOE)
    traits = _traits(space, nc, True)
    obeyed = {s.names for s in nc.strategies if _obeys(space.mesh, "op", traits, s, ("dp", "tp"))}
    assert ("batch", WITHIN) in obeyed and (EXPERTS, WITHIN) in obeyed and ("batch", EXPERTS) in obeyed
    assert not any(names[0] == WITHIN or names[1] in ("batch", "replicate") for names in obeyed), obeyed


@functools.cache
def _captured():
    """The zoo's Mixtral captured on meta for 16 x 64 tokens (the tests that price its experts)."""
    return capture(*meta_model(NAME, 16, 64))


@pytest.mark.parametrize("n", [2, 4])
def test_the_experts_all_to_alls_are_priced_on_the_link_of_the_call_the_kernel_makes(n):
    """Split by expert, the counts and the rows (there and back, again in the backward) are the
    kernel's ``all_to_all_single``: priced on the profile's link of that kind, each rank's buffer
    1/n of the rows; a profile measured before that kind prices them on DTensor's all-to-all's.
    Where its layer is recomputed, the forward's run again. In a step they are priced at the
    experts' in-step factor, where the profile has one, else at that of blocking collectives."""
    from autopar.core.capture import tensor_val
    from autopar.core.ops.moe import DOWN, HIDDEN, IDS, all_to_alls, expert_axis
    from autopar.core.strategies import build_space
    from cost_models.comm import Link, collective_time
    from cost_models.estimate import CostModel
    from cost_models.profile import Profile, collective_key

    space = build_space(_captured(), MeshSpec((n,), hardware="cpu"))
    nc = next(nc for nc in space.nodes if nc.node.target is MOE)
    split = next(s for s in nc.strategies if expert_axis(s) == 0)
    moves = all_to_alls(nc.node, split, (n,), True, None)
    assert len(moves) == 5 and {m.kind for m in moves} == {"all_to_all_single"}
    tokens, hidden = tensor_val(nc.node.args[HIDDEN]).shape
    rows = tokens * tensor_val(nc.node.args[IDS]).shape[1] * hidden * 4   # fp32, T*k rows of H
    assert tensor_val(nc.node.args[DOWN]).shape[0] == 4   # 4 experts: [n, 4] int64 counts
    dtensor, single = Link(bandwidth=1e7, latency=1e-3), Link(bandwidth=1e9, latency=1e-4)

    def inside(links: dict[str, Link], calibration: dict[str, float] | None = None) -> float:
        profile = Profile({"device": "cpu"}, collectives={collective_key(k, n): v for k, v in links.items()},
                          calibration=calibration or {})
        return CostModel(space.mesh, space, profile=profile)._inside(nc, split, 0.0).comm_s

    def priced(link: Link) -> float:
        return collective_time("all_to_all", n * 4 * 8 / n, n, link) + 4 * collective_time("all_to_all", rows / n, n, link)

    assert inside({"all_to_all": dtensor, "all_to_all_single": single}) == pytest.approx(priced(single))
    assert inside({"all_to_all": dtensor}) == pytest.approx(priced(dtensor))
    assert inside({"all_to_all_single": single}, {f"comm@{n}": 1.5}) == pytest.approx(1.5 * priced(single))
    assert inside({"all_to_all_single": single}, {f"comm@{n}": 1.5, f"experts@{n}": 2.5}) == pytest.approx(
        2.5 * priced(single))
    # recomputed (its layer checkpointed), its forward runs the counts and the rows' two again
    profile = Profile({"device": "cpu"}, collectives={collective_key("all_to_all_single", n): single})
    plain, full = (CostModel(space.mesh, space, profile=profile, recompute=r).node(nc, split) for r in ("none", "full"))
    again = collective_time("all_to_all", n * 4 * 8 / n, n, single) + 2 * collective_time("all_to_all", rows / n, n, single)
    assert full.comm_s - plain.comm_s == pytest.approx(again)


def test_the_experts_are_timed_as_generated_code_runs_them():
    """Profiling times the kernel under autograd (``moe.AS_RUN``, rows routed evenly over the
    local experts), not the op, whose backward runs the kernel's forward again; its ranks find
    it by the name its profile key shows."""
    from autopar.core.ops.moe import AS_RUN, expert_axis
    from autopar.core.strategies import build_space
    from autopar.profiling.profiler import _op, _op_name
    from cost_models.activations import gradients
    from cost_models.profile_ops import op_call, time_op_calls

    space = build_space(_captured(), MeshSpec((2,), hardware="cpu"))
    nc = next(nc for nc in space.nodes if nc.node.target is MOE)
    split = next(s for s in nc.strategies if expert_axis(s) == 0)
    call = op_call(nc, split, (2,), gradients(space))
    assert call.target is AS_RUN and call.key.startswith("autopar.moe_experts.kernel(float32[512, 64](grad), int64[512, 2]")
    assert "float32[2, 256, 64](grad)" in call.key   # this rank's two experts
    assert _op(_op_name(AS_RUN)) is AS_RUN
    timed = time_op_calls([call], min_time_s=0.002, repeats=1)[call.key]
    assert timed.fwd_s > 0 and timed.bwd_s > 0


def _kernel_peaks(tokens: int, experts: int, k: int, hidden: int, inner: int) -> tuple[int, int]:
    """The peak bytes ``routed_experts`` holds on one rank (no group: the same tensors but the
    all-to-alls'), its rows routed evenly to ``experts`` local experts: (forward alone, with its
    output kept; forward and backward, the inputs' and experts' gradients included)."""
    from autopar.profiling.measure import cpu_peak_growth

    gen = torch.Generator().manual_seed(0)
    ids = (torch.arange(tokens * k) % experts).view(tokens, k)
    leaves = [torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, k, generator=gen),
              torch.randn(experts, 2 * inner, hidden, generator=gen), torch.randn(experts, hidden, inner, generator=gen)]
    x, w, gate_up, down = (t.requires_grad_() for t in leaves)
    kept: list[torch.Tensor] = []
    forward = cpu_peak_growth(lambda: kept.append(ep.routed_experts(x, ids, w, gate_up, down)))
    kept.clear()
    both = cpu_peak_growth(lambda: ep.routed_experts(x, ids, w, gate_up, down).backward(torch.ones(tokens, hidden)))
    return forward, both


@pytest.mark.parametrize("layout", ["by expert", "by token", "within"])
def test_the_experts_memory_is_what_the_kernel_holds(layout):
    """The experts' kept rows, output and working memory (``Kept.by_parts``, ``row_buffers``) add
    up to the kernel's forward peak on a rank, and bound its backward's. Their backward frees
    the kept rows as it goes, so their gradients are not working memory, nor are the all-to-alls'
    buffers beside the rows (the accounting before gave 5x the kernel's temporaries). Split
    within, a rank runs every token on its half of each expert's intermediate dimension."""
    from autopar.core.capture import tensor_val
    from autopar.core.ops.moe import GATE_UP, IDS, expert_axis, within_axis
    from autopar.core.strategies import build_space
    from cost_models.estimate import CostModel

    space = build_space(_captured(), MeshSpec((2,), hardware="cpu"))   # 512 tokens a rank, 1024 rows (top-2)
    nc = next(nc for nc in space.nodes if nc.node.target is MOE)
    s = next(s for s in nc.strategies if (expert_axis(s) is not None) == (layout == "by expert")
             and (within_axis(s) is not None) == (layout == "within") and s.out[0] != Replicate())
    costs = CostModel(space.mesh, space)
    cost = costs.node(nc, s)
    tokens, hidden = tensor_val(nc.node.args[0]).shape
    tokens //= 1 if layout == "within" else 2
    gate_up = tensor_val(nc.node.args[GATE_UP])
    experts, k = gate_up.shape[0] // (2 if layout == "by expert" else 1), tensor_val(nc.node.args[IDS]).shape[1]
    inner = gate_up.shape[1] // (4 if layout == "within" else 2)
    out = tokens * hidden * 4
    internal = costs._kept(nc, s, tensor_val(nc.node))[1]
    forward, both = _kernel_peaks(tokens, experts, k, hidden, inner)
    assert internal + cost.transient_bytes == pytest.approx(forward, rel=0.05)
    grads = (tokens * (hidden + k) + experts * 3 * inner * hidden) * 4
    assert both <= internal + cost.transient_bytes + grads
    assert cost.transient_bytes < 2 * out + internal / 2


def _torch_ep_worker(mesh, name, batches) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """torch EP x DP (``peers.expert_parallel``) trained on this rank's part of each batch: the
    mean of the ranks' losses each step, this rank's parameters (its experts' slices) at the end
    and its gradients of the first step (AdamW would hide a gradient wrong by a constant factor)."""
    import torch.distributed as dist

    from autopar.profiling import peers

    model = build(name)
    wrapped, _ = peers.wrap("torch EP x DP", model, batches[0], mesh)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=equivalence.LR, eps=equivalence.EPS)
    losses, grads = [], {}
    for batch in batches:
        args, kwargs = peers.rank_batch(batch, dist.get_world_size(), dist.get_rank())
        loss = equivalence.loss_of(wrapped(*args, **kwargs))
        loss.backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


def _as_global(key: str, rank: int, local: int) -> str:
    """A hand-written list's local expert ``experts.i.`` on ``rank``: global expert ``rank*local + i``."""
    head, sep, tail = key.partition(".experts.")
    index, _, rest = tail.partition(".")
    return f"{head}.experts.{rank * local + int(index)}.{rest}" if sep and index.isdigit() else key


@pytest.mark.parametrize("name, shape", [(NAME, (2,)), ("autopar.models.moe:build", (2,)),
                                         pytest.param("autopar.models.moe:build", (2, 2), marks=slow)])
def test_torch_expert_parallel_reference_trains_as_one_device(name, shape):
    """The hand-written torch EP that benchmarks/peer_runtime.py times autopar against (experts
    split by expert, tokens dispatched by all-to-all, DDP for the rest; on 2x2 the experts'
    gradients summed over dp as they are ready) trains as one device does on gloo processes:
    losses, and each rank's slice of every parameter; for transformers' fused experts and for a
    hand-written list of them."""
    from autopar.profiling.launch import run_on_gloo_mesh

    batches = BATCHES if name == NAME else make_batches(name, 2 * shape[0], 4)
    ref_losses, ref_state = equivalence.train_reference(name, batches)
    model = build(name)
    equivalence.loss_of(model(*batches[0][0], **batches[0][1])).backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    ranks = run_on_gloo_mesh(_torch_ep_worker, shape, name, batches, axis_names=("dp", "ep")[-len(shape):],
                             start_method="forkserver")
    for rank, (losses, state, grads) in enumerate(ranks):
        r = rank % shape[-1]   # (its rank on ep)
        torch.testing.assert_close(losses, ref_losses, rtol=equivalence.RTOL, atol=equivalence.ATOL)
        for got, ref in ((state, ref_state), (grads, ref_grads)):
            got = {_as_global(k, r, 2): v for k, v in got.items()}   # (4 experts, 2 a rank)
            assert set(got) <= set(ref) and len(got) < len(ref) if name != NAME else set(got) == set(ref)
            for key, have in got.items():
                want = ref[key]
                rows = have.shape[0] if key.endswith(("gate_up_proj", "down_proj")) else None
                torch.testing.assert_close(have, want if rows is None else want[r * rows:(r + 1) * rows],
                                           rtol=equivalence.RTOL, atol=equivalence.ATOL,
                                           msg=lambda m, key=key: f"{key}: {m}")


OSS = "gpt-oss-tiny"   # transformers' gpt-oss: transposed experts with biases, a clamped SwiGLU on interleaved columns


def test_gpt_oss_experts_run_as_one_op_with_the_gate_of_their_class():
    """Experts of another layout than Mixtral's (``is_transposed``, ``has_bias``, gpt-oss's own
    ``_apply_gate``) are one op on their weights' transposed views, gated by their class's gate."""
    args, kwargs = make_batches(OSS, 2, 8)[0]
    moes = [n for n in capture(build(OSS), args, kwargs).graph.nodes if n.target is MOE]
    assert len(moes) == 2
    gate = moes[0].args[5]
    assert gate.startswith("transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(") and gate in ep.GATES
    assert "limit=7.0" in gate and "alpha=1.702" in gate
    assert not list(ep.GATES[gate].args[0].parameters())   # the registry keeps no expert weights alive
    assert [a.target for a in moes[0].args[3:5]] == [torch.ops.aten.transpose.int] * 2
    assert all(isinstance(b, torch.fx.Node) for b in moes[0].args[6:8])   # its biases


def test_experts_gated_by_their_models_own_function_are_not_split_within():
    from tests.strategy_cases import OwnGateExperts, _routing

    inputs = (torch.randn(8, 6), _routing(), torch.rand(8, 2))
    with pytest.raises(AutoparError, match="gate with a function of their model's own"):
        autopar.plan(OwnGateExperts(), MeshSpec((2,)), inputs, expert_parallel={"within": "x"}, profile=None)


@pytest.mark.parametrize("mesh_shape, runner, axis", [((2,), gloo_runner, "x"), ((2, 2), local_runner, "tp")])
def test_gpt_oss_trains_exactly_with_its_experts_split_by_expert(mesh_shape, runner, axis, monkeypatch):
    seen = recording_dispatch(monkeypatch)
    batches = make_batches(OSS, 2, 8)
    plan = expert_parallel_plan(OSS, batches, mesh_shape, axis)
    assert plan.expert_parallel == {"axis": axis, "experts_per_rank": 2, "layers": 2, "of": 2}
    check_training(OSS, 0, 0, mesh_shape, runner, {"plan": plan}, batches=batches)
    if runner is local_runner:
        assert seen and any(0 in per_expert for counts in seen for per_expert in counts), seen


#: transformers' MoE architectures beyond the zoo's, at a tiny size each (4 experts, top-2): their
#: routers (DeepSeek-V3's grouped sigmoid scores, PhiMoE's sparse mixer, GLM-4's), shared experts,
#: and the layers around them (LFM2's convolutions) as transformers builds them.
ARCHITECTURES = {
    "Qwen3MoeConfig": {"num_experts": 4, "head_dim": 16},
    "DeepseekV3Config": {"n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                         "first_k_dense_replace": 0, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
                         "qk_nope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4},
    "Glm4MoeConfig": {"n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                      "first_k_dense_replace": 0, "head_dim": 16},
    "PhimoeConfig": {"num_local_experts": 4},
    "HunYuanMoEV1Config": {"num_experts": 4, "moe_topk": 2, "head_dim": 16, "intermediate_size": 32},
    "Lfm2MoeConfig": {"num_experts": 4, "num_dense_layers": 0, "layer_types": ["full_attention", "conv"]},
}


def _architecture(config: str) -> torch.nn.Module:
    import transformers

    sizes = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "moe_intermediate_size": 32, "vocab_size": 256, "num_experts_per_tok": 2,
             "max_position_embeddings": 128, "eos_token_id": 0, "pad_token_id": 0, "bos_token_id": 0}
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config)(**sizes | ARCHITECTURES[config]))


@pytest.mark.parametrize("config", sorted(ARCHITECTURES))
def test_transformers_moe_architectures_train_exactly_split_by_expert(config):
    gen = torch.Generator().manual_seed(1)
    batches = [((ids,), {"labels": ids.clone(), "use_cache": False})
               for ids in (torch.randint(0, 256, (2, 8), generator=gen) for _ in range(3))]
    options = {"expert_parallel": {"axis": "x"}, "hand_plans": False, "time_limit": None, "profile": None,
               "pipeline": False, "microbatches": 1, "recompute": "none"}
    plan = check_training(functools.partial(_architecture, config), 0, 0, (2,), local_runner, options, batches=batches)
    assert plan.expert_parallel is not None and plan.expert_parallel["axis"] == "x"
    assert plan.expert_parallel["layers"] == plan.expert_parallel["of"] == 2


def test_a_gate_of_the_models_own_is_priced_keeping_what_autograd_keeps_of_it():
    """``gate_kept`` counts what autograd keeps of a captured gate by running it: SwiGLU written as
    a gate of its own keeps the 4I the op's SwiGLU is priced at (its rows, activation and product);
    gpt-oss's clamped, interleaved one 7I, and its layer's kept rows are priced that much more."""
    import torch.nn.functional as F

    from autopar.core.strategies import build_space
    from cost_models.estimate import CostModel
    from tests.strategy_cases import INTERLEAVED, MoEExperts, OwnGateExperts, _routing

    def swiglu(x):
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

    ep.GATES["tests.test_moe.swiglu"] = swiglu
    assert (ep.gate_kept("tests.test_moe.swiglu", 12), ep.gate_kept(INTERLEAVED, 12)) == (4 * 6, 7 * 6)
    inputs = (torch.randn(8, 6), _routing(), torch.rand(8, 2))
    kept = []
    for layer in (MoEExperts(), OwnGateExperts()):
        space = build_space(capture(layer, inputs), MeshSpec((1,), hardware="cpu"))
        nc = next(nc for nc in space.nodes if nc.node.target is MOE)
        kept.append(CostModel(space.mesh, space)._kept(nc, nc.strategies[0], None)[1])
    rows = 8 * 2
    assert kept[1] - kept[0] == rows * (7 - 4) * 6 * 4


def _routed_by_hooks(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Rows per expert of each transformers experts module, seen by a hook on its inputs."""
    seen: list[torch.Tensor] = []

    def hook(module, hook_args, hook_kwargs):
        ids = hook_args[1] if len(hook_args) > 1 else hook_kwargs["top_k_index"]
        seen.append(torch.bincount(ids.flatten(), minlength=module.num_experts))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()
               if type(m).__name__.endswith("Experts")]
    with torch.no_grad():
        model(*args, **kwargs)
    for h in handles:
        h.remove()
    return seen


def test_a_router_measured_on_the_example_batch_is_priced_per_expert_axis_size():
    """``expert_skew="measured"``: the captured graph run on the model's weights counts what a hook
    on transformers' experts modules sees (a freshly built Mixtral's router is uneven on 4 x 16
    tokens), priced per expert-axis size (2 ranks, 4) and recorded in the plan; a model on meta is
    refused, saying to give a number."""
    from autopar.core.routing import busiest_over_mean

    args, kwargs = make_batches(NAME, 4, 16)[0]
    torch.manual_seed(0)
    model = build(NAME)
    rows = _routed_by_hooks(model, args, kwargs)
    want = {n: sum(busiest_over_mean(r, n) for r in rows) / len(rows) for n in (2, 4)}
    assert want[2] != want[4] and min(want.values()) > 1.05, want   # uneven, unlike per size: the check can fail
    options = dict(expert_parallel="auto", hand_plans=False, time_limit=None, profile=None, pipeline=False,
                   microbatches=1, recompute="none")
    plans = {shape: autopar.plan(model, MeshSpec(shape, ("x", "y")[:len(shape)]), args, kwargs, expert_skew="measured",
                                 **{**options, "expert_parallel": {"axis": "x"}}) for shape in ((2,), (4,))}
    for shape, plan in plans.items():
        assert plan.expert_parallel["skew"] == pytest.approx(want[shape[0]], abs=1e-3), (shape, plan.expert_parallel)
    on_meta = build(NAME).to("meta")
    with pytest.raises(AutoparError, match="meta device.*as a number"):
        autopar.plan(on_meta, MeshSpec((2,)), args, kwargs, expert_skew="measured", **options)


def _compiled_skew(mesh, model, batch) -> dict:
    args, kwargs = batch
    pmodel = autopar.compile(model, mesh, args, kwargs, expert_skew="measured", expert_parallel={"axis": "x"},
                             hand_plans=False, time_limit=None, profile=None, pipeline=False, microbatches=1,
                             recompute="none")
    return pmodel.plan.expert_parallel


def test_compile_measures_the_router_too():
    """``autopar.compile(..., expert_skew="measured")`` (ranks simulated in one process) prices the
    factor ``autopar.plan`` measures on the same weights and batch."""
    args, kwargs = make_batches(NAME, 4, 16)[0]
    torch.manual_seed(0)
    planned = autopar.plan(build(NAME), MeshSpec((2,), ("x",)), args, kwargs, expert_skew="measured",
                           expert_parallel={"axis": "x"}, hand_plans=False, time_limit=None, profile=None,
                           pipeline=False, microbatches=1, recompute="none")
    torch.manual_seed(0)
    compiled = run_on_local_tensor_mesh(_compiled_skew, (2,), build(NAME), (args, kwargs))
    assert compiled["skew"] == planned.expert_parallel["skew"] > 1.0, (compiled, planned.expert_parallel)

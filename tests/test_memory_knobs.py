"""The memory knobs of a training step, each exact and priced:

* gradient accumulation (``plan.microbatches``, ``ShardedModule.train_step``): the global batch
  runs as microbatches whose weighted losses and summed gradients equal one device's on the
  whole batch (padding targets and a smaller last microbatch included), gradients are
  synchronised once a step, and the planner takes microbatches when the whole batch does not fit;
* activation recomputation (``plan.recompute``): repeated blocks (or their attention cores, under
  selective recomputation) run as checkpointed functions, alone and with ZeRO-3, tensor
  parallelism and microbatches, and the planner takes it when no count of microbatches fits;
* ZeRO-2 (``NodePlan.kept``): parameters gathered once a step and kept, gradients and optimizer
  states sharded; ZeRO-1 (``NodePlan.accumulated``): the gradient summed whole over the
  microbatches and reduce-scattered once;
* offload (``NodePlan.offloaded``): ZeRO-sharded parameters' shards, gradients and optimizer states
  in host memory, priced over the host link, taken by the planner only where nothing else fits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar import MeshSpec
from autopar.core.blocks import recompute_modes, recomputed_regions
from autopar.core.capture import capture
from autopar.core.errors import AutoparError, InfeasibleError, LossWeightError, PlanningTimeout
from autopar.core.microbatch import batch_size, split
from autopar.planning.baselines import candidates
from autopar.profiling.launch import per_rank, run_on_local_tensor_mesh
from codegen.recompute import checkpointed
from tests.equivalence import (
    TOLERANCES,
    build,
    check_training,
    gloo_runner,
    local_runner,
    loss_of,
    make_batches,
    meta_model,
    padded_batches,
    train_reference,
    train_steps,
)
from tests.tiers import slow

MODELS = ["gpt-tiny", "llama-tiny", "gpt2-tiny"]


@pytest.mark.parametrize("name, microbatches", [("gpt-tiny", 4), ("llama-tiny", 2), ("gpt2-tiny", 4)])
@slow
def test_microbatches_train_like_one_device(name, microbatches):
    plan = check_training(name, 8, 16, (2, 2), local_runner, {"microbatches": microbatches})
    assert (plan.microbatches, plan.batch_size, plan.microbatch_size) == (microbatches, 8, 8 // microbatches)


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-tiny"])
@slow
def test_padding_targets_weigh_microbatches_by_their_targets(name):
    batches = padded_batches(name)
    check_training(name, 8, 16, (2, 2), local_runner, {"microbatches": 4}, batches=batches)


@slow
def test_padded_batch_on_gloo_processes_with_a_data_parallel_plan():
    """Real processes: the DDP buckets skip their all-reduce until the last microbatch."""
    name = "gpt2-tiny"
    batches = padded_batches(name)
    plan = candidates(build(name), MeshSpec((2,)), *batches[0], microbatches=2, names=["ddp"])["ddp"]
    assert plan.microbatches == 2
    check_training(name, 8, 16, (2,), gloo_runner, {"plan": plan}, batches=batches)


@slow
def test_a_smaller_batch_makes_a_smaller_last_microbatch():
    """Planned for 8 rows in microbatches of 4, fed 6 rows: microbatches of 4 and 2, still exact."""
    name = "llama-tiny"
    planned, fed = make_batches(name, 8, 16, steps=1), make_batches(name, 6, 16)
    ref_losses, ref_state = train_reference(name, fed)
    model = build(name)

    def body(mesh):
        pmodel = autopar.compile(model, mesh, *planned[0], microbatches=2)
        losses = train_steps(pmodel, fed)
        return [float(per_rank(l)[0]) for l in losses], {k: per_rank(v)[0].clone() for k, v in
                                                          autopar.full_state_dict(pmodel).items()}

    losses, state = run_on_local_tensor_mesh(body, (2, 2))
    rtol, loss_atol, atol = TOLERANCES["fp32"]
    assert losses == pytest.approx(ref_losses, rel=rtol, abs=loss_atol)
    for key, want in ref_state.items():
        torch.testing.assert_close(state[key], want, rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}")


@slow
def test_gradients_are_reduced_once_per_step(monkeypatch):
    """Four microbatches launch as many all-reduces as one: the last backward's bucket (gpt-tiny's
    gradients fill one), the loss of every microbatch summed over ranks in it; the loss is exact."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    name = "gpt-tiny"
    batch = padded_batches(name)[0]
    want = train_reference(name, [batch])[0][0]
    launched = []
    for module in (funcol, dist):   # functional and c10d's own all-reduces (the buckets use the latter)
        all_reduce = module.all_reduce
        monkeypatch.setattr(module, "all_reduce", lambda *a, _f=all_reduce, **k: launched.append(1) or _f(*a, **k))
    counts = {}
    for k in (1, 4):
        plan = candidates(build(name), MeshSpec((2,)), *batch, microbatches=k, names=["ddp"])["ddp"]
        model = build(name)

        def body(mesh, model=model, plan=plan):
            pmodel = autopar.compile(model, mesh, *batch, plan=plan)
            launched.clear()
            return [float(v) for v in per_rank(pmodel.train_step(*batch[0], **batch[1]))]
        losses = run_on_local_tensor_mesh(body, (2,))
        counts[k] = len(launched)
        assert losses == pytest.approx([want] * 2, rel=TOLERANCES["fp32"][0], abs=TOLERANCES["fp32"][1])
    assert counts == {1: 1, 4: 1}


@slow
def test_gradient_buckets_accumulate_across_backwards_and_are_reused():
    """Two backwards of different batches without ``zero_grad`` between them sum their gradients
    as on one device (the first one's gradients, views of the bucket buffers, are not overwritten
    by the second); after ``zero_grad(set_to_none=True)`` the next backward flattens into the same
    buffers (a gradient kept past it is overwritten, as documented)."""
    from torch.distributed.tensor import DTensor

    name = "gpt-tiny"
    batches = padded_batches(name)[:2]
    reference = build(name)
    for args, kwargs in batches:
        loss_of(reference(*args, **kwargs)).backward()
    plan = candidates(build(name), MeshSpec((2,)), *batches[0], names=["ddp"])["ddp"]
    model = build(name)

    def body(mesh):
        pmodel = autopar.compile(model, mesh, *batches[0], plan=plan)
        for args, kwargs in batches:
            pmodel.train_step(*args, **kwargs)
        summed = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                  for n, p in pmodel.named_parameters()}
        pmodel.zero_grad(set_to_none=True)
        pmodel.train_step(*batches[0][0], **batches[0][1])
        kept = {n: per_rank(p.grad)[0] for n, p in pmodel.named_parameters()}   # held: its memory stays taken
        pmodel.zero_grad(set_to_none=True)
        pmodel.train_step(*batches[1][0], **batches[1][1])
        return summed, all(per_rank(p.grad)[0].data_ptr() == kept[n].data_ptr() for n, p in pmodel.named_parameters())

    summed, reused = run_on_local_tensor_mesh(body, (2,))
    for n, p in reference.named_parameters():
        for got in per_rank(summed[n]):
            assert torch.allclose(got, p.grad, rtol=TOLERANCES["fp32"][0], atol=TOLERANCES["fp32"][1]), n
    assert reused, "the next step's gradients are not in the bucket buffers the step before used"


class _ScaledLoss(torch.nn.Module):
    """A loss the microbatches cannot be weighed for: a mean scaled by a learned parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.proj(x).pow(2).mean() * self.scale


class _NoLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("module, microbatches, match", [
    (_ScaledLoss, 2, "not a mean or sum"), (_NoLoss, 1, "returns no loss")])
def test_train_step_refuses_a_loss_it_cannot_weigh(module, microbatches, match):
    x = torch.randn(8, 8)

    def body(mesh):
        pmodel = autopar.compile(module(), mesh, (x,), microbatches=microbatches)
        with pytest.raises(LossWeightError, match=match):
            pmodel.train_step(x)
        return pmodel.train_step(x[:4]) if microbatches > 1 else None   # one microbatch: nothing to weigh

    run_on_local_tensor_mesh(body, (2,))


def test_microbatches_must_divide_the_batch():
    model, args, kwargs = meta_model("gpt-tiny", 8, 16)
    with pytest.raises(AutoparError, match=r"microbatches=3 does not divide the batch of 8 rows.*\[1, 2, 4, 8\]"):
        autopar.plan(model, MeshSpec((2,)), args, kwargs, microbatches=3)
    with pytest.raises(AutoparError, match="'auto'"):
        autopar.PlanOptions(microbatches=0)


@slow
def test_costs_of_microbatches():
    """The same plan in 2 microbatches: the same compute and gradient synchronisation per step
    (ops are priced per microbatch, run twice; gradients reduced once), less activation memory,
    twice the activation traffic of tensor parallelism."""
    model, args, kwargs = meta_model("gpt-tiny", 16, 64)
    whole = candidates(model, MeshSpec((2, 2)), args, kwargs, profile=None)
    halves = candidates(model, MeshSpec((2, 2)), args, kwargs, profile=None, microbatches=2)
    ddp, ddp2 = whole["ddp"].predicted, halves["ddp"].predicted
    assert ddp2.overlapped_comm_s == pytest.approx(ddp.overlapped_comm_s, rel=1e-9)
    assert ddp2.compute_s == pytest.approx(ddp.compute_s, rel=0.15)
    assert ddp2.memory_breakdown["activations"] < 0.6 * ddp.memory_breakdown["activations"]
    tp, tp2 = whole["dp(dp) x tp(tp)"].predicted, halves["dp(dp) x tp(tp)"].predicted
    assert tp2.comm_bytes["tp"] == pytest.approx(tp.comm_bytes["tp"], rel=1e-3)   # bytes per step: about the same
    assert tp2.comm_s > tp.comm_s                                                   # twice the latencies


def least_memory(model, mesh, args, kwargs, option: str, values, **fixed) -> dict:
    """The least memory per device any plan needs with planning option ``option`` at each of
    ``values`` (and the ``fixed`` others), as the planner's error states it under a 1-byte budget."""
    least = {}
    for value in values:
        with pytest.raises(InfeasibleError) as info:
            autopar.plan(model, mesh, args, kwargs, **{option: value}, **fixed, memory_budget=1.0, profile=None)
        least[value] = info.value.min_memory_bytes
    return least


@slow
def test_planner_takes_microbatches_when_the_whole_batch_does_not_fit():
    model, args, kwargs = meta_model("gpt-tiny", 16, 64)
    mesh = MeshSpec((2,))
    least = least_memory(model, mesh, args, kwargs, "microbatches", (1, 16), recompute="none")
    assert least[16] < 0.5 * least[1]
    budget = least[1] * 0.9
    plan = autopar.plan(model, mesh, args, kwargs, memory_budget=budget, profile=None)
    assert plan.microbatches > 1 and plan.feasible and plan.predicted.peak_memory_bytes <= budget
    assert "microbatches" in plan.report()
    assert autopar.Plan.from_json(plan.to_json()).microbatches == plan.microbatches
    roomy = autopar.plan(model, mesh, args, kwargs, profile=None)
    assert roomy.microbatches == 1
    with pytest.raises(InfeasibleError, match=r"Microbatches were tried up to 16 \(of 1 rows each\)"):
        autopar.plan(model, mesh, args, kwargs, memory_budget=0.95 * least[16], recompute="none", profile=None)
    with pytest.raises(InfeasibleError, match="Microbatches would not help: what does not shrink"):
        autopar.plan(model, mesh, args, kwargs, memory_budget=0.2 * least[16], profile=None)


def test_a_search_that_runs_out_of_time_keeps_the_plan_it_has(monkeypatch):
    """The solver finding nothing in the last seconds (fewer microbatches, a second mode) leaves
    the plan in hand; it is an error only where no plan was found at all."""
    import autopar.planning.planner as planner
    model, args, kwargs = meta_model("gpt-tiny", 16, 64)
    mesh = MeshSpec((2,))
    budget = 0.9 * least_memory(model, mesh, args, kwargs, "microbatches", (1,), recompute="none")[1]
    solved = planner._plan
    calls = []

    def first_only(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise PlanningTimeout("no plan in the time left")
        return solved(*a, **k)

    monkeypatch.setattr(planner, "_plan", first_only)
    plan = autopar.plan(model, mesh, args, kwargs, memory_budget=budget, profile=None)
    assert plan.feasible and len(calls) > 1   # the first solve's plan; every later one timed out
    calls.append(1)   # from now on every solve finds nothing
    with pytest.raises(PlanningTimeout):
        autopar.plan(model, mesh, args, kwargs, memory_budget=budget, profile=None)


# ---------------------------------------------------------------- activation recomputation

@pytest.mark.parametrize("name", MODELS)
@slow
def test_full_recomputation_trains_like_one_device(name):
    plan = check_training(name, 8, 16, (2, 2), local_runner, {"recompute": "full"})
    assert plan.recompute and set(plan.recompute.values()) == {"full"}


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@slow
def test_recomputation_with_zero3_tensor_parallelism_and_microbatches(name):
    """Recomputed blocks gather their ZeRO-3 parameters and run their TP collectives again in the
    backward; with microbatches on top."""
    batches = make_batches(name, 8, 16)
    plan = candidates(build(name), MeshSpec((2, 2)), *batches[0], recompute="full",
                      microbatches=2, names=["fsdp(dp) x tp+sp(tp)"])["fsdp(dp) x tp+sp(tp)"]
    assert plan.microbatches == 2 and plan.recompute
    check_training(name, 8, 16, (2, 2), local_runner, {"plan": plan}, batches=batches)
    assert "recompute(block_" in autopar_code(name, plan, batches)


def autopar_code(name, plan, batches, **compile_options) -> str:
    model = build(name)

    def body(mesh):
        return autopar.compile(model, mesh, *batches[0], plan=plan, **compile_options).code
    return run_on_local_tensor_mesh(body, plan.mesh.shape)


def test_recomputation_costs():
    """Full recomputation: activations of one block at a time instead of all, about a third more
    compute (the forward again), the same communication bytes of data parallelism."""
    model, args, kwargs = meta_model("gpt-tiny", 16, 64)
    plain = candidates(model, MeshSpec((2,)), args, kwargs, profile=None, names=["ddp"])["ddp"]
    again = candidates(model, MeshSpec((2,)), args, kwargs, profile=None, recompute="full", names=["ddp"])["ddp"]
    assert again.recompute == {"transformer.h.0": "full", "transformer.h.1": "full"}
    p, q = plain.predicted, again.predicted
    assert q.peak_memory_bytes < p.peak_memory_bytes
    assert q.memory_breakdown["activations"] + q.memory_breakdown["recomputed"] < 0.6 * p.memory_breakdown["activations"]
    assert 1.1 * p.compute_s < q.compute_s < 1.5 * p.compute_s
    assert q.overlapped_comm_s == pytest.approx(p.overlapped_comm_s)
    assert "full for 2 block(s) (transformer.h.0 ... transformer.h.1)" in again.report()
    assert autopar.Plan.from_json(again.to_json()).recompute == again.recompute


def test_a_recomputed_block_and_an_identical_one_not_recomputed_are_priced_apart():
    """Identical layers share their costs, but not where only the first is recomputed: it keeps
    its block's inputs, the second its activations (priced as the first, Llama-3 8B's plan at 256k
    tokens on 8 H100 that recomputed one block of 32 was priced as if it recomputed all 32)."""
    from autopar.core.strategies import build_space
    from cost_models.estimate import CostModel
    from cost_models.schedule import PricedSpace

    model, args, kwargs = meta_model("gpt-tiny", 16, 64)
    space = build_space(capture(model, args, kwargs), MeshSpec((1,)))

    def kept(recompute) -> float:
        priced = PricedSpace(space, CostModel(space.mesh, space, recompute=recompute))
        return sum(costs[0].saved_bytes for costs in priced.nodes)

    none, first, full = kept("none"), kept({"transformer.h.0": "full"}), kept("full")
    assert full < first < none and first - full == pytest.approx(none - first, rel=0.05)


@slow
def test_planner_recomputes_when_no_microbatch_count_fits():
    """A batch of one sequence cannot be cut into microbatches: only recomputation makes it fit."""
    model, args, kwargs = meta_model("gpt2-tiny", 1, 256)
    mesh = MeshSpec((2,))
    least = least_memory(model, mesh, args, kwargs, "recompute", ("none", "full"))
    budget = 1.2 * least["full"]   # room for what the least-memory bound leaves out (collective buffers)
    assert budget < least["none"]
    plan = autopar.plan(model, mesh, args, kwargs, memory_budget=budget, profile=None)
    assert plan.recompute and plan.feasible and plan.predicted.peak_memory_bytes <= budget
    with pytest.raises(InfeasibleError, match="With full recomputation of the repeated blocks too, a plan needs"):
        autopar.plan(model, mesh, args, kwargs, memory_budget=0.9 * least["full"], profile=None)
    with pytest.raises(AutoparError, match="recompute is 'auto', 'none', 'selective', 'full'"):
        autopar.PlanOptions(recompute="attention")


@slow
def test_planner_recomputes_only_the_blocks_it_needs_to():
    """Between what full recomputation and none need, recomputing the first block alone fits and
    is faster than recomputing both; a plan recomputing some blocks trains exactly."""
    model, args, kwargs = meta_model("gpt2-tiny", 1, 256)   # one row: microbatches cannot help
    mesh = MeshSpec((2,))
    least = least_memory(model, mesh, args, kwargs, "recompute", ("none", "full"))
    budget = (least["none"] + least["full"]) / 2
    full = autopar.plan(model, mesh, args, kwargs, recompute="full", memory_budget=budget, profile=None)
    auto = autopar.plan(model, mesh, args, kwargs, memory_budget=budget, profile=None)
    assert full.recompute == {"transformer.h.0": "full", "transformer.h.1": "full"}
    assert auto.feasible and auto.recompute == {"transformer.h.0": "full"} and "1 of 2 blocks" in auto.solver["recompute_blocks"]
    assert auto.predicted.step_time_s < full.predicted.step_time_s
    batches = make_batches("gpt2-tiny", 8, 16)
    some = candidates(build("gpt2-tiny"), MeshSpec((2, 2)), *batches[0], recompute="full", names=["fsdp(dp) x tp+sp(tp)"])["fsdp(dp) x tp+sp(tp)"]
    some = dataclasses.replace(some, recompute={"transformer.h.1": "full"})
    check_training("gpt2-tiny", 8, 16, (2, 2), local_runner, {"plan": some}, batches=batches)
    code = autopar_code("gpt2-tiny", some, batches)
    assert "recompute(block_transformer_h_1" in code and "block_transformer_h_0" not in code


@slow
def test_planner_prices_recomputation_against_more_microbatches():
    """Where the whole batch needs microbatches, "auto" plans it both ways, each in the fewest
    microbatches that fit, and keeps the faster: recomputation may need fewer, larger ones."""
    model, args, kwargs = meta_model("gpt2-tiny", 16, 256)
    mesh = MeshSpec((2,))
    least = least_memory(model, mesh, args, kwargs, "recompute", ("none", "full"), microbatches=1)
    budget = 1.2 * least["full"]
    assert budget < least["none"]   # the whole batch fits only with recomputation
    each = {mode: autopar.plan(model, mesh, args, kwargs, recompute=mode, memory_budget=budget, profile=None)
            for mode in ("none", "full")}
    assert each["none"].microbatches > each["full"].microbatches and not each["none"].recompute
    auto = autopar.plan(model, mesh, args, kwargs, memory_budget=budget, profile=None)
    faster = min(each, key=lambda mode: each[mode].predicted.step_time_s)
    assert auto.feasible and auto.predicted.step_time_s == pytest.approx(each[faster].predicted.step_time_s)
    assert auto.microbatches == each[faster].microbatches and auto.recompute == each[faster].recompute
    assert "none: " in auto.solver["recompute"] and "full: " in auto.solver["recompute"]
    assert auto.solver["recompute"].endswith(f"kept {faster}")


def test_attention_cores_are_found_where_attention_is_not_fused():
    """BLOOM computes attention in ops (baddbmm, softmax, bmm): its blocks have cores; SDPA models none."""
    bloom = capture(build("bloom-tiny"), *make_batches("bloom-tiny", 2, 8, steps=1)[0]).graph
    cores = recomputed_regions(bloom, recompute_modes(bloom, "selective"))
    assert [c.path for c in cores] == ["transformer.h.0", "transformer.h.1"]
    targets = [n.target for n in bloom.nodes if n.name in cores[0].nodes]
    assert targets[0] is torch.ops.aten.baddbmm.default and targets[-1] is torch.ops.aten.bmm.default
    assert torch.ops.aten.softmax.int in targets and torch.ops.aten.linear.default not in targets
    llama = capture(build("llama-tiny"), *make_batches("llama-tiny", 2, 8, steps=1)[0]).graph
    assert recompute_modes(llama, "selective") == {} and len(recompute_modes(llama, "full")) == 2


@slow
def test_selective_recomputation_trains_like_one_device():
    batches = make_batches("bloom-tiny", 8, 16)
    plan = candidates(build("bloom-tiny"), MeshSpec((2, 2)), *batches[0], recompute="selective",
                      microbatches=2, names=["dp(dp) x tp+sp(tp)"])["dp(dp) x tp+sp(tp)"]
    assert set(plan.recompute.values()) == {"selective"}
    check_training("bloom-tiny", 8, 16, (2, 2), local_runner, {"plan": plan}, batches=batches)
    assert "recompute(attention_core_transformer_h_1" in autopar_code("bloom-tiny", plan, batches)


@slow
def test_selective_recomputation_costs_and_choice():
    """Selective recomputation keeps less than none and more than full, for a fraction of full's
    extra compute; the planner takes it where nothing fits without it and it does."""
    model, args, kwargs = meta_model("bloom-tiny", 1, 512)   # one row: microbatches cannot help
    mesh = MeshSpec((2,))
    plans = {mode: candidates(model, mesh, args, kwargs, profile=None, recompute=mode, names=["ddp"])["ddp"].predicted
             for mode in ("none", "selective", "full")}
    assert plans["full"].peak_memory_bytes < plans["selective"].peak_memory_bytes < plans["none"].peak_memory_bytes
    assert plans["none"].compute_s < plans["selective"].compute_s < plans["full"].compute_s
    least = least_memory(model, mesh, args, kwargs, "recompute", ("none", "selective"))
    budget = 1.2 * least["selective"]
    assert budget < least["none"]
    plan = autopar.plan(model, mesh, args, kwargs, memory_budget=budget, profile=None)
    assert plan.feasible and set(plan.recompute.values()) == {"selective"}
    assert "selective for 2 block(s)" in plan.report()


# ---------------------------------------------------------------- ZeRO-2

@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@slow
def test_zero2_with_microbatches_trains_like_one_device(name):
    """The kept copy serves every microbatch of a step and is gathered again after each
    optimizer step (a stale copy would train on old weights)."""
    batches = make_batches(name, 8, 16)
    plan = candidates(build(name), MeshSpec((2, 2)), *batches[0], microbatches=2, names=["zero2"])["zero2"]
    assert any(p.kept for p in plan.parameters.values())
    check_training(name, 8, 16, (2, 2), local_runner, {"plan": plan}, batches=batches)


@slow
def test_zero1_reduces_gradients_once_a_step_and_trains_like_one_device(monkeypatch):
    """ZeRO-1 sums each group's gradients whole over the microbatches and reduce-scatters them in
    the last backward (ZeRO-2 in every backward); both train as one device does."""
    import codegen.zero3 as zero3

    launched = []
    reduce_scatter = zero3.funcol.reduce_scatter_single
    monkeypatch.setattr(zero3.funcol, "reduce_scatter_single", lambda *a, **k: launched.append(1) or reduce_scatter(*a, **k))
    batches = make_batches("gpt2-tiny", 8, 16)
    counts = {}
    for stage in ("zero1", "zero2"):
        plan = candidates(build("gpt2-tiny"), MeshSpec((2, 2)), *batches[0], microbatches=2, names=[stage])[stage]
        assert all(p.accumulated == (stage == "zero1") for p in plan.parameters.values() if p.kept)
        launched.clear()
        check_training("gpt2-tiny", 8, 16, (2, 2), local_runner, {"plan": plan}, batches=batches)
        counts[stage] = len(launched)
    assert counts["zero2"] == 2 * counts["zero1"] > 0   # per step: 2 microbatches' reduce-scatters, or 1


def test_zero1_costs():
    """ZeRO-1 holds the microbatches' gradient whole where ZeRO-2 holds its shard; with one
    microbatch the two are one plan."""
    model, args, kwargs = meta_model("gpt-tiny", 16, 64)
    plans = candidates(model, MeshSpec((4,)), args, kwargs, profile=None, microbatches=4)
    zero1, zero2 = plans["zero1"].predicted, plans["zero2"].predicted
    assert zero1.memory_breakdown["gradients"] == pytest.approx(4 * zero2.memory_breakdown["gradients"])
    assert zero1.memory_breakdown["state"] == zero2.memory_breakdown["state"]
    whole = candidates(model, MeshSpec((4,)), args, kwargs, profile=None)
    assert whole["zero1"].predicted == whole["zero2"].predicted


def test_zero2_costs():
    """ZeRO-2 beside ZeRO-3 and DDP: optimizer states and gradients sharded as ZeRO-3's, the whole
    parameters held as DDP's; one gather a step, not one per microbatch."""
    model, args, kwargs = meta_model("gpt-tiny", 16, 64)
    plans = candidates(model, MeshSpec((4,)), args, kwargs, profile=None, microbatches=4)
    ddp, fsdp, zero2 = (plans[k].predicted for k in ("ddp", "fsdp", "zero2"))
    assert fsdp.memory_breakdown["state"] < zero2.memory_breakdown["state"] < ddp.memory_breakdown["state"]
    assert zero2.comm_bytes["x"] < fsdp.comm_bytes["x"]
    assert "gathered once a step and kept" in plans["zero2"].report(top=None)


# ---------------------------------------------------------------- offload

@pytest.mark.parametrize("name, hand_plan", [("llama-tiny", "fsdp(dp) x tp+sp(tp)"), ("gpt2-tiny", "zero2")])
@slow
def test_offloaded_optimizer_states_train_like_one_device(name, hand_plan):
    """Offloaded ZeRO-3 and ZeRO-2 parameters, gathered alone and in groups small enough that an
    offloaded group hands its gradient over while the backward goes on, over microbatches."""
    batches = make_batches(name, 8, 16)
    plan = candidates(build(name), MeshSpec((2, 2)), *batches[0], offload="optimizer", microbatches=2, names=[hand_plan])[hand_plan]
    zero = [p for p in plan.parameters.values() if p.storage != p.out]
    assert zero and all(p.offloaded for p in zero) and not any(p.offloaded for p in plan.parameters.values() if p not in zero)
    check_training(name, 8, 16, (2, 2), local_runner, {"plan": plan, "bucket_bytes": 4096}, batches=batches)
    code = autopar_code(name, plan, batches, bucket_bytes=4096)
    assert code.count("(offloaded: shards, gradients and optimizer states in host memory") > 1


@slow
def test_offload_costs():
    """Offloaded states leave the device, paid for in host-link copies and a host optimizer step; on
    the CPU preset, whose device is the host, offload moves and saves nothing."""
    model, args, kwargs = meta_model("gpt2-tiny", 16, 64)
    gpu = MeshSpec((4,), hardware="h100-80gb")
    kept, off = (candidates(model, gpu, args, kwargs, profile=None, microbatches=2, offload=mode)
                 for mode in ("none", "optimizer"))
    assert off["ddp"].predicted == kept["ddp"].predicted and not off["ddp"].offloaded   # nothing ZeRO-sharded
    for name, left in (("fsdp", 0.1), ("zero2", 0.7)):   # ZeRO-2 keeps its gathered copy on the device
        p, q = kept[name].predicted, off[name].predicted
        assert off[name].offloaded and q.memory_breakdown["state"] < left * p.memory_breakdown["state"]
        assert q.comm_s > p.comm_s and q.step_time_s > p.step_time_s
    report = off["fsdp"].report(top=None)
    assert "in host memory" in report and "offload         optimizer: " in report
    assert autopar.Plan.from_json(off["fsdp"].to_json()).offloaded == off["fsdp"].offloaded
    cpu = [candidates(model, MeshSpec((4,)), args, kwargs, profile=None, offload=mode, names=["fsdp"])["fsdp"] for mode in ("none", "optimizer")]
    assert cpu[1].offloaded and cpu[1].predicted == cpu[0].predicted


@slow
def test_planner_offloads_only_when_nothing_else_fits():
    model, args, kwargs = meta_model("gpt2-tiny", 2, 16)   # parameters outweigh activations
    mesh = MeshSpec((4,), hardware="h100-80gb")
    least = least_memory(model, mesh, args, kwargs, "offload", ("none", "optimizer"))
    budget = 1.9 * least["optimizer"]   # room for what the least-memory bound leaves out
    assert budget < least["none"]
    with pytest.raises(InfeasibleError):
        autopar.plan(model, mesh, args, kwargs, offload="none", memory_budget=budget, profile=None)
    plan = autopar.plan(model, mesh, args, kwargs, memory_budget=budget, profile=None)
    assert plan.feasible and plan.offloaded and "offloaded to host memory" in plan.solver["offload"]
    assert not autopar.plan(model, mesh, args, kwargs, profile=None).offloaded   # it fits 80 GB as it is
    with pytest.raises(InfeasibleError, match="offloaded to host memory"):
        autopar.plan(model, mesh, args, kwargs, memory_budget=0.5 * least["optimizer"], profile=None)
    with pytest.raises(AutoparError, match="offload is 'auto', 'none', 'optimizer'"):
        autopar.PlanOptions(offload="nvme")


# ---------------------------------------------------------------- pieces

def test_split_cuts_the_rows_of_batch_tensors_only():
    ids, labels, positions = torch.arange(16).view(8, 2), torch.arange(16).view(8, 2) + 100, torch.arange(2).view(1, 2)
    parts = split((ids, positions), {"labels": labels, "use_cache": False}, 3)
    assert [a[0].shape[0] for a, _ in parts] == [3, 3, 2]
    assert all(a[1] is positions and k["use_cache"] is False for a, k in parts)
    assert torch.equal(torch.cat([k["labels"] for _, k in parts]), labels)
    assert batch_size((ids, positions), {}) == 8


def test_checkpointed_block_takes_what_it_reads_and_returns_what_later_lines_read():
    lines = ["    a = f(x)", "    b = g(a, w)", "    del a, x", "    c = h(b)", "    del b", "    return (c,)"]
    out = checkpointed(lines, 1, 5, {"x", "w"}, "block_0", "recomputed")
    assert out[1].splitlines()[0] == "    def block_0(a, w):  # recomputed"
    assert "        del a" in out[1].splitlines() and out[2:] == ["    (c,) = recompute(block_0, a, w)", "    del a, x",
                                                                   "    return (c,)"]
    calls = []
    namespace = {"f": lambda x: x + 1, "g": lambda a, w: a * w, "h": lambda b: b - 1,
                 "recompute": lambda fn, *args: calls.append(fn.__name__) or fn(*args)}
    exec("def forward(x, w):\n" + "\n".join(out) + "\n", namespace)
    assert namespace["forward"](2, 3) == ((2 + 1) * 3 - 1,) and calls == ["block_0"]

"""Whole-model equivalence: sharded training equals single-device training (fp32, tight tolerance),
on real models (hand-written GPT, HuggingFace GPT-2 and Llama), over 3 AdamW steps, on 1-D and
2-D meshes including uneven ones, both in one process (LocalTensorMode) and on gloo processes."""
from __future__ import annotations

import pytest
import torch

import codegen.runtime
from autopar.launch import per_rank, run_on_gloo_mesh, run_on_local_tensor_mesh
from tests.equivalence import build, make_batches, train_reference, train_sharded

RTOL, ATOL = 1e-4, 1e-5
MODELS = ["gpt-tiny", "gpt2-tiny", "llama-tiny"]
MESHES = [(1,), (2,), (3,), (4,), (2, 2)]
# With a tight memory row the solver closes its last few % of gap slowly; any plan it returns
# must train exactly like one device, so a short limit loses nothing here.
SOLVE_S = 10.0


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    """A placement mismatch between plan and runtime is a bug: fail instead of silently resharding."""
    monkeypatch.setattr(codegen.runtime, "STRICT", True)


def _check(name, batch, seq, mesh_shape, runner, plan_options):
    batches = make_batches(name, batch, seq)
    ref_losses, ref_state = train_reference(name, batches)
    losses, state, plan = runner(mesh_shape, name, batches, plan_options)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        for r, value in enumerate(got):
            assert abs(value - want) <= ATOL + RTOL * abs(want), f"step {step} rank {r}: loss {value} != {want}"
    assert state.keys() == ref_state.keys()
    for key, want in ref_state.items():
        for r, value in enumerate(state[key]):
            torch.testing.assert_close(value, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key} rank {r}: {m}")
    return plan


def _local_runner(mesh_shape, name, batches, plan_options):
    model = build(name)

    def body(mesh):
        losses, state, plan = train_sharded(mesh, model, batches, plan_options)
        return ([[float(x) for x in per_rank(l)] for l in losses],
                {k: [t.clone() for t in per_rank(v)] for k, v in state.items()}, plan)
    return run_on_local_tensor_mesh(body, mesh_shape)


def _gloo_worker(mesh, name, batches, plan_options):
    codegen.runtime.STRICT = True
    losses, state, plan = train_sharded(mesh, build(name), batches, plan_options)
    return [float(l) for l in losses], state, plan.to_json()


def _gloo_runner(mesh_shape, name, batches, plan_options):
    results = run_on_gloo_mesh(_gloo_worker, mesh_shape, name, batches, plan_options, start_method="forkserver")
    assert len({res[2] for res in results}) == 1, "every rank must run the same plan"
    losses = [[results[r][0][s] for r in range(len(results))] for s in range(len(results[0][0]))]
    state = {k: [res[1][k] for res in results] for k in results[0][1]}
    return losses, state, results[0][2]


def _tight_budget(name, batch, seq, mesh_shape) -> float:
    """Halfway between the least memory any plan needs on this mesh and what full replication
    needs (the planner's own estimates): replicating everything does not fit, so the planner
    must shard (TP and/or ZeRO-3)."""
    import autopar
    from autopar.errors import InfeasibleError
    from autopar.mesh import MeshSpec

    args, kwargs = make_batches(name, batch, seq, steps=1)[0]
    replicated = autopar.plan(build(name), MeshSpec((1,)), args, kwargs).predicted.peak_memory_bytes
    with pytest.raises(InfeasibleError) as info:
        autopar.plan(build(name), MeshSpec(mesh_shape), args, kwargs, memory_budget=1.0)
    return info.value.min_memory_bytes + 0.5 * (replicated - info.value.min_memory_bytes)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MODELS)
def test_local_default_plan(name, mesh_shape):
    _check(name, 6, 16, mesh_shape, _local_runner, {})


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MODELS)
def test_local_memory_constrained_plan(name, mesh_shape):
    """A budget that rules out replication forces sharded parameters; results must not change."""
    budget = _tight_budget(name, 6, 16, mesh_shape)
    plan = _check(name, 6, 16, mesh_shape, _local_runner, {"memory_budget": budget, "time_limit": SOLVE_S})
    assert any(p.storage != (torch.distributed.tensor.Replicate(),) * len(mesh_shape)
               for p in plan.parameters.values()), "a tight budget must shard some parameter"


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", MODELS)
def test_gloo_processes(name, mesh_shape):
    budget = _tight_budget(name, 6, 16, mesh_shape)
    _check(name, 6, 16, mesh_shape, _gloo_runner, {"memory_budget": budget, "time_limit": SOLVE_S})


@pytest.mark.parametrize("keep_sharded", [False, True])
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_logits_without_labels(name, keep_sharded):
    """HuggingFace models called without labels return logits; sharded logits equal the original's."""
    from torch.distributed.tensor import DTensor

    args, _ = make_batches(name, 5, 16, steps=1)[0]
    torch.manual_seed(0)
    want = build(name)(*args)[0].detach()
    model = build(name)
    budget = _tight_budget(name, 5, 16, (2, 2))

    def body(mesh):
        import autopar

        pm = autopar.compile(model, mesh, args, keep_outputs_sharded=keep_sharded, memory_budget=budget,
                             time_limit=SOLVE_S)
        out = pm(*args)[0]
        assert isinstance(out, DTensor) == keep_sharded
        full = out.full_tensor() if keep_sharded else out
        return [t.clone() for t in per_rank(full)]

    for got in run_on_local_tensor_mesh(body, (2, 2)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_plan_made_on_meta_compiles_on_cpu():
    """The offline workflow: plan a meta-device copy, save the JSON, compile the real model with it."""
    import autopar
    from autopar.mesh import MeshSpec
    from autopar.zoo import get_model

    name = "gpt-tiny"
    batches = make_batches(name, 6, 16)
    args, kwargs = batches[0]
    with torch.device("meta"):
        meta_model = get_model(name).build()
    meta_args = tuple(a.to("meta") for a in args)
    plan = autopar.plan(meta_model, MeshSpec((2, 2)), meta_args, kwargs, memory_budget=_tight_budget(name, 6, 16, (2, 2)))
    saved = autopar.Plan.from_json(plan.to_json())
    _check(name, 6, 16, (2, 2), _local_runner, {"plan": saved})

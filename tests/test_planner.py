"""Planning behaviour: plans move as the costs say, errors are clear, plans round-trip and repeat."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

import autopar
from autopar import MeshSpec
from autopar.zoo import get_model


def _meta_gpt(batch: int, seq: int):
    entry = get_model("gpt-tiny")
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(batch, seq, device="meta")
    return model, args, kwargs


def test_large_batch_small_model_is_data_parallel():
    # Enough tokens that compute, not collective latency, dominates on an H100.
    model, args, kwargs = _meta_gpt(1024, 64)
    plan = autopar.plan(model, MeshSpec((4,), hardware="h100-80gb"), args, kwargs)
    linears = [n for n in plan.nodes if n.op == "aten.linear.default"]
    assert linears and all(n.strategy == "batch" for n in linears), [(n.name, n.strategy) for n in linears]
    replicated = autopar.plan(model, MeshSpec((1,), hardware="h100-80gb"), args, kwargs)
    assert plan.predicted.step_time_s < 0.5 * replicated.predicted.step_time_s


def test_small_batch_first_layer_may_stay_replicated():
    # With few tokens, the last gradients of the backward (the first layer's) could not be hidden
    # under compute: computing that layer redundantly on every rank avoids their all-reduce.
    model, args, kwargs = _meta_gpt(64, 64)
    plan = autopar.plan(model, MeshSpec((4,), hardware="h100-80gb"), args, kwargs)
    linears = [n for n in plan.nodes if n.op == "aten.linear.default"]
    assert linears[0].strategy == "replicate" and "batch" in {n.strategy for n in linears[1:]}
    assert plan.predicted.exposed_comm_s < 0.5 * plan.predicted.overlapped_comm_s   # most of it is hidden


def test_small_budget_shards_parameters_and_fits():
    model, args, kwargs = _meta_gpt(8, 32)
    replicated = autopar.plan(model, MeshSpec((1,)), args, kwargs).predicted.peak_memory_bytes
    budget = 0.45 * replicated
    plan = autopar.plan(model, MeshSpec((4,)), args, kwargs, memory_budget=budget)
    sharded = [n for n in plan.parameters.values() if n.storage != (Replicate(),)]
    assert sharded, "a budget below replication must shard parameters (tensor parallel or ZeRO-3)"
    assert plan.predicted.peak_memory_bytes <= budget


def test_infeasible_budget_states_minimum():
    model, args, kwargs = _meta_gpt(8, 32)
    with pytest.raises(autopar.InfeasibleError) as info:
        autopar.plan(model, MeshSpec((2,)), args, kwargs, memory_budget=1000)
    assert info.value.min_memory_bytes > 1000
    message = str(info.value)
    assert "budget is 1000 B per device" in message and "needs" in message, message


def test_plan_is_deterministic_and_json_round_trips(tmp_path):
    model, args, kwargs = _meta_gpt(8, 32)
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


def test_plan_predictions_are_in_seconds_and_bytes_per_axis():
    model, args, kwargs = _meta_gpt(8, 32)
    plan = autopar.plan(model, MeshSpec((2, 2), ("dp", "tp"), hardware="h100-80gb"), args, kwargs)
    p = plan.predicted
    assert p.step_time_s > 0 and p.peak_memory_bytes > 0
    assert set(p.comm_bytes) == {"dp", "tp"}
    assert abs(p.step_time_s - (p.compute_s + p.comm_s)) < 1e-12


def test_foreign_and_stale_plan_files_are_refused(tmp_path):
    model, args, kwargs = _meta_gpt(8, 32)
    plan = autopar.plan(model, MeshSpec((2,)), args, kwargs)
    other = autopar.plan(model, MeshSpec((2,)), *_meta_gpt(8, 16)[1:])
    with pytest.raises(autopar.PlanFileError, match="another model or input shapes"):
        other.check_matches(plan.fingerprint, plan.mesh)
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
    model, args, kwargs = _meta_gpt(8, 32)
    with pytest.raises(autopar.MeshError, match="DeviceMesh or an autopar.MeshSpec"):
        autopar.plan(model, (2, 2), args, kwargs)
    with pytest.raises(autopar.MeshError):
        MeshSpec((2, 0))


def test_inputs_that_do_not_match_forward():
    model, args, kwargs = _meta_gpt(8, 32)
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
    with pytest.raises(autopar.CaptureError, match=r"test_planner.py:\d+.*x.sum\(\) > 0"):
        autopar.plan(DataDependent(), MeshSpec((2,)), (torch.randn(2, 4),))


class Cumsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cumsum(self.lin(x), dim=1).sum()


def test_unknown_op_falls_back_to_replication_with_warning(caplog):
    plan = autopar.plan(Cumsum(), MeshSpec((2,)), (torch.randn(6, 4),))
    assert any("aten.cumsum" in w for w in plan.warnings), plan.warnings
    node = next(n for n in plan.nodes if "cumsum" in n.op)
    assert node.out == (Replicate(),) and node.strategy == "replicate"


def test_unknown_op_still_trains_correctly():
    from autopar.launch import per_rank, run_on_local_tensor_mesh

    torch.manual_seed(0)
    x = torch.randn(6, 4)
    ref = Cumsum()
    model = Cumsum()
    model.load_state_dict(ref.state_dict())
    ref(x).backward()

    def body(mesh):
        pm = autopar.compile(model, mesh, (x,))
        loss = pm(x)
        loss.backward()
        return [float(v) for v in per_rank(loss)], {k: per_rank(p.grad.full_tensor())[0].clone() for k, p in pm.named_parameters()}

    losses, grads = run_on_local_tensor_mesh(body, (2,))
    assert all(abs(v - ref(x).item()) < 1e-5 for v in losses)
    for k, p in ref.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-5)

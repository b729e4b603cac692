"""Each component of the cost model responds as it should: FLOP time and bytes scale with the
dimensions, collectives with the axis size, memory follows placements and lifetimes, overlapped
communication is hidden only up to the compute under it, and measured numbers replace the
roofline where a profile has them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import MeshSpec
from autopar.core.capture import capture
from autopar.core.placements import grad_placement, grad_target
from autopar.core.strategies import Strategy, all_replicated, build_space
from autopar.models.zoo import get_model
from autopar.planning.baselines import candidates
from autopar.planning.options import PlanOptions
from autopar.planning.planner import plan_captured
from cost_models.activations import gradients
from cost_models.comm import Link, collective_time
from cost_models.estimate import Cost, CostModel, get_optimizer
from cost_models.profile import OpTime, Profile, collective_key, local_fingerprint
from cost_models.profile_ops import op_call
from cost_models.schedule import PricedSpace, Timeline, step_costs
from tests.strategy_cases import TiedLM
from tests.tiers import slow

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


class MLP(nn.Module):
    def __init__(self, d: int = 64, h: int = 256) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.gate = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)) * self.gate(x)).sum()


def _space(batch: int = 32, d: int = 64, h: int = 256, mesh: tuple[int, ...] = (2,), hardware: str = "h100-80gb"):
    with torch.device("meta"):
        model = MLP(d, h)
    captured = capture(model, (torch.empty(batch, d, device="meta"),))
    return build_space(captured, MeshSpec(mesh, hardware=hardware))


def _node(space, name):
    return next(nc for nc in space.nodes if nc.node.name == name)


def _strategy(nc, out, ins=None, storage=None):
    for s in nc.strategies:
        if s.out == out and (ins is None or s.ins == ins) and (storage is None or s.storage == storage):
            return s
    raise AssertionError(f"{nc.node.name} has no strategy {out} {ins} {storage}: {nc.strategies}")


def test_doubling_batch_doubles_flop_time_and_activation_bytes():
    costs = []
    for batch in (4096, 8192):   # large enough to be compute-bound on an H100
        space = _space(batch=batch, d=1024, h=4096)
        model = CostModel(space.mesh, space)
        linear = _node(space, "linear")
        costs.append(model.node(linear, _strategy(linear, (R,), ((R,), (R,), (R,)))))
    small, big = costs
    assert big.compute_s == pytest.approx(2 * small.compute_s, rel=0.01)
    assert big.saved_bytes == pytest.approx(2 * small.saved_bytes)
    # working memory: the output (its gradient in the backward)
    assert small.transient_bytes == 4096 * 4096 * 4 and big.transient_bytes == 2 * small.transient_bytes


def test_doubling_hidden_quadruples_weight_flops_and_parameter_bytes():
    flops, params = [], []
    for d in (512, 1024):
        space = _space(batch=64, d=d, h=4 * d)
        model = CostModel(space.mesh, space)
        flops.append(model.flops(_node(space, "linear").node))
        weight = _node(space, "p_up_weight")
        params.append(model.node(weight, _strategy(weight, (R,), storage=(R,))).state_bytes)
    assert flops[1] == pytest.approx(4 * flops[0])
    assert params[1] == pytest.approx(4 * params[0])


def test_sharding_an_op_divides_its_time_and_bytes():
    space = _space(batch=8192, d=1024, h=4096)
    model = CostModel(space.mesh, space)
    linear = _node(space, "linear")
    whole = model.node(linear, _strategy(linear, (R,), ((R,), (R,), (R,))))
    batch = model.node(linear, _strategy(linear, (S0,), ((S0,), (R,), (R,))))
    assert batch.compute_s == pytest.approx(whole.compute_s / 2, rel=0.01)
    assert batch.saved_bytes == pytest.approx(whole.saved_bytes / 2)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_of_gradients_grows_with_axis_size(n):
    """Ring all-reduce moves 2(n-1)/n of the tensor per device: bytes by that factor exactly, time
    (latency aside, a 1 GiB tensor) too."""
    space = _space(mesh=(n,))
    model = CostModel(space.mesh, space)
    shape = (2**28,)
    cost = model.redistribute(shape, torch.float32, (Partial(),), (R,))
    assert cost.comm_bytes[0] == pytest.approx(2 * (n - 1) / n * 2**30)
    two = CostModel(_space(mesh=(2,)).mesh, _space(mesh=(2,))).redistribute(shape, torch.float32, (Partial(),), (R,))
    assert cost.comm_s / two.comm_s == pytest.approx((2 * (n - 1) / n) / 1.0, rel=0.01)


@pytest.mark.parametrize("n", [2, 4])
def test_an_all_to_all_is_priced_on_one_ranks_buffer_as_the_profile_fits_it(n):
    """Shard(0) -> Shard(1) of the (n, cols) tensor ``autopar profile`` times costs what its fitted
    link says of one rank's buffer (an all-to-all's N: 1/n of the tensor), on a profile as on the
    roofline; a kernel's own ``all_to_all_single`` on that kind's link, or where a profile lacks
    it, on DTensor's all-to-all's. (All-to-alls were priced on the whole tensor: n times over.)"""
    space = _space(mesh=(n,), hardware="cpu")
    shape, each = (n, 2**18), 2**20   # fp32: 1 MiB a rank
    dtensor, single = Link(bandwidth=1e8, latency=1e-3), Link(bandwidth=1e9, latency=1e-4)

    def move(links: dict[str, Link] | None, kind=None) -> Cost:
        profile = None if links is None else Profile(
            {"device": "cpu"}, collectives={collective_key(k, n): v for k, v in links.items()})
        return CostModel(space.mesh, space, profile=profile).redistribute(shape, torch.float32, (S0,), (S1,), kind=kind)

    both = {"all_to_all": dtensor, "all_to_all_single": single}
    assert move(both).comm_s == pytest.approx(collective_time("all_to_all", each, n, dtensor))
    assert move(both).comm_bytes == move(both, "all_to_all_single").comm_bytes == pytest.approx((each * (n - 1) / n,))
    assert move(both, "all_to_all_single").comm_s == pytest.approx(collective_time("all_to_all", each, n, single))
    assert move({"all_to_all": dtensor}, "all_to_all_single").comm_s == move(both).comm_s
    roofline = CostModel(space.mesh, space).links[0]
    assert move(None).comm_s == pytest.approx(collective_time("all_to_all", each, n, roofline))
    assert move(None, "all_to_all_single").comm_s == move(None).comm_s   # NCCL's is a real all-to-all too


def test_bucketed_collectives_pay_their_share_of_one_latency():
    """Gradient sync (queued) and ZeRO-3 gathers (batched) share one collective per bucket, as the
    runtime runs them: a small tensor pays the bucket's latency in proportion to its bytes, a
    bucket-sized one all of it; bandwidth and bytes sent are the same either way. A bucket
    holds at most the model's parameters (this MLP's: one bucket, one gather)."""
    from autopar.core.execution import BUCKET_BYTES

    space = _space(mesh=(4,), hardware="cpu")
    model = CostModel(space.mesh, space)
    params = 4 * sum(p.numel() for p in MLP(64, 256).parameters())
    for numel in (1024, BUCKET_BYTES // 4):
        alone = model.redistribute((numel,), torch.float32, (Partial(),), (R,))
        queued = model.redistribute((numel,), torch.float32, (Partial(),), (R,), queued=True)
        gathered = model.redistribute((numel,), torch.float32, (S0,), (R,), batched=True)
        latency = 2 * 3 * model.links[0].latency   # a ring all-reduce over 4: 2(n - 1) steps
        share = min(1.0, numel * 4 / min(BUCKET_BYTES, params))
        assert queued.overlap_s == pytest.approx(alone.comm_s - latency * (1 - share))
        assert queued.comm_bytes == alone.comm_bytes
        assert gathered.comm_s == pytest.approx(
            model.redistribute((numel,), torch.float32, (S0,), (R,)).comm_s - 3 * model.links[0].latency * (1 - share))


def test_in_step_calibration_scales_blocking_and_queued_collectives_apart():
    """A profile's in-step factors of this mesh shape scale blocking collectives (``comm``) and
    queued gradient sync (``sync``) separately, and nothing else: bytes moved stay what the
    collective sends. Factors of another mesh shape do not apply."""
    space = _space(mesh=(2,), hardware="cpu")
    linear, weight = _node(space, "linear"), _node(space, "p_up_weight")
    s = _strategy(linear, (S0,), ((S0,), (R,), (R,)))
    w = _strategy(weight, (R,), storage=(R,))
    i = linear.inputs.index(weight.node)

    def costs(calibration):
        model = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}, calibration=calibration))
        return model.redistribute((1024, 1024), torch.float32, (Partial(),), (R,)), model.edge(weight, w, linear, s, i)

    (blocking, sync), (blocking2, sync3) = costs({}), costs({"comm@2": 2.0, "sync@2": 3.0})
    bandwidth = costs({"sync@2": 0.0})[1].overlap_s   # the sync's factor scales its share of a bucket's latency
    assert blocking.comm_s > 0 and sync.overlap_s > bandwidth > 0 and sync.comm_s == 0
    assert blocking2.comm_s == pytest.approx(2 * blocking.comm_s) and blocking2.comm_bytes == blocking.comm_bytes
    assert sync3.overlap_s == pytest.approx(bandwidth + 3 * (sync.overlap_s - bandwidth))
    assert sync3.comm_bytes == sync.comm_bytes
    other_shape = costs({"comm@2x1": 2.0, "sync@1x2": 3.0})   # fitted on another mesh shape: not this one's
    assert other_shape[0].comm_s == pytest.approx(blocking.comm_s)
    assert other_shape[1].overlap_s == pytest.approx(sync.overlap_s)


def test_a_zero_parameter_an_op_reads_replicated_is_priced_as_gathered_alone():
    """Generated code gathers ZeRO parameters in groups only where their gradient is partial on
    the gathered axes (data parallel: reduce-scattered back); one read by an op that runs
    replicated is gathered alone, and pays the whole collective's latency, not a group's share
    (a group holds at most the model's parameters)."""
    space = _space(mesh=(4,), hardware="cpu")
    model = CostModel(space.mesh, space)
    weight, linear = _node(space, "p_up_weight"), _node(space, "linear")
    i = linear.inputs.index(weight.node)
    zero = _strategy(weight, (R,), storage=(S0,))
    data_parallel = model.edge(weight, zero, linear, _strategy(linear, (S0,), ((S0,), (R,), (R,))), i)
    replicated = model.edge(weight, zero, linear, _strategy(linear, (R,), ((R,), (R,), (R,))), i)
    share = 64 * 256 * 4 / (4 * sum(p.numel() for p in MLP(64, 256).parameters()))
    assert data_parallel.comm_s == 0 and data_parallel.overlap_s > 0   # grouped; its reduce-scatter queued
    assert replicated.comm_s == pytest.approx(3 * model.links[0].latency * (1 - share))   # all-gather over 4


def test_a_bucket_summed_over_every_axis_of_the_job_is_one_all_reduce():
    """The runtime sums a bucket reduced over every axis of a mesh that is the whole job in one
    all-reduce of all its ranks (``collectives.spans_job``), on the profile's link for groups
    of that size; over some axes, or on a pipeline stage's mesh (part of a job), one all-reduce
    per axis. The tensor here is larger than the model (a whole bucket's latency)."""
    space = _space(mesh=(2, 2), hardware="cpu")
    shape, nbytes = (2**20,), 2**22
    job = CostModel(space.mesh, space)
    stage = CostModel(MeshSpec((2, 2), hardware="cpu", job_size=8), space)
    per_axis = collective_time("all_reduce", nbytes, 2, job.links[0]) + collective_time("all_reduce", nbytes, 2, job.links[1])

    def synced(model, src, dst=(R, R)):
        return model.redistribute(shape, torch.float32, src, dst, queued=True).overlap_s

    assert synced(job, (P, P)) == pytest.approx(collective_time("all_reduce", nbytes, 4, job.links[0]))
    assert synced(stage, (P, P)) == pytest.approx(per_axis)
    assert synced(job, (P, R)) == pytest.approx(collective_time("all_reduce", nbytes, 2, job.links[0]))
    grid, _ = job.redistribute_grid(shape, torch.float32, [(P, P), (P, R)], [(R, R), (S0, R)], queued=True)
    assert grid.overlap_s[0, 0] == pytest.approx(synced(job, (P, P)))
    assert grid.overlap_s[1, 0] == pytest.approx(synced(job, (P, R)))
    assert grid.overlap_s[0, 1] == pytest.approx(synced(job, (P, P), (S0, R)))   # a reduce-scatter: per axis
    fitted = Link(bandwidth=1e9, latency=1e-3)
    profiled = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}, collectives={
        collective_key("all_reduce", 4): fitted}))
    assert synced(profiled, (P, P)) == pytest.approx(collective_time("all_reduce", nbytes, 4, fitted))


@pytest.mark.parametrize("d, h", [(64, 256), (1024, 4096)])
def test_gradient_sync_pays_one_latency_per_bucket(d, h):
    """Gradients are all-reduced in buckets of up to 25 MiB, each paying the collective's latency
    once: a model smaller than a bucket pays it once in all (shares by bytes of the model's
    parameters), a larger one about once per 25 MiB."""
    space = _space(d=d, h=h, mesh=(4,), hardware="cpu")
    model = CostModel(space.mesh, space)
    link = model._link("all_reduce", 0)
    params = [nc for nc in space.nodes if nc.kind == "param"]
    synced = sum(model.redistribute(nc.node.meta["val"].shape, torch.float32, (Partial(),), (R,), queued=True).overlap_s
                 for nc in params)
    free = sum(collective_time("all_reduce", nc.node.meta["val"].numel() * 4, 4, Link(link.bandwidth, 0.0)) for nc in params)
    latency = 2 * 3 * link.latency   # a ring all-reduce over 4: 2(n - 1) steps
    buckets = max(1.0, sum(nc.node.meta["val"].numel() * 4 for nc in params) / (25 * 2**20))
    assert synced - free == pytest.approx(buckets * latency)


def test_no_backward_collective_for_a_tensor_without_gradient():
    """The input batch gets no gradient: a column-parallel matmul's partial input gradient is
    all-reduced only where the input needs one (Megatron's f/g pair), not for the model's input."""
    space = _space(mesh=(2,))
    model = CostModel(space.mesh, space)
    x, linear = _node(space, "x"), _node(space, "linear")
    column = _strategy(linear, (S1,), ((R,), (S0,), (S0,)))
    edge = model.edge(x, _strategy(x, (R,)), linear, column, 0)
    assert edge.comm_s == 0 and edge.overlap_s == 0
    relu, down = _node(space, "relu"), _node(space, "linear_2")
    hidden = next(s for s in relu.strategies if s.out == (R,))
    row = next(s for s in down.strategies if s.ins[0] == (R,) and s.ins[1] == (S0,))
    assert model.edge(relu, hidden, down, row, 0).comm_s > 0   # needs its gradient: all-reduced back


def test_the_gradient_of_position_embeddings_is_summed_with_the_parameters():
    """Position embeddings (computed from a parameter and positions alone) run whole on every
    rank and are added to the batch split: their partial gradient is summed in gradient sync's
    buckets with the parameters' (``autopar.core.gradients.partial_passes``), not all-reduced blocking in
    the backward; the token embeddings, computed from the batch, are not."""
    entry = get_model("gpt-tiny")
    args, kwargs = entry.example(4, 16)
    space = build_space(capture(entry.build(), args, kwargs), MeshSpec((2,), hardware="cpu"))
    model = CostModel(space.mesh, space)
    positions, tokens, add = (_node(space, n) for n in ("embedding_1", "embedding", "add"))
    split = next(s for s in add.strategies if s.out == (S0,) and s.ins[0] == (S0,) and s.ins[1] == (R,))
    whole = _strategy(positions, (R,), ((R,), (R,)))
    back = model.edge(positions, whole, add, split, 1)
    assert back.comm_s == 0 and back.overlap_s > 0
    replicated_tokens = _strategy(tokens, (R,), ((R,), (R,)))
    back = model.edge(tokens, replicated_tokens, add, split, 0)   # its gradient gathered, blocking
    assert back.comm_s > 0 and back.overlap_s == 0


def test_sharded_parameter_memory_is_its_shard():
    space = _space(mesh=(4,))
    weight = _node(space, "p_up_weight")
    full_bytes = 256 * 64 * 4
    for name, states in (("adamw", 2), ("sgd", 0), ("sgd-momentum", 1)):
        model = CostModel(space.mesh, space, optimizer=get_optimizer(name))
        replicated = model.node(weight, _strategy(weight, (R,), storage=(R,)))
        sharded = model.node(weight, _strategy(weight, (S0,), storage=(S0,)))
        assert replicated.state_bytes == full_bytes * (1 + states)
        assert sharded.state_bytes == full_bytes / 4 * (1 + states)
        assert sharded.grad_bytes == full_bytes / 4
    # ZeRO-3: stored as a shard, gathered for use: the gathered copy is kept for the backward.
    zero3 = model.node(weight, _strategy(weight, (R,), storage=(S0,)))
    assert zero3.state_bytes == full_bytes / 4 * 2 and zero3.saved_bytes == full_bytes and zero3.comm_s > 0


def test_kept_activations_come_from_the_graph_and_are_counted_once():
    """x feeds two linears (kept once); relu keeps its output; the product keeps both inputs;
    linear_2 keeps mul's output; sum keeps nothing. Found by autograd's saved-tensor hooks, not by op-name tables."""
    space = _space(batch=32, mesh=(1,))
    model = CostModel(space.mesh, space)
    saved = {nc.node.name: model.node(nc, nc.strategies[0]).saved_bytes for nc in space.nodes if nc.kind == "op"}
    act = 32 * 256 * 4
    assert saved["linear"] == 32 * 64 * 4          # the input x (first keeper)
    assert saved["linear_1"] == 0                    # x again: already counted
    assert saved["relu"] == act                      # its output
    assert saved["mul"] == 2 * act                   # relu's output and gate's output (first keeper of both)
    assert saved["linear_2"] == act                  # mul's output (mul keeps only its inputs)
    assert saved["sum_1"] == 0


def test_overlap_hides_gradient_sync_only_up_to_the_compute_after_it():
    """Gradient sync is queued when a parameter's gradient is complete (after the backward of its
    first user) and runs under the backward compute that follows, no further."""
    space = _space(mesh=(2,))
    timeline = Timeline(space)
    index = {nc.node.name: i for i, nc in enumerate(space.nodes)}
    up, down = index["linear"], index["linear_2"]      # first and last linear of the forward
    assert down > up

    def exposed(param: str, compute_at_up: float, comm: float) -> float:
        costs = [Cost() for _ in space.nodes]
        costs[up] = Cost(compute_s=compute_at_up, backward_s=compute_at_up)
        return timeline.simulate(costs, [(index[param], comm)]).exposed_s

    # up.weight is complete after linear's backward, the last compute of the step: nothing hides it.
    assert exposed("p_up_weight", 3e-3, 5e-3) == pytest.approx(5e-3)
    # down.weight is complete before linear's backward runs: 3 ms of compute hide 3 of its 5 ms.
    assert exposed("p_down_weight", 3e-3, 5e-3) == pytest.approx(2e-3)
    assert exposed("p_down_weight", 10e-3, 5e-3) == 0.0
    # Where collectives share the compute's cores (measured by the profile), compute hides less.
    costs = [Cost() for _ in space.nodes]
    costs[up] = Cost(compute_s=3e-3, backward_s=3e-3)
    half = Timeline(space, overlap_efficiency=0.5).simulate(costs, [(index["p_down_weight"], 5e-3)])
    assert half.exposed_s == pytest.approx(5e-3 - 0.5 * 3e-3)


def test_plan_with_overlap_charges_only_exposed_communication():
    with torch.device("meta"):
        model = MLP(512, 2048)
    # DDP: the gradient all-reduces are queued under the backward
    plan = candidates(model, MeshSpec((4,), hardware="h100-80gb"), (torch.empty(4096, 512, device="meta"),), names=["ddp"])["ddp"]
    p = plan.predicted
    assert p.overlapped_comm_s > 0
    assert 0 <= p.exposed_comm_s <= p.overlapped_comm_s
    assert p.step_time_s == pytest.approx(p.compute_s + p.comm_s + p.exposed_comm_s)


def test_profile_numbers_replace_the_roofline_and_the_plan_says_so():
    space = _space(mesh=(2,), hardware="cpu")
    linear = _node(space, "linear")
    s = _strategy(linear, (S0,), ((S0,), (R,), (R,)))
    key = op_call(linear, s, space.mesh.shape, gradients(space)).key
    profile = Profile(local_fingerprint(MeshSpec((2,), hardware="cpu")), ops={key: OpTime(0.25, 0.5)}, overheads={"param_read": 0.125})
    measured = CostModel(space.mesh, space, profile=profile).node(linear, s)
    roofline = CostModel(space.mesh, space).node(linear, s)
    assert measured.compute_s == pytest.approx(0.25 + 0.5) and measured.backward_s == 0.5
    assert measured.timed_s == measured.compute_s and roofline.timed_s == 0.0
    with torch.device("meta"):
        model = MLP()
    plan = plan_captured(capture(model, (torch.empty(32, 64, device="meta"),)), MeshSpec((2,), hardware="cpu"),
                         PlanOptions(profile=profile))
    assert plan.predicted.cost_source.startswith("profile")
    assert {n.source for n in plan.nodes} >= {"roofline"}


def test_the_runtimes_measured_overheads_count_as_measured_compute():
    """A small model's step is mostly the runtime's per-parameter costs (gradient hook, optimizer
    update as a DTensor), which the profile micro-benchmarks: a plan priced on them rests on the
    profile, not on the roofline (a calibrated 2x2 profile of a small MoE measured 37% of its
    compute time by op times alone and its plan was labelled a lower bound)."""
    with torch.device("meta"):
        model = MLP()
    captured = capture(model, (torch.empty(32, 64, device="meta"),))
    fingerprint = local_fingerprint(MeshSpec((2,), hardware="cpu"))
    plans = {}
    for overhead in (0.0, 1.0):
        profile = Profile(fingerprint, overheads={"optimizer_per_param": overhead, "grad_hook": overhead},
                          calibration={"ops": 1.0, "overheads": 1.0})
        plans[overhead] = plan_captured(captured, MeshSpec((2,), hardware="cpu"), PlanOptions(profile=profile))
    without, with_ = plans[0.0], plans[1.0]
    assert without.predicted.basis == "roofline" and "0% of compute time measured" in without.predicted.cost_source
    assert with_.predicted.basis == "profile", with_.predicted.cost_source
    params = [n for n in with_.nodes if n.op == "parameter"]
    assert params and all(n.source.startswith("measured") for n in params)
    assert all(n.source.startswith("roofline") for n in without.nodes if n.op == "parameter" and n.compute_s > 0)


class _Scaled(nn.Module):
    """A linear layer scaled by a function of the input alone: ``abs`` and ``add`` get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * (x.abs() + 1)).sum()


def test_backward_costs_only_where_gradients_flow_and_ops_cost_what_they_were_timed():
    """Generated code runs each op as the ATen op the profile times: no per-op runtime cost. A
    parameter read as stored is its plain shard; one read otherwise (moved first) pays the
    runtime's parameter read. The roofline gives no backward to ops on values that need no
    gradient."""
    space = build_space(capture(_Scaled(), (torch.randn(4, 8),)), MeshSpec((1,), hardware="cpu"))
    cost = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}, overheads={"param_read": 0.5, "move": 8.0}))
    roofline = CostModel(space.mesh, space)
    for name in ("abs_1", "add", "linear", "mul"):
        nc = _node(space, name)
        s = nc.strategies[0]
        assert (roofline.node(nc, s).backward_s > 0) == (name in ("linear", "mul")), name
    linear, weight = _node(space, "linear"), _node(space, "p_lin_weight")
    i = linear.inputs.index(weight.node)
    stored = weight.strategies[0]
    assert cost.move_overhead(weight, stored, linear, linear.strategies[0], i) == 0.0
    wants_partial = Strategy((R,), tuple((P,) if k == i else (R,) for k in range(len(linear.inputs))), ("x",))
    assert cost.move_overhead(weight, stored, linear, wants_partial, i) == pytest.approx(0.5)   # read partial first


@pytest.mark.parametrize("src, dst, mib, extra", [
    ((S0,), (R,), 4, lambda r, f: 0.0),                        # gathered along the first dim, reused buffer
    ((S1,), (R,), 4, lambda r, f: 4 * r),                      # concatenated after gathering
    ((S0,), (R,), 256, lambda r, f: 224 * f),                  # its result mapped afresh
    ((S1,), (R,), 256, lambda r, f: 256 * r + 2 * 224 * f),    # and the concatenation's
    ((P,), (S1,), 256, lambda r, f: 96 * f + 256 * r + 224 * f),   # packed, then half of it kept
    ((P,), (R,), 256, lambda r, f: 224 * f),
    ((R,), (P,), 256, lambda r, f: 256 * r + 224 * f),         # no collective: the value divided by n
])
def test_a_move_pays_its_relayout_and_the_page_faults_of_buffers_mapped_afresh(src, dst, mib, extra):
    """Beside the collective the profile timed (along the first dim, in reused buffers), a
    blocking move pays the profile's per-MiB rates for the copy DTensor makes splitting along
    another dim and for each buffer above ``FRESH_BUFFER_BYTES`` (32 MiB), at the in-step
    factor; without those rates (the roofline) it pays the collective alone."""
    space = _space(mesh=(2,), hardware="cpu")
    rates = {"relayout_per_mib": 1e-3, "fresh_per_mib": 1e-4}
    shape = (mib, 512, 512)   # fp32: ``mib`` MiB

    def move(overheads):
        profile = Profile({"device": "cpu"}, overheads=overheads, calibration={"comm@2": 2.0})
        return CostModel(space.mesh, space, profile=profile).redistribute(shape, torch.float32, src, dst).comm_s

    assert move(rates) - move({}) == pytest.approx(2.0 * extra(*rates.values()))
    queued = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}, overheads=rates))
    plain = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}))
    assert (queued.redistribute(shape, torch.float32, src, dst, queued=True).overlap_s
            == plain.redistribute(shape, torch.float32, src, dst, queued=True).overlap_s)   # gradient buckets: their own


def test_a_tied_parameter_read_with_a_replicated_gradient_pays_joining_the_partial_ones():
    """A parameter two ops read sums their gradients: one given back replicated on an axis is
    divided there to join the other's partial sum, a pass over the whole weight; a parameter one
    op reads pays no such pass. The planner's grids price it as ``edge`` does."""
    space = build_space(capture(TiedLM(), (torch.randint(0, 64, (8, 4)),)), MeshSpec((2,), hardware="cpu"))
    profile = Profile({"device": "cpu"}, overheads={"relayout_per_mib": 1.0, "fresh_per_mib": 1.0})
    model = CostModel(space.mesh, space, profile=profile)
    tied = next(nc for nc in space.nodes if nc.kind == "param" and len(nc.node.users) == 2)
    single = next(nc for nc in space.nodes if nc.kind == "param" and len(nc.node.users) == 1)
    pass_s = 64 * 16 * 4 / 2**20   # the weight's MiB at 1 s per MiB

    def read(param, replicated):
        user = next(iter(param.node.users))
        dst = next(nc for nc in space.nodes if nc.node is user)
        i = dst.inputs.index(param.node)
        stored = next(s for s in param.strategies if s.out == (R,) and s.storage == (R,))
        d = next(d for d in dst.strategies if d.ins[i] == (R,)
                 and (grad_placement(d.ins[i], d.ins, d.out) == (R,)) == replicated)
        plain = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}))
        grid = model.edge_grid(param, dst, i)
        a, b = param.strategies.index(stored), dst.strategies.index(d)
        assert grid[a, b].comm_s == pytest.approx(model.edge(param, stored, dst, d, i).comm_s)
        return model.edge(param, stored, dst, d, i).comm_s - plain.edge(param, stored, dst, d, i).comm_s

    assert read(tied, replicated=True) == pytest.approx(pass_s)
    assert read(tied, replicated=False) == 0.0
    assert read(single, replicated=True) == 0.0


def test_a_parameter_gradient_is_queued_where_it_is_summed_and_blocks_the_backward_where_it_is_gathered():
    """Gradient sync sums partial gradients in buckets, under the backward; a gradient given back
    split (a replicated embedding read by vocabulary) is gathered as its read's redistribution
    is differentiated, blocking the backward, at the in-step factor of blocking collectives."""
    space = build_space(capture(TiedLM(), (torch.randint(0, 64, (8, 4)),)), MeshSpec((2,), hardware="cpu"))
    model = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}, calibration={"comm@2": 2.0}))
    weight = next(nc for nc in space.nodes if nc.kind == "param" and len(nc.node.users) == 2)
    stored = next(s for s in weight.strategies if s.out == (R,) and s.storage == (R,))

    def read(op, want, grad):
        dst = next(nc for nc in space.nodes if nc.node.target is op)
        i = dst.inputs.index(weight.node)
        d = next(d for d in dst.strategies if d.ins[i] == want and grad_placement(d.ins[i], d.ins, d.out) == grad)
        return model.edge(weight, stored, dst, d, i)

    by_vocabulary = read(torch.ops.aten.embedding.default, (S0,), (S0,))
    gathered = model.redistribute((64, 16), torch.float32, (S0,), (R,))
    assert gathered.comm_s > 0 and by_vocabulary.overlap_s == 0
    assert by_vocabulary.comm_s == pytest.approx(gathered.comm_s)
    batch_split = read(torch.ops.aten.linear.default, (R,), (P,))
    assert batch_split.comm_s == 0 and batch_split.overlap_s > 0


def test_a_placement_change_pays_the_runtime_move_where_generated_code_makes_one():
    """An edge costs one ``runtime.move`` where the placement changes, or where a replicated value
    feeds a split op (its partial gradient is all-reduced back): as ``codegen`` emits them."""
    space = _space(mesh=(2,), hardware="cpu")
    cost = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}, overheads={"move": 1.0}))
    src, dst = next((space.nodes[i], space.nodes[j], k) for i, j, k in space.edges()
                    if space.nodes[i].kind == "op" and space.nodes[j].kind == "op")[:2]
    i = dst.inputs.index(src.node)
    for s in src.strategies:
        for d in dst.strategies:
            grad = grad_placement(d.ins[i], d.ins, d.out)
            want = 1.0 if (s.out != d.ins[i] or grad != grad_target(s.out)) else 0.0
            assert cost.move_overhead(src, s, dst, d, i) == want, (s, d)
    assert {cost.move_overhead(src, s, dst, d, i) for s in src.strategies for d in dst.strategies} == {0.0, 1.0}


def test_the_ops_factor_scales_only_ops_that_fit_in_their_ranks_share_of_the_last_level_cache():
    """Timed alone in a loop an op finds its inputs in cache, in a step not: calibration's "ops"
    factor says by how much. An op larger than its rank's share of the cache streams from memory
    either way and keeps its measured time (the factor, fitted on tiny models, priced gpt2-125m's
    steps a third slow)."""
    space = build_space(capture(_Scaled(), (torch.randn(4, 8),)), MeshSpec((1,), hardware="cpu"))
    linear = _node(space, "linear")
    s = linear.strategies[0]
    key = op_call(linear, s, space.mesh.shape, CostModel(space.mesh, space).saved.grad).key
    working = 4 * (4 * 8 + 8 * 8 + 8 + 4 * 8)   # fp32 input, weight, bias and output
    for cache, ranks, factor in ((2 * working, 1, 3.0), (2 * working, 4, 1.0), (working, 1, 3.0), (0, 8, 3.0)):
        fingerprint = {"device": "cpu", "cache_bytes": cache, "processes_per_host": ranks}
        profile = Profile(fingerprint, ops={key: OpTime(1.0, 2.0)}, calibration={"ops": 3.0})
        assert CostModel(space.mesh, space, profile=profile).node(linear, s).compute_s == pytest.approx(3.0 * factor), \
            (cache, ranks)


def test_one_calibrated_factor_scales_every_runtime_overhead():
    """Calibration fits one in-step factor for the runtime's micro-benchmarked costs: it must
    scale the per-parameter (gradient hook, optimizer) and per-step costs as it scales the
    per-op ones, or a host where the micro-benchmarks run slow pushes that factor onto the ops."""
    space = build_space(capture(_Scaled(), (torch.randn(4, 8),)), MeshSpec((1,), hardware="cpu"))
    overheads = {"param_read": 1.0, "grad_hook": 2.0 ** -2, "optimizer_per_param": 2.0 ** -3, "step": 2.0 ** -4}
    fingerprint = {"device": "cpu"}
    plain = CostModel(space.mesh, space, profile=Profile(fingerprint, overheads=overheads))
    scaled = CostModel(space.mesh, space, profile=Profile(fingerprint, overheads=overheads,
                                                          calibration={"overheads": 3.0}))
    weight = _node(space, "p_lin_weight")
    s = weight.strategies[0]
    assert scaled.node(weight, s).compute_s - plain.node(weight, s).compute_s == pytest.approx(2 * (2.0 ** -2 + 2.0 ** -3))
    assert scaled.step_overhead() == pytest.approx(3 * 2.0 ** -4)
    linear, weight = _node(space, "linear"), _node(space, "p_lin_weight")
    i = linear.inputs.index(weight.node)
    wants_partial = Strategy((R,), tuple((P,) if k == i else (R,) for k in range(len(linear.inputs))), ("x",))
    assert scaled.move_overhead(weight, s, linear, wants_partial, i) == pytest.approx(3.0)


def _scaled_plans() -> tuple:
    """``_Scaled``'s space on 2 ranks and three plans of it: every node replicated; the same with
    the linear layer split by column, so that it reads its replicated parameters split; the weight
    stored split."""
    captured = capture(_Scaled(), (torch.randn(4, 8),))
    space = build_space(captured, MeshSpec((2,), hardware="cpu"))
    weight, linear = _node(space, "p_lin_weight"), _node(space, "linear")
    replicated = [next(s for s in nc.strategies if all_replicated(s)) for nc in space.nodes]
    read_split, stored_split = list(replicated), list(replicated)
    read_split[space.index[linear.node]] = next(s for s in linear.strategies if s.ins[1] == (Shard(0),))
    stored_split[space.index[weight.node]] = next(s for s in weight.strategies if s.storage != (R,))
    return captured, space, {"replicated": replicated, "read split": read_split, "stored split": stored_split}


def test_parameters_are_priced_plain_only_in_a_plan_that_splits_none_and_reads_them_as_stored():
    """A plan storing every parameter replicated and reading each as stored keeps them plain
    (DDP's); one that splits any, or reads one split (a slice of the replicated weight), keeps
    every parameter a DTensor, its replicated ones too (torch's foreach optimizers cannot mix
    them), whose update costs more: each parameter pays that price in such a plan."""
    _, space, plans = _scaled_plans()
    overheads = {"grad_hook": 0.0, "optimizer_per_param": 2.0 ** -3, "optimizer_per_plain_param": 2.0 ** -5}
    model = CostModel(space.mesh, space, profile=Profile({"device": "cpu"}, overheads=overheads))
    bias = _node(space, "p_lin_bias")
    roofline = CostModel(space.mesh, space)
    prices = {"replicated": 2.0 ** -5, "read split": 2.0 ** -3, "stored split": 2.0 ** -3}
    for name, chosen in plans.items():
        costs, _ = step_costs(space, model, chosen)
        bare, _ = step_costs(space, roofline, chosen)
        i = space.index[bias.node]
        assert costs[i].compute_s - bare[i].compute_s == pytest.approx(prices[name]), name
        assert PricedSpace(space, model).step_costs([nc.strategies.index(s) for nc, s in zip(space.nodes, chosen, strict=True)])[0][i] \
            == costs[i]


def test_the_runtime_keeps_parameters_plain_exactly_where_they_are_priced_plain():
    """The cost model's predicate (``schedule.parameter_saving``) and the module's: plain tensors in
    the plan of every node replicated, DTensors in the other two."""
    from torch.distributed.tensor import DTensor

    import autopar
    from autopar.profiling.launch import run_on_local_tensor_mesh
    from cost_models.schedule import parameter_saving

    captured, space, plans = _scaled_plans()
    x = torch.randn(4, 8)
    for name, chosen in plans.items():
        forced = {nc.node.name: s for nc, s in zip(space.nodes, chosen, strict=True) if nc.kind in ("param", "op")}
        plan = plan_captured(captured, space.mesh, forced=forced)

        def body(mesh, plan=plan):
            pmodel = autopar.compile(_Scaled(), mesh, x, plan=plan)
            return {isinstance(p, DTensor) for p in pmodel.parameters()}

        priced_plain = parameter_saving(space, chosen, 1.0) > 0
        assert run_on_local_tensor_mesh(body, (2,)) == {not priced_plain}, name
    assert [parameter_saving(space, c, 1.0) > 0 for c in plans.values()] == [True, False, False]


def test_gradients_all_reduced_in_buckets_are_held_twice_when_the_backward_ends():
    """A bucket's all-reduce returns the sum in a buffer of its own, which becomes ``grad`` only
    when the backward ends; the last bucket's flattened input is live at its launch too. At a
    small batch that moment is the step's peak: gpt-tiny's 'ddp' on 4 processes at 8 x 32 measured
    its state plus 3x its gradients (``benchmarks/cost_accuracy.py``), where 1x was predicted."""
    entry = get_model("gpt-tiny")
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(8, 32, device="meta")
    plan = candidates(model, MeshSpec((4,), hardware="cpu"), args, kwargs, profile=None, gather_outputs=False, names=["ddp"])["ddp"]
    p = plan.predicted
    assert p.peak_at == "backward: gradient buckets", p.peak_at
    grads = p.memory_breakdown["gradients"]
    # all but the position embedding's (summed through the op computed from it alone) twice more
    assert 1.9 * grads <= p.memory_breakdown["working"] <= 2 * grads, p.memory_breakdown
    assert p.memory_breakdown["activations"] == 0.0


def test_the_loss_summed_with_the_gradients_runs_no_collective_of_its_own():
    """``train_step`` sums a mean cross-entropy over ranks in a gradient bucket's all-reduce; a
    loss the model goes on computing with is summed by a collective of its own."""
    def loss_comm(model: nn.Module) -> tuple[float, str | None]:
        args = (torch.randint(0, 16, (8, 4)), torch.randint(0, 16, (8, 4)))
        space = build_space(capture(model, args), MeshSpec((2,), hardware="cpu"))
        ce = next(nc for nc in space.nodes if nc.node.target is torch.ops.autopar.cross_entropy.default)
        split = next(s for s in ce.strategies if s.ins[0] == (S0,) and s.out == (R,))
        return sum(CostModel(space.mesh, space).node(ce, split).comm_bytes), space.loss_with_gradients

    assert loss_comm(_Classifier()) == (0.0, "cross_entropy_loss")
    comm, rides = loss_comm(_Classifier(scale=2.0))
    assert comm > 0 and rides is None


class _Classifier(nn.Module):
    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.emb, self.scale = nn.Embedding(16, 16), scale

    def forward(self, x, y):
        loss = nn.functional.cross_entropy(self.emb(x).flatten(0, 1), y.flatten())
        return loss if self.scale is None else loss * self.scale


def test_attention_flops_counted_for_cpu_models():
    """A model built on the CPU runs SDPA as CPU flash attention, which FlopCounterMode does not
    count by itself: the cost model registers its formula (4*B*H*S*S*D forward)."""
    class Attention(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, q, q).sum()

    space = build_space(capture(Attention(), (torch.randn(2, 4, 32, 16),)), MeshSpec((1,), hardware="cpu"))
    node = next(nc.node for nc in space.nodes if "scaled_dot" in nc.node.name)
    assert CostModel(space.mesh, space).flops(node) == 4 * 2 * 4 * 32 * 32 * 16


def _close(got: float, want: float, rel: float = 1e-12) -> bool:
    """``got == pytest.approx(want, rel=rel, abs=0)``, without building an approx object per
    value (the test below compares tens of thousands)."""
    return abs(got - want) <= rel * abs(want)


#: The edge grid test checks one pair in this many.
STRIPES = 5


@pytest.mark.parametrize("mesh", [(2, 2, 2), (4, 2)])
@slow
def test_edge_grids_price_every_pair_as_edge_does(mesh):
    """The planner prices edges as grids over distinct layouts (``CostModel.edge_grid``, every
    axis once per distinct move, strategies in classes); each pair must cost exactly what
    ``edge``, the grid of that one pair, gives it: the classes merge no pairs that differ. With a
    profiled link on one collective (its pairs marked measured) and in-step factors. Every edge,
    and in it every source and every destination strategy, is checked, in a fifth of the pairs
    (diagonal stripes, shifted per edge): all 129k pairs took 49-63 s of CI."""
    space = _space(mesh=mesh, hardware="cpu")
    shape = "x".join(map(str, mesh))
    profile = Profile({"device": "cpu"}, collectives={collective_key("all_gather", 2): Link(bandwidth=1e8, latency=1e-4)},
                      calibration={f"comm@{shape}": 1.5, f"sync@{shape}": 0.5},
                      overheads={"move": 1e-5, "relayout_per_mib": 1e-3, "fresh_per_mib": 1e-4})
    model = CostModel(space.mesh, space, profile=profile)
    checked = measured = 0
    for e, (i, j, k) in enumerate(space.edges()):
        src, dst = space.nodes[i], space.nodes[j]
        grid = model.edge_grid(src, dst, k)
        for a, s in enumerate(src.strategies):
            for b, d in enumerate(dst.strategies):
                if (a + b + e) % STRIPES:
                    continue
                want, got = model.edge(src, s, dst, d, k), grid[a, b]
                for name in ("compute_s", "comm_s", "overlap_s", "transient_bytes", "state_bytes", "saved_bytes"):
                    assert _close(getattr(got, name), getattr(want, name)), (name, s, d)
                assert len(got.comm_bytes) == len(want.comm_bytes)
                assert all(_close(g, w) for g, w in zip(got.comm_bytes, want.comm_bytes, strict=True)), (s, d)
                assert got.measured == want.measured
                checked, measured = checked + 1, measured + ("comm" in got.measured)
        blocking = grid.matrix(lambda c: c.compute_s + c.comm_s)
        summed = sum((t.core[np.ix_(t.rows, t.cols)] for t in grid.blocking_terms()), np.zeros(blocking.shape))
        assert summed == pytest.approx(blocking, rel=1e-12, abs=1e-18)   # what the ILP pairs, per axis
        both = grid.matrix(lambda c: c.compute_s + c.comm_s + c.overlap_s)
        assert both.shape == (len(src.strategies), len(dst.strategies))
        assert both[-1, -1] == pytest.approx(model.edge(src, src.strategies[-1], dst, dst.strategies[-1], k).time_s)
    assert checked > 1000 and 0 < measured < checked


@pytest.mark.parametrize("name, mesh", [("gpt-tiny", (2, 2)), ("llama-tiny", (2, 1, 2)), ("bert-tiny", (4,))])
def test_identical_layers_share_node_costs_without_changing_any(name, mesh):
    """``PricedSpace`` prices a node once per signature (the same op of identical layers): every
    node's shared costs must be exactly what ``node`` gives it alone, and sharing must happen."""
    entry = get_model(name)
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(2, 16, device="meta")
    space = build_space(capture(model, args, kwargs), MeshSpec(mesh, hardware="h100-80gb"))
    model_costs = CostModel(space.mesh, space)
    priced = PricedSpace(space, model_costs)
    for i, nc in enumerate(space.nodes):
        for k, s in enumerate(nc.strategies):
            assert priced.nodes[i][k] == model_costs.node(nc, s), (nc.node.name, s)
            largest = max(model_costs.input_bytes(nc, s, floating_only=True), default=0.0)
            assert priced.largest_input[i][k] == largest, (nc.node.name, s)
    assert len({id(costs) for costs in priced.nodes}) < 0.8 * len(space.nodes)   # the second layer reuses the first's


class Reused(nn.Module):
    """Two weights of one shape, one read twice (its gradient joined from both reads)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.a(x))).sum()


@pytest.mark.parametrize("name, mesh, first_block", [("gpt-tiny", (2, 2), False), ("gpt2-tiny", (4,), True),
                                                     ("reused", (4,), False)])
def test_identical_layers_share_edge_grids_without_changing_any(name, mesh, first_block):
    """``PricedSpace`` prices an edge once per signature: identical layers' parameters (lists of
    strategies of their own, equal) share their edges' grids, which must be exactly what
    ``edge_grid`` gives each alone. gpt2-tiny ties its embedding to its head (a parameter two
    ops read) and recomputes only its first block (``Planner._lighter``); ``Reused`` reads one of
    two weights of a shape twice: the edges that differ by those must not share. GPT-3 175B priced each parameter's edges apart: 11 s of a 15 s
    limit."""
    from autopar.core.blocks import recompute_modes
    from cost_models.estimate import _SUMMED
    if name == "reused":
        captured = capture(Reused(), (torch.randn(8, 16),))
    else:
        entry = get_model(name)
        with torch.device("meta"):
            model = entry.build()
        args, kwargs = entry.example(2, 16, device="meta")
        captured = capture(model, args, kwargs)
    space = build_space(captured, MeshSpec(mesh, hardware="h100-80gb"))
    recompute = recompute_modes(captured.graph, "full", blocks=1) if first_block else "none"
    cm = CostModel(space.mesh, space, recompute=recompute)
    priced = PricedSpace(space, cm)
    for (i, j, k), grid in priced.edges.items():
        alone = cm.edge_grid(space.nodes[i], space.nodes[j], k)
        for field in _SUMMED:
            assert np.array_equal(grid.matrix(lambda c, f=field: getattr(c, f)),
                                  alone.matrix(lambda c, f=field: getattr(c, f))), (space.nodes[i].node.name, field)
    params = [e for e in priced.edges if space.nodes[e[0]].kind == "param"]
    if name != "reused" and not first_block:   # the second layer's reuse the first's
        assert len({id(priced.edges[e]) for e in params}) < 0.6 * len(params)


class WithLogits(nn.Module):
    """Returns its logits beside the loss, as language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(x)
        return logits.logsumexp(-1).mean(), logits


@pytest.mark.parametrize("rows", [32, 30])
@pytest.mark.parametrize("gather", [True, False])
def test_a_returned_output_is_gathered_in_the_step_only_when_split_unevenly(gather, rows):
    """Held at the forward's end (``train_step`` keeps only the loss through the backward). An
    evenly split output is gathered only where read (``autopar.core.launched``): no collective
    in the step, this rank's part held; an uneven one, gathered in the forward, whole."""
    with torch.device("meta"):
        model = WithLogits()
    captured = capture(model, (torch.empty(rows, 64, device="meta"),))
    space = build_space(captured, MeshSpec((4,), hardware="h100-80gb"))
    out = next(nc for nc in space.nodes if nc.kind == "output")
    i = next(i for i, n in enumerate(out.inputs) if n.meta["val"].dim() == 2)
    logits = next(nc for nc in space.nodes if nc.node is out.inputs[i])
    cm = CostModel(space.mesh, space, gather_outputs=gather)
    split = _strategy(logits, (S0,))
    cost = cm.edge(logits, split, out, out.strategies[0], i)
    whole = rows * 256 * 4
    in_step = gather and rows % 4 != 0
    assert (cost.comm_s > 0) == in_step and cost.state_bytes == 0
    buffers = 2 * whole if in_step else 0   # the all-gather's result and staging copy
    assert cost.transient_bytes == pytest.approx(whole + buffers if in_step else whole * 8 / 32)
    grid = cm.edge_grid(logits, out, i)
    assert grid[(logits.strategies.index(split), 0)].transient_bytes == cost.transient_bytes


def test_a_dropout_that_drops_nothing_is_no_op_and_prices_nothing():
    """ATen's dropout of probability 0 (or not training) returns its input and draws nothing: capture
    drops it, so that a model's eager attention at ``attention_dropout=0.0`` does not pay a pass
    over every score matrix; one that drops something stays, and the plans differ by its price."""
    class Scores(nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.p, self.proj = p, nn.Linear(16, 64)

        def forward(self, x):
            scores = self.proj(x) @ self.proj(x).transpose(-1, -2)
            return (nn.functional.dropout(scores.softmax(-1), self.p, self.training) @ self.proj(x)).square().sum()

    x, model = torch.randn(4, 64, 16), Scores(0.0)
    kept, idle = capture(Scores(0.1), (x,)), capture(model, (x,))
    ops = [str(n.target) for n in idle.graph.nodes if n.op == "call_function"]
    assert "aten.dropout.default" not in ops and "aten.dropout.default" in str(kept.graph)
    priced = [plan_captured(c, MeshSpec((1,)), PlanOptions(hand_plans=False, profile=None, time_limit=None)).predicted
              for c in (kept, idle)]
    assert priced[1].step_time_s < priced[0].step_time_s
    torch.testing.assert_close(idle.program.module()(x), model(x))

"""Precision policy "bf16" (autopar.core.precision): bf16 compute with fp32 parameters, gradients
and optimizer states. Sharded training equals one device's under the same policy (bf16
tolerance), first gradients included; the cost model prices bf16 activations and FLOPs while
keeping fp32 state; plans carry the policy."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar import ComputeIn, MeshSpec
from autopar.core.errors import AutoparError, PlanFileError
from autopar.planning.baselines import candidates
from autopar.profiling.launch import per_rank, run_on_local_tensor_mesh
from tests.equivalence import build, check_training, gloo_runner, local_runner, loss_of, make_batches, meta_model
from tests.tiers import slow

MODELS = ["gpt-tiny", "gpt2-tiny", "llama-tiny"]
SHARDED = "fsdp(dp) x tp+sp(tp)"   # ZeRO-3 over one axis, Megatron TP with sequence parallelism over the other


def _hand_plan(name: str, mesh_shape: tuple[int, ...], which: str, batches) -> autopar.Plan:
    return candidates(build(name), MeshSpec(mesh_shape), *batches[0], precision="bf16", names=[which])[which]


@pytest.mark.parametrize("name", MODELS)
@slow
def test_bf16_auto_plan_trains_like_one_device(name):
    plan = check_training(name, 6, 16, (2, 2), local_runner, {"precision": "bf16"})
    assert plan.precision == "bf16"


@pytest.mark.parametrize("name", MODELS)
@slow
def test_bf16_tensor_parallel_and_zero3_train_like_one_device(name):
    batches = make_batches(name, 6, 16)
    plan = _hand_plan(name, (2, 2), SHARDED, batches)
    check_training(name, 6, 16, (2, 2), local_runner, {"plan": plan}, batches=batches)


@slow
def test_bf16_on_gloo_processes():
    """Real bf16 collectives (activations move in bf16, gradients are reduced in fp32)."""
    batches = make_batches("gpt2-tiny", 6, 16)
    plan = _hand_plan("gpt2-tiny", (2, 2), "fsdp(dp) x tp(tp)", batches)
    check_training("gpt2-tiny", 6, 16, (2, 2), gloo_runner, {"plan": plan}, batches=batches)


def _first_gradients(mesh, model, batch, options):
    pmodel = autopar.compile(model, mesh, *batch, **options)
    loss_of(pmodel(*batch[0], **batch[1])).backward()
    return {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in pmodel.named_parameters()}


@pytest.mark.parametrize("mesh_shape, options", [((3,), {}), ((2, 2), {"plan": SHARDED})],
                         ids=["3-auto", "2x2-" + SHARDED])
@slow
def test_bf16_gradients_are_fp32_and_equal_one_devices(mesh_shape, options):
    """Gradients, which AdamW's normalisation hides in the parameters: within bf16 rounding of one
    device's under the policy (a lost or doubled reduction is off by 50% or more), and fp32."""
    name = "llama-tiny"
    batch = make_batches(name, 6, 16, steps=1)[0]
    reference = build(name)
    loss_of(ComputeIn(reference, "bf16")(*batch[0], **batch[1])).backward()
    if "plan" in options:
        options = {"plan": _hand_plan(name, mesh_shape, options["plan"], [batch])}
    model = build(name)
    grads = run_on_local_tensor_mesh(_first_gradients, mesh_shape, model, batch, {"precision": "bf16", **options})
    for fqn, p in reference.named_parameters():
        for r, got in enumerate(per_rank(grads[fqn])):
            assert got.dtype == torch.float32, f"{fqn}: gradient in {got.dtype}"
            error = (got - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
            assert error < 2e-2, f"{fqn} rank {r}: gradient off by {error:.1%} of its norm"


@pytest.mark.parametrize("mesh_shape, which, precision", [((3,), "ddp", "bf16"), ((2, 2), SHARDED, "bf16"),
                                                         ((2,), "fsdp", "fp32")],
                         ids=["3-ddp", "2x2-" + SHARDED, "2-fsdp-fp32-compute"])
@slow
def test_bf16_gradient_reduction(mesh_shape, which, precision):
    """reduce_precision="bf16": DDP's buckets, ZeRO-3 parameters' reduce-scatters (one by one, and
    in groups: fp32 compute) sum in bf16. The gradients are fp32, within bf16 rounding of one
    device's, and rounded (not the fp32 sums)."""
    name = "llama-tiny"
    batch = make_batches(name, 6, 16, steps=1)[0]
    reference = build(name)
    loss_of((reference if precision == "fp32" else ComputeIn(reference, precision))(*batch[0], **batch[1])).backward()
    grads = {}
    for reduce in ("fp32", "bf16"):
        plan = candidates(build(name), MeshSpec(mesh_shape), *batch, precision=precision, reduce_precision=reduce, names=[which])[which]
        assert plan.reduce_precision == reduce
        grads[reduce] = run_on_local_tensor_mesh(_first_gradients, mesh_shape, build(name), batch, {"plan": plan})
    rounded = 0
    for fqn, p in reference.named_parameters():
        for r, (got, exact) in enumerate(zip(per_rank(grads["bf16"][fqn]), per_rank(grads["fp32"][fqn]), strict=True)):
            assert got.dtype == torch.float32, f"{fqn}: gradient in {got.dtype}"
            error = (got - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
            assert error < 2e-2, f"{fqn} rank {r}: gradient off by {error:.1%} of its norm"
            rounded += not torch.equal(got, exact)
    assert rounded > 0, "every gradient equals the fp32 reduction's: nothing was summed in bf16"


@slow
def test_bf16_gradient_reduction_trains_like_one_device():
    batches = make_batches("gpt2-tiny", 6, 16)
    plan = candidates(build("gpt2-tiny"), MeshSpec((2, 2)), *batches[0], precision="bf16",
                      reduce_precision="bf16", names=["zero2(dp) x tp+sp(tp)"])["zero2(dp) x tp+sp(tp)"]
    check_training("gpt2-tiny", 6, 16, (2, 2), local_runner, {"plan": plan}, batches=batches)


@slow
def test_bf16_gradient_reduction_halves_the_gradient_sync():
    """DDP on an H100 mesh (outputs not gathered: its only collective is the gradients'
    all-reduce): half the bytes, in less time."""
    model, args, kwargs = meta_model("gpt2-125m", 8, 512)
    mesh = MeshSpec((4,), hardware="h100-80gb")
    plans = {r: candidates(model, mesh, args, kwargs, precision="bf16", reduce_precision=r, gather_outputs=False, names=["ddp"])["ddp"]
             for r in ("fp32", "bf16")}
    fp32, bf16 = (plans[r].predicted for r in ("fp32", "bf16"))
    assert bf16.comm_bytes["x"] == pytest.approx(fp32.comm_bytes["x"] / 2, rel=0.02)
    assert bf16.overlapped_comm_s < 0.7 * fp32.overlapped_comm_s
    assert "summed over ranks in bf16" in plans["bf16"].report()
    assert autopar.Plan.from_json(plans["bf16"].to_json()).reduce_precision == "bf16"


@slow
def test_bf16_costs_halve_activations_and_keep_fp32_state():
    """The same hand plan in fp32 and bf16 on an H100 mesh: parameters, gradients and optimizer
    states (fp32 masters) cost the same bytes; activations and the data tensor parallelism moves
    cost less (its gradient sync of replicated weights stays fp32); compute runs at the bf16 peak."""
    model, args, kwargs = meta_model("gpt2-125m", 8, 512)
    mesh = MeshSpec((2, 2), hardware="h100-80gb")
    plans = [candidates(model, mesh, args, kwargs, precision=p, names=["dp(dp) x tp(tp)"])["dp(dp) x tp(tp)"] for p in ("fp32", "bf16")]
    state = [sum(n.memory_bytes for n in plan.nodes if n.op == "parameter") for plan in plans]
    fp32, bf16 = (plan.predicted for plan in plans)
    assert state[1] == pytest.approx(state[0])   # parameter, gradient and AdamW states per device
    saved = [sum(n.saved_bytes for n in plan.nodes) for plan in plans]   # at any moment, not the peak's
    assert saved[1] < 0.7 * saved[0]
    assert bf16.comm_bytes["tp"] < 0.7 * fp32.comm_bytes["tp"]   # activations in bf16, gradients of replicated weights in fp32
    assert bf16.compute_s < 0.5 * fp32.compute_s


def test_plans_carry_their_precision(tmp_path):
    model, args, kwargs = meta_model("gpt-tiny")
    plan = autopar.plan(model, MeshSpec((2,)), args, kwargs, precision="bf16")
    again = autopar.Plan.from_json(plan.to_json())
    assert again.precision == "bf16"
    assert "bf16" in plan.report()
    with pytest.raises(PlanFileError, match="computes in bf16.*precision='bf16'"):
        again.check_matches(plan.fingerprint, plan.mesh, "fp32")
    with pytest.raises(autopar.InfeasibleError) as info:   # already in bf16: not told to use it
        autopar.plan(model, MeshSpec((2,)), args, kwargs, precision="bf16", memory_budget=1000)
    assert "precision=" not in str(info.value)
    with pytest.raises(AutoparError, match="precision must be one of fp32, bf16"):
        autopar.plan(model, MeshSpec((2,)), args, kwargs, precision="fp16")


class MixesABuffer(torch.nn.Module):
    """An fp32 buffer added to bf16 activations by an op that wants one dtype (``baddbmm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("bias", torch.zeros(1, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.baddbmm(self.bias.expand(x.shape[0], 4, 4), h, h.transpose(1, 2)).sum()


def test_an_op_mixing_a_buffer_with_bf16_activations_is_explained():
    """bf16 casts parameters and inputs, not buffers (FSDP2's policy): where the model then mixes
    dtypes, the error says so and what to do, not "check that the model runs eagerly" (it does)."""
    from autopar.core.capture import capture
    from autopar.core.errors import CaptureError

    x = torch.randn(2, 4, 8)
    capture(MixesABuffer(), (x,))   # fp32: captured
    with pytest.raises(CaptureError, match=r"casts the parameters and floating inputs .* not the buffers.*"
                                           r"precision='fp32'") as error:
        capture(MixesABuffer(), (x,), precision="bf16")
    assert "runs eagerly" not in str(error.value)

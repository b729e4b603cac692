"""Buffers the forward writes: BatchNorm's running statistics (and its batch counter) and a model's
own in-place buffer updates are kept as one device keeps them, on 2x2, free plan and under a
budget that forces sharding; a batch norm split by batch normalises by the whole batch's
statistics (SyncBatchNorm's semantics), so the reference is the plain model trained on the whole
batch. After training, eval mode (running statistics) gives one device's outputs. Plans that run
a step's forward on parts of the batch (microbatches) are refused by name."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate

import autopar
from autopar import BufferWriteError, InputMismatchError, MeshSpec
from autopar.core.capture import capture
from autopar.core.ops.batch_norm import batch_statistics
from autopar.core.strategies import build_space
from autopar.planning.planner import plan_captured
from autopar.profiling.launch import per_rank, run_on_local_tensor_mesh
from tests.equivalence import (
    ATOL,
    RTOL,
    build,
    check_training,
    gloo_runner,
    local_runner,
    tight_budget,
    train_reference,
    train_steps,
)
from tests.tiers import slow


class SmallCNN(nn.Module):
    """A torchvision-style CNN: conv, BatchNorm2d and ReLU, a residual block, average pooling and
    a linear head; returns its cross-entropy loss."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x, labels):
        h = self.stem(x)
        h = torch.relu(self.block(h) + h)
        return F.cross_entropy(self.fc(torch.flatten(self.pool(h), 1)), labels)


class RunningAverage(nn.Module):
    """An MLP keeping a running average of its hidden features and a count of its calls in buffers
    of its own, written in place in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 6)
        self.register_buffer("average", torch.zeros(16))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.relu(self.up(x))
        self.average.mul_(0.9).add_(h.detach().mean((0, 1)), alpha=0.1)
        self.calls += 1
        return (self.down(h) - x).pow(2).mean()


class TrainingOnlyWrite(nn.Module):
    """Writes through a view of an activation in training mode only."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 16), nn.Linear(16, 6)

    def forward(self, x):
        h = self.up(x)
        if self.training:
            h.view(-1)[::2].add_(1.0)
        return (self.down(torch.relu(h)) - x).pow(2).mean()


def hf_resnet() -> nn.Module:
    """Hugging Face's ResNet for image classification, four stages, defaults otherwise (small widths)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1])
    return ResNetForImageClassification(config)


def _images(batch: int = 4, side: int = 16, as_kwargs: bool = False, steps: int = 3) -> list[tuple[tuple, dict]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        x, y = torch.randn(batch, 3, side, side, generator=gen), torch.randint(0, 2, (batch,), generator=gen)
        out.append(((), {"pixel_values": x, "labels": y}) if as_kwargs else ((x, y), {}))
    return out


def _eval_outputs(model: nn.Module, batch: tuple[tuple, dict]) -> list[torch.Tensor]:
    """The tensors ``model`` returns in eval mode on ``batch`` (its logits, where it returns them)."""
    model.eval()
    with torch.no_grad():
        out = model(*batch[0], **batch[1])
    return [out.logits] if hasattr(out, "logits") else [out]


def _runner_with_eval(batch: tuple[tuple, dict], outputs: list, compiled_in_eval: bool = False):
    """``local_runner`` that, after training, also runs the module in eval mode on ``batch`` and
    appends each rank's outputs to ``outputs``; ``compiled_in_eval``: the model is compiled in
    eval mode and trained after ``train()``."""
    def runner(mesh_shape, name, batches, plan_options):
        model = build(name).train(not compiled_in_eval)

        def body(mesh):
            pmodel = autopar.compile(model, mesh, *batches[0], **plan_options).train()
            losses = train_steps(pmodel, batches)
            state = {k: [t.clone() for t in per_rank(v)] for k, v in autopar.full_state_dict(pmodel).items()}
            outputs.extend([per_rank(t) for t in _eval_outputs(pmodel, batch)])
            return [[float(x) for x in per_rank(l)] for l in losses], state, pmodel.plan
        return run_on_local_tensor_mesh(body, mesh_shape)
    return runner


def _check(name, batches: list, mesh_shape: tuple[int, ...], plan_options: dict,
           compiled_in_eval: bool = False) -> autopar.Plan:
    """Losses, parameters and buffers after training equal one device's (``check_training``), and
    so do the outputs in eval mode afterwards, on a batch of new values."""
    probe = tuple(a + 0.5 if a.is_floating_point() else a for a in batches[0][0]), {
        k: v + 0.5 if v.is_floating_point() else v for k, v in batches[0][1].items()}
    got: list = []
    plan = check_training(name, 0, 0, mesh_shape, _runner_with_eval(probe, got, compiled_in_eval), plan_options,
                          batches=batches)
    reference = build(name)
    reference.load_state_dict(train_reference(name, batches)[1])
    for want, ranks in zip(_eval_outputs(reference, probe), got, strict=True):
        for r, value in enumerate(ranks):
            torch.testing.assert_close(value, want, rtol=RTOL, atol=ATOL, msg=lambda m, r=r: f"eval output rank {r}: {m}")
    return plan


def _strategies(plan: autopar.Plan, op: str) -> set[str]:
    return {n.strategy for n in plan.nodes if n.op == op}


BATCH_NORM = str(torch.ops.aten.batch_norm.default)


@pytest.mark.parametrize("tight", [False, True], ids=["free", "tight"])
@slow
def test_hf_resnet_keeps_running_statistics(tight):
    batches = _images(as_kwargs=True)
    options = {"memory_budget": tight_budget(hf_resnet, 0, 0, (2, 2), batches)} if tight else {}
    plan = _check(hf_resnet, batches, (2, 2), options)
    if tight:   # the batch split of batch norms is what a tight budget chooses here
        assert any("batch" in s for s in _strategies(plan, BATCH_NORM)), plan.report()


@pytest.mark.parametrize("mesh_shape, tight", [((2, 2), False), pytest.param((2, 2), True, marks=slow),
                                               pytest.param((3,), True, marks=slow)],
                         ids=["2x2-free", "2x2-tight", "3-tight"])
def test_small_cnn_keeps_running_statistics(mesh_shape, tight):
    batches = _images(batch=5, side=8)   # 5 rows: uneven over 2x2 and 3
    options = {"memory_budget": tight_budget(SmallCNN, 0, 0, mesh_shape, batches)} if tight else {}
    plan = _check(SmallCNN, batches, mesh_shape, options)
    if tight:
        assert any("batch" in s for s in _strategies(plan, BATCH_NORM)), plan.report()


@slow
def test_compiled_in_eval_mode_trains_in_training_mode():
    """The plan of the eval capture (batch norms split by batch, no batch counter) runs the training
    capture by counterpart: statistics gathered, counters counted."""
    batches = _images(batch=5, side=8)
    options = {"memory_budget": tight_budget(SmallCNN, 0, 0, (2, 2), batches)}
    plan = _check(SmallCNN, batches, (2, 2), options, compiled_in_eval=True)
    assert any("batch" in s for s in _strategies(plan, BATCH_NORM)), plan.report()


def test_a_write_the_planned_mode_lacks_on_a_split_value_is_refused():
    """Compiled in eval mode with the activation split by batch, the training forward's write
    through a view of it cannot keep that split: refused by name, not run wrong."""
    gen = torch.Generator().manual_seed(3)
    batches = [((torch.randn(8, 5, 6, generator=gen),), {}) for _ in range(3)]
    budget = tight_budget(TrainingOnlyWrite, 0, 0, (2, 2), batches)
    with pytest.raises(InputMismatchError, match="in train mode"):
        _check(TrainingOnlyWrite, batches, (2, 2), {"memory_budget": budget}, compiled_in_eval=True)


def _forced(model_fn, batch, mesh_shape, names: tuple[str, ...]) -> autopar.Plan:
    """The plan with every training batch norm forced to the strategy named ``names`` per axis."""
    captured = capture(build(model_fn), *batch)
    space = build_space(captured, MeshSpec(mesh_shape))
    forced = {nc.node.name: next(s for s in nc.strategies if s.names == names)
              for nc in space.nodes if batch_statistics(nc.node)}
    return plan_captured(captured, MeshSpec(mesh_shape), forced=forced)


@pytest.mark.parametrize("names", [("channels", "channels"), ("batch", "channels"), ("channels", "batch")],
                         ids=lambda n: "-".join(n))
@slow
def test_split_channels_write_running_statistics_back(names):
    """Channels split: each rank updates its channels of the running statistics, gathered back into
    the whole buffer; with the batch split on the other axis, statistics are gathered there."""
    batches = _images(batch=4, side=4)
    plan = _forced(SmallCNN, batches[0], (2, 2), names)
    _check(SmallCNN, batches, (2, 2), {"plan": plan})


@pytest.mark.parametrize("tight", [False, True], ids=["free", "tight"])
def test_buffers_a_model_writes_itself(tight):
    """A running average of features split by batch, and a call counter, written in place."""
    gen = torch.Generator().manual_seed(3)
    batches = [((torch.randn(4, 5, 6, generator=gen),), {}) for _ in range(3)]
    options = {"memory_budget": tight_budget(RunningAverage, 0, 0, (2, 2), batches)} if tight else {}
    plan = check_training(RunningAverage, 0, 0, (2, 2), local_runner, options, batches=batches)
    if tight:
        assert any(p.storage != (Replicate(), Replicate()) for p in plan.parameters.values())


def test_steps_in_parts_of_the_batch_are_refused():
    """Microbatches would normalise each part by its own statistics and count each part: refused
    by name, at planning, at compile (a plan given) and at a train_step on a larger batch."""
    model, batch = build(SmallCNN), _images(batch=4, side=4, steps=1)[0]
    with pytest.raises(BufferWriteError, match=r"stem\.1.*microbatches=2"):
        autopar.plan(model, MeshSpec((2,)), *batch, microbatches=2)
    with pytest.raises(BufferWriteError, match="a pipeline runs it in microbatches"):
        autopar.plan(model, MeshSpec((2, 2)), *batch, pipeline={"axis": 0})
    plan = autopar.plan(model, MeshSpec((2,)), *batch)
    assert plan.microbatches == 1

    def body(mesh):
        with pytest.raises(BufferWriteError, match="stem.1.num_batches_tracked"):
            autopar.compile(model, mesh, *batch, plan=autopar.Plan.from_json(plan.to_json().replace(
                '"microbatches": 1', '"microbatches": 2')))
        pmodel = autopar.compile(model, mesh, *batch, plan=plan)
        bigger = tuple(torch.cat([t, t]) for t in batch[0])
        with pytest.raises(BufferWriteError, match="batches of at most 4 rows"):
            pmodel.train_step(*bigger)
    run_on_local_tensor_mesh(body, (2,))


@slow
def test_gloo_processes():
    """Real processes: batch norms split by batch gather their statistics over gloo."""
    batches = _images(batch=4, side=4)
    plan = _forced(SmallCNN, batches[0], (2,), ("batch",))
    check_training(SmallCNN, 0, 0, (2,), gloo_runner, {"plan": plan}, batches=batches)

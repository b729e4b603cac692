"""Op calls to profile: one local call per node and strategy, deduplicated across layers, timed."""
from __future__ import annotations

import functools
import logging
import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from autopar import MeshSpec
from autopar.core.capture import capture
from autopar.core.lean_loss import LEAN
from autopar.core.strategies import StrategySpace, build_space
from autopar.models import GPT, GPTConfig
from autopar.models.zoo import get_model
from cost_models.activations import gradients
from cost_models.profile_ops import OpCall, no_compute, op_call, op_calls, time_op_calls
from tests.tiers import slow

aten = torch.ops.aten
MESH = (2, 2)


@functools.lru_cache(maxsize=None)
def zoo_space(name: str) -> StrategySpace:
    entry = get_model(name)
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(device="meta")
    return build_space(capture(model, args, kwargs), MeshSpec(MESH))


def call(space: StrategySpace, nc, s, mesh=MESH) -> OpCall | None:
    """``op_call`` with the space's gradients, as the cost model and profiling ask."""
    return op_call(nc, s, mesh, gradients(space))


def gpt_space(n_layer: int) -> StrategySpace:
    """gpt-tiny with another number of layers."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer))
    args, kwargs = get_model("gpt-tiny").example(device="meta")
    return build_space(capture(model, args, kwargs), MeshSpec(MESH))


def op_node(space: StrategySpace, target):
    return next(nc for nc in space.nodes if nc.kind == "op" and nc.node.target is target)


def test_identical_layers_share_keys():
    assert GPTConfig().n_layer == 2
    two = {c.key for c in op_calls(zoo_space("gpt-tiny"), MESH)}
    four = {c.key for c in op_calls(gpt_space(4), MESH)}
    assert two == four and len(two) > 20


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-tiny", "llama-tiny"])
@slow
def test_every_op_node_is_timed_or_has_no_compute(name):
    space = zoo_space(name)
    for nc in space.nodes:
        if nc.kind != "op":
            continue
        for s in nc.strategies:
            got = call(space, nc, s)
            if no_compute(nc.node):
                assert got is None, nc.node
            else:
                assert isinstance(got, OpCall) and got.key.startswith(str(nc.node.target)), nc.node
                assert got.key == call(space, nc, s).key  # deterministic
    keys = {c.key for c in op_calls(space, MESH)}
    assert len(keys) == len(op_calls(space, MESH))


def test_linear_column_parallel_runs_on_the_largest_weight_shard():
    model = nn.Linear(16, 7)  # 7 output rows over 2 ranks: shards of 4 and 3 rows
    space = build_space(capture(model, (torch.randn(4, 16),)), MeshSpec((2,)))
    nc = op_node(space, aten.linear.default)
    column = next(s for s in nc.strategies if s.ins[1] == (Shard(0),))
    x, w, b = call(space, nc, column, (2,)).args
    assert (x.shape, w.shape, b.shape) == ((4, 16), (4, 16), (4,))
    assert all(t.device.type == "meta" for t in (x, w, b))
    batch = next(s for s in nc.strategies if s.ins[0] == (Shard(0),))
    assert call(space, nc, batch, (2,)).args[0].shape == (2, 16)


def test_batch_split_cross_entropy_times_what_the_runtime_helper_runs():
    space = zoo_space("gpt-tiny")
    nc = op_node(space, LEAN)
    split = next(s for s in nc.strategies if any(isinstance(p, Shard) for p in s.ins[0]))
    whole = next(s for s in nc.strategies if not any(isinstance(p, Shard) for p in s.ins[0]))
    logits, target, weight, reduction, ignore_index = call(space, nc, split).args
    assert (reduction, ignore_index, weight) == (2, -100, None)  # summed locally, divided globally
    assert logits.shape[0] < call(space, nc, whole).args[0].shape[0]


def test_cross_entropy_keeps_the_models_ignore_index():
    class Loss(nn.Module):
        def forward(self, logits, target):
            return nn.functional.cross_entropy(logits, target, ignore_index=5)

    space = build_space(capture(Loss(), (torch.randn(8, 10), torch.zeros(8, dtype=torch.long))), MeshSpec((2,)))
    nc = op_node(space, LEAN)
    split = next(s for s in nc.strategies if s.ins[0] == (Shard(0),))
    logits, _, _, reduction, ignore_index = call(space, nc, split, (2,)).args
    assert (logits.shape, reduction, ignore_index) == ((4, 10), 2, 5)


def test_device_arguments_do_not_depend_on_the_capture_device():
    space = zoo_space("gpt-tiny")
    nc = op_node(space, aten.arange.default)
    key = call(space, nc, nc.strategies[0]).key
    assert "'device': device" in key and "meta" not in key


def test_keys_mark_the_inputs_that_need_a_gradient():
    space = build_space(capture(nn.Linear(16, 8), (torch.randn(4, 16),)), MeshSpec((1,)))
    nc = op_node(space, aten.linear.default)
    got = call(space, nc, nc.strategies[0], (1,))
    assert [a.requires_grad for a in got.args] == [False, True, True]   # input; weight, bias
    assert got.key.count("(grad)") == 2
    assert op_call(nc, nc.strategies[0], (1,), {}).key.count("(grad)") == 0


def test_time_op_calls_measures_forward_and_backward():
    calls = [c for c in op_calls(zoo_space("gpt-tiny"), MESH)
             if c.target in (aten.linear.default, aten.embedding.default, aten.arange.default)][:4]
    ints = OpCall(aten.add.Tensor, (torch.empty(8, dtype=torch.int64, device="meta"),) * 2, {})
    seen = []
    times = time_op_calls(calls + [ints], min_time_s=0.002, repeats=3, progress=lambda i, n, k: seen.append((i, n, k)))
    assert seen == [(i, len(calls) + 1, c.key) for i, c in enumerate(calls + [ints])]
    assert set(times) == {c.key for c in calls + [ints]}
    for call in calls + [ints]:
        t = times[call.key]
        assert t.fwd_s > 0 and math.isfinite(t.fwd_s) and math.isfinite(t.bwd_s), call.key
        differentiable = any(isinstance(a, torch.Tensor) and a.requires_grad for a in call.args)
        assert (t.bwd_s > 0) == differentiable, call.key


def test_an_op_that_fails_on_real_inputs_is_skipped_with_a_warning(caplog):
    bad = OpCall(aten.mm.default, (torch.empty(2, 3, device="meta"), torch.empty(4, 5, device="meta")), {})
    good = OpCall(aten.relu.default, (torch.empty(4, device="meta"),), {})
    with caplog.at_level(logging.WARNING, logger="cost_models.profile_ops"):
        times = time_op_calls([bad, good], min_time_s=0.002, repeats=3)
    assert set(times) == {good.key}
    assert any(bad.key in r.getMessage() for r in caplog.records)


def test_a_view_is_timed_with_its_local_target_shape():
    """Generated code passes a view its local shape: so does the timed call (the global shape
    would not fit the local input)."""
    space = zoo_space("gpt-tiny")
    nc = next(nc for nc in space.nodes if nc.kind == "op" and nc.node.target is aten.view.default
              and any(s.out[0] == Shard(0) for s in nc.strategies))
    split = next(s for s in nc.strategies if s.out[0] == Shard(0))
    x, shape = call(space, nc, split).args[:2]
    full = list(nc.node.meta["val"].shape)
    assert shape == [full[0] // MESH[0], *full[1:]] and x.numel() == math.prod(shape)

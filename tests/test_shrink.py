"""Shrinking the sharding problem: followers folded, identical inner layers share decisions, and
what the solver picks on the small problem is as good as on the full one and trains exactly."""
from __future__ import annotations

import torch

import autopar
from autopar import MeshSpec
from autopar.core.capture import capture
from autopar.planning.options import PlanOptions
from autopar.planning.problem import prepare
from autopar.planning.shrink import is_follower
from tests import deep_gpt
from tests.equivalence import check_training, local_runner, meta_model
from tests.tiers import slow


def _planning(name: str, mesh: tuple[int, ...], **options):
    model, args, kwargs = meta_model(name)
    return prepare(capture(model, args, kwargs), MeshSpec(mesh, hardware="h100-80gb"), PlanOptions(**options))


def test_inner_layers_share_decisions_first_and_last_do_not():
    p = _planning(deep_gpt.NAME, (4,))
    g, space = p.grouping, p.space
    start, period, count = g.blocks
    unshared = _planning(deep_gpt.NAME, (4,), share_layers=False).grouping
    assert count >= deep_gpt.LAYERS - 1 and len(g.sizes) < len(unshared.sizes) - period, g.describe(len(space.nodes))
    linears = [i for i, nc in enumerate(space.nodes) if nc.node.target == torch.ops.aten.linear.default]
    per_layer = len(linears) // deep_gpt.LAYERS   # qkv, attention out, mlp in, mlp out
    owners = [[g.owner[i] for i in linears[k * per_layer:(k + 1) * per_layer]] for k in range(deep_gpt.LAYERS)]
    assert owners[2] == owners[3], owners   # inner layers of one segment: one decision each
    assert not set(owners[0]) & set(owners[2]) and not set(owners[-1]) & set(owners[2])
    assert owners[2] != owners[-3]          # segments along the depth choose independently
    # their weights too: parameters of shared layers follow the same decision
    weights = {space.nodes[space.index[nc.inputs[1]]].fqn: g.owner[space.index[nc.inputs[1]]]
               for nc in (space.nodes[i] for i in linears)}
    assert weights["transformer.h.2.mlp.c_fc.weight"] == weights["transformer.h.3.mlp.c_fc.weight"]
    assert weights["transformer.h.0.mlp.c_fc.weight"] != weights["transformer.h.2.mlp.c_fc.weight"]


def test_parallel_residual_layers_are_repeated_blocks():
    """GPT-NeoX (as GPT-J and Phi) adds attention, MLP and the layer's input in one residual: the
    add reads the previous layer's output exactly one layer back, and the layers still share."""
    model, args, kwargs = meta_model("pythia-1.4b", 2, 128)
    p = prepare(capture(model, args, kwargs), MeshSpec((4,), hardware="h100-80gb"), PlanOptions())
    blocks = p.grouping.blocks
    assert blocks is not None and blocks[2] >= model.config.num_hidden_layers - 1, \
        p.grouping.describe(len(p.space.nodes))


def test_followers_take_no_decision_of_their_own():
    p = _planning("gpt-tiny", (2, 2), share_layers=False)
    g, space = p.grouping, p.space
    followers = [j for j in range(len(space.nodes)) if is_follower(space, j)]
    assert followers and g.folded == len(followers)
    for j in followers:
        producer = space.index[space.nodes[j].inputs[0]]
        assert g.owner[j] == g.owner[producer]
    roots = {g.owner[i] for i, nc in enumerate(space.nodes) if nc.kind != "alias" and not is_follower(space, i)}
    assert len(g.sizes) == len(roots)


def test_sharing_layers_costs_nothing_on_identical_layers():
    """The full problem (every layer free) is a superset: sharing may only lose where layers should
    differ, which identical inner layers do not."""
    model, args, kwargs = meta_model(deep_gpt.NAME, 64, 64)
    spec = MeshSpec((4,), hardware="h100-80gb")
    shared = autopar.plan(model, spec, args, kwargs, hand_plans=False)
    free = autopar.plan(model, spec, args, kwargs, share_layers=False, hand_plans=False)
    assert shared.solver["variables"] < free.solver["variables"]
    assert shared.predicted.step_time_s <= free.predicted.step_time_s * 1.01


@slow
def test_shared_plan_trains_exactly():
    batch, seq = 6, 16
    plan = check_training(deep_gpt.NAME, batch, seq, (2, 2), local_runner, {"time_limit": 20})
    assert "repeated blocks" in plan.solver["problem"], plan.solver["problem"]

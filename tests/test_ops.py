"""The op registry (``autopar.core.ops``) and the placement helpers the cost model and the code
generator share: an op's entry is what every stage reads, an op declares a hook once, and the
two texts and two shapes of a placement say what they mean."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.core.errors import AutoparError
from autopar.core.lean_loss import LEAN
from autopar.core.ops import entry_for, rule_for
from autopar.core.ops.base import REGISTRY, rule
from autopar.core.ops.cross_entropy import CROSS_ENTROPY
from autopar.core.placements import (
    gathered_in_group,
    largest_shard_shape,
    parse_placement,
    placements_str,
    shard_shape_at,
)
from autopar.core.rules import family_rule

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _loss_node() -> torch.fx.Node:
    graph = torch.fx.Graph()
    logits, target = graph.placeholder("logits"), graph.placeholder("target")
    return graph.call_function(CROSS_ENTROPY, (logits, target))


def test_an_op_with_an_entry_takes_its_rule_from_there_and_others_from_their_family():
    node = _loss_node()
    entry = entry_for(node)
    assert entry is REGISTRY[CROSS_ENTROPY]
    assert all(hook is not None for hook in (entry.rule, entry.emit, entry.timed, entry.collectives))
    assert rule_for(node) is entry.rule and family_rule(node) is None   # declared once, in its module
    add = node.graph.call_function(torch.ops.aten.add.Tensor, (node, node))
    assert entry_for(add) is None and rule_for(add) is family_rule(add) is not None


def test_an_op_declares_each_hook_once():
    with pytest.raises(AutoparError, match="two rule hooks"):
        rule(CROSS_ENTROPY)(lambda v, n: [])
    assert REGISTRY[CROSS_ENTROPY].rule.__name__ == "cross_entropy"


def test_placements_read_in_plan_files_and_in_generated_code():
    assert placements_str((S0,)) == "(S(0))" and placements_str((S0,), code=True) == "(S(0),)"
    assert placements_str((R, P)) == "(R, P)" == placements_str((R, P), code=True)
    avg = Partial("avg")
    assert placements_str((avg,)) == "(P(avg))" and parse_placement("P(avg)") == avg
    assert placements_str((avg, S1), code=True) == "(Partial('avg'), S(1))"


def test_the_largest_shard_shape_and_one_ranks():
    """5 rows over 2 x 2, split on both axes: ranks hold 2, 1, 1 and 1 rows (as torch.chunk
    splits, axis by axis); the cost model prices the largest."""
    placed, mesh = (S0, S0), (2, 2)
    assert largest_shard_shape((5, 8), placed, mesh) == (2, 8)
    assert [shard_shape_at((5, 8), placed, coords, mesh)[0]
            for coords in ((0, 0), (0, 1), (1, 0), (1, 1))] == [2, 1, 1, 1]


def test_a_read_fits_a_groups_gather_where_its_gradient_goes_back_reduce_scattered():
    """ZeRO-3 over axis 0 of 2: read whole with a partial gradient there, it joins its group's
    gather; read split, or giving its gradient back whole, it is gathered alone."""
    storage, out = (S0, R), (R, R)
    assert gathered_in_group(storage, out, want=(R, R), grad=(P, R))
    assert not gathered_in_group(storage, out, want=(S0, R), grad=(S0, R))   # not read as gathered
    assert not gathered_in_group(storage, out, want=(R, R), grad=(R, R))     # gradient not reduce-scattered
    assert gathered_in_group(storage, out, want=(R, R), grad=(R, R), trains=False)   # frozen: no gradient


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.proj(x), y)


def test_an_error_while_generating_code_names_the_node_and_its_source_line(monkeypatch):
    """As ``torch.fx.Interpreter`` does: the error keeps its type and message, and says which
    node's code was being generated and where the model made it (capture keeps no stack traces:
    the module and the function called)."""
    from autopar.core.capture import capture
    from autopar.core.mesh import MeshSpec
    from autopar.planning.baselines import candidates
    from codegen.generate import generate

    model, inputs = _Classifier(), (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    plan = candidates(model, MeshSpec((2,)), inputs, profile=None, names=["ddp"])["ddp"]

    def broken(em, site):
        raise AutoparError("the loss cannot be emitted")

    monkeypatch.setattr(REGISTRY[LEAN], "emit", broken)   # (capture made the loss lean)
    with pytest.raises(AutoparError) as info:
        generate(capture(model, inputs), plan)
    message = str(info.value)
    assert message.startswith("the loss cannot be emitted")
    assert "while generating code for %cross_entropy_loss" in message
    assert message.endswith("made by function.cross_entropy in the model forward")

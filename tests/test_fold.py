"""Values that depend on no input, parameter or buffer are computed once per generated forward
(``autopar.core.fold``), and an attention mask so computed that is exactly causal (or all-pass) runs
SDPA as ``is_causal`` (or unmasked), as eager Hugging Face calls it."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor

import autopar
import autopar.core.ops.attention as sdpa
from autopar.core.capture import capture
from autopar.core.execution import written_aliases
from autopar.core.fold import foldable
from autopar.core.mesh import MeshSpec
from autopar.core.ops import KERNELS
from autopar.planning.baselines import candidates
from autopar.profiling.launch import run_on_local_tensor_mesh
from tests.equivalence import build, check_training, local_runner, make_batches
from tests.tiers import slow


def _mask_calls(monkeypatch) -> list[object]:
    """The mask every SDPA call of generated code gets (the ``attention`` kernel's)."""
    calls = []

    def attention(q, k, v, attn_mask=None, *args, **kwargs):
        calls.append(attn_mask)
        return sdpa.attention(q, k, v, attn_mask, *args, **kwargs)
    monkeypatch.setitem(KERNELS, "attention", attention)
    return calls


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@slow
def test_a_causal_mask_built_from_shapes_runs_sdpa_as_is_causal(name, monkeypatch):
    """Hugging Face builds its causal mask from positions: generated code builds it once, finds it
    causal on every rank, and calls SDPA with is_causal=True and no mask; training stays exact."""
    calls = _mask_calls(monkeypatch)
    batch = make_batches(name, 4, 16, steps=1)[0]
    model = build(name)

    def body(mesh):
        pmodel = autopar.compile(model, mesh, *batch, profile=None)
        pmodel(*batch[0], **batch[1])
        pmodel(*batch[0], **batch[1])
        return pmodel.code

    code = run_on_local_tensor_mesh(body, (2,))
    assert "def constants(self, mesh, device, sizes):" in code and "= once(self, constants," in code
    assert calls and all(mask is sdpa.CAUSAL for mask in calls)
    check_training(name, 6, 16, (2, 2), local_runner, {"profile": None})


def test_attention_mask_kinds():
    causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    assert sdpa.attention_mask(causal) is sdpa.CAUSAL
    assert sdpa.attention_mask(torch.ones(2, 1, 5, 5, dtype=torch.bool)) is None
    assert sdpa.attention_mask(torch.zeros(2, 1, 5, 5)) is None   # additive, nothing masked
    window = causal & torch.ones(5, 5, dtype=torch.bool).triu(-2)    # sliding window: a real mask
    assert sdpa.attention_mask(window) is window
    rows = torch.ones(4, 5, dtype=torch.bool).tril()                 # queries split: not square
    assert sdpa.attention_mask(rows) is rows
    ranks = LocalTensor({0: causal[0], 1: torch.ones(1, 5, 5, dtype=torch.bool)})
    assert sdpa.attention_mask(ranks) is ranks                   # ranks disagree: keep the mask


class _Folds(nn.Module):
    """Shape-only values of every kind: one read (folded), one written in place, one random, one
    returned, one too large to keep."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        positions = torch.arange(n, dtype=x.dtype)                  # folded: read by the forward
        written = torch.zeros(n)
        written[1:].add_(1.0)                                       # written in place (a view): not folded
        noise = torch.rand(n)                                       # random: not folded
        big = torch.ones(2048, 4096) * 2                            # 32 MiB kept: not folded
        small = torch.ones(1024, 1024).mean()                       # 4 MiB made, 4 bytes kept: folded
        returned = torch.arange(n) * 2                              # returned: not folded
        return (x * positions + written + noise).sum() + (big * x[0]).mean() + small, returned


def test_what_is_folded():
    x = torch.randn(6)
    captured = capture(_Folds(), (x,), {})
    plan = candidates(_Folds(), MeshSpec((2,)), (x,), profile=None, names=["ddp"])["ddp"]
    names = foldable(captured, {n.name: n for n in plan.nodes}, {n.name for n in written_aliases(captured.graph)})
    folded = [n for n in captured.graph.nodes if n.name in names]
    assert sorted(str(n.target) for n in folded) == ["aten.arange.default", "aten.arange.default",
                                                      "aten.mean.default", "aten.ones.default"]
    assert {tuple(n.meta["val"].shape) for n in folded} == {(6,), (), (1024, 1024)}


def test_folded_ops_cost_nothing_a_step():
    """The cost model prices what runs each step: the ops folded into ``constants`` and the moves
    of their results cost nothing, and profiling does not time them; the other ops keep their cost."""
    from autopar.core.strategies import build_space
    from cost_models.estimate import Cost, CostModel
    from cost_models.profile_ops import op_calls

    name = "llama-tiny"
    batch = make_batches(name, 4, 16, steps=1)[0]
    space = build_space(capture(build(name), *batch), MeshSpec((2,), hardware="cpu"))
    model = CostModel(space.mesh, space)
    folded = [nc for nc in space.nodes if nc.node.name in space.folded]
    assert len(folded) > 10   # Hugging Face's causal mask, from positions
    assert all(model.node(nc, s) == Cost() for nc in folded for s in nc.strategies)
    assert all(model.edge(space.nodes[i], s, space.nodes[j], d, k) == Cost()
               for i, j, k in space.edges() if space.nodes[i].node.name in space.folded
               for s in space.nodes[i].strategies for d in space.nodes[j].strategies)
    unfolded = dataclasses.replace(space, folded=frozenset())
    assert len(op_calls(space, space.mesh.shape)) < len(op_calls(unfolded, space.mesh.shape))
    assert any(model.node(nc, s).compute_s > 0 for nc in space.nodes if nc.kind == "op" for s in nc.strategies)

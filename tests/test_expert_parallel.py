"""Expert parallelism (autopar/core/expert_parallel.py) against the same mixture-of-experts layer
on one device (``reference_moe``): outputs and the gradients of the tokens, the router and every
expert's parameters, on gloo groups of 2 and 4 processes, with even, uneven and skewed routing
(experts, and a whole rank, receiving no tokens; a rank sending none)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
import torch
import torch.nn.functional as F

import autopar.core.expert_parallel as ep
from autopar.core.errors import AutoparError
from autopar.profiling.launch import run_on_gloo_mesh
from tests.tiers import slow, slow_except

HIDDEN, INTER, TOP_K = 8, 6, 2
FP32 = {"atol": 1e-5, "rtol": 1e-5}
BLOCKED = -1e4   # router bias of an expert no token may choose


@dataclass(frozen=True)
class Case:
    num_experts: int
    tokens: Literal["even", "uneven", "first-empty"] = "even"   # tokens per rank
    skewed: bool = False   # no token may choose expert 1, nor any expert of the last of several ranks


CASES = {
    "even": Case(4),
    "uneven": Case(8, "uneven"),
    "skewed": Case(8, "uneven", skewed=True),
    "first-empty": Case(4, "first-empty", skewed=True),
}


@dataclass(frozen=True)
class Layer:
    """A top-2 router with SwiGLU experts, every rank's tokens and the output's gradient."""

    rows: list[int]          # tokens per rank
    x: torch.Tensor          # [sum(rows), HIDDEN]: rank r's tokens follow rank r-1's
    router: torch.Tensor     # [E, HIDDEN]
    bias: torch.Tensor       # [E]: BLOCKED for the experts no token may choose
    gate_up: torch.Tensor    # [E, 2*INTER, HIDDEN]
    down: torch.Tensor       # [E, HIDDEN, INTER]
    d_out: torch.Tensor      # [sum(rows), HIDDEN]

    @property
    def num_experts(self) -> int:
        return self.router.size(0)

    def part(self, rank: int) -> slice:
        """Rows of ``x`` that ``rank`` holds."""
        start = sum(self.rows[:rank])
        return slice(start, start + self.rows[rank])


def _layer(case: Case, n: int, seed: int) -> Layer:
    rows = {"even": [6] * n, "uneven": [3 + 2 * r for r in range(n)], "first-empty": [0] + [7] * (n - 1)}[case.tokens]
    gen = torch.Generator().manual_seed(seed)
    e = case.num_experts
    bias = torch.zeros(e)
    if case.skewed:
        bias[1] = BLOCKED
        if n > 1:
            bias[e - e // n:] = BLOCKED
    x, d_out = (torch.randn(sum(rows), HIDDEN, generator=gen) for _ in range(2))
    return Layer(rows, x, torch.randn(e, HIDDEN, generator=gen), bias,
                 torch.randn(e, 2 * INTER, HIDDEN, generator=gen) * 0.3,
                 torch.randn(e, HIDDEN, INTER, generator=gen) * 0.3, d_out)


def _route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router: softmax of the logits, top-k, the top probabilities renormalised."""
    top, ids = torch.softmax(F.linear(x, router) + bias, -1).topk(TOP_K, -1)
    return top / top.sum(-1, keepdim=True), ids


def _run(layer: Layer, group, rank: int, n: int) -> tuple:
    """(output, d tokens, d router, d gate_up, d down, rows per local expert) of this rank's part
    of the layer, its experts being slice ``rank`` of ``n`` of the experts."""
    local = slice(rank * layer.num_experts // n, (rank + 1) * layer.num_experts // n)
    x = layer.x[layer.part(rank)].clone().requires_grad_()
    router, gate_up, down = (t.clone().requires_grad_() for t in (layer.router, layer.gate_up[local], layer.down[local]))
    counts: list[list[int]] = []

    def experts(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        counts.append(per_expert)
        return ep.grouped_swiglu(rows, per_expert, gate_up, down)

    weights, ids = _route(x, router, layer.bias)
    out = ep.expert_parallel_moe(x, weights, ids, experts, layer.num_experts, group)
    out.backward(layer.d_out[layer.part(rank)])
    return out.detach(), x.grad, router.grad, gate_up.grad, down.grad, counts[0]


def _on_rank(mesh, axis: int, layers: dict[str, Layer]) -> dict[str, tuple]:
    group = mesh.get_group(axis)
    return {name: _run(layer, group, group.rank(), group.size()) for name, layer in layers.items()}


def _reference(layer: Layer) -> tuple:
    """What ``_run`` returns, put together over the ranks, computed on one device."""
    x, router, gate_up, down = (t.clone().requires_grad_() for t in (layer.x, layer.router, layer.gate_up, layer.down))
    weights, ids = _route(x, router, layer.bias)
    out = ep.reference_moe(x, weights, ids, lambda e, rows: ep.swiglu(rows, gate_up[e], down[e]), layer.num_experts)
    out.backward(layer.d_out)
    counts = torch.bincount(ids.flatten(), minlength=layer.num_experts).tolist()
    return out.detach(), x.grad, router.grad, gate_up.grad, down.grad, counts


def _check(name: str, layer: Layer, results: list[tuple]) -> None:
    """Every rank's results of one layer, put together, against the one-device reference."""
    out, d_x, d_router, d_gate_up, d_down, counts = zip(*results, strict=True)
    got = (torch.cat(out), torch.cat(d_x), sum(d_router), torch.cat(d_gate_up), torch.cat(d_down))
    want = _reference(layer)
    for what, a, b in zip(("out", "d tokens", "d router", "d gate_up", "d down"), got, want[:-1], strict=True):
        torch.testing.assert_close(a, b, **FP32, msg=lambda m, label=f"{name}, {what}": f"{label}: {m}")
    assert [c for per_rank in counts for c in per_rank] == want[-1], name
    if name == "skewed" and len(counts) > 1:   # the case reaches what it is for: idle experts and rank
        assert want[-1][1] == 0 and sum(counts[-1]) == 0 and all(sum(c) for c in counts[:-1]), counts


def _check_all(n: int, axis: int = 0, mesh_shape: tuple[int, ...] | None = None) -> None:
    layers = {name: _layer(case, n, seed) for seed, (name, case) in enumerate(CASES.items())}
    per_rank = run_on_gloo_mesh(_on_rank, mesh_shape or (n,), axis, layers, timeout_s=120, start_method="forkserver")
    groups = [per_rank] if mesh_shape is None else [per_rank[0::2], per_rank[1::2]]
    for results in groups:
        for name, layer in layers.items():
            _check(name, layer, [r[name] for r in results])


@pytest.mark.parametrize("n", slow_except([2, 4], 2))
def test_expert_parallel_matches_the_layer_on_one_device(n):
    _check_all(n)


@slow
def test_on_a_mesh_axis_the_experts_split_within_its_group():
    # mesh [[0, 1], [2, 3]], split over axis 0: groups {0, 2} and {1, 3}, each holding all experts
    _check_all(2, axis=0, mesh_shape=(2, 2))


# ----------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [name for name in CASES if name != "first-empty"])   # one rank: no tokens at all
def test_one_rank_matches_the_reference(name):
    layer = _layer(CASES[name], 1, 7)
    _check(name, layer, [_run(layer, None, 0, 1)])


def test_dispatch_groups_each_experts_rows_in_token_order():
    tokens = torch.arange(5.0).unsqueeze(1).expand(5, 3)
    ids = torch.tensor([[2, 0], [1, 2], [2, 3], [0, 1], [3, 0]])
    d = ep.dispatch(tokens, ids, 4, None)
    assert d.counts == [3, 2, 3, 2]
    assert d.tokens[:, 0].tolist() == [0, 3, 4, 1, 3, 0, 1, 2, 2, 4]
    weights = torch.rand(5, 2)
    torch.testing.assert_close(ep.combine(d.tokens * 2, d, weights), tokens * 2 * weights.sum(1, keepdim=True))


def test_routing_the_layer_cannot_split_is_refused():
    tokens = torch.zeros(3, 4)
    with pytest.raises(AutoparError, match=r"lie in \[0, 4\); got ids from 0 to 4"):
        ep.dispatch(tokens, torch.tensor([[0, 4], [1, 2], [3, 3]]), 4, None)
    with pytest.raises(AutoparError, match="6 experts cannot split evenly over 4 ranks"):
        ep.experts_per_rank(6, 4)
    with pytest.raises(AutoparError, match=r"tokens \[T, H\] and expert ids \[T, k\]"):
        ep.dispatch(tokens, torch.zeros(2, 2, dtype=torch.long), 4, None)
    d = ep.dispatch(tokens, torch.zeros(3, 2, dtype=torch.long), 4, None)
    with pytest.raises(AutoparError, match="T\\*k = 6"):
        ep.combine(d.tokens, d, torch.ones(3, 1))


def test_a_model_of_ones_own_is_captured_without_importing_transformers():
    """transformers' experts registry is routed only where transformers is loaded (a model of its
    classes loads it): capture does not cost every rank its import otherwise."""
    import subprocess
    import sys

    code = ("import sys, autopar; from autopar.models.zoo import get_model; from autopar.core.mesh import MeshSpec; "
            "e = get_model('gpt-tiny'); a, k = e.example(4, 16); autopar.plan(e.build(), MeshSpec((2,)), a, k); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"

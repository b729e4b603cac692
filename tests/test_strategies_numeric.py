"""Per-strategy numeric tests: for every op the zoo's test models use, every strategy the planner
may choose for it is forced in turn (the ILP picks the rest of the plan), compiled, and run on a
simulated mesh; forward outputs and every parameter's full gradient must match one device.

The runtime is strict (``codegen.runtime.STRICT``): an op whose DTensor output placement differs
from its rule's raises, so these tests check the rules themselves, not only the final numbers.
References run in plain PyTorch outside the simulated mesh. Failures are collected over all
strategies of a case and reported together (op, mesh, strategy, placements, error).
"""
from __future__ import annotations

import copy
import operator
import traceback

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

import codegen.runtime as runtime
from autopar.capture import capture, readable_name
from autopar.launch import per_rank, run_on_local_tensor_mesh
from autopar.mesh import MeshSpec
from autopar.placements import placements_str
from autopar.planner import plan_captured
from autopar.strategies import Strategy, build_space
from codegen.module import ShardedModule
from tests.strategy_cases import CASES, Case

RTOL, ATOL = 1e-4, 1e-5
CASE_BY_NAME = {c.name: c for c in CASES}
PARAMS = [pytest.param(c.name, mesh, id=f"{c.name}-{'x'.join(map(str, mesh))}") for c in CASES for mesh in c.meshes]

# Nodes with no tensor input or no tensor output have no strategy to choose.
NOT_FORCEABLE = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten.to.device}


@pytest.fixture(autouse=True)
def strict_runtime(monkeypatch):
    monkeypatch.setattr(runtime, "STRICT", True)


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _op_name(target) -> str:
    return "getitem" if target is operator.getitem else str(target)


def _in_pre(node: fx.Node) -> bool:
    """Nodes of the ``Pre`` plumbing modules (``pre``, ``pq``, ``pa``...) are not under test."""
    stack = node.meta.get("nn_module_stack") or {}
    return any(str(type_name).endswith(".Pre") for _path, type_name in stack.values())


def _reference(case: Case):
    torch.manual_seed(0)
    model = case.build()
    torch.manual_seed(1)
    inputs = case.inputs()
    out = model(*inputs)
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(t.shape, generator=gen) for t in _leaves(out)]
    loss = sum((t * w).sum() for t, w in zip(_leaves(out), weights))
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return model, inputs, [t.detach() for t in _leaves(out)], weights, grads


def _run_sharded(model, captured, plan, mesh_shape, inputs, weights):
    def fn(mesh):
        pmodel = ShardedModule(model, mesh, plan, captured)
        outs = _leaves(pmodel(*inputs))
        loss = sum((t * w).sum() for t, w in zip(outs, weights))
        loss.backward()
        grads = {}
        for name, p in pmodel.named_parameters():
            if p.grad is None:
                grads[name] = None
                continue
            assert isinstance(p.grad, DTensor), f"{name}: gradient is not a DTensor"
            assert tuple(p.grad.placements) == tuple(p.placements), (
                f"{name}: gradient placed {placements_str(p.grad.placements)}, "
                f"parameter stored {placements_str(p.placements)}")
            grads[name] = p.grad.full_tensor()
        return [t.detach() for t in outs], grads, pmodel.code

    return run_on_local_tensor_mesh(fn, mesh_shape)


def _compare(outs, ref_outs, grads, ref_grads) -> None:
    assert len(outs) == len(ref_outs), f"{len(outs)} outputs, expected {len(ref_outs)}"
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        for rank, local in enumerate(per_rank(o)):
            torch.testing.assert_close(local, r, rtol=RTOL, atol=ATOL, msg=lambda m: f"output {i}, rank {rank}: {m}")
    for name, r in ref_grads.items():
        g = grads.get(name)
        assert g is not None, f"parameter {name}: no gradient"
        for rank, local in enumerate(per_rank(g)):
            torch.testing.assert_close(local, r, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"grad of {name}, rank {rank}: {m}")


def _describe(s: Strategy) -> str:
    ins = ", ".join(placements_str(p) for p in s.ins)
    return f"{s.label()} [out {placements_str(s.out)}; ins {ins}]"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    msg = " | ".join(lines[:3]) if lines else ""
    return f"{type(e).__name__}: {msg}"[:600]


@pytest.mark.parametrize("case_name,mesh_shape", PARAMS)
def test_every_strategy_matches_one_device(case_name, mesh_shape):
    case = CASE_BY_NAME[case_name]
    model, inputs, ref_outs, weights, ref_grads = _reference(case)
    captured = capture(copy.deepcopy(model), inputs)
    mesh = MeshSpec(mesh_shape)
    space = build_space(captured, mesh)
    nodes = [n for n in captured.graph.nodes if n.op == "call_function" and n.target in case.targets and not _in_pre(n)]

    # Every op the case is about is in its graph, and each has the rules it should have.
    present = {n.target for n in nodes}
    assert present == set(case.targets), f"ops not in the graph: {set(case.targets) - present}"
    if mesh_shape == (2,):
        for target, names in case.expect.items():
            have = set()
            for n in nodes:
                if n.target is target:
                    have |= {name for s in space.nodes[space.index[n]].strategies for name in s.names}
            assert names <= have, f"{_op_name(target)} lost rules {sorted(names - have)} (has {sorted(have)})"

    failures, tried = [], 0
    for node in nodes:
        for strategy in space.nodes[space.index[node]].strategies:
            tried += 1
            where = f"{case.name} {mesh_shape} {node.name} ({_op_name(node.target)}) {_describe(strategy)}"
            try:
                plan = plan_captured(captured, mesh, forced={node.name: strategy})
                chosen = plan.node(node.name)
                assert (chosen.out, chosen.ins) == (strategy.out, strategy.ins), "plan ignored the forced strategy"
                outs, grads, _code = _run_sharded(copy.deepcopy(model), captured, plan, mesh_shape, inputs, weights)
                _compare(outs, ref_outs, grads, ref_grads)
            except Exception as e:  # noqa: BLE001 - every failure is collected and reported below
                failures.append(f"{where}: {_first_line(e)}")
    assert tried > 0
    if failures:
        pytest.fail(f"{len(failures)} of {tried} forced strategies failed:\n" + "\n".join(failures), pytrace=False)


def test_cases_cover_every_op_of_the_zoo_test_models():
    """Every op with a tensor input in the tiny zoo models is forced by some case above."""
    from autopar.zoo import get_model

    covered = {t for c in CASES for t in c.targets}
    missing = {}
    for name in ("gpt-tiny", "gpt2-tiny", "llama-tiny", "bert-tiny"):
        entry = get_model(name)
        torch.manual_seed(0)
        model = entry.build()
        args, kwargs = entry.example(batch=2, seq=8)
        captured = capture(model, args, kwargs)
        for n in captured.graph.nodes:
            if n.op == "call_function" and n.target not in covered and n.target not in NOT_FORCEABLE:
                missing.setdefault(_op_name(n.target), set()).add(name)
    assert not missing, f"ops of the zoo test models with no per-strategy numeric case: {missing}"

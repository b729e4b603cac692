"""Per-strategy numeric tests: for every op the zoo's test models use, each strategy the planner
may choose for it is forced (``plan_captured(..., forced=...)``; the ILP chooses the rest), the
plan is compiled and run on a simulated mesh, and the outputs and every parameter's full gradient
(on every rank) must match one device. Meshes (2,), (3,) and (2, 2), with shapes that some axes
divide unevenly (batch 3 on 2 ranks...).

* The runtime is strict (``codegen.runtime.STRICT``, set for every test in conftest.py): an op whose DTensor output placement is not
  the one its rule promised raises, so the rules themselves are checked, not only the numbers.
* References run in plain PyTorch, outside the simulated mesh.
* The cases (tests/strategy_cases.py) feed float inputs through a parameter of the input's full
  shape, so each op's input gradient is checked through that parameter's gradient.
* Cost: one plan + run per *round*, not per strategy. Round i forces the i-th candidate of every
  op under test at once; a failing round is bisected down to the strategies that fail on their
  own, so each failure is reported against the strategy that causes it. Nodes with the same op
  and shapes have the same candidates and are tested once; a getitem is tested with the
  placements its producer can have. On the 2-D mesh, cases not marked ``all_2d`` force a covering
  subset of the candidates (every per-axis rule on each axis, every kind of output placement
  pair: replicate/shard/partial, the same tensor dim sharded twice or not), and the inputs and
  ``Pre`` plumbing keep the placements an unforced plan gives them (planning is the cost there).

All failures of a case are collected and reported together: case, mesh, node, op, the strategy
with its placements, and the error.
"""
from __future__ import annotations

import copy
import functools
import operator

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Shard

from autopar.core.capture import capture
from autopar.core.mesh import MeshSpec
from autopar.core.ops.attention import BALANCED_RING
from autopar.core.placements import placements_str
from autopar.core.strategies import Strategy, build_space
from autopar.planning.planner import plan_captured
from autopar.profiling.launch import per_rank, run_on_local_tensor_mesh
from codegen.module import ShardedModule
from tests.strategy_cases import CASES, Case, Pre, TiedLM
from tests.tiers import slow

RTOL, ATOL = 1e-4, 1e-5
CASE_BY_NAME = {c.name: c for c in CASES}
# the fast tier runs every case on 2 ranks; 3 ranks and 2x2 run in the full suite
PARAMS = [pytest.param(c.name, mesh, id=f"{c.name}-{'x'.join(map(str, mesh))}", marks=() if mesh == (2,) else slow)
          for c in CASES for mesh in c.meshes]
ZOO_TEST_MODELS = ("gpt-tiny", "gpt2-tiny", "llama-tiny", "bert-tiny")

# Nodes with no tensor input or no tensor output: there is no placement to choose.
NOT_FORCEABLE = {torch.ops.aten._assert_tensor_metadata.default}


# ---------------------------------------------------------------------------------------------
# reference and sharded runs
# ---------------------------------------------------------------------------------------------


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _reference(case: Case):
    """The model (deterministic init), inputs, outputs, backward weights and parameter gradients."""
    torch.manual_seed(0)
    model = case.build()
    torch.manual_seed(1)
    inputs = case.inputs()
    outs = _leaves(model(*inputs))
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(t.shape, generator=gen) for t in outs]
    sum((t * w).sum() for t, w in zip(outs, weights, strict=True)).backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return model, inputs, [t.detach() for t in outs], weights, grads


def _run_sharded(model, captured, plan, mesh_shape, inputs, weights):
    def fn(mesh):
        pmodel = ShardedModule(model, mesh, plan, captured)
        outs = _leaves(pmodel(*inputs))
        sum((t * w).sum() for t, w in zip(outs, weights, strict=True)).backward()
        grads = {}
        for name, p in pmodel.named_parameters():
            if p.grad is None:
                continue
            if not isinstance(p, DTensor):   # a plan replicating every parameter keeps them plain
                assert not isinstance(p.grad, DTensor), f"{name}: a plain parameter's gradient is a DTensor"
                grads[name] = p.grad
                continue
            assert isinstance(p.grad, DTensor), f"{name}: gradient is not a DTensor"
            assert tuple(p.grad.placements) == tuple(p.placements), (
                f"{name}: gradient placed {placements_str(p.grad.placements)}, "
                f"parameter stored {placements_str(p.placements)}")
            grads[name] = p.grad.full_tensor()
        return [t.detach() for t in outs], grads

    return run_on_local_tensor_mesh(fn, mesh_shape)


def _compare(outs, ref_outs, grads, ref_grads) -> None:
    assert len(outs) == len(ref_outs), f"{len(outs)} outputs, expected {len(ref_outs)}"
    for i, (out, ref) in enumerate(zip(outs, ref_outs, strict=True)):
        for rank, local in enumerate(per_rank(out)):
            torch.testing.assert_close(local, ref, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, i=i, rank=rank: f"output {i}, rank {rank}: {m}")
    for name, ref in ref_grads.items():
        assert name in grads, f"parameter {name}: no gradient"
        for rank, local in enumerate(per_rank(grads[name])):
            torch.testing.assert_close(local, ref, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name, rank=rank: f"grad of {name}, rank {rank}: {m}")


def _check(model, captured, mesh, forced, inputs, weights, ref_outs, ref_grads) -> None:
    plan = plan_captured(captured, mesh, forced=forced)
    for name, s in forced.items():
        chosen = plan.node(name)
        assert (chosen.out, chosen.ins) == (s.out, s.ins), f"the plan does not use the strategy forced on {name}"
    outs, grads = _run_sharded(copy.deepcopy(model), captured, plan, mesh.shape, inputs, weights)
    _compare(outs, ref_outs, grads, ref_grads)


# ---------------------------------------------------------------------------------------------
# which nodes, which strategies
# ---------------------------------------------------------------------------------------------


def _in_pre(node: fx.Node) -> bool:
    """Nodes of the ``Pre`` plumbing modules (``pre``, ``pq``, ``pa``...) are not under test."""
    stack = node.meta.get("nn_module_stack") or {}
    return any(str(type_name).endswith(".Pre") for _path, type_name in stack.values())


def _signature(node: fx.Node) -> tuple:
    """Nodes with the same op, arguments and shapes have the same candidates: test one of them."""
    def shape(a: fx.Node):
        val = a.meta.get("val")
        return tuple(val.shape) if isinstance(val, torch.Tensor) else a.name

    return node.target, repr(torch.utils._pytree.tree_map_only(fx.Node, shape, (node.args, node.kwargs)))


def _nodes_under_test(case: Case, graph: fx.Graph) -> list[fx.Node]:
    nodes, seen = [], set()
    for n in graph.nodes:
        if n.op == "call_function" and n.target in case.targets and not _in_pre(n) and _signature(n) not in seen:
            seen.add(_signature(n))
            nodes.append(n)
    return nodes


def _pinned_plumbing(model, captured, space, mesh) -> dict[str, Strategy]:
    """The strategies an unforced plan gives the inputs and the ``Pre`` plumbing, to pin them on
    2-D meshes: planning each round then only re-solves the nodes around the ops under test."""
    plan = plan_captured(captured, mesh)
    pinned = {}
    for nc in space.nodes:
        node = nc.node
        pre_param = nc.kind == "param" and isinstance(model.get_submodule(nc.fqn.rpartition(".")[0]), Pre)
        if nc.kind == "input" or pre_param or (nc.kind == "op" and _in_pre(node)):
            chosen = plan.node(node.name)
            pinned[node.name] = next(s for s in nc.strategies
                                     if (s.out, s.ins, s.storage) == (chosen.out, chosen.ins, chosen.storage))
    return pinned


def _kind(p) -> str:
    return "S" if isinstance(p, Shard) else "P" if isinstance(p, Partial) else "R"


def covering_2d(strategies: list[Strategy]) -> list[Strategy]:
    """A subset of 2-D strategies that uses every per-axis rule on each axis and every kind of
    output placement pair: (R|S|P) x (R|S|P), and both axes sharding the same tensor dim (nested,
    uneven shards) or not."""
    keep, seen = [], set()
    for s in strategies:
        features = {(axis, s.names[axis], s.out[axis], tuple(p[axis] for p in s.ins)) for axis in (0, 1)}
        same = isinstance(s.out[0], Shard) and s.out[0] == s.out[1]
        features.add(("pair", _kind(s.out[0]), _kind(s.out[1]), same))
        if features - seen:
            keep.append(s)
            seen |= features
    return keep


def _candidates(case: Case, space, node: fx.Node, mesh_shape) -> list[Strategy]:
    strategies = space.nodes[space.index[node]].strategies
    if node.target is operator.getitem:
        # A getitem aliases one output of its producer: its candidates are the producer's output
        # placements, each tested once.
        strategies = list({s.out: s for s in strategies}.values())
    return covering_2d(strategies) if len(mesh_shape) == 2 and not case.all_2d else strategies


def _rounds(cands: dict[str, list[Strategy]], nodes: list[fx.Node]) -> list[dict[str, Strategy]]:
    """Round i forces the i-th candidate of every node at once. ``getitem`` nodes get rounds of
    their own: forcing one against its multi-output producer would make an inconsistent plan."""
    rounds = []
    for group in ([n.name for n in nodes if n.target is not operator.getitem],
                  [n.name for n in nodes if n.target is operator.getitem]):
        for i in range(max((len(cands[name]) for name in group), default=0)):
            rounds.append({name: cands[name][i] for name in group if i < len(cands[name])})
    return rounds


def _op_name(target) -> str:
    return "getitem" if target is operator.getitem else str(target)


def _describe(s: Strategy) -> str:
    ins = ", ".join(placements_str(p) for p in s.ins)
    return f"{s.label()} [out {placements_str(s.out)}; ins {ins}]"


def _error(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {' | '.join(lines[:3])}"[:500]


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_name,mesh_shape", PARAMS)
def test_every_strategy_matches_one_device(case_name, mesh_shape):
    case = CASE_BY_NAME[case_name]
    model, inputs, ref_outs, weights, ref_grads = _reference(case)
    captured = capture(copy.deepcopy(model), inputs)
    mesh = MeshSpec(mesh_shape)
    space = build_space(captured, mesh)
    nodes = _nodes_under_test(case, captured.graph)
    by_name = {n.name: n for n in nodes}

    # Every op the case is about is in its graph, and has the rules it should have.
    missing = set(case.targets) - {n.target for n in nodes}
    assert not missing, f"ops not in the graph of {case.name}: {sorted(map(_op_name, missing))}"
    if mesh_shape == (2,):
        for target, names in case.expect.items():
            have = {name for n in nodes if n.target is target
                    for s in space.nodes[space.index[n]].strategies for name in s.names}
            assert names <= have, f"{_op_name(target)} lost rules {sorted(names - have)} (has {sorted(have)})"

    cands = {n.name: _candidates(case, space, n, mesh_shape) for n in nodes}
    pinned = _pinned_plumbing(model, captured, space, mesh) if len(mesh_shape) == 2 else {}
    # A balanced ring refuses a parameter split beside its sequence (``seq_layout``), and a plan
    # solved around a forced one may split the Pre plumbing's key parameter so (on 3 ranks): its
    # rounds pin the plumbing as an unforced plan places it, as 2-D meshes' rounds do.
    balanced_pins = functools.cache(lambda: pinned or _pinned_plumbing(model, captured, space, mesh))

    def where(name: str, s: Strategy) -> str:
        return f"{case.name} {mesh_shape} {name} ({_op_name(by_name[name].target)}) {_describe(s)}"

    def run(forced: dict[str, Strategy]) -> Exception | None:
        pins = balanced_pins() if any(BALANCED_RING in s.names for s in forced.values()) else pinned
        try:
            _check(model, captured, mesh, {**pins, **forced}, inputs, weights, ref_outs, ref_grads)
        except Exception as e:  # noqa: BLE001 - every failure is collected and reported below
            return e
        return None

    def culprits(items: list[tuple[str, Strategy]], error: Exception) -> list[str]:
        """Bisect a failing round down to the strategies that fail on their own."""
        if len(items) == 1:
            return [f"{where(*items[0])}: {_error(error)}"]
        found = []
        for part in (items[: len(items) // 2], items[len(items) // 2:]):
            if (e := run(dict(part))) is not None:
                found += culprits(part, e)
        # Fails only with its neighbours forced too: report the combination.
        return found or ["together: " + "; ".join(where(n, s) for n, s in items) + f": {_error(error)}"]

    failures = []
    for forced in _rounds(cands, nodes):
        if (e := run(forced)) is not None:
            failures += culprits(list(forced.items()), e)
    if failures:
        tried = sum(len(c) for c in cands.values())
        pytest.fail(f"{len(failures)} of {tried} forced strategies failed:\n" + "\n".join(failures), pytrace=False)


def test_covering_2d_keeps_every_axis_rule_and_pair_kind():
    """The 2-D subset is a cover, not a sample: every rule of each axis stays."""
    torch.manual_seed(0)
    case = CASE_BY_NAME["linear-bias"]
    captured = capture(case.build(), case.inputs())
    space = build_space(captured, MeshSpec((2, 2)))
    node = next(n for n in captured.graph.nodes if n.target is torch.ops.aten.linear.default)
    every = space.nodes[space.index[node]].strategies
    kept = covering_2d(every)
    assert len(kept) < len(every)
    for axis in (0, 1):
        assert {s.names[axis] for s in kept} == {s.names[axis] for s in every}
    out_pairs = lambda ss: {(_kind(s.out[0]), _kind(s.out[1])) for s in ss}
    assert out_pairs(kept) == out_pairs(every)


def test_cases_cover_every_op_of_the_zoo_test_models():
    """Every op with a placement to choose in the tiny zoo models is forced by some case."""
    from autopar.models.zoo import get_model

    covered = {t for c in CASES for t in c.targets}
    missing: dict[str, set[str]] = {}
    for name in ZOO_TEST_MODELS:
        entry = get_model(name)
        torch.manual_seed(0)
        args, kwargs = entry.example(batch=2, seq=8)
        captured = capture(entry.build(), args, kwargs)
        for n in captured.graph.nodes:
            if n.op == "call_function" and n.target not in covered and n.target not in NOT_FORCEABLE:
                missing.setdefault(_op_name(n.target), set()).add(name)
    assert not missing, f"ops of the zoo test models with no per-strategy numeric case: {missing}"


class _SharedBias(torch.nn.Module):
    """T5's relative position bias in small: a value computed from a parameter, replicated, that
    two batch-split ops read (``add`` and ``mul``, forced by the test)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.bias.unsqueeze(0)
        return x + b, y * b


def test_a_value_passing_partial_gradients_is_summed_once_where_a_move_reduces_on_another_axis():
    """The bias's gradient stays partial over dp through the unsqueeze (both readers split the
    batch there; gradient sync sums it), while on tp one reader gives it back partial and the other
    whole: that reader's move all-reduces over tp alone. Reduced over dp too, as the value is
    placed, its share was summed twice (T5 on 2x2 trained its decoder's relative attention bias
    wrong under a plan the solver found in some runs, not others)."""
    from torch.distributed.tensor import Replicate

    from codegen.generate import generate

    case = Case("shared-bias", _SharedBias, lambda: (torch.randn(4, 4, 8), torch.randn(4, 4, 8)),
                targets=(torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor), meshes=((2, 2),))
    model, inputs, ref_outs, weights, ref_grads = _reference(case)
    captured = capture(model, inputs)
    mesh = MeshSpec((2, 2))
    space = build_space(captured, mesh)
    rep = (Replicate(), Replicate())
    wanted = {"add": (Shard(0), Shard(0)), "mul": (Shard(0), Replicate())}
    forced = {nc.node.name: next(s for s in nc.strategies if s.out == wanted[nc.node.name] and s.ins[1] == rep)
              for nc in space.nodes if nc.node.name in wanted}
    # the bias and what it computes stay replicated, whatever the cost model would store them as
    forced.update({nc.node.name: next(s for s in nc.strategies if s.out == rep and s.storage in (None, rep))
                   for nc in space.nodes if nc.node.name in ("p_bias", "unsqueeze")})
    assert len(forced) == 4
    _check(model, captured, mesh, forced, inputs, weights, ref_outs, ref_grads)
    code = generate(captured, plan_captured(captured, mesh, forced=forced)).source
    assert "grad=(R, P)" in code and "backward: all-reduce over tp:" in code, code   # the case under test arose


@pytest.mark.parametrize("mesh_shape", [(2,), (3,)])
def test_a_tied_weight_stored_by_vocabulary_is_read_as_stored_where_the_lookup_splits_it_so(mesh_shape):
    """ZeRO-3 stores the tied weight by vocabulary; the lookup reads it by vocabulary, the LM head
    whole on a split batch. The lookup reads the stored shard, its gradient lands there, and the
    head's partial one is reduce-scattered onto it: the numbers equal one device's, and no gather
    serves the lookup (through the gathered copy, the lookup's gradient was gathered back in the
    backward, then divided to join the head's)."""
    from torch.distributed.tensor import Replicate

    from codegen.generate import generate

    case = Case("tied-lm", lambda: TiedLM(vocab=7, d=4), lambda: (torch.randint(0, 7, (6, 3)),),
                targets=(torch.ops.aten.embedding.default,), meshes=(mesh_shape,))
    model, inputs, ref_outs, weights, ref_grads = _reference(case)
    captured = capture(model, inputs)
    mesh = MeshSpec(mesh_shape)
    space = build_space(captured, mesh)
    vocab, rep = (Shard(0),), (Replicate(),)
    forced = {}
    for nc in space.nodes:
        if nc.kind == "param" and len(nc.node.users) == 2:   # the tied weight
            forced[nc.node.name] = next(s for s in nc.strategies if s.out == rep and s.storage == vocab)
        elif nc.node.target is torch.ops.aten.embedding.default:
            forced[nc.node.name] = next(s for s in nc.strategies if s.ins[0] == vocab and isinstance(s.out[0], Partial))
        elif nc.node.target is torch.ops.aten.linear.default:
            forced[nc.node.name] = next(s for s in nc.strategies if s.ins[1] == rep and s.out == (Shard(0),))
    assert len(forced) == 3
    _check(model, captured, mesh, forced, inputs, weights, ref_outs, ref_grads)
    code = generate(captured, plan_captured(captured, mesh, forced=forced)).source
    lookup = next(line for line in code.splitlines() if "sharded_embedding(" in line)
    weight = next(n for n in captured.graph.nodes if n.target is torch.ops.aten.embedding.default).args[0]
    fqn = captured.param_of[weight.name]
    assert f"{lookup.split('(')[1].split(',')[0]} = param_shard(held(self, {fqn!r}), (S(0),), grad=(S(0),))" in code, code

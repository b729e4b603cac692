"""Helpers the tests share: train a zoo model single-device and sharded with the same batches and
compare (``check_training`` with ``local_runner`` or ``gloo_runner``), zoo models on ``meta``.

The reference runs in plain PyTorch outside any simulated mesh. AdamW uses eps=1e-6: key biases
of attention have a gradient that is exactly zero in exact arithmetic, so its float noise is all
Adam normalises; a larger eps keeps that noise from turning into lr-sized steps in either run.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
import torch

import autopar
from autopar.core.errors import InfeasibleError
from autopar.core.mesh import MeshSpec
from autopar.core.precision import ComputeIn
from autopar.models.zoo import get_model
from autopar.profiling.launch import per_rank, run_on_gloo_mesh, run_on_local_tensor_mesh

STEPS = 3
LR = 1e-3
EPS = 1e-6


def make_batches(name: str, batch: int, seq: int, steps: int = STEPS) -> list[tuple[tuple, dict]]:
    """``steps`` batches shaped as the entry's example inputs, each with new values: integer
    tensors (ids, labels) drawn below the example's largest value, float tensors (pixels) normal;
    other arguments (``use_cache=False``) as they are."""
    entry = get_model(name)
    gen = torch.Generator().manual_seed(1234)

    def fresh(v):
        if not isinstance(v, torch.Tensor):
            return v
        if v.dtype == torch.long:
            return torch.randint(0, int(v.max()) + 1, v.shape, generator=gen)
        return torch.randn(v.shape, generator=gen, dtype=v.dtype)

    out = []
    for _ in range(steps):
        args, kwargs = entry.example(batch, seq)
        out.append((tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}))
    return out


def padded_batches(name: str) -> list[tuple[tuple, dict]]:
    """Batches of 8 x 16 whose first rows are mostly padding (ignore_index): microbatches, and
    ranks holding rows of the batch, average different numbers of targets, so weighing them
    equally would be wrong."""
    batches = make_batches(name, 8, 16)
    for args, kwargs in batches:
        (kwargs["labels"] if "labels" in kwargs else args[1])[:3, 4:] = -100
    return batches


def build(name: str | Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Zoo model ``name``, or a model a (module-level, picklable) function builds; same seed, same weights."""
    torch.manual_seed(0)
    return get_model(name).build() if isinstance(name, str) else name()


def loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else out.loss


def train(model: torch.nn.Module, batches) -> list[torch.Tensor]:
    """A few AdamW steps; the loss of each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for args, kwargs in batches:
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def train_reference(name: str | Callable[[], torch.nn.Module], batches, precision: str = "fp32"
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device's losses and final state, under the precision policy the sharded run uses; a
    zoo model's computed once per process for the same batches (tests on several meshes share it;
    read it, do not write to it)."""
    key = (name, _digest(batches), precision) if isinstance(name, str) else None
    if key not in _REFERENCES:
        model = build(name)
        losses = train(model if precision == "fp32" else ComputeIn(model, precision), batches)
        result = [l.item() for l in losses], {k: v.detach().clone() for k, v in model.state_dict().items()}
        if key is None:
            return result
        _REFERENCES[key] = result
    losses, state = _REFERENCES[key]
    return list(losses), dict(state)


_REFERENCES: dict[tuple, tuple[list[float], dict[str, torch.Tensor]]] = {}


def _digest(batches) -> str:
    """What identifies ``batches``: their structure and every value (tensors by their bytes)."""
    leaves, spec = torch.utils._pytree.tree_flatten(batches)
    h = hashlib.sha256(repr(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            h.update(repr((leaf.dtype, tuple(leaf.shape))).encode())
            h.update(leaf.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def train_steps(pmodel, batches) -> list[torch.Tensor]:
    """``train`` of a compiled module, through its ``train_step`` (microbatches as planned)."""
    opt = torch.optim.AdamW(pmodel.parameters(), lr=LR, eps=EPS)
    losses = []
    for args, kwargs in batches:
        losses.append(pmodel.train_step(*args, **kwargs))
        opt.step()
        opt.zero_grad()
    return losses


def train_sharded(mesh, model: torch.nn.Module, batches, plan_options: dict) -> tuple[list, dict, autopar.Plan]:
    """Runs on every rank (or once under LocalTensorMode, with ``model`` built outside it);
    compiled for the first batch, trained through ``train_step``."""
    args, kwargs = batches[0]
    pmodel = autopar.compile(model, mesh, args, kwargs, **plan_options)
    losses = train_steps(pmodel, batches)
    return losses, autopar.full_state_dict(pmodel), pmodel.plan


RTOL, ATOL = 1e-4, 1e-5
#: (rtol, atol of losses, atol of final parameters) per precision policy. In bf16 a sharded op rounds
#: partial results of its own (a split reduction sums in another order): a loss computed in bf16
#: (gpt-tiny's) may land two units in the last place away (0.03 each near 5.5); and AdamW turns a gradient entry near
#: zero into a step of up to lr whatever its size, so a parameter may move up to 2 lr per step
#: apart from one device's (gradients themselves are compared in tests/test_precision.py).
TOLERANCES = {"fp32": (RTOL, ATOL, ATOL), "bf16": (2 * torch.finfo(torch.bfloat16).eps, 1e-4, 2 * LR * STEPS)}


def meta_model(name: str, batch: int | None = None, seq: int | None = None) -> tuple[torch.nn.Module, tuple, dict]:
    """(model, args, kwargs) of zoo model ``name`` on the meta device: for planning only."""
    entry = get_model(name)
    with torch.device("meta"):
        model = entry.build()
    return (model, *entry.example(batch, seq, device="meta"))


def check_training(name: str | Callable[[], torch.nn.Module], batch: int, seq: int, mesh_shape: tuple[int, ...],
                   runner, plan_options: dict, batches: list | None = None) -> autopar.Plan:
    """Train ``name`` on one device and sharded (``runner``: ``local_runner`` or ``gloo_runner``)
    with the same batches (by default ``STEPS`` of ``batch`` x ``seq``, given for a model outside
    the zoo, which ``name`` then builds: see ``build``; the sharded module is
    compiled for the first); every rank's losses and final parameters must equal one device's.
    Without a memory budget, planned without hand plans unless ``plan_options`` says
    (``hand_plans``): the solve is optimal, so they change only how ties fall, and they cost a
    tenth of these tests' time; every hand plan is trained in tests/test_baselines.py. Under a
    budget they stay: their warm start is what closes a tight MIP within the tests' time limits."""
    batches = batches or make_batches(name, batch, seq)
    if "plan" not in plan_options and "memory_budget" not in plan_options:
        plan_options = {"hand_plans": False, **plan_options}
    precision = plan_options["plan"].precision if "plan" in plan_options else plan_options.get("precision", "fp32")
    rtol, loss_atol, atol = TOLERANCES[precision]
    ref_losses, ref_state = train_reference(name, batches, precision)
    losses, state, plan = runner(mesh_shape, name, batches, plan_options)
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        for r, value in enumerate(got):
            assert abs(value - want) <= loss_atol + rtol * abs(want), f"step {step} rank {r}: loss {value} != {want}"
    assert state.keys() == ref_state.keys()
    for key, want in ref_state.items():
        for r, value in enumerate(state[key]):
            torch.testing.assert_close(value, want, rtol=rtol, atol=atol, msg=lambda m, key=key, r=r: f"{key} rank {r}: {m}")
    return plan


def local_runner(mesh_shape, name, batches, plan_options):
    """Every rank in this process (LocalTensorMode): per-step losses and final state per rank."""
    model = build(name)

    def body(mesh):
        losses, state, plan = train_sharded(mesh, model, batches, plan_options)
        return ([[float(x) for x in per_rank(l)] for l in losses],
                {k: [t.clone() for t in per_rank(v)] for k, v in state.items()}, plan)
    return run_on_local_tensor_mesh(body, mesh_shape)


def _gloo_worker(mesh, name, batches, plan_options):
    losses, state, plan = train_sharded(mesh, build(name), batches, plan_options)
    return [float(l) for l in losses], state, plan.to_json()


def gloo_runner(mesh_shape, name, batches, plan_options):
    """One gloo process per rank; they must all have run the same plan."""
    results = run_on_gloo_mesh(_gloo_worker, mesh_shape, name, batches, plan_options, start_method="forkserver")
    assert len({res[2] for res in results}) == 1, "every rank must run the same plan"
    losses = [[results[r][0][s] for r in range(len(results))] for s in range(len(results[0][0]))]
    state = {k: [res[1][k] for res in results] for k in results[0][1]}
    return losses, state, results[0][2]


def tight_budget(name, batch, seq, mesh_shape, batches: list | None = None) -> float:
    """Halfway between the least memory any plan needs on this mesh and what full replication
    needs (the planner's own estimates): replicating everything does not fit, so the planner
    must shard (TP and/or ZeRO-3). ``batches``: as ``check_training`` takes them (a model
    outside the zoo), planned for the first; a zoo model's computed once per process."""
    args, kwargs = (batches or make_batches(name, batch, seq, steps=1))[0]
    key = (name, tuple(mesh_shape), _digest((args, kwargs))) if isinstance(name, str) else None
    if key in _BUDGETS:
        return _BUDGETS[key]
    replicated = autopar.plan(build(name), MeshSpec((1,)), args, kwargs).predicted.peak_memory_bytes
    with pytest.raises(InfeasibleError) as info:
        autopar.plan(build(name), MeshSpec(mesh_shape), args, kwargs, memory_budget=1.0)
    budget = info.value.min_memory_bytes + 0.5 * (replicated - info.value.min_memory_bytes)
    if key is not None:
        _BUDGETS[key] = budget
    return budget


_BUDGETS: dict[tuple, float] = {}


def expert_parallel_plan(name: str, batches: list, mesh_shape: tuple[int, ...], axis: str,
                         hand: str | None = None) -> autopar.Plan:
    """The auto plan of ``name`` for ``batches[0]`` with the experts forced over ``axis``, or the
    hand plan ``hand`` made so; solved to optimality (no time limit a loaded host could cut
    short), the search kept small."""
    from autopar.planning.baselines import candidates
    from autopar.planning.options import PlanOptions

    args, kwargs = batches[0]
    options = PlanOptions(expert_parallel={"axis": axis}, hand_plans=hand is not None, time_limit=None, profile=None,
                          pipeline=False, microbatches=1, recompute="none")
    if hand is not None:
        return candidates(build(name), MeshSpec(mesh_shape), args, kwargs, options=options, names=[hand])[hand]
    return autopar.plan(build(name), MeshSpec(mesh_shape), args, kwargs, options=options)


def recording_dispatch(monkeypatch) -> list[list[list[int]]]:
    """Record, at each expert-parallel dispatch, each rank's (token, choice) pairs per expert."""
    import autopar.core.expert_parallel as ep

    seen: list[list[list[int]]] = []
    real = ep.dispatch

    def dispatch(tokens, expert_ids, num_experts, group):
        seen.append([torch.bincount(ids.flatten(), minlength=num_experts).tolist() for ids in per_rank(expert_ids)])
        return real(tokens, expert_ids, num_experts, group)

    monkeypatch.setattr(ep, "dispatch", dispatch)
    return seen

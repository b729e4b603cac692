"""The standard hand-written strategies as plans on the planner's own graph and costs.

A hand plan gives each mesh axis a role:

* ``dp``: data parallel: parameters replicated, the batch split, no op on the batch computed twice
  (DDP; what does not depend on the inputs, such as position ids, is computed on every rank),
  attention never run as a ring (split by sequence: that is ``cp``);
* ``fsdp``: the same, with parameters stored sharded and gathered on use (ZeRO-3/FSDP);
* ``zero2``: the same, with parameters gathered once a step and kept (ZeRO-2: gradients and
  optimizer states sharded), on every axis at once, as DeepSpeed runs it, or on the data axes
  beside tensor parallelism, as Megatron's distributed optimizer does;
* ``zero1``: ``zero2`` with each gradient summed whole over the step's microbatches and
  reduce-scattered once (ZeRO-1: optimizer states sharded), on every axis at once;
* ``tp``: Megatron tensor parallel: every matmul weight sharded (the solver picks column or row
  per matrix, which recovers Megatron's column -> row pairs), inputs replicated;
* ``tp+sp``: ``tp`` with sequence parallelism: the residual stream (adds of two activations) is
  split along the sequence between the tensor-parallel regions;
* ``cp``: context parallel as torchtitan runs it: the inputs split by sequence, every attention
  split by sequence as ring attention, parameters stored sharded and gathered on use (FSDP over
  the context axis too), where the model has attention that can be split so.

Combined over the axes (tensor parallel on the last, intra-node axis), this gives DDP, FSDP, HSDP, Megatron
with and without sequence parallelism, every data x tensor mix on 2-D and 3-D meshes, and
torchtitan's FSDP x CP and FSDP x TP x CP (``context_role_sets``). Each is
the planner's problem with the choices the role forbids removed; the solver fills in the rest
(how each activation is laid out), so a hand plan is the best plan of its family under the same
cost model, and a warm start the auto plan can only improve on. A hand plan that does not fit the
memory budget is kept, with ``feasible == False`` and its ``shortfall_bytes``.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from autopar.core.capture import CapturedGraph, as_args, capture
from autopar.core.errors import AutoparError, InfeasibleError, PlanningTimeout
from autopar.core.execution import CAST_OPS, VIEW_OPS
from autopar.core.mesh import MeshSpec, as_mesh_spec
from autopar.core.microbatch import microbatch_capture
from autopar.core.ops import moe
from autopar.core.ops.attention import BALANCED_RING, SDPA
from autopar.core.plan import Plan
from autopar.core.routing import measured_if_asked
from autopar.core.seq_layout import BalancedLayoutError, plan_layout
from autopar.core.strategies import NodeChoices, NodeKind, Strategy
from autopar.core.units import fmt
from autopar.planning.clock import Clock, Deadline
from autopar.planning.options import PlanOptions
from autopar.planning.pipeline import (
    PipelineChoice,
    job_setting,
    pipeline_choice,
    pipeline_layouts,
    pipelined,
    sub_mesh,
)
from autopar.planning.problem import Planning, prepare, solve_planning

__all__ = ["candidates", "hand_plans", "ROLES"]

#: What a hand plan does on one mesh axis: data parallel (``dp``), FSDP (ZeRO-3), Megatron tensor
#: parallel without and with sequence parallelism, ZeRO-2 or ZeRO-1.
Role = Literal["dp", "fsdp", "tp", "tp+sp", "zero2", "zero1", "cp"]
ROLES: tuple[Role, ...] = ("dp", "fsdp", "tp", "tp+sp")   # combined freely over the axes (``role_sets``)
DATA_ROLES: tuple[Role, ...] = ("dp", "fsdp", "zero2", "zero1")   # the batch split, every weight used whole
R = Replicate()
aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.linear.default, aten.bmm.default, aten.matmul.default}
EMBEDDINGS = {aten.embedding.default}
# Share of the time left that all hand plans together may spend solving.
HAND_PLAN_TIME_SHARE = 0.4


def candidates(model: nn.Module, mesh: Any, example_inputs: Any, example_kwargs: dict | None = None, *,
               names: Collection[str] | None = None, options: PlanOptions | None = None,
               **option_values: Any) -> dict[str, Plan]:
    """Every standard strategy for ``mesh`` as a ``Plan``, costed like the auto plan (the same
    ``PlanOptions`` as ``autopar.plan``; ``microbatches`` and ``recompute`` "auto" plan the whole
    batch without recomputation, a count that many microbatches, "full" recomputes every block;
    ``offload`` "optimizer" offloads the ZeRO plans' states, "auto" does not); each can be
    compiled and run (``autopar.compile(plan=...)``). ``names``: only these plans are costed
    (e.g. ``["ddp", "fsdp(dp) x tp(tp)"]``); one the mesh has none of is an ``AutoparError``."""
    options = PlanOptions.of(options, **option_values)
    spec = as_mesh_spec(mesh)
    t0 = time.perf_counter()
    args = as_args(example_inputs)
    k = 1 if options.microbatches == "auto" else options.microbatches
    whole = capture(model, args, example_kwargs, precision=options.precision)
    options = measured_if_asked(options, whole, model, args, example_kwargs, spec.shape)
    captured = whole if k == 1 else microbatch_capture(model, args, example_kwargs, options.precision)(k)
    planning = prepare(captured, spec, options, timings={"capture": time.perf_counter() - t0}, microbatches=k,
                       whole=whole, recompute="none" if options.recompute == "auto" else options.recompute,
                       offload=options.offload == "optimizer")
    deadline = Clock(options.time_limit, start=t0, deterministic=options.deterministic).deadline()
    flat = None if names is None else [n for n in names if not n.startswith("pp(")]
    plans = {name: plan for name, (plan, _) in hand_plans(planning, deadline=deadline, share=1.0,  # type: ignore[misc]  # cost_unfit (the default): every value is a (plan, choices) pair
                                                          names=flat).items()}
    if pipeline_choice(options.pipeline) is not None and (names is None or len(flat or ()) < len(names)):
        recapture = microbatch_capture(model, args, example_kwargs, options.precision)
        plans.update(pipeline_hand_plans(whole, spec, options, recapture, deadline, names=names))
    _check_named(names, plans, spec)
    return plans


def _check_named(names: Collection[str] | None, plans: dict[str, Plan], mesh: MeshSpec) -> None:
    """Refuse a name asked of ``candidates`` that no costed plan has, listing the mesh's."""
    missing = [n for n in names or () if n not in plans]
    if missing:
        known = [plan_name(mesh, roles) for roles in role_sets(mesh)]
        raise AutoparError(f"no hand plan named {', '.join(map(repr, missing))} was costed on mesh {mesh.shape}: "
                           f"its plans are {', '.join(map(repr, known))}, torchtitan's context-parallel ones "
                           "where attention can be split by sequence, and pipelines named "
                           "'pp(<axis>[=<degree>], <schedule>) x <stage plan>'; or the time limit ran out first")


#: Megatron's pipeline schedules: 1F1B, and interleaved 1F1B with two stages per rank.
PIPELINE_SCHEDULES = (("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2))


def pipeline_hand_plans(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions,
                        recapture: Callable[[int], CapturedGraph], deadline: Deadline | None = None,
                        names: Collection[str] | None = None) -> dict[str, Plan]:
    """Megatron's 3-D plans: pipeline stages over a factor of the mesh's first axis (the degrees
    the planner weighs, ``pipeline.pipeline_layouts``: each data-parallel rank's share of a
    microbatch one row), run by 1F1B and by interleaved 1F1B (two stages per rank), each stage one
    of the hand plans of the other axes (tensor parallel inside a node, data parallel or ZeRO
    across); a ``PipelineChoice`` in ``options.pipeline`` sets the axis, schedule, microbatches and
    stages per rank instead. None where no axis or the model cannot carry stages. Named
    ``"pp(<axis>[=<degree>], <schedule>) x <stage plan>"``; ``names``: only these."""
    choice = pipeline_choice(options.pipeline)
    choice = choice if isinstance(choice, PipelineChoice) else PipelineChoice(axis="auto")
    try:
        layouts = pipeline_layouts(captured, mesh, choice)
    except AutoparError:   # no axis or too few blocks to cut
        return {}
    budget, profile = job_setting(options, mesh)
    schedules = PIPELINE_SCHEDULES if choice.schedule == "auto" else \
        [(choice.schedule, choice.virtual_stages if choice.virtual_stages != "auto" else 2)]
    out = {}
    for shaped, axis, counts in layouts:
        m = counts[-1]
        micro = recapture(m)
        ranks = shaped.shape[axis]
        planning = prepare(micro, sub_mesh(shaped, axis),
                           replace(options, memory_budget=budget * ranks, pipeline=False, profile=profile),
                           microbatches=m, whole=captured,
                           recompute="none" if options.recompute == "auto" else options.recompute,
                           offload=options.offload == "optimizer")
        # a stage's plans: Megatron's (its pipelines run no context parallelism)
        stages = None if names is None else [n.split(") x ", 1)[-1] for n in names if n.startswith("pp(")]
        for name, entry in hand_plans(planning, deadline=deadline, share=1.0, context=False, names=stages).items():
            if isinstance(entry, InfeasibleError):
                continue
            for schedule, virtual in schedules:
                try:
                    plan = pipelined(entry[0], micro, shaped, axis, schedule, virtual, budget, captured.fingerprint,
                                     profile)
                except AutoparError:   # too few blocks for two stages per rank, or microbatches per rank
                    continue
                short = schedule.removeprefix("Schedule")
                plan.name = f"pp({shaped.axis_names[axis]}{'' if shaped is mesh else f'={ranks}'}, {short}) x {name}"
                if names is None or plan.name in names:
                    out[plan.name] = plan
    return out


def role_sets(mesh: MeshSpec) -> list[tuple[Role, ...]]:
    """Role per axis of every hand plan on ``mesh`` (axes of size 1 take no role: ``dp``). Tensor
    parallelism goes on the last axis only, as in practice: it is the one inside a node; ZeRO-2
    on every axis, or on the data axes of Megatron's plans."""
    live = [a for a, n in enumerate(mesh.shape) if n > 1]
    out: list[tuple[Role, ...]] = []
    for combo in itertools.product(ROLES, repeat=len(live)):
        if all(not r.startswith("tp") for r in combo[:-1]):
            roles: list[Role] = ["dp"] * mesh.ndim
            for a, r in zip(live, combo, strict=True):
                roles[a] = r
            out.append(tuple(roles))
    if live:
        zeros: tuple[Role, ...] = ("zero2", "zero1")
        out += [tuple(zero if n > 1 else "dp" for n in mesh.shape) for zero in zeros]
    megatron: tuple[Role, ...] = ("tp", "tp+sp") if len(live) > 1 else ()
    for tp in megatron:   # Megatron with its distributed optimizer
        out.append(tuple("zero2" if a in live[:-1] else tp if a == live[-1] else "dp" for a in range(mesh.ndim)))
    return out


def context_role_sets(mesh: MeshSpec, ring_axes: set[int]) -> list[tuple[Role, ...]]:
    """torchtitan's context-parallel plans on ``mesh`` (its mesh order: FSDP outermost, then
    CP, then TP innermost), where some attention can run as a ring on the context axis
    (``ring_axes``): FSDP x CP (CP on the last axis, FSDP on the others and on the context axis
    too) and FSDP x TP x CP (TP on the last axis, CP on the one before, FSDP on the rest)."""
    live = [a for a, n in enumerate(mesh.shape) if n > 1]
    out: list[tuple[Role, ...]] = []
    for cp, tp in ((live[-1:], None), (live[-2:-1], live[-1] if len(live) > 1 else None)):
        if cp and cp[0] in ring_axes and (tp is not None or cp[0] == live[-1]):
            out.append(tuple("cp" if a == cp[0] else "tp" if a == tp else "fsdp" if a in live else "dp"
                             for a in range(mesh.ndim)))
    return out


#: A ring's rule names, either layout (``autopar.core.ops.attention``).
RINGS = ("context-ring", BALANCED_RING)


def _ring_axes(space) -> set[int]:
    """The mesh axes some attention of ``space`` can run ring attention on."""
    return {a for nc in space.nodes if nc.kind == "op" and nc.node.target is SDPA
            for s in nc.strategies for a, name in enumerate(s.names) if name in RINGS}


def plan_name(mesh: MeshSpec, roles: Sequence[Role]) -> str:
    live = [(mesh.axis_names[a], "fsdp+cp" if r == "cp" else r) for a, r in enumerate(roles) if mesh.shape[a] > 1]
    kinds = {r for _, r in live}
    if kinds <= {"dp"}:
        return "ddp"
    if kinds in ({"fsdp"}, {"zero2"}, {"zero1"}, {"fsdp+cp"}):
        return kinds.pop()
    if len(live) == 1:
        return live[0][1]
    return " x ".join(f"{r}({a})" for a, r in live)


def hand_plans(planning: Planning, *, deadline: Deadline | None = None, share: float = HAND_PLAN_TIME_SHARE,
               cost_unfit: bool = True, context: bool = True,
               names: Collection[str] | None = None) -> dict[str, tuple[Plan, tuple[int, ...]] | InfeasibleError]:
    """Every hand plan of ``planning``'s mesh: name -> (plan, choice per decision). One no choice
    of which fits the budget is costed without it (``cost_unfit``), or stands as the solver's
    error, which says the least memory it needs: the planner only compares plans that fit, and a
    second solve of every hand plan that cannot was half its time on a 2-D mesh.

    All together end by ``share`` of the time ``deadline`` leaves, each one solved in an equal part
    of what the ones before left (those the memory bound rules out take none); those the time does
    not reach are left out (the deadline's clock says so): a solve past the share would eat the
    auto plan's time. ``context``: torchtitan's context-parallel plans too, where attention can
    be split by sequence (``context_role_sets``). ``names``: only the plans so named."""
    mesh = planning.space.mesh
    # torchtitan's context-parallel plans costed first: where a long sequence makes them the ones
    # that fit, the time share must not run out before they are; listed last (ties go to the rest)
    contexts = context_role_sets(mesh, _ring_axes(planning.space)) if context else []
    sets = contexts + role_sets(mesh)
    on_batch = _on_batch(planning.space)
    traits = [_traits(planning.space, nc, i in on_batch) for i, nc in enumerate(planning.space.nodes)]
    out: dict[str, tuple[Plan, tuple[int, ...]] | InfeasibleError] = {}
    end = deadline.share(share) if deadline is not None else None
    sets = [roles for roles in sets if names is None or plan_name(mesh, roles) in names]
    named = [(plan_name(mesh, roles), _allowed(planning, roles, traits)) for roles in sets]
    least = [planning.bounds().least(allowed) for _, allowed in named]
    # known without a solve (which took 0.5 s to say so on Llama-2 70B); the time goes to the rest
    solved = [k for k in range(len(named)) if cost_unfit or least[k] <= planning.budget]
    for k, (name, allowed) in enumerate(named):
        fits = least[k] <= planning.budget
        if k not in solved:
            out[name] = InfeasibleError(f"no {name!r} plan fits the memory budget ({fmt(planning.budget, 'B')} per "
                                        f"device): it needs at least {fmt(least[k], 'B')}", min_memory_bytes=least[k])
            continue
        if end is not None and end.passed():
            end.clock.note(f"hand plan {name!r} (not costed)")
            continue
        own = end.share(1 / sum(1 for j in solved if j >= k)) if end is not None else None
        try:
            try:
                out[name] = _solved(planning, own, allowed, name, fits)
            except InfeasibleError as e:   # kept, marked infeasible, with its shortfall
                out[name] = _solved(planning, own, allowed, name, False) if cost_unfit else e
        except PlanningTimeout:
            end.clock.note(f"hand plan {name!r} (not costed)")
    first = {plan_name(mesh, roles) for roles in contexts}
    return {**{k: v for k, v in out.items() if k not in first}, **{k: v for k, v in out.items() if k in first}}


def _solved(planning: Planning, deadline: Deadline | None, allowed: list[list[int] | None], name: str,
            budget: bool) -> tuple[Plan, tuple[int, ...]]:
    """One hand plan's solve (``budget=False``: costed without the memory budget); solved again with
    its causal rings contiguous where their balanced layout cannot run (each attention picks its
    ring's layout, so equal costs may mix them), as the planner's own plan is (``_runs_in_order``)."""
    plan, choices = solve_planning(planning, deadline=deadline, allowed=allowed, name=name, budget=budget,
                                   stage="hand plans")
    if plan.context_parallel is None:   # no ring
        return plan, choices
    try:
        plan_layout(planning.captured, plan)
    except BalancedLayoutError as e:
        contiguous = _contiguous_rings(planning, allowed)
        if contiguous is None:   # the options force the balanced layout: the plan stands, refused where run
            return plan, choices
        plan, choices = solve_planning(planning, deadline=deadline, allowed=contiguous, name=name, budget=budget,
                                       stage="hand plans")
        plan.warnings.append(f"the plan's causal rings run contiguous: the balanced layout was refused ({e})")
    return plan, choices


def _contiguous_rings(planning: Planning, allowed: list[list[int] | None]) -> list[list[int] | None] | None:
    """``allowed`` without the choices that run an attention as a balanced ring; None where that
    leaves a decision no choice (the options force the balanced layout)."""
    grouping, out = planning.grouping, list(allowed)
    for i, nc in enumerate(planning.space.nodes):
        balanced = np.array([BALANCED_RING in s.names for s in nc.strategies])
        if not balanced.any():
            continue
        d = grouping.owner[i]
        ok = ~balanced[grouping.choice[i]]
        out[d] = [c for c in (range(grouping.sizes[d]) if out[d] is None else out[d]) if ok[c]]
        if not out[d]:
            return None
    return out


def _allowed(planning: Planning, roles: Sequence[Role], traits: Sequence[Traits]) -> list[list[int] | None]:
    """Per decision, the choices the roles allow: every member node's strategy must obey them.
    A node no strategy of which obeys (an op the role cannot express) is left free."""
    space, grouping = planning.space, planning.grouping
    ok: dict[int, np.ndarray] = {}
    seen: dict[tuple, np.ndarray] = {}   # nodes of identical layers share strategy lists
    for i, nc in enumerate(space.nodes):
        key = (id(nc.strategies), nc.kind, traits[i])
        if key not in seen:
            seen[key] = np.array([_obeys(space.mesh, nc.kind, traits[i], s, roles) for s in nc.strategies])
        obeys = seen[key]
        if obeys.any() and not obeys.all():
            ok[i] = obeys[grouping.choice[i]]   # per choice of its decision
    per_decision: list[np.ndarray | None] = [None] * len(grouping.sizes)
    for i, mask in ok.items():
        d = grouping.owner[i]
        per_decision[d] = mask if per_decision[d] is None else per_decision[d] & mask
    allowed: list[list[int] | None] = []
    for d, mask in enumerate(per_decision):
        if mask is not None and not mask.any():   # members disagree: keep what the decision's own node needs
            root = grouping.representative[d]
            mask = ok.get(root)
        allowed.append(None if mask is None or not mask.any() else np.flatnonzero(mask).tolist())
    return allowed


Traits = tuple[bool, bool, bool, tuple[int, ...], tuple[int, ...], bool, bool]


def _traits(space, nc: NodeChoices, on_batch: bool) -> Traits:
    """What the roles look at: (computes on the batch, is a matmul weight, is a residual add,
    positions of the inputs that are weights of this matmul, of this embedding's table, is
    attention, is an expert weight of a mixture-of-experts layer)."""
    if nc.kind == "param":
        return False, _is_matmul_weight(nc), False, (), (), False, _is_expert_weight(nc)
    if nc.kind == "op":
        weights = tuple(k for k, u in enumerate(nc.inputs) if nc.node.target in MATMULS and _from_param(space, u))
        if nc.node.target is moe.MOE:   # the experts' weights: used split on a tensor-parallel axis, as Megatron's
            weights = (moe.GATE_UP, moe.DOWN)
        tables = tuple(k for k, u in enumerate(nc.inputs) if nc.node.target in EMBEDDINGS and _from_param(space, u))
        return on_batch, False, _is_residual_add(nc), weights, tables, nc.node.target is SDPA, False
    return False, False, False, (), (), False, False


def _obeys(mesh: MeshSpec, kind: NodeKind, traits: Traits, s: Strategy, roles: Sequence[Role]) -> bool:
    for a, role in enumerate(roles):
        if mesh.shape[a] == 1:
            continue
        if role == "cp":
            if not _obeys_context(kind, traits, s, a):
                return False
            continue
        if not _obeys_role(kind, traits, s, a, role):
            return False
    return True


def _obeys_context(kind: NodeKind, traits: Traits, s: Strategy, a: int) -> bool:
    """Does ``s`` run as torchtitan's context parallelism on axis ``a``: parameters FSDP, the
    inputs split by sequence, ops on the batch split (attention as a ring), weights used whole?"""
    on_batch, _, _, weights, tables, attention, _ = traits
    if kind == "param":
        return s.out[a] == R and isinstance(s.storage[a], Shard) and not s.kept
    if kind == "input":
        return s.out[a] == Shard(1)
    if kind == "op":
        if attention:   # either layout: the balanced one where it is priced faster (causal, 2n chunks)
            return s.names[a] in RINGS
        replicated = s.out[a] == R and all(p[a] == R for p in s.ins)
        return on_batch != replicated and all(s.ins[k][a] == R for k in weights + tables)
    return True


def _obeys_role(kind: NodeKind, traits: Traits, s: Strategy, a: int, role: Role) -> bool:
    """Does ``s`` obey ``role`` (one of ``ROLES`` or ZeRO) on axis ``a``?"""
    on_batch, matmul_weight, residual_add, weights, tables, attention, expert_weight = traits
    if kind == "param":
        use, stored = s.out[a], s.storage[a]
        if role in DATA_ROLES and expert_weight and use == stored == Shard(0):
            return True   # experts split by expert over a data axis: Megatron's expert x data parallelism
        if role == "dp" and not (use == R and stored == R):
            return False
        if role in ("fsdp", "zero2", "zero1") and not (use == R and isinstance(stored, Shard)
                                                        and s.kept == (role != "fsdp")
                                                        and s.accumulated == (role == "zero1")):
            return False
        if role.startswith("tp") and (stored != use or (matmul_weight and not isinstance(use, Shard))):
            return False
    elif kind == "input":
        want = Shard(0) if role in DATA_ROLES else R
        if s.out[a] != want:
            return False
    elif kind == "op":
        replicated = s.out[a] == R and all(p[a] == R for p in s.ins)
        if role in DATA_ROLES and on_batch == replicated:
            return False   # an op on the batch computed on every rank, or one without it split
        if role in DATA_ROLES and attention and s.names[a] in RINGS:
            return False   # split by sequence, passing keys and values round: context parallelism ("cp")
        if role in DATA_ROLES and any(s.ins[k][a] != R for k in weights + tables) and s.names[a] != moe.EXPERTS:
            return False   # data parallelism uses every weight whole (embedding tables too: DDP's do), but experts by expert
        if role.startswith("tp") and any(s.ins[k][a] == R for k in weights):
            return False   # Megatron splits the matmul itself: its weight is used sharded
        if role == "tp+sp" and residual_add and s.out[a] != Shard(1):
            return False
    return True


def _on_batch(space) -> set[int]:
    """Indices of the ops that depend on the model's inputs. The others (position ids and their
    embeddings, causal masks) have no batch to split: data parallelism computes them everywhere."""
    out: set[int] = set()
    for i, nc in enumerate(space.nodes):   # in graph order: producers first
        if nc.kind == "input" or any(space.index.get(u) in out for u in nc.inputs):
            out.add(i)
    return out


def _from_param(space, node) -> bool:
    """``node`` is a parameter, or a view or cast of one."""
    while (node.target in VIEW_OPS or node.target in CAST_OPS) and node.args:
        node = node.args[0]
    i = space.index.get(node)
    return i is not None and space.nodes[i].kind == "param"


def _is_matmul_weight(nc: NodeChoices) -> bool:
    """Used (through views and casts) as an operand of a matrix multiplication."""
    todo = [nc.node]
    while todo:
        for user in todo.pop().users:
            if user.target in MATMULS:
                return True
            if user.target in VIEW_OPS or user.target in CAST_OPS:
                todo.append(user)
    return False


def _is_expert_weight(nc: NodeChoices) -> bool:
    """Read (through views and casts) as the experts' weights of a mixture-of-experts layer."""
    todo = [nc.node]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.target is moe.MOE and node in user.args[moe.GATE_UP:]:
                return True
            if user.target in VIEW_OPS or user.target in CAST_OPS:
                todo.append(user)
    return False


def _is_residual_add(nc: NodeChoices) -> bool:
    """An add of two activations of the output's (batch, sequence, hidden) shape."""
    if nc.node.target != aten.add.Tensor or len(nc.inputs) != 2:
        return False
    shape = tuple(nc.node.meta["val"].shape)
    return len(shape) == 3 and all(tuple(u.meta["val"].shape) == shape for u in nc.inputs)

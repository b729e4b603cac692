"""Pipeline plans: an SPMD plan for one stage's sub-mesh, cut into stages over a mesh axis.

``pipelined`` turns a plan made on the mesh without the pipeline axis (``stage_plan``: the whole
model over the step's microbatches, every node's predicted seconds and bytes) into a pipeline plan:

1. each repeated block's time per microbatch is its nodes' (forward + backward + communication,
   ZeRO gathers; the stage plan prices a step of the pipeline's microbatches, gathers each time,
   gradient synchronisation and the optimizer once), the embedding's counts to the first stage,
   the head's and the loss's to the last;
2. ``cost_models.pipeline.balanced_stages`` cuts the blocks into stages whose slowest is fastest;
3. ``cost_models.pipeline.simulate`` plays the schedule out on those stages, each activation send
   priced on the link the pipeline axis crosses: the step time, the bubble, and per rank the
   microbatches in flight at once;
4. per stage, peak memory = its parameters' state + its kept activations x the microbatches in
   flight on its rank + the stage plan's working memory; the step adds, after the last backward,
   the optimizer and gradient synchronisation of the slowest rank's parameters.

The plan keeps the stage plan's placements with the pipeline axis replicated (``Plan.within_stage``
gives them back) and says what it did in ``plan.pipeline`` (``autopar.core.plan.PipelinePlan``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch.fx as fx
from torch.distributed.tensor import Replicate

from autopar.core.blocks import Block, repeated_blocks
from autopar.core.capture import CapturedGraph, readable_name, value_bytes
from autopar.core.errors import AutoparError, InfeasibleError, PlanningTimeout
from autopar.core.hardware import get_hardware
from autopar.core.mesh import MeshSpec, split_first_axis
from autopar.core.microbatch import captured_rows, fewest_at_least, microbatch_rows
from autopar.core.placements import shard_fraction
from autopar.core.plan import NodePlan, PipelinePlan, Plan, Prediction, StagePlan, rank_of_stage
from autopar.core.units import fmt
from autopar.planning import work
from autopar.planning.clock import Deadline, Once
from cost_models.comm import Link, collective_time, link_for_axis
from cost_models.pipeline import Interval, StageCost, balanced_stages, simulate, stages_per_rank
from cost_models.profile import Profile, resolve_profile, runtime_overhead

#: Of one microbatch's time on a stage, the share its forward takes (the roofline's backward is
#: twice the forward: a gradient for the input and one for the weight).
FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class _Stage:
    nodes: tuple[NodePlan, ...]
    blocks: tuple[int, int]
    modules: tuple[str, ...]


def sub_mesh(mesh: MeshSpec, axis: int) -> MeshSpec:
    """``mesh`` without ``axis``: what one pipeline stage runs on, inside the whole mesh's job (its
    profile prices the stage)."""
    if mesh.ndim < 2:
        raise AutoparError(f"a pipeline over the only axis of mesh {mesh.describe()} leaves no mesh for its stages; "
                           "build the mesh with a second axis of size 1 (e.g. (pp, 1)) to pipeline over all of it")
    return MeshSpec(mesh.shape[:axis] + mesh.shape[axis + 1:], mesh.axis_names[:axis] + mesh.axis_names[axis + 1:],
                    mesh.hardware, job_size=mesh.processes)


def pipelined(stage_plan: Plan, captured: CapturedGraph, mesh: MeshSpec, axis: int, schedule: str,
              virtual: int = 1, budget: float | None = None, fingerprint: str | None = None,
              profile: Profile | None = None) -> Plan:
    """The pipeline plan of ``stage_plan`` (planned on ``sub_mesh(mesh, axis)`` for a step of
    ``stage_plan.microbatches`` microbatches of ``captured``'s shape, one microbatch's capture)
    with ``mesh.shape[axis]`` ranks of ``virtual`` stages each (two for the V-shaped schedules),
    run by ``schedule`` over those microbatches. ``profile``: the runtime's measured costs per
    microbatch on a stage and per step (``pipeline_microbatch``, ``pipeline_step``, ``step``)."""
    microbatches = stage_plan.microbatches
    ranks = mesh.shape[axis]
    per_rank = stages_per_rank(schedule, virtual)
    blocks = repeated_blocks(captured.graph)
    count = ranks * per_rank
    if count > len(blocks):
        raise AutoparError(f"{schedule} on {ranks} pipeline ranks runs {count} stages; the model has "
                           f"{len(blocks)} repeated blocks, at least one per stage is needed")
    stages = _cut(stage_plan, captured.graph, blocks, count)
    per_microbatch = runtime_overhead(profile, {"pipeline_microbatch": 1})
    step_costs = [_stage_cost(s, microbatches, per_microbatch) for s in stages]
    boundary = _boundary_bytes(stage_plan, captured, stages)
    step = simulate(schedule, step_costs, ranks, microbatches, _send_seconds(boundary, mesh, axis, per_microbatch > 0))
    held = {r: [s for s in range(count) if rank_of_stage(schedule, s, ranks, per_rank) == r] for r in range(ranks)}
    working = stage_plan.predicted.memory_breakdown.get("working", 0.0)
    after = stage_plan.predicted.exposed_comm_s / stage_plan.predicted.overlapped_comm_s \
        if stage_plan.predicted.overlapped_comm_s > 0 else 1.0
    peaks, finals = [], []
    for r in range(ranks):
        state = sum(_state_bytes(stages[s]) for s in held[r])
        peaks.append(state + step.peak_activation_bytes[r] + working)
        finals.append(sum(_final_s(stages[s], after) for s in held[r]))
    rank_of = {s: r for r, ss in held.items() for s in ss}
    stage_plans = tuple(StagePlan(blocks=s.blocks, modules=s.modules, forward_s=c.forward_s, backward_s=c.backward_s,
                                  peak_memory_bytes=peaks[rank_of[k]],
                                  parameters=tuple(n.fqn for n in s.nodes if n.op == "parameter"))
                        for k, (s, c) in enumerate(zip(stages, step_costs, strict=True)))
    worst = max(range(ranks), key=peaks.__getitem__)
    p = stage_plan.predicted
    state = sum(_state_bytes(stages[s]) for s in held[worst])
    predicted = Prediction(
        step_time_s=step.step_s + max(finals) + runtime_overhead(profile, {"pipeline_step": 1, "step": 1}),
        peak_memory_bytes=peaks[worst],
        comm_bytes={**{a: b / ranks for a, b in p.comm_bytes.items()},
                    mesh.axis_names[axis]: sum(boundary) * microbatches * 2 / ranks},   # activations and their gradients
        compute_s=p.compute_s / ranks, comm_s=p.comm_s / ranks, overlapped_comm_s=p.overlapped_comm_s / ranks,
        exposed_comm_s=p.exposed_comm_s / ranks,
        memory_breakdown={"state": state, "activations": step.peak_activation_bytes[worst], "working": working},
        peak_at=f"pipeline rank {worst} (stage {', '.join(map(str, held[worst]))}), "
                + _in_flight(step.peak_in_flight[worst], microbatches, per_rank),
        cost_source=p.cost_source, basis=p.basis, band_low=p.band_low, band_high=p.band_high,
        model_flops=p.model_flops, hardware_flops=p.hardware_flops, peak_flops=p.peak_flops * ranks)
    pipeline = PipelinePlan(axis=mesh.axis_names[axis], schedule=schedule, num_microbatches=microbatches,
                            virtual_stages=per_rank, stages=stage_plans, bubble_fraction=step.bubble_fraction,
                            microbatch_fingerprint=captured.fingerprint)
    budget = stage_plan.memory_budget if budget is None else budget
    return replace(stage_plan, mesh=mesh, fingerprint=fingerprint or stage_plan.fingerprint, nodes=[_lifted(n, axis) for n in stage_plan.nodes], predicted=predicted,
                   memory_budget=budget, feasible=peaks[worst] <= budget,
                   shortfall_bytes=max(0.0, peaks[worst] - budget), pipeline=pipeline,
                   batch_size=stage_plan.microbatch_size * microbatches, microbatches=microbatches,
                   solver=stage_plan.solver.copy(), timings=dict(stage_plan.timings))


def _in_flight(count: int, microbatches: int, per_rank: int) -> str:
    """A rank's activations in flight at its peak: ``count`` microbatches' on one stage (of the
    step's ``microbatches``), or stage-microbatch pairs' over its ``per_rank`` stages."""
    if per_rank == 1:
        return f"the activations of {count} of the {microbatches} microbatches in flight"
    return (f"the activations of {count} microbatches in flight over its {per_rank} stages (at most "
            f"{microbatches} on each)")


def _cut(plan: Plan, graph: fx.Graph, blocks: Sequence[Block], count: int) -> list[_Stage]:
    """The stages: the blocks cut by ``balanced_stages`` on each one's time, with what comes
    before the first block on the first stage and what follows the last on the last."""
    by_name = {n.name: n for n in plan.nodes}
    block_of = {name: b for b, block in enumerate(blocks) for name in block.nodes}
    ops = [n for n in graph.nodes if n.op != "placeholder" and n.name in by_name]
    first_block = next(i for i, n in enumerate(ops) if n.name in block_of)
    part_of = {}   # op -> its block, or -1 before the blocks, len(blocks) after them
    current = -1
    for i, n in enumerate(ops):
        if n.name in block_of:
            current = block_of[n.name]
        part_of[n.name] = current if i >= first_block else -1
    times = [0.0] * (len(blocks) + 2)
    for n in ops:
        times[part_of[n.name] + 1] += _seconds(by_name[n.name])
    after_last = {n.name for n in ops if part_of[n.name] == len(blocks) - 1 and n.name not in block_of}
    last_time = sum(_seconds(by_name[name]) for name in after_last)
    times[len(blocks)] -= last_time
    ranges = balanced_stages(times[1:len(blocks) + 1], count, first=times[0], last=last_time)
    stage_of_part = {b: k for k, r in enumerate(ranges) for b in r}
    members: list[list[NodePlan]] = [[] for _ in ranges]
    for n in ops:
        b = part_of[n.name]
        k = 0 if b < 0 else count - 1 if n.name in after_last else stage_of_part[b]
        members[k].append(by_name[n.name])
    readers = {}   # parameter -> the stages whose ops read it
    op_stage = {n.name: k for k, ms in enumerate(members) for n in ms}
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in by_name:
            readers[n.name] = sorted({op_stage[u.name] for u in n.users if u.name in op_stage})
    for name, ks in readers.items():
        for k in ks:   # a parameter two stages read (tied embeddings) is held by both
            members[k].append(by_name[name])
    out = []
    for k, (r, ms) in enumerate(zip(ranges, members, strict=True)):
        paths = []
        for n in graph.nodes:
            if n.name in op_stage and op_stage[n.name] == k:
                layer = readable_name(n)
                inside = next((blocks[b].path for b in r if layer == blocks[b].path
                               or layer.startswith(blocks[b].path + ".")), layer)
                if inside and inside not in paths:
                    paths.append(inside)
        out.append(_Stage(tuple(ms), (r.start, r.stop), tuple(paths)))
    return out


def _seconds(n: NodePlan) -> float:
    """A node's seconds in a step's microbatches: an op's forward, backward and communication, a
    parameter's gathers (its optimizer step and any node's gradient synchronisation run once a
    step, after the stage's last backward: ``_final_s``)."""
    return n.comm_s - n.sync_s + (n.compute_s if n.op != "parameter" else 0.0)


def _stage_cost(stage: _Stage, microbatches: int, runtime_s: float = 0.0) -> StageCost:
    """A stage's seconds per microbatch (its ops' forward and backward, their communication and
    its parameters' gathers; ``runtime_s``: the schedule's own, half in each pass, as each receives
    and sends) and the activations one microbatch keeps on it."""
    ops = [n for n in stage.nodes if n.op != "parameter"]
    seconds = sum(_seconds(n) for n in stage.nodes) / microbatches
    # no part of the backward runs apart as a weight step (weight_s 0): generated code computes the
    # weights' gradients in the input-gradient pass (``codegen.pipelined``)
    return StageCost(forward_s=seconds * FORWARD_SHARE + runtime_s / 2,
                     backward_s=seconds * (1 - FORWARD_SHARE) + runtime_s / 2,
                     activation_bytes=sum(n.saved_bytes for n in ops))


def _state_bytes(stage: _Stage) -> float:
    """Parameters, gradients and optimizer states the stage holds."""
    return sum(n.memory_bytes for n in stage.nodes if n.op == "parameter")


def _final_s(stage: _Stage, exposed_share: float) -> float:
    """What follows the stage's last backward: its parameters' optimizer step and the share of
    the gradient synchronisation (queued by its parameters and ops) no backward hides."""
    return sum((n.compute_s if n.op == "parameter" else 0.0) + n.sync_s * exposed_share for n in stage.nodes)


def _crossing(captured: CapturedGraph, stages: Sequence[_Stage]) -> list[list[str]]:
    """Per stage boundary, the values an op after it reads that were computed before it (or are
    model inputs): what the pipeline sends across it."""
    stage_of: dict[str, int] = {}
    planned = {n.name: k for k, s in enumerate(stages) for n in s.nodes if n.op != "parameter"}
    current = 0
    for n in captured.graph.nodes:   # ops the plan does not list (getitem) run with the op before
        if n.op == "call_function":
            current = planned.get(n.name, current)
            stage_of[n.name] = current
    out: list[list[str]] = [[] for _ in stages[1:]]
    for n in captured.graph.nodes:
        mine = stage_of.get(n.name, 0 if n.name in captured.user_inputs else None)
        if mine is None:
            continue
        last = max((stage_of[u.name] for u in n.users if u.name in stage_of), default=mine)
        for k in range(mine, last):
            out[k].append(n.name)
    return out


def _boundary_bytes(plan: Plan, captured: CapturedGraph, stages: Sequence[_Stage]) -> list[float]:
    by_name = {n.name: n for n in plan.nodes}
    shape = plan.mesh.shape
    return [sum(value_bytes(captured.graph, name) * (shard_fraction(by_name[name].out, shape) if name in by_name
                                                     else 1.0)
                for name in names) for names in _crossing(captured, stages)]


def _send_seconds(boundary_bytes: Sequence[float], mesh: MeshSpec, axis: int, latency_measured: bool) -> list[float]:
    """Seconds to send one microbatch's values across each stage boundary, on the pipeline axis's
    link; its bandwidth alone where the profile's per-microbatch cost holds the sends' latency
    (``latency_measured``)."""
    link = link_for_axis(get_hardware(mesh.hardware), mesh.shape, axis)
    if latency_measured:
        link = Link(bandwidth=link.bandwidth, latency=0.0)
    return [collective_time("send_recv", b, 2, link) for b in boundary_bytes]


def _lifted(n: NodePlan, axis: int) -> NodePlan:
    """``n`` with the pipeline axis put back, replicated there."""
    def lift(ps):
        return None if ps is None else ps[:axis] + (Replicate(),) + ps[axis:]
    return replace(n, out=lift(n.out), ins=tuple(lift(i) for i in n.ins), storage=lift(n.storage))


@dataclass(frozen=True)
class PipelineChoice:
    """What a pipeline plan must use (``PlanOptions.pipeline``); "auto" leaves a field to the planner.
    ``axis``: the mesh axis carrying stages (name or index); ``schedule``: a class name of
    ``cost_models.pipeline.SCHEDULES``; ``microbatches``: per step, at least the axis's size;
    ``virtual_stages``: stages per rank (interleaved and looped schedules)."""

    axis: str | int = 0                # "auto": a factor of the first axis (the plan's mesh splits it)
    schedule: str = "auto"
    microbatches: int | Literal["auto"] = "auto"
    virtual_stages: int | Literal["auto"] = "auto"

    def axis_index(self, mesh: MeshSpec) -> int:
        if isinstance(self.axis, int) and 0 <= self.axis < mesh.ndim:
            return self.axis
        if self.axis in mesh.axis_names:
            return mesh.axis_names.index(self.axis)
        raise AutoparError(f"pipeline axis {self.axis!r} is not an axis of mesh {mesh.describe()} "
                           f"(axes {', '.join(mesh.axis_names)})")


def pipeline_choice(value: bool | str | PipelineChoice | dict) -> PipelineChoice | None | str:
    """``PlanOptions.pipeline`` checked: "auto" (the planner decides), None (no pipeline: False or
    "none"), or the ``PipelineChoice`` a pipeline plan must follow (a dict of its fields, or a
    schedule name, is one)."""
    if value is False or value == "none":
        return None
    if value == "auto":
        return "auto"
    if isinstance(value, str):
        value = PipelineChoice(schedule=value)
    if isinstance(value, dict):
        try:
            value = PipelineChoice(**value)
        except TypeError as e:
            raise AutoparError(f"pipeline={value!r}: {e}; its fields are axis, schedule, microbatches, "
                               "virtual_stages") from None
    if not isinstance(value, PipelineChoice):
        raise AutoparError(f"pipeline is 'auto', False, a schedule name or a PipelineChoice, got {value!r}")
    if value.schedule != "auto":
        stages_per_rank(value.schedule)   # an unknown schedule raises, listing the known ones
    for name in ("microbatches", "virtual_stages"):
        v = getattr(value, name)
        if v != "auto" and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise AutoparError(f"pipeline {name} is 'auto' or a count >= 1, got {v!r}")
    return value


#: The schedules the planner weighs, each with the stages per rank it runs: one, or two (the
#: interleaved and looped schedules with two virtual stages, the V-shaped zero-bubble one).
AUTO_SCHEDULES = (("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2), ("ScheduleGPipe", 1),
                  ("ScheduleLoopedBFS", 2), ("ScheduleInterleavedZeroBubble", 2), ("ScheduleZBVZeroBubble", 2))


def pipeline_search(captured: CapturedGraph, mesh: MeshSpec, options: Any, choice: PipelineChoice,
                    recapture: Once | None, deadline: Deadline,
                    plan_stage: Callable[[CapturedGraph, MeshSpec, Any, Deadline], Plan]) -> Plan:
    """The fastest pipeline plan that fits, over ``choice``'s axis (or, for axis "auto", over
    each of ``pipeline_degrees`` of the first axis, the plan's mesh cutting it): for each layout
    and microbatch count, the stage's SPMD plan of one microbatch on the other axes
    (``plan_stage``, the planner itself, with the budget times the pipeline ranks: each holds that
    share of the model), cut into stages under each schedule (``_schedules``). Where recomputation
    is the planner's, every layout is planned as the stage plan chooses first, then with full
    recomputation (less memory), at once where none fit (``_attempts``). Each attempt may take
    half the time left (a stage plan cut short is a poor one): the first are weighed well, the
    last only where time remains; what the deadline does not reach is said on its clock. Raises
    ``InfeasibleError`` where none fits, ``AutoparError`` where the model cannot be pipelined so."""
    layouts = pipeline_layouts(captured, mesh, choice)
    if any(m > 1 for _, _, counts in layouts for m in counts) and recapture is None:
        raise AutoparError("a pipeline runs microbatches: plan with autopar.plan or autopar.compile, which can "
                           "capture one")
    budget, profile = job_setting(options, mesh)
    # the stage plan is made as if the model's state were split over the ranks (it is) and every
    # microbatch's activations too (they are not: a rank keeps several in flight)
    modes = ["auto", "full"] if options.recompute == "auto" else [options.recompute]
    count = len(modes) * sum(len(counts) for _, _, counts in layouts)
    tried: dict[str, str] = {}
    fitted: set[int] = set()   # layouts with a pipeline plan that fits
    best: Plan | None = None
    took = 0.0   # the last attempt's seconds once captured: one that would end past the deadline is not begun
    for i, (layout, shaped, axis, m, mode) in enumerate(_attempts(layouts, modes, fitted)):
        ranks = shaped.shape[axis]
        where = f"{shaped.axis_names[axis]}={ranks}, {m} microbatches, recompute {mode}"
        capture_s = 0.0 if m == 1 or m in recapture.done else deadline.clock.estimate("capture")
        if best is not None and not deadline.affords(took + capture_s):
            deadline.clock.note(f"pipeline layout {where} (not weighed)")
            continue
        # priced as the stage runs it, m microbatches a step (ZeRO-3 gathers each time, gradient sync
        # once); no hand plans: they stand for the stage plans of the Megatron plans it is compared with
        stage_options = replace(options, pipeline=False, microbatches=m, memory_budget=budget * ranks, recompute=mode,
                                hand_plans=False, profile=profile)
        with deadline.clock.doing(f"pipeline layout {where}"):
            try:
                micro = captured if m == 1 else recapture(m, deadline)   # a capture the first time
                started = deadline.clock.spent   # ``took``: what an attempt is charged once captured
                stage_plan = plan_stage(captured, sub_mesh(shaped, axis), stage_options,
                                        deadline.share(1 / min(count - i, 2)))
            except (InfeasibleError, PlanningTimeout) as e:
                tried[where] = f"no stage plan: {e}"
                continue
            for key, plan in _schedules(stage_plan, micro, shaped, axis, choice, budget, captured.fingerprint,
                                        profile, deadline):
                tried[f"{key}, {where}"] = _told(plan)
                if isinstance(plan, str):
                    continue
                fitted.update([layout] if plan.feasible else [])
                if best is None or _ranked(plan) > _ranked(best):
                    best = plan
        took = deadline.clock.spent - started
    if best is None:
        raise InfeasibleError("no pipeline plan: " + "; ".join(f"{k}: {v}" for k, v in tried.items()),
                              min_memory_bytes=float("inf"))
    best.solver["pipelines"] = tried
    return best


def _ranked(plan: Plan) -> tuple[bool, float]:
    """A pipeline plan's rank: fitting first, then the faster."""
    return plan.feasible, -plan.predicted.step_time_s


def _told(plan: Plan | str) -> str:
    """A pipeline plan as ``solver["pipelines"]`` lists it: its step and peak (or why there is none)."""
    return plan if isinstance(plan, str) else (
        f"{fmt(plan.predicted.step_time_s, 's')}, peak {fmt(plan.predicted.peak_memory_bytes, 'B')}"
        + ("" if plan.feasible else " (over the budget)"))


def _attempts(layouts: list[tuple[MeshSpec, int, list[int]]], modes: Sequence[str], fitted: set[int]
              ) -> Iterator[tuple[int, MeshSpec, int, int, str]]:
    """(layout number, mesh, axis, microbatches, recomputation) of each attempt, layout by layout
    in the first mode; a layout none of whose pipeline plans fit (``fitted``, read as each comes)
    is tried in the other modes (less memory) at once, before the next layout: its capture is in
    hand, the next layout's is not (GPT-3 175B written with Hugging Face's GPT-2 on 128x8 A100:
    32 stages over the budget without recomputation, the next layout not reached in 60 s, so the
    plan without a pipeline, 40x slower, was kept). The other layouts' other modes come last."""
    later = []
    for n, (shaped, axis, counts) in enumerate(layouts):
        yield from ((n, shaped, axis, m, modes[0]) for m in counts)
        rest = [(n, shaped, axis, m, mode) for mode in modes[1:] for m in counts]
        if n in fitted:
            later += rest
        else:
            yield from rest
    yield from later


#: The schedule of the fewest activations in flight: where its plan does not fit, "auto" simulates
#: no other (each 3-7 s on GPT-3 175B, and each above 1F1B's peak on every layout measured:
#: interleaved, looped and zero-bubble 2-35% above it, GPipe all microbatches; GPipe, as cheap to
#: simulate, is kept). The simulations left the next layout no time: Hugging Face's GPT-2 175B on
#: 128x8 A100 spent 13.7 s on schedules over the budget and kept a plan without pipeline 30x slower.
LEANEST = "Schedule1F1B"
#: Relative seconds of ``pipelined``'s schedule simulation (``cost_models.pipeline.simulate``),
#: 1F1B's 1, measured on GPT-3 175B at 384 microbatches over 32 ranks (0.3 s for 1F1B, 3.4-3.6 s
#: interleaved and looped, 6.6-6.7 s zero-bubble): a schedule is simulated only where the time
#: left affords its charge (``work``: its weight times microbatches times stages). Unknown
#: schedules count as the slowest.
SIMULATION_WORK = {"Schedule1F1B": 1.0, "ScheduleGPipe": 1.0, "ScheduleInterleaved1F1B": 12.0,
                   "ScheduleLoopedBFS": 12.0, "ScheduleInterleavedZeroBubble": 22.0, "ScheduleZBVZeroBubble": 22.0}


def _schedules(stage_plan: Plan, micro: CapturedGraph, mesh: MeshSpec, axis: int, choice: PipelineChoice,
               budget: float, fingerprint: str, profile: Profile | None, deadline: Deadline
               ) -> Iterator[tuple[str, Plan | str]]:
    """(schedule, its pipeline plan or why there is none) for each schedule ``choice`` allows, the
    cheapest to simulate first, each only where ``deadline`` affords its simulation."""
    schedules = [(s, v) for s, v in AUTO_SCHEDULES if choice.schedule in ("auto", s)] or \
        [(choice.schedule, 2 if stages_per_rank(choice.schedule, 2) == 2 else 1)]
    if choice.virtual_stages != "auto":
        schedules = [(s, choice.virtual_stages) for s, _ in schedules
                     if stages_per_rank(s, choice.virtual_stages) == choice.virtual_stages]
    slowest = max(SIMULATION_WORK.values())
    clock = deadline.clock
    runs = stage_plan.microbatches * mesh.shape[axis]   # microbatches through stages: a schedule's actions, 1F1B's
    leanest: Plan | str | None = None   # 1F1B's plan, where "auto" weighs it
    for schedule, virtual in sorted(schedules, key=lambda sv: SIMULATION_WORK.get(sv[0], slowest)):
        weight, key = SIMULATION_WORK.get(schedule, slowest), f"{schedule} x{virtual}"
        if isinstance(leanest, Plan) and not leanest.feasible and schedule != "ScheduleGPipe":
            yield key, f"not simulated: {LEANEST} does not fit the budget, and this schedule keeps more in flight"
            continue
        if not deadline.affords(work.seconds("simulation", actions=weight * runs)):
            clock.note(f"pipeline schedule {schedule} (not simulated)")
            yield key, "not simulated: no time was left"
            continue
        try:
            with clock.stage("pipeline schedules", what=f"simulating {schedule} x{virtual}") as timed:
                plan: Plan | str = pipelined(stage_plan, micro, mesh, axis, schedule, virtual, budget, fingerprint,
                                             profile)
        except AutoparError as e:
            plan = str(e)
        clock.charge("simulation", timed.seconds, actions=weight * runs)
        leanest = plan if schedule == LEANEST and choice.schedule == "auto" else leanest
        yield key, plan


def job_setting(options: Any, mesh: MeshSpec) -> tuple[float, Profile | None]:
    """(a device's memory budget, the job's profile) that every pipeline layout of ``mesh`` is
    planned with: the stages' sub-meshes run inside the whole job, whose profile prices them."""
    return options.device_budget(mesh.hardware), resolve_profile(options.profile, mesh)


def pipeline_layouts(captured: CapturedGraph, mesh: MeshSpec, choice: PipelineChoice) -> list[tuple[MeshSpec, int, list[int]]]:
    """(mesh, pipeline axis, microbatch counts) to weigh: the choice's axis of ``mesh``, or for
    axis "auto" ``mesh`` with its first axis cut at each of ``pipeline_degrees``, each run as
    Megatron runs it, each data-parallel rank's share of a microbatch one row."""
    rows = captured_rows(captured)
    blocks = len(repeated_blocks(captured.graph))
    if choice.axis != "auto":
        axis = choice.axis_index(mesh)
        ranks = mesh.shape[axis]
        if ranks < 2 or blocks < 2:
            raise AutoparError(f"no pipeline over axis {mesh.axis_names[axis]!r}: it has {ranks} rank(s) and the "
                               f"model {blocks} repeated block(s); a pipeline needs two of each")
        sub_mesh(mesh, axis)   # a mesh of one axis has none left for the stages: says so
        if choice.microbatches != "auto":
            microbatch_rows(rows, choice.microbatches)   # refuses a count that does not divide the batch
            return [(mesh, axis, [choice.microbatches])]
        return [(mesh, axis, microbatch_counts(rows, ranks))]
    degrees = [f for f in pipeline_degrees(mesh.shape[0], blocks) if f < mesh.shape[0] or mesh.ndim > 1]
    if not degrees:
        raise AutoparError(f"no pipeline degree divides the first axis of {mesh.describe()} into at most "
                           f"{blocks} stages and leaves an axis for the stages")
    layouts = []
    for f in degrees:
        shaped = split_first_axis(mesh, f)
        count = choice.microbatches if choice.microbatches != "auto" else \
            fewest_at_least(rows, max(rows * f / mesh.shape[0], f))
        layouts.append((shaped, 0, [count]))
    return layouts


def microbatch_counts(rows: int, ranks: int) -> list[int]:
    """The microbatch counts weighed for a ``rows``-row batch on ``ranks`` pipeline ranks: about 2
    and 8 per rank (each a divisor of the batch; at least one per rank), fewest first. More
    microbatches shrink the bubble, smaller ones run less efficient kernels."""
    return list(dict.fromkeys(c for c in (fewest_at_least(rows, 2 * ranks), fewest_at_least(rows, 8 * ranks))
                              if c >= ranks))


def pipeline_degrees(n: int, blocks: int) -> list[int]:
    """The pipeline degrees "auto" weighs over a first axis of ``n`` ranks for a model of
    ``blocks`` repeated blocks: the two largest divisors of ``n`` that cut the blocks evenly
    (any two, where none does); each degree weighed costs a stage plan, within the time limit.
    GPT-3 175B (96 blocks) on 128 x 8: 32 and 16 stages (Megatron ran 16)."""
    fits = [f for f in range(2, min(n, blocks) + 1) if n % f == 0]
    even = [f for f in fits if blocks % f == 0]
    return sorted(even or fits, reverse=True)[:2]


def schedule_timeline(plan: Plan) -> list[Interval]:
    """The pipeline schedule of ``plan`` played out again on its stages' recorded seconds per
    microbatch, for a Gantt chart (``Plan.to_html``): per computation (rank, kind, stage,
    microbatch, start, end). Activation sends are not recorded in the plan, so they take no time
    here, nor does a zero-bubble schedule's weight gradient run apart (empty without a pipeline)."""
    p = plan.pipeline
    if p is None:
        return []
    out: list[Interval] = []
    simulate(p.schedule, [StageCost(s.forward_s, s.backward_s) for s in p.stages], p.ranks, p.num_microbatches,
             timeline=out)
    return out

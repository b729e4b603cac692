"""Profile the machine at hand for one model and mesh (``autopar profile``), and calibrate the
cost model on whole training steps (``cost_models.profile.find_profile`` looks the result up).

One local gloo run measures everything, with every rank busy at once as in training (CPU ranks
share cores): each rank times the model's distinct local op calls (``profile_ops``; the slowest
rank's time is kept: ``missing_ops.time_on_every_rank``, which ``autopar.compile`` uses too for
the ops of its model a profile lacks), then the collectives per mesh axis and the runtime's
overheads (``profile_comm``). Ops already in the cached profile are not measured again.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.capture import CapturedGraph, as_args, capture
from autopar.core.mesh import MeshSpec, as_mesh_spec
from autopar.core.microbatch import microbatch_capture
from autopar.core.ops.base import TIMED_KERNELS
from autopar.core.plan import Plan
from autopar.core.precision import Precision
from autopar.core.strategies import Strategy, StrategySpace, all_replicated, build_space
from autopar.models.zoo import get_model
from autopar.planning.baselines import hand_plans
from autopar.planning.options import PlanOptions
from autopar.planning.planner import plan_captured, priced_workloads
from autopar.planning.problem import prepare
from autopar.profiling.launch import run_on_gloo_mesh
from autopar.profiling.measure import slowest_rank_steps, time_in_turns
from autopar.profiling.missing_ops import quiet, time_on_every_rank
from autopar.profiling.profile_comm import measure_mesh, print_progress, time_overlap
from codegen.module import ShardedModule
from cost_models.estimate import CostModel
from cost_models.profile import (
    OpTime,
    Profile,
    ProfileError,
    StaleProfileError,
    calibration_key,
    default_profile_path,
    local_fingerprint,
    missing_kinds,
)
from cost_models.profile_ops import OpCall, op_calls
from cost_models.schedule import StepPrediction, Timeline, parameter_saving, step_costs

Progress = Callable[[str], None]
log = logging.getLogger(__name__)


def profile_model(model: nn.Module, mesh: MeshSpec | tuple[int, ...], example_inputs: Any,
                  example_kwargs: dict | None = None, *, path: str | Path | None = None,
                  progress: Progress | None = print_progress, calibrate: bool = True, precision: Precision = "fp32",
                  options: PlanOptions | None = None) -> tuple[Profile, Path]:
    """Measure the ops ``model`` runs on ``mesh`` (every candidate strategy's local shapes; with
    ``options``, those of every graph and mesh a plan with them prices: its microbatches, its
    pipeline stages' sub-meshes, ``planner.priced_workloads``), the
    collectives of each mesh axis and the runtime overheads on a local gloo mesh; merge them into
    the cached profile for this host and mesh size and save it; the first time, calibrate how
    much slower ops run inside a step, and the first time on each mesh shape how much slower
    collectives do (``_calibrate``). ``precision``: the policy whose ops to time
    (``autopar.core.precision``). Returns (profile, file)."""
    spec = as_mesh_spec(mesh) if not isinstance(mesh, tuple) else MeshSpec(mesh, hardware="cpu")
    say = progress or (lambda line: None)
    t0 = time.perf_counter()
    args = as_args(example_inputs)
    captured = capture(model, args, example_kwargs, precision=precision)
    workloads = [(captured, spec)] if options is None else \
        priced_workloads(captured, spec, options, microbatch_capture(model, args, example_kwargs, precision))
    spaces = [build_space(graph, on) for graph, on in workloads]
    fingerprint = local_fingerprint(spec)
    path = Path(path) if path is not None else default_profile_path(fingerprint)
    profile = _measure(spec, path, spaces, progress, captured_s=time.perf_counter() - t0)
    if calibrate and fingerprint["device"] == "cuda":   # every factor stays 1
        say("not calibrated: on a GPU an op's kernels in a step take their time alone, and the calibration "
            "workloads train on the CPU (gloo)")
    elif calibrate and _uncalibrated(profile, spec):
        factors = _calibrate(spec, path, say, profile.calibration)
        profile = Profile.from_json(path)   # now with the calibration workloads' ops too
        profile.calibration.update(factors)
        profile.to_json(path)
    return profile, path


#: A measuring launch may take this long, and this long more per op call it times: a model's
#: few hundred calls take a few minutes on shared cores (gpt2-125m's 367 on 4 processes sharing
#: 2: 250 s), before the collectives and overheads.
MEASURE_TIMEOUT_S = 300.0
OP_CALL_TIMEOUT_S = 3.0
#: The calibration launch's limit grows by this for each plan it times: 29 plans on a 2x2 mesh of
#: this 2-core host took 459 s, past a fixed 300 s limit (RESULTS.md).
CALIBRATION_PLAN_TIMEOUT_S = 45.0


def _measure(spec: MeshSpec, path: Path, spaces: Sequence[StrategySpace], progress: Progress | None, *,
             captured_s: float, comm: bool = True) -> Profile:
    """Time, in one local gloo launch, the op calls of ``spaces`` that the profile at ``path``
    lacks, and (``comm``) the collectives and runtime overheads it lacks; merge them in, save and
    return the profile. One launch for every workload: each costs seconds of process start."""
    say = progress or (lambda line: None)
    fingerprint = local_fingerprint(spec)
    try:
        profile = Profile.from_json(path) if path.exists() else Profile(fingerprint)
    except StaleProfileError as e:   # measured by another autopar: nothing in it can be trusted
        say(f"{e}; measuring afresh")
        profile = Profile(fingerprint)
    if profile.fingerprint != fingerprint:
        raise ProfileError(f"{path} holds a profile of other hardware; pass another path")
    calls = list({c.key: c for space in spaces for c in op_calls(space, space.mesh.shape)
                  if c.key not in profile.ops}.values())
    # The runtime overheads and the overlap are measured once per profile, and the collectives
    # once per kind and group size: calibration fits its factors against those numbers, and on
    # shared cores a second measurement can differ by half.
    need_overheads = comm and not profile.overheads
    kinds = missing_kinds(profile, spec.shape) if comm else ()
    say(f"{len(calls)} op calls to time ({len(profile.ops)} cached), "
        f"{'collectives (' + ', '.join(kinds) + ')' if kinds else 'collectives cached'}"
        f"{' and overheads' if need_overheads else ''}; captured in {captured_s:.1f} s")
    if fingerprint["device"] == "cuda":   # gloo on CPU tensors says nothing of NCCL: keep the presets' links
        kinds, need_overheads = (), False
    if not calls and not kinds and not need_overheads:
        return profile
    t1 = time.perf_counter()
    portable = [(_op_name(c.target), c.args, c.kwargs) for c in calls]   # op overloads do not pickle
    ops, links, overheads, overlap = run_on_gloo_mesh(_worker, spec.shape, portable, kinds, need_overheads,
                                                      fingerprint, progress, axis_names=spec.axis_names,
                                                      start_method="forkserver",
                                                      timeout_s=MEASURE_TIMEOUT_S + OP_CALL_TIMEOUT_S * len(calls))[0]
    profile.merge(Profile(fingerprint, ops, links, overheads, calibration=overlap))
    profile.to_json(path)
    say(f"measured in {time.perf_counter() - t1:.1f} s; saved {path}")
    return profile


#: Calibration workloads: two zoo models at sizes the cost-accuracy benchmark does not run (it
#: runs gpt-tiny at its own sizes, and reports the models not calibrated on apart), with different
#: mixes of ops (GPT's fused attention projection, BERT's padding, token types and MLM head), each
#: at sizes from one where the runtime's per-call costs dominate to one where the ops do. One
#: model alone lets its own quirks and the host's drift during its few steps set the factors.
CALIBRATION = (("gpt-tiny", ((4, 16), (12, 48), (24, 64))), ("bert-tiny", ((4, 16), (12, 48), (24, 64))))
#: And on a mesh of several devices, for the collectives' factors only: a heavier workload, a
#: tenth of a second of compute a step, tens of milliseconds between its tensor-parallel plan's
#: collectives, as in real models, whose blocking collectives cost more in a step than the tiny
#: workloads' do (larger, colder buffers, moved while ranks share cores): fitted on the tiny
#: ones alone (1.04 on 4 processes), the factor priced gpt-tiny at 256 x 64's
#: 'tp' step 22% low and gpt2-125m's 25% low, and the planner chose that plan for gpt2-125m,
#: measured 1.16x 'ddp'.
COLLECTIVE_CALIBRATION = (("gpt-tiny", ((256, 64),)),)
#: And for the experts' dispatch and combine (``Collective.in_step``): a mixture of experts written
#: by hand (not the transformers models cost_accuracy checks the factor on), split by expert over
#: the mesh's last axis. Those all-to-alls follow whole blocks of compute, after which ranks
#: arrive further apart than at a tensor-parallel step's collectives: priced at the factor fitted
#: there, every expert-parallel step cost_accuracy ran was under-predicted (benchmarks/RESULTS.md).
EXPERT_CALIBRATION = (("autopar.models.moe:build", ((16, 64), (32, 64))),)
CALIBRATION_STEPS = 6
#: Each plan is timed in this many rounds, taking turns with the others; the median of all its
#: steps counts.
CALIBRATION_ROUNDS = 5


def _calibration_plan(hand: str) -> bool:
    """The hand plans timed for the collectives' factors: DDP (gradient sync) and Megatron tensor
    parallel, alone or beside data parallel (blocking collectives)."""
    return hand == "ddp" or ("tp" in hand and "sp" not in hand and "fsdp" not in hand)


@dataclass(frozen=True)
class _Row:
    """One calibration plan at one size: its measured step and its predicted parts, in seconds."""
    label: str        # workload, size and plan, for progress lines
    plan: str         # "replicated", or the hand plan's name
    measured: float
    ops: float        # the ops calibration scales (CostModel.calibrated), alone (the profile's timings)
    overheads: float  # the runtime's per-call costs (micro-benchmarks): per op, per parameter, per step
    comm: float       # blocking collectives (the profile's links, in lockstep)
    sync: float       # the exposed gradient synchronisation's fixed cost (its buckets' latency)
    rest: float       # the other predicted parts (its bytes at the links' bandwidth, optimizer memory traffic,
                      # ops the profile lacks), not fitted
    experts: float = 0.0   # the experts' dispatch and combine (the profile's links, in lockstep); not in ``comm``

    @property
    def unfitted(self) -> float:
        return self.measured - self.rest


def _uncalibrated(profile: Profile, spec: MeshSpec) -> bool:
    """Whether ``profile`` lacks in-step factors ``spec`` needs: ops and overheads (per process
    count, like the profile), collectives (per mesh shape)."""
    return "ops" not in profile.calibration or (
        spec.size > 1 and calibration_key("comm", spec.shape) not in profile.calibration)


def _calibrate(spec: MeshSpec, path: Path, say: Progress, known: dict[str, float]) -> dict[str, float]:
    """In-step factors for what the profile measures alone, from whole training steps of the
    calibration workloads (``_calibration_rows``), fitted by least squares in stages:

    * every op replicated (no communication): ``measured = a * ops_alone + b * overheads + rest``
      (``ops_alone``: the ops that fit in cache, ``CostModel.calibrated``; the others are in ``rest``),
      where the overheads are all the runtime's micro-benchmarked costs, per op, per parameter and
      per step: measured with every rank at it at once, they are inflated alike where ranks
      outnumber cores (left out of the fit, the per-parameter ones pushed ``b`` to its clamp);
      skipped where ``known`` has them (fitted on another mesh of as many processes);
    * on a mesh of several devices, the calibration models' data- and tensor-parallel hand plans
      (and ``COLLECTIVE_CALIBRATION``'s, a heavier workload's):
      what ``a`` and ``b`` leave, ``c * blocking comm + d * gradient buckets' latency``, for this
      mesh shape. Collectives in a step cost more than alone in lockstep: ranks reach them apart,
      and CPU ranks share their cores with the compute of others. A gradient bucket's bytes are
      not scaled: the calibration models' buckets are nearly all latency, and a factor on their
      whole time priced a large model's bandwidth-bound ones several times too high (gpt2-125m
      on 4 gloo processes: 'ddp' predicted 9.3 s a step, measured 6.5 s);
    * then, on the plans of ``EXPERT_CALIBRATION`` (experts split by expert), what all the above
      leave, ``e * the experts' all-to-alls``: their own factor (``Collective.in_step``).

    Not run on a GPU host (``profile_model``): the calibration steps would run on its CPU."""
    replicated = "ops" not in known
    several = spec.size > 1
    rows = _calibration_rows(spec, path, CALIBRATION, replicated, COLLECTIVE_CALIBRATION if several else (),
                             EXPERT_CALIBRATION if several else ())
    for r in rows:
        say(f"calibration {r.label}: step {r.measured * 1e3:.1f} ms; ops in cache alone {r.ops * 1e3:.1f}, runtime overheads "
            f"{r.overheads * 1e3:.1f}, blocking comm {r.comm * 1e3:.1f}, gradient sync {r.sync * 1e3:.1f}, "
            f"other {r.rest * 1e3:.1f} ms")
    if replicated:
        a, b = _fit([r for r in rows if r.plan == "replicated"], lambda r: (r.ops, r.overheads),
                    lambda r: r.unfitted)
        say(f"calibrated: ops that fit in cache run {a:.2f}x their time alone, runtime overheads {b:.2f}x their micro-benchmarks")
    else:
        a, b = known["ops"], known["overheads"]
    factors = {"ops": a, "overheads": b}
    talking = [r for r in rows if (r.comm or r.sync) and not r.experts]
    c, d = 1.0, 1.0
    if talking:
        c, d = _fit(talking, lambda r: (r.comm, r.sync), lambda r: r.unfitted - a * r.ops - b * r.overheads)
        factors.update({calibration_key("comm", spec.shape): c, calibration_key("sync", spec.shape): d})
        say(f"calibrated on {spec.describe()}: blocking collectives take {c:.2f}x their lockstep timings, a "
            f"gradient bucket's latency {d:.2f}x")
    routed = [r for r in rows if r.experts]
    if routed:
        e, _ = _fit(routed, lambda r: (r.experts, 0.0),
                    lambda r: r.unfitted - a * r.ops - b * r.overheads - c * r.comm - d * r.sync)
        factors[calibration_key("experts", spec.shape)] = e
        say(f"calibrated on {spec.describe()}: the experts' all-to-alls take {e:.2f}x their lockstep timings")
    return factors


def _fit(rows: Sequence[_Row], x: Callable[[_Row], tuple[float, float]], y: Callable[[_Row], float]
         ) -> tuple[float, float]:
    """Least-squares factors of ``y ~ f1 * x1 + f2 * x2`` in error relative to each row's measured
    step (what cost_accuracy scores), each kept within [0.5, 4] (a factor out there is noise, not
    the machine); a column that is all zeros keeps factor 1. In absolute seconds the
    tensor-parallel rows (60-490 ms on 4 processes) outweighed the data-parallel ones (12-30 ms)
    that most plans are: fitted on 2x2, the buckets' latency factor came out 0.53 where those
    rows alone ask about 1.5, and cost_accuracy's 'ddp' plans there were priced 25-38% low."""
    weight = np.array([1.0 / r.measured if r.measured > 0 else 1.0 for r in rows])
    X, Y = np.array([x(r) for r in rows]) * weight[:, None], np.array([y(r) for r in rows]) * weight
    used = np.abs(X).sum(axis=0) > 0
    factors = np.ones(2)
    if used.any():
        factors[used] = np.linalg.lstsq(X[:, used], Y, rcond=None)[0]
    return tuple(float(min(max(f, 0.5), 4.0)) for f in factors)   # type: ignore[return-value]


Workloads = Sequence[tuple[str, Sequence[tuple[int, int]]]]


def _calibration_rows(spec: MeshSpec, path: Path, workloads: Workloads, replicated: bool,
                      collective_workloads: Workloads = (), expert_workloads: Workloads = ()) -> list[_Row]:
    """Each workload (model, sizes) at each size: every op replicated (if ``replicated``), and on
    several devices the calibration hand plans (of ``collective_workloads`` those alone; of
    ``expert_workloads`` 'ddp' with the experts split by expert over the last axis), each
    planned with the profile's uncalibrated numbers; all of them timed in one launch on this
    mesh, taking turns (``_calibration_worker``)."""
    t0 = time.perf_counter()
    routed = set(_sized(expert_workloads))
    hands_only = (set(_sized(collective_workloads)) | routed) - set(_sized(workloads))
    sized = _sized(workloads) + sorted(hands_only)
    with quiet("autopar.core.strategies"):   # the calibration models' ops without rules are not the user's concern
        captured = {w: capture(*_calibration_model(*w)) for w in sized}
        spaces = {w: build_space(c, spec) for w, c in captured.items()}
        _measure(spec, path, list(spaces.values()), None, captured_s=time.perf_counter() - t0, comm=False)
        profile = Profile.from_json(path)
        # the factors are fitted against the ops' and overheads' own numbers: none applied yet
        profile = replace(profile, calibration={k: v for k, v in profile.calibration.items() if k == "overlap"})
        plans = {}   # (model, batch, seq, plan name) -> (plan, its cost model, space, chosen strategies)
        for w, c in captured.items():
            plans.update(_calibration_plans(spec, profile, w, c, spaces[w], replicated and w not in hands_only,
                                            experts=w in routed))
    measured = run_on_gloo_mesh(_calibration_worker, spec.shape, [(key, p[0].to_json()) for key, p in plans.items()],
                                axis_names=spec.axis_names, start_method="forkserver",
                                timeout_s=MEASURE_TIMEOUT_S + CALIBRATION_PLAN_TIMEOUT_S * len(plans))
    return [_row(key, *planned, statistics.median(slowest_rank_steps([m[key] for m in measured])),
                 experts=key[:3] in routed) for key, planned in plans.items()]


def _row(key: tuple[str, int, int, str], plan: Plan, cost: CostModel, space: StrategySpace,
         chosen: Sequence[Strategy], typical: float, experts: bool) -> _Row:
    """A timed calibration plan's row: its typical step and its predicted parts (``experts``: its
    experts' all-to-alls apart from the other blocking collectives)."""
    name, batch, seq, hand = key
    # the ops the factor scales (CostModel.calibrated); the others are in ``rest``
    scaled = [(nc, s) for nc, s in zip(space.nodes, chosen, strict=True) if nc.kind == "op" and cost.calibrated(nc, s)]
    alone = sum(t.total_s for t in (cost.measured_time(nc, s) for nc, s in scaled) if t is not None)
    params = sum(nc.kind == "param" for nc in space.nodes) * (
        cost.param_overhead() - parameter_saving(space, chosen, cost.plain_saving()))
    overhead = _moves_overhead(cost, space, chosen) + params + cost.step_overhead()
    p = plan.predicted
    latency = p.exposed_comm_s - _exposed_without_latency(cost, space, chosen)
    routed = _experts_comm(cost, space, chosen) if experts else 0.0
    return _Row(f"{name} {batch}x{seq} {hand}", hand, typical, alone, overhead, p.comm_s - routed, latency,
                p.step_time_s - alone - overhead - p.comm_s - latency, routed)


def _sized(workloads: Workloads) -> list[tuple[str, int, int]]:
    return [(name, batch, seq) for name, sizes in workloads for batch, seq in sizes]


def _simulated(cost: CostModel, space: StrategySpace, chosen: Sequence[Strategy], factor: str, value: float
               ) -> StepPrediction:
    """A plan's step priced with the in-step ``factor`` of this mesh shape set to ``value``."""
    priced = replace(cost, profile=replace(cost.profile, calibration={
        **cost.profile.calibration, calibration_key(factor, cost.mesh.shape): value}))
    costs, queued = step_costs(space, priced, chosen)
    timeline = Timeline(space, overlap_efficiency=priced.overlap_efficiency, block_of=priced.block_of)
    return timeline.simulate(costs, queued, priced.step_overhead())


def _exposed_without_latency(cost: CostModel, space: StrategySpace, chosen: Sequence[Strategy]) -> float:
    """A plan's exposed gradient synchronisation were its buckets' latency free: what of it the
    sync factor does not scale."""
    return _simulated(cost, space, chosen, "sync", 0.0).exposed_s


def _experts_comm(cost: CostModel, space: StrategySpace, chosen: Sequence[Strategy]) -> float:
    """The experts' dispatch and combine in a plan's blocking communication, at their lockstep
    timings: what the experts factor scales (none in a plan without experts split by expert)."""
    return _simulated(cost, space, chosen, "experts", 1.0).comm_s - _simulated(cost, space, chosen, "experts", 0.0).comm_s


def _moves_overhead(cost: CostModel, space: StrategySpace, chosen: Sequence[Strategy]) -> float:
    """The wrapping cost of every placement change and wrapped parameter read a plan's generated
    code makes (``CostModel.move_overhead``)."""
    strategy = {nc.node: s for nc, s in zip(space.nodes, chosen, strict=True)}
    return sum(cost.move_overhead(space.nodes[space.index[src]], strategy[src], nc, s, i)
               for nc, s in zip(space.nodes, chosen, strict=True) if nc.kind == "op"
               for i, src in enumerate(nc.inputs) if src in strategy)


def _calibration_model(name: str, batch: int, seq: int) -> tuple[nn.Module, tuple, dict]:
    """A calibration workload's model (built afresh: zoo models build deterministically) and batch."""
    entry = get_model(name)
    return (entry.build(), *entry.example(batch, seq))


def _calibration_plans(spec: MeshSpec, profile: Profile, workload: tuple[str, int, int], captured: CapturedGraph,
                       space: StrategySpace, replicated: bool, experts: bool = False
                       ) -> dict[tuple[str, int, int, str], tuple[Plan, CostModel, StrategySpace, list[Strategy]]]:
    """One workload (model, batch, seq), captured, with its strategy space: the replicated plan (if
    ``replicated``) and on several devices the calibration hand plans (``experts``: 'ddp' alone,
    its experts split by expert over the mesh's last axis), each with its cost model, space and
    strategies."""
    plans = {}
    if replicated:
        chosen = [next(s for s in nc.strategies if all_replicated(s)) for nc in space.nodes]   # every node has one
        forced = {nc.node.name: s for nc, s in zip(space.nodes, chosen, strict=True) if nc.kind != "alias"}
        plans[workload + ("replicated",)] = (
            plan_captured(captured, spec, PlanOptions(profile=profile, hand_plans=False), forced=forced),
            CostModel(spec, space, profile=profile), space, chosen)
    if spec.size > 1:
        routed = {"expert_parallel": {"axis": spec.axis_names[-1]}} if experts else {}
        planning = prepare(captured, spec, PlanOptions(profile=profile, **routed))  # type: ignore[arg-type]
        for hand, (plan, choices) in hand_plans(planning).items():  # type: ignore[misc]  # cost_unfit (the default): every value is a (plan, choices) pair
            if hand == "ddp" if experts else _calibration_plan(hand):
                chosen = [nc.strategies[k] for nc, k in zip(planning.space.nodes, planning.grouping.strategies(choices), strict=True)]
                plans[workload + (hand,)] = (plan, planning.model, planning.space, chosen)
    return plans


def _calibration_worker(mesh: DeviceMesh, plans: list[tuple[tuple[str, int, int, str], str]]
                        ) -> dict[tuple[str, int, int, str], list[float]]:
    """Seconds of each timed training step (AdamW) of each calibration (model, batch, seq, plan)
    on this rank, ``CALIBRATION_STEPS`` at a time in ``CALIBRATION_ROUNDS`` rounds
    taking turns with all the others. Turns spread each plan's steps over the whole run: the
    host's slow and fast spells last seconds, and the median of steps spread over them is the
    typical step, the figure the cost model predicts."""
    runs = {}
    for key, plan_json in plans:
        model, args, kwargs = _calibration_model(*key[:3])
        sharded = ShardedModule(model, mesh, Plan.from_json(plan_json), capture(model, args, kwargs))
        runs[key] = (sharded, torch.optim.AdamW(sharded.parameters()), (args, kwargs))
    rounds = time_in_turns(runs, rounds=CALIBRATION_ROUNDS, warmup=1, steps=CALIBRATION_STEPS)
    return {key: [s for steps in per_round for s in steps] for key, per_round in rounds.items()}


def _op_name(target: Any) -> str:
    name = str(target)
    if _op(name) is not target:
        raise ProfileError(f"cannot profile {target!r}: not an ATen operator")
    return name


def _op(name: str) -> Any:
    if name in TIMED_KERNELS:   # a kernel an op is timed as (``autopar.core.ops.base.TimedKernel``)
        return TIMED_KERNELS[name]
    op: Any = torch.ops
    for part in name.split("."):
        op = getattr(op, part)
    return op


def _worker(mesh: DeviceMesh, portable: list[tuple[str, tuple, dict]], kinds: tuple[str, ...], need_overheads: bool,
            fingerprint: dict[str, Any], progress: Progress | None) -> tuple[dict[str, OpTime], dict, dict, dict]:
    say = progress if dist.get_rank() == 0 else None
    calls = [OpCall(_op(name), args, kwargs) for name, args, kwargs in portable]
    slowest = time_on_every_rank(calls, fingerprint, say)
    if not kinds and not need_overheads:
        return slowest, {}, {}, {}
    links, overheads = measure_mesh(mesh, progress=progress, overheads=need_overheads, kinds=kinds)
    overlap = {"overlap": time_overlap(mesh)} if need_overheads and any(n > 1 for n in mesh.shape) else {}
    if say is not None and overlap:
        say(f"overlap: {100 * overlap['overlap']:.0f}% of an asynchronous all-reduce runs under compute")
    return slowest, links, overheads, overlap

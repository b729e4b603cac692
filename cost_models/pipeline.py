"""A pipeline schedule's step, simulated from the order PyTorch itself runs it in.

Every schedule of ``torch.distributed.pipelining`` computes, when it is built, the list of
actions each pipeline rank runs (``pipeline_order``: forward ``F``, full backward ``B``, or the
zero-bubble split into input-gradient ``I`` and weight-gradient ``W`` backwards, per stage and
microbatch). ``schedule_actions`` builds a schedule on stand-ins for its stages (no process group,
no model) to read that order, so the costs follow the schedules as PyTorch runs them, including
the ones added later, rather than a formula per schedule. The two single-stage schedules (GPipe,
1F1B) run their own loop instead: their order is written here as that loop runs it.

``simulate`` plays the order out: each rank runs its actions one after another, an action starts
when its rank is free and what it needs is done (a forward, the stage before's forward of the same
microbatch; a backward, its own forward and the next stage's backward), plus the point-to-point
send between ranks. It returns the step's time, each rank's idle share (the bubble), and each
rank's peak of activations in flight: a microbatch's activations on a stage live from its forward
to the end of its backward (its weight-gradient part, under zero-bubble schedules).

``balanced_stages`` cuts a model's repeated blocks into contiguous stages whose slowest is as
fast as it can be, the embedding on the first stage and the head on the last (the DP over layer
ranges Alpa's stage search is built on).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules

from autopar.core.errors import AutoparError
from autopar.core.plan import V_SHAPED

#: The schedules of ``torch.distributed.pipelining`` a plan may use, by class name.
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")

_F = torch_schedules.FORWARD
_B = torch_schedules.FULL_BACKWARD
_I = torch_schedules.BACKWARD_INPUT
_W = torch_schedules.BACKWARD_WEIGHT
_FB = torch_schedules.OVERLAP_F_B


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage, per microbatch: forward and backward seconds (``weight_s`` of the
    backward computes the weights' gradients, which zero-bubble schedules run apart) and the bytes
    of activations its forward keeps for its backward."""

    forward_s: float
    backward_s: float
    weight_s: float = 0.0
    activation_bytes: float = 0.0


#: One computation as ``simulate`` ran it: (rank, kind "F", "B", "I" or "W", stage, microbatch, start s, end s).
Interval = tuple[int, str, int, int, float, float]


@dataclass(frozen=True)
class PipelineStep:
    """A simulated step: ``step_s`` from the first forward to the last backward; per rank, its
    share of the step spent idle (``bubble``) and its peak activation bytes and microbatches in
    flight (summed over the stages it holds)."""

    step_s: float
    bubble: tuple[float, ...]
    peak_activation_bytes: tuple[float, ...]
    peak_in_flight: tuple[int, ...]

    @property
    def bubble_fraction(self) -> float:
        """The idle share of the busiest rank's step (the schedule's bubble, as papers quote it)."""
        return min(self.bubble)


@dataclass
class _Stage:
    """What a schedule reads (and writes) of a ``PipelineStage`` to decide its order."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: Any = None   # no module: nothing for the zero-bubble schedules' compile check to look at

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def stages_per_rank(schedule: str, virtual: int = 1) -> int:
    """Stages each rank holds: 1 for single-stage schedules, 2 for V-shaped ones, ``virtual`` for
    the interleaved and looped ones."""
    cls = _schedule_class(schedule)
    if schedule in V_SHAPED:
        return 2
    return virtual if issubclass(cls, torch_schedules.PipelineScheduleMulti) else 1


def schedule_actions(schedule: str, ranks: int, microbatches: int, virtual: int = 1) -> dict[int, list[Any]]:
    """Each rank's actions, in order, as ``schedule`` (a class name of ``SCHEDULES``) runs
    ``microbatches`` over ``ranks`` pipeline ranks holding ``stages_per_rank`` stages each."""
    cls = _schedule_class(schedule)
    per_rank = stages_per_rank(schedule, virtual)
    total = ranks * per_rank
    try:
        if not issubclass(cls, torch_schedules.PipelineScheduleMulti):
            cls(_Stage(0, total, ranks), microbatches)   # its own checks
            return {r: _single_stage_order(schedule, r, ranks, microbatches) for r in range(ranks)}
        held = [0, total - 1] if schedule in V_SHAPED else list(range(0, total, ranks))
        return cls([_Stage(s, total, ranks) for s in held], microbatches).pipeline_order
    except (ValueError, RuntimeError, AssertionError) as e:
        raise AutoparError(f"{schedule} cannot run {microbatches} microbatches on {ranks} ranks with {per_rank} "
                           f"stage(s) each: {e}") from None


def _single_stage_order(schedule: str, rank: int, ranks: int, microbatches: int) -> list[Any]:
    """The order a single-stage schedule's ``_step_microbatches`` runs on ``rank``: GPipe every
    forward, then every backward; 1F1B ``ranks - rank`` forwards, then a backward and a forward in
    turn, then the backwards left. (Their ``_get_pipeline_order``, a description for tools, is not
    what runs: in torch 2.13 1F1B's misnumbers the last rank's forwards.)"""
    forwards = [torch_schedules._Action(rank, _F, mb) for mb in range(microbatches)]
    backwards = [torch_schedules._Action(rank, _B, mb) for mb in range(microbatches)]
    if schedule == "ScheduleGPipe":
        return forwards + backwards
    warmup = min(microbatches, ranks - rank)
    order = forwards[:warmup]
    for mb in range(microbatches - warmup):
        order += [backwards[mb], forwards[warmup + mb]]
    return order + backwards[microbatches - warmup:]


def simulate(schedule: str, stages: Sequence[StageCost], ranks: int, microbatches: int,
             send_s: Sequence[float] | float = 0.0, timeline: list[Interval] | None = None) -> PipelineStep:
    """Play ``schedule`` out over ``stages`` (in pipeline order; ``ranks`` x ``stages_per_rank``
    of them) for ``microbatches``. ``send_s``: seconds to send one microbatch's activation (or its
    gradient) across each stage boundary, where the two stages sit on different ranks. ``timeline``:
    a list each computation is appended to, as it runs (a Gantt chart's bars)."""
    per_rank = len(stages) // ranks
    if per_rank * ranks != len(stages) or per_rank != stages_per_rank(schedule, per_rank):
        raise AutoparError(f"{schedule} on {ranks} ranks runs {ranks * stages_per_rank(schedule, max(per_rank, 1))} "
                           f"stages, got {len(stages)}")
    boundary = list(send_s) if isinstance(send_s, Sequence) else [float(send_s)] * (len(stages) - 1)
    if len(boundary) != len(stages) - 1:
        raise AutoparError(f"send_s gives {len(boundary)} boundaries, the pipeline has {len(stages) - 1}")
    order = {r: [a for a in actions if a is not None] for r, actions in
             schedule_actions(schedule, ranks, microbatches, per_rank).items()}
    rank_of = {a.stage_index: r for r, actions in order.items() for a in _computations(actions)}
    done: dict[tuple[str, int, int], float] = {}   # (kind, stage, microbatch) -> finish time
    free = [0.0] * ranks
    busy = [0.0] * ranks
    events: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]   # per rank: (time, activation change)
    position = [0] * ranks
    while any(position[r] < len(order[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while position[r] < len(order[r]):
                parts = _computations([order[r][position[r]]])
                ready = [_ready(a, done, stages, rank_of, boundary) for a in parts]
                if any(t is None for t in ready):
                    break
                start = max([free[r], *ready])
                for a in parts:   # an overlapped forward-backward pair runs as its two halves in turn
                    cost = stages[a.stage_index]
                    took = {_F: cost.forward_s, _B: cost.backward_s, _I: cost.backward_s - cost.weight_s,
                            _W: cost.weight_s}[a.computation_type]
                    done[(a.computation_type.value, a.stage_index, a.microbatch_index)] = start + took
                    if a.computation_type == _F:
                        events[r].append((start, cost.activation_bytes))
                    elif a.computation_type == _B or a.computation_type == _W:
                        events[r].append((start + took, -cost.activation_bytes))
                    busy[r] += took
                    if timeline is not None:
                        timeline.append((r, a.computation_type.value, a.stage_index, a.microbatch_index, start, start + took))
                    start += took
                free[r] = start
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(order[r][position[r]]) for r in range(ranks) if position[r] < len(order[r])}
            raise AutoparError(f"{schedule}: the actions {stuck} wait on each other (a schedule PyTorch would deadlock on)")
    step = max(free)
    peaks, counts = [], []
    for r in range(ranks):
        live = count = peak = top = 0.0
        for _, change in sorted(events[r], key=lambda e: (e[0], e[1])):   # frees before allocations at one instant
            live += change
            count += 1 if change > 0 else -1
            peak, top = max(peak, live), max(top, count)
        peaks.append(peak)
        counts.append(int(top))
    return PipelineStep(step, tuple(1.0 - b / step if step else 0.0 for b in busy), tuple(peaks), tuple(counts))


def _schedule_class(schedule: str) -> type:
    if schedule not in SCHEDULES or not hasattr(torch_schedules, schedule):
        raise AutoparError(f"unknown pipeline schedule {schedule!r}; the schedules are {', '.join(SCHEDULES)}")
    return getattr(torch_schedules, schedule)


def _computations(actions: Sequence[Any]) -> list[Any]:
    """The forward and backward actions among ``actions`` (an overlapped pair as its two halves)."""
    out = []
    for a in actions:
        if a.computation_type == _FB:
            out.extend(a.sub_actions)
        elif a.computation_type in (_F, _B, _I, _W):
            out.append(a)
    return out


def _ready(a: Any, done: dict[tuple[str, int, int], float], stages: Sequence[StageCost],
           rank_of: dict[int, int], boundary: Sequence[float]) -> float | None:
    """When action ``a`` may start (what it needs done, sent where it crosses ranks), or None
    while something it needs has not run."""
    s, mb, kind = a.stage_index, a.microbatch_index, a.computation_type
    needs: list[tuple[tuple[str, int, int], float]] = []
    if kind == _F:
        if s > 0:
            needs.append((("F", s - 1, mb), boundary[s - 1] if rank_of[s - 1] != rank_of[s] else 0.0))
    elif kind == _W:
        needs.append((("I", s, mb), 0.0))
    else:   # a backward of the input's gradient (full or not): its forward, the next stage's backward
        needs.append((("F", s, mb), 0.0))
        if s + 1 < len(stages):
            later = next((k for k in ("B", "I") if (k, s + 1, mb) in done), "I")
            needs.append(((later, s + 1, mb), boundary[s] if rank_of[s + 1] != rank_of[s] else 0.0))
    times = []
    for key, send in needs:
        if key not in done:
            return None
        times.append(done[key] + send)
    return max(times, default=0.0)


def balanced_stages(blocks: Sequence[float], stages: int, first: float = 0.0, last: float = 0.0) -> list[range]:
    """Cut ``blocks`` (each repeated block's time, in order) into ``stages`` contiguous runs, one
    per pipeline stage, that make the slowest stage as fast as it can be: the first stage also
    runs what comes before the blocks (``first``: the embedding), the last what comes after
    (``last``: the head and the loss). A pipeline runs at its slowest stage's pace."""
    n = len(blocks)
    if not 1 <= stages <= n:
        raise AutoparError(f"{n} repeated blocks cannot make {stages} pipeline stages of at least one block each")
    before = [0.0]
    for t in blocks:
        before.append(before[-1] + t)

    def cost(i: int, j: int, stage: int) -> float:   # blocks i..j-1 as stage ``stage``
        return before[j] - before[i] + (first if stage == 0 else 0.0) + (last if stage == stages - 1 else 0.0)

    # best[s][j]: the slowest stage of the best cut of blocks 0..j-1 into stages 0..s; cut[s][j]: where stage s starts
    best = [[float("inf")] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                slowest = max(best[s - 1][i], cost(i, j, s))
                if slowest < best[s][j]:
                    best[s][j], cut[s][j] = slowest, i
    bounds, j = [n], n
    for s in range(stages - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]

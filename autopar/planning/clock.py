"""One planning call's time limit (``PlanOptions.time_limit``), kept by one object.

``Clock`` starts when ``autopar.plan`` is called and travels through every stage of the call:
the capture, the microbatch recaptures, the hand plans, the pipeline layouts, every solve and its
memory repairs. The search decides on its own time, ``spent``: by default the wall clock's; where
``deterministic``, the seconds each piece of work is charged from its size
(``autopar.planning.work``), so that what the search tries, and so its plan, is the same on every
run of the same call. The wall clock is always the hard stop: where it reaches the limit first (a
slow or loaded host), nothing more begins, and the plan says that it may differ from run to run.
``timings`` are wall seconds per stage (they add up to the call's wall time, what no stage claimed
as "other"); ``cut_short`` says what the limit left out. ``Deadline`` is a point on the search's
time: the whole search's, or a share of it (a hand plan's, a pipeline layout's) that never reaches
past its parent's.

Work that cannot be stopped once begun (a capture, an ILP build, a pipeline schedule's
simulation) is only begun where the deadline ``affords`` it, judged by what the last of its kind
was charged (``Clock.estimate``) or, for an ILP build, by its strategies, and where the wall
clock affords it too, at the host's pace for that kind of work (``Clock.pace``); a capture
running at the hard stop is stopped from inside (``Clock.stops_capture``); a solve is bounded by
branch-and-bound nodes (``work.node_limit``) and by the wall clock's hard stop.

The clock is also what the call tells the user while it runs: ``Clock.shown`` draws a status line
(``autopar.core.progress``) for the call, each stage and each ``doing`` says what it does on it
(and, with ``autopar -v``, in the log with its seconds).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from autopar.core import progress
from autopar.core.errors import PlanningTimeout
from autopar.planning import work

#: Share of the time limit kept after the search's deadline for what runs past it: turning the
#: last solve into a plan (0.2-0.7 s on GPT-3 175B) and work begun on an estimate that ran long.
#: The call must end within 5% past the limit.
RESERVE = 0.06
#: What ``cut_short`` says where the wall clock stopped the search before its charged time did.
HARD_STOP = "the search itself: the wall clock reached the time limit first (a slow or loaded host; another run may give another plan)"
#: The least time a solve gets where its own share of the deadline has passed (enough to return
#: the polished hint and let the solver try to beat it), granted only while the whole search's
#: deadline has not passed: past it, no solve begins.
MIN_SOLVE_S = 0.25
#: What each stage of ``Clock.stage`` (and of a planning problem, ``problem._stage``) does, as the
#: status line and the log say it.
STAGES = {"capture": "capturing the model (torch.export)", "strategies": "listing the strategies",
          "costs": "pricing the strategies", "ilp": "building the ILP", "hand plans": "costing the hand plan",
          "solve": "solving the plan", "pipeline schedules": "simulating the pipeline schedule"}


@dataclass
class Clock:
    """The time of one planning call: its start and limit (None: no limit), seconds per stage,
    the last duration of each kind of work that cannot be stopped, and what time cut short."""

    limit: float | None
    start: float | None = None
    now: Callable[[], float] = time.perf_counter
    deterministic: bool = False                                  # the search's time is ``charged``, else the wall's
    timings: dict[str, float] = field(default_factory=dict)      # wall seconds per stage
    took: dict[str, float] = field(default_factory=dict)         # the last charge of each kind of work
    charged: float = 0.0                                         # seconds charged by size
    paces: dict[str, tuple[float, float]] = field(default_factory=dict)   # wall and charged seconds per kind
    cut_short: list[str] = field(default_factory=list)
    line: progress.StatusLine | None = None   # the call's status line, while ``shown``

    def __post_init__(self) -> None:
        if self.start is None:
            self.start = self.now()

    @property
    def end(self) -> float:
        """The search's deadline on its time (``spent``): the limit less ``RESERVE`` (inf without one)."""
        return math.inf if self.limit is None else (1 - RESERVE) * self.limit

    def deadline(self) -> Deadline:
        """The whole search's deadline."""
        return Deadline(self.end, self)

    def wall(self) -> float:
        """Seconds since the call began."""
        return self.now() - self.start

    def wall_left(self) -> float:
        """Wall seconds to the hard stop: the limit less ``RESERVE`` since the call began."""
        return self.end - self.wall()

    def stopped(self) -> bool:
        """Has the wall clock reached the hard stop (said once in ``cut_short`` where that makes a
        ``deterministic`` search one that may differ from run to run)?"""
        if self.wall_left() > 0:
            return False
        if self.deterministic:
            self.note(HARD_STOP)
        return True

    def pace(self, kind: str | None = None) -> float:
        """Wall seconds per charged second of the work of ``kind`` charged so far: how fast this
        host runs it against its charges (1 before any, for no kind, and where the charges are
        wall seconds). Each kind its own: on a 2-core host captures ran at 1.8 and ILP builds at
        0.4-0.8 against charges fitted on a faster one."""
        wall, charged = self.paces.get(kind or "", (1.0, 1.0))
        return wall / charged if self.deterministic and charged > 0 else 1.0

    def wall_affords(self, wall_s: float) -> bool:
        """Would work of ``wall_s`` wall seconds begun now end before the hard stop? Where not (a
        slow or loaded host), a deterministic search says the wall clock stopped it
        (``HARD_STOP``): GPT-3 175B on a host 2x slower than the fit captured in 13 of 15 s and
        then began an ILP build of 2.6 s."""
        if self.wall_left() >= wall_s:
            return True
        if self.deterministic:
            self.note(HARD_STOP)
        return False

    @property
    def spent(self) -> float:
        """The search's time so far: the seconds charged where ``deterministic``, else the wall's."""
        return self.charged if self.deterministic else self.wall()

    @spent.setter
    def spent(self, seconds: float) -> None:   # tests move a deterministic search's time by hand
        self.charged = seconds

    @property
    def reproducible(self) -> bool:
        """Does another run make the same plan: a deterministic search the wall clock did not stop,
        or a search nothing was cut short of?"""
        return HARD_STOP not in self.cut_short if self.deterministic else not self.cut_short

    def charge(self, kind: work.WorkKind, wall_s: float, **features: float) -> float:
        """Charge a piece of work of ``kind`` by its size (``work.seconds``; by its wall seconds
        where not ``deterministic``): the search's time moves on by it, and it is the estimate of
        the next of its kind. Returns the charge."""
        seconds = work.seconds(kind, **features) if self.deterministic else wall_s
        self.charged += seconds
        wall, charged = self.paces.get(kind, (0.0, 0.0))
        self.paces[kind] = (wall + wall_s, charged + seconds)
        self.took[kind] = seconds
        work.log(f"{os.getpid()}@{self.start:.6f}", kind, wall_s, seconds, **features)
        return seconds

    @contextmanager
    def shown(self, title: str, show: bool = True) -> Iterator[Clock]:
        """The call, with a status line saying ``title``, its seconds and what is left of the limit
        (where ``show`` and ``progress.shown`` allow)."""
        with progress.working(title, progress=show, start=self.start, limit=self.limit, now=self.now) as line:
            self.line = line
            try:
                yield self
            finally:
                self.line = None

    @contextmanager
    def stops_capture(self, what: str) -> Iterator[None]:
        """A capture in the block stops (``PlanningTimeout``) at its first module call past the
        hard stop: ``torch.export`` cannot be stopped from outside, and GPT-3 175B's took 13-26 s
        of a 15 s limit on a slow or loaded host."""
        if self.limit is None:
            yield
            return

        def check(module: torch.nn.Module, args: object) -> None:
            if self.wall_left() <= 0:
                raise PlanningTimeout(f"{what} ran past the time limit ({self.limit:g} s with a {RESERVE:.0%} "
                                      "reserve); give a larger time_limit")
        handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
        try:
            yield
        finally:
            handle.remove()

    def doing(self, what: str) -> contextlib.AbstractContextManager[None]:
        """``what`` runs for the block (on the status line; logged with its seconds), not timed:
        the stages inside it are."""
        return progress.doing(what, self.line)

    @contextmanager
    def stage(self, name: str, what: str | None = None) -> Iterator[Timed]:
        """Time a stage into ``timings[name]`` (wall seconds, also in the yielded ``Timed`` once
        it ends), even where it raises; ``what`` it does is said (``doing``; default:
        ``STAGES[name]``). The work is charged apart (``charge``), by its size."""
        timed, t0 = Timed(), self.now()
        try:
            with self.doing(what or STAGES.get(name, name)):
                yield timed
        finally:
            timed.seconds = self.now() - t0
            self.timings[name] = self.timings.get(name, 0.0) + timed.seconds

    def add(self, seconds: dict[str, float]) -> None:
        """Seconds per stage timed elsewhere (a planning problem's own ``timings``)."""
        for name, s in seconds.items():
            self.timings[name] = self.timings.get(name, 0.0) + s

    def estimate(self, kind: str, default: float = 0.0) -> float:
        """Seconds the next work of ``kind`` will be charged: what the last one was."""
        return self.took.get(kind, default)

    def note(self, what: str) -> None:
        """Record that the time limit cut ``what`` short (once)."""
        if what not in self.cut_short:
            self.cut_short.append(what)

    def breakdown(self) -> dict[str, float]:
        """Seconds per stage, adding up to the wall time so far ("other": what no stage claimed)."""
        out = dict(self.timings)
        out["other"] = max(self.wall() - sum(out.values()), 0.0)
        return out


@dataclass
class Timed:
    """A stage's wall seconds, known once it ends."""

    seconds: float = 0.0


@dataclass(frozen=True)
class Deadline:
    """A point on a ``Clock``'s search time (``spent``; inf: none); the wall clock's hard stop
    passes it too."""

    end: float
    clock: Clock

    @property
    def limited(self) -> bool:
        return math.isfinite(self.end)

    def left(self) -> float:
        """Seconds of the search's time to the deadline (negative once passed; inf without a limit)."""
        return self.end - self.clock.spent

    def passed(self) -> bool:
        return self.left() <= 0 or self.clock.stopped()

    def share(self, fraction: float) -> Deadline:
        """A deadline ``fraction`` of the time left from now (never past this one)."""
        if not self.limited:
            return self
        return Deadline(self.clock.spent + max(self.left(), 0.0) * fraction, self.clock)

    def affords(self, seconds: float, wall_s: float | None = None) -> bool:
        """Would work of ``seconds`` (of the search's time) begun now end before the deadline, and
        its ``wall_s`` (default: as many as it is charged) before the wall clock's hard stop
        (``Clock.wall_affords``)?"""
        return self.left() >= seconds and self.clock.wall_affords(seconds if wall_s is None else wall_s)

    def affords_kind(self, kind: str, default: float = 0.0) -> bool:
        """Would work of ``kind`` (``Clock.estimate``) begun now end before the deadline, and at
        the host's pace for it (``Clock.pace``) before the hard stop?"""
        seconds = self.clock.estimate(kind, default)
        return self.affords(seconds, seconds * self.clock.pace(kind))

    def solve_seconds(self) -> float | None:
        """Seconds (of the search's time) a solve begun now may take: to this deadline, at least ``MIN_SOLVE_S``
        while the whole search's deadline has not passed, 0 once it has or the hard stop came
        (None: no limit)."""
        if not self.limited:
            return None
        if self.clock.stopped():
            return 0.0
        left = self.left()
        if left >= MIN_SOLVE_S:
            return left
        return min(MIN_SOLVE_S, max(self.clock.end - self.clock.spent, 0.0))


def no_limit() -> Deadline:
    """A deadline that never comes, on a clock of its own (planning calls without a limit)."""
    return Clock(None).deadline()


class Once:
    """``work(key)``, a capture, computed once per key (microbatch counts, shared by the
    searches), each timed on the clock as stage ``stage`` and charged by its graph's size (the
    estimate of the next): a new key is begun only where the caller's deadline affords as much as
    the last was charged."""

    def __init__(self, work: Callable, clock: Clock, stage: str) -> None:
        self.work, self.clock, self.stage = work, clock, stage
        self.done: dict = {}

    def __call__(self, key, deadline: Deadline | None = None):
        if key not in self.done:
            if deadline is not None and not deadline.affords_kind(self.stage):
                raise PlanningTimeout(f"no time was left for the {self.stage} of {key} microbatches "
                                      f"(the last was charged {self.clock.estimate(self.stage):.1f} s)")
            what = f"capturing one of {key} microbatches"
            with self.clock.stage(self.stage, what) as timed, self.clock.stops_capture(what):
                self.done[key] = self.work(key)
            charge_capture(self.clock, self.done[key], timed.seconds)
        return self.done[key]


def charge_capture(clock: Clock, captured, wall_s: float) -> None:
    """Charge a capture by its graph's size."""
    clock.charge("capture", wall_s, graph_nodes=len(captured.graph.nodes))

"""One planning call's time limit (``PlanOptions.time_limit``), kept by one object.

``Clock`` starts when ``autopar.plan`` is called and travels through every stage of the call:
the capture, the microbatch recaptures, the hand plans, the pipeline layouts, every solve and its
memory repairs. It records the seconds each stage took (the plan's ``timings``: they add up to the
call's wall time, what no stage claimed as "other") and what the time limit cut short (said in the
plan: a plan cut short may differ from run to run, as the machine's load does). ``Deadline`` is
an end time on that clock: the whole search's, or a share of it (a hand plan's, a pipeline
layout's) that never reaches past its parent's.

Work that cannot be stopped once begun (a capture, an ILP build, a pipeline schedule's
simulation) is only begun where the deadline ``affords`` it, judged by the last time the same
kind of work took (``Clock.estimate``); a solve is stopped by the solver's own time limit.

The clock is also what the call tells the user while it runs: ``Clock.shown`` draws a status line
(``autopar.core.progress``) for the call, each stage and each ``doing`` says what it does on it
(and, with ``autopar -v``, in the log with its seconds).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from autopar.core import progress
from autopar.core.errors import PlanningTimeout

#: Share of the time limit kept after the search's deadline for what runs past it: turning the
#: last solve into a plan (0.2-0.7 s on GPT-3 175B) and work begun on an estimate that ran long.
#: The call must end within 5% past the limit.
RESERVE = 0.06
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
    timings: dict[str, float] = field(default_factory=dict)
    took: dict[str, float] = field(default_factory=dict)
    cut_short: list[str] = field(default_factory=list)
    line: progress.StatusLine | None = None   # the call's status line, while ``shown``

    def __post_init__(self) -> None:
        if self.start is None:
            self.start = self.now()

    @property
    def end(self) -> float:
        """The search's deadline: the limit less ``RESERVE`` (inf without a limit)."""
        return math.inf if self.limit is None else self.start + (1 - RESERVE) * self.limit

    def deadline(self) -> Deadline:
        """The whole search's deadline."""
        return Deadline(self.end, self)

    def wall(self) -> float:
        """Seconds since the call began."""
        return self.now() - self.start

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

    def doing(self, what: str) -> contextlib.AbstractContextManager[None]:
        """``what`` runs for the block (on the status line; logged with its seconds), not timed:
        the stages inside it are."""
        return progress.doing(what, self.line)

    @contextmanager
    def stage(self, name: str, kind: str | None = None, what: str | None = None) -> Iterator[None]:
        """Time a stage into ``timings[name]`` (and its duration into ``took[kind]``: the estimate
        of the next work of that kind), even where it raises; ``what`` it does is said
        (``doing``; default: ``STAGES[name]``)."""
        t0 = self.now()
        try:
            with self.doing(what or STAGES.get(name, name)):
                yield
        finally:
            seconds = self.now() - t0
            self.timings[name] = self.timings.get(name, 0.0) + seconds
            if kind is not None:
                self.took[kind] = seconds

    def add(self, seconds: dict[str, float]) -> None:
        """Seconds per stage timed elsewhere (a planning problem's own ``timings``)."""
        for name, s in seconds.items():
            self.timings[name] = self.timings.get(name, 0.0) + s

    def estimate(self, kind: str, default: float = 0.0) -> float:
        """Seconds the next work of ``kind`` will likely take: as long as the last one did."""
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


@dataclass(frozen=True)
class Deadline:
    """An end time on a ``Clock`` (inf: none)."""

    end: float
    clock: Clock

    @property
    def limited(self) -> bool:
        return math.isfinite(self.end)

    def left(self) -> float:
        """Seconds to the deadline (negative once passed; inf without a limit)."""
        return self.end - self.clock.now()

    def passed(self) -> bool:
        return self.left() <= 0

    def share(self, fraction: float) -> Deadline:
        """A deadline ``fraction`` of the time left from now (never past this one)."""
        if not self.limited:
            return self
        return Deadline(self.clock.now() + max(self.left(), 0.0) * fraction, self.clock)

    def affords(self, seconds: float) -> bool:
        """Would work of ``seconds`` begun now end before the deadline?"""
        return self.left() >= seconds

    def affords_kind(self, kind: str, default: float = 0.0) -> bool:
        """Would work of ``kind`` (``Clock.estimate``) begun now end before the deadline?"""
        return self.affords(self.clock.estimate(kind, default))

    def solve_seconds(self) -> float | None:
        """Seconds a solve begun now may take: to this deadline, at least ``MIN_SOLVE_S`` while the
        whole search's deadline has not passed, 0 once it has (None: no limit)."""
        if not self.limited:
            return None
        left = self.left()
        if left >= MIN_SOLVE_S:
            return left
        return min(MIN_SOLVE_S, max(self.clock.end - self.clock.now(), 0.0))


def no_limit() -> Deadline:
    """A deadline that never comes, on a clock of its own (planning calls without a limit)."""
    return Clock(None).deadline()


class Once:
    """``work(key)`` computed once per key (microbatch captures, shared by the searches), each
    computation timed on the clock as stage ``stage`` (the estimate of the next): a new key is
    begun only where the caller's deadline affords as long as the last took."""

    def __init__(self, work: Callable, clock: Clock, stage: str) -> None:
        self.work, self.clock, self.stage = work, clock, stage
        self.done: dict = {}

    def __call__(self, key, deadline: Deadline | None = None):
        if key not in self.done:
            if deadline is not None and not deadline.affords_kind(self.stage):
                raise PlanningTimeout(f"no time was left for the {self.stage} of {key} microbatches "
                                      f"(the last took {self.clock.estimate(self.stage):.1f} s)")
            with self.clock.stage(self.stage, self.stage, f"capturing one of {key} microbatches"):
                self.done[key] = self.work(key)
        return self.done[key]

"""What autopar says while it works: a status line during long work, and the ``autopar`` logger.

Long work (a planning call's capture, problem building, hand plans, solves and pipeline layouts;
the demo's measuring of its host) shows one line on stderr: what runs, the seconds since the work
began and, under a time limit, the seconds left of it. A thread of its own redraws it a few times a
second, since a capture or a solve holds the caller's thread for seconds. It is drawn by tqdm, on
rank 0 only, where stderr is a terminal, unless ``PlanOptions.progress`` is False or
``AUTOPAR_PROGRESS=0`` (the command line's ``-q`` sets it), and erased when the work ends.

What autopar tells in lines goes to the ``autopar`` logger: INFO for what a user should read
(``compile``'s summary of the plan it runs), DEBUG for each stage of the work and its seconds (the
command line's ``-v``). Where the program configured no logging (the root logger has no handler),
a handler of this module writes them to stderr, above the status line when one shows; where it
did, they reach its handlers as any library's do. ``logging.getLogger("autopar").setLevel(
logging.WARNING)`` silences them.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tqdm import tqdm

from autopar.core.report import summary
from autopar.core.together import first_rank

if TYPE_CHECKING:
    from autopar.core.plan import Plan

__all__ = ["ENV", "Countdown", "StatusLine", "doing", "log", "log_summary", "note", "say", "shown", "verbose", "working"]

#: Set to "0" (or "false", "no", "off") and no status line is drawn.
ENV = "AUTOPAR_PROGRESS"
#: Seconds between two redraws of the status line.
REFRESH_S = 0.25

log = logging.getLogger("autopar")


def shown(progress: bool = True) -> bool:
    """Is a status line drawn here: asked for (``progress``, ``AUTOPAR_PROGRESS`` not off), on the
    job's first rank, where stderr is a terminal (a log file gets no redrawn line)?"""
    if not progress or os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) and first_rank()


class _Line(tqdm):
    """tqdm's bar with ``told`` (the seconds, said as ``StatusLine`` says them) to format."""

    told = ""

    @property
    def format_dict(self) -> dict:
        return {**super().format_dict, "told": self.told}


class StatusLine:
    """The line of one piece of work: ``title``, what runs in it now (the two innermost ``doing``),
    the seconds since ``start`` and, with a ``limit``, a bar of the limit and the seconds left."""

    def __init__(self, title: str, start: float, limit: float | None = None,
                 now: Callable[[], float] = time.perf_counter) -> None:
        self.title, self.start, self.limit, self.now = title, start, limit, now
        self.doing: list[str] = []
        self.noted = ""                   # how far the innermost work is (``note``)
        self._bar = _Line(total=limit, file=sys.stderr, leave=False, dynamic_ncols=True,
                          bar_format="{desc} {bar:12} {told}" if limit is not None else "{desc}  {told}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._redraw, name="autopar-status-line", daemon=True)
        self._thread.start()

    def text(self) -> tuple[str, str]:
        """(what runs, the seconds): "planning: solving the auto plan", "21 s, 39 s left of 60 s"."""
        elapsed = self.now() - self.start
        what = f"autopar: {self.title}" + "".join(f": {d}" for d in [*self.doing[-2:], self.noted] if d)
        if self.limit is None:
            return what, f"{elapsed:.0f} s"
        left = self.limit - elapsed
        return what, (f"{elapsed:.0f} s, {left:.0f} s left of {self.limit:g} s" if left >= 0
                      else f"{elapsed:.0f} s, past the limit of {self.limit:g} s")

    def draw(self) -> None:
        what, told = self.text()
        room = _columns() - len(told) - 16   # the bar and the spaces around it
        if room > 10 and len(what) > room:   # a wrapped line is not redrawn in place
            what = what[:room - 1] + "…"
        with self._bar.get_lock():
            self._bar.desc, self._bar.told = what, told
            if self.limit is not None:
                self._bar.n = min(max(self.now() - self.start, 0.0), self.limit)
            self._bar.refresh(nolock=True)

    def write(self, line: str) -> None:
        """``line`` above the status line."""
        self._bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._bar.close()

    def _redraw(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self.draw()
            except (OSError, ValueError):   # stderr closed under it: nothing left to draw on
                return


def _columns() -> int:
    """The terminal's width on stderr (0: unknown)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


#: The status line drawn now in this process (one at a time: work inside work says what it does on
#: the line of the outer work).
_active: StatusLine | None = None


@contextmanager
def working(title: str, *, progress: bool = True, start: float | None = None, limit: float | None = None,
            now: Callable[[], float] = time.perf_counter) -> Iterator[StatusLine | None]:
    """A status line for the work of the block (None where ``shown(progress)`` is not): ``title``,
    its seconds since ``start`` (default: now) and what is left of ``limit`` seconds. Inside
    another's block, the title is said on that line (as ``doing``)."""
    global _active
    if _active is not None:
        with doing(title, _active):
            yield _active
        return
    if not shown(progress):
        yield None
        return
    line = _active = StatusLine(title, now() if start is None else start, limit, now)
    try:
        line.draw()
        yield line
    finally:
        _active = None
        line.close()


@contextmanager
def doing(what: str, line: StatusLine | None) -> Iterator[None]:
    """``what`` runs for the block: said on ``line`` (where there is one) while it runs, and logged
    (DEBUG) with its seconds when it ends."""
    t0 = time.perf_counter()
    if line is not None:
        line.doing.append(what)
        line.draw()
    try:
        yield
    finally:
        if line is not None:
            line.doing.pop()
            line.noted = ""
        log.debug("autopar: %s: %.2f s", what, time.perf_counter() - t0)


def note(what: str) -> None:
    """How far the work under way is ("op 12/80: ..."): on the status line where one shows, and
    logged (DEBUG)."""
    log.debug("autopar: %s", what)
    if _active is not None:
        _active.noted = what


class Countdown:
    """Work of ``total`` steps of about equal length (``compare --measure``'s builds, its training
    steps taken in turns): how far it is, its seconds, and the seconds left at the pace so far."""

    def __init__(self, total: int, unit: str = "steps", now: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.unit, self.now, self.start, self.done = total, unit, now, now(), 0

    def tick(self, steps: int = 1) -> None:
        self.done += steps

    def left_s(self) -> float | None:
        """Seconds left at the pace so far (None before the first step)."""
        if not self.done:
            return None
        return (self.now() - self.start) / self.done * max(self.total - self.done, 0)

    def text(self) -> str:
        """"12 of 120 steps, 8 s, about 70 s left"."""
        left = self.left_s()
        told = "" if left is None else f", about {left:.0f} s left"
        return f"{self.done} of {self.total} {self.unit}, {self.now() - self.start:.0f} s{told}"


def log_summary(plan: Plan) -> None:
    """``report.summary`` of ``plan`` to the log (INFO), on the job's first rank only."""
    if first_rank():
        for line in summary(plan):
            log.info("autopar: %s", line)


def say(text: str) -> None:
    """A line to stderr, above the status line where one shows."""
    if _active is not None:
        _active.write(text)
    else:
        print(text, file=sys.stderr, flush=True)


class _Stderr(logging.Handler):
    """The ``autopar`` loggers' lines on stderr (``say``) in a program that configured no logging
    (the root logger has no handler; where it has, the lines reach it as every library's do)."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            say(self.format(record))
        except Exception:  # noqa: BLE001 - logging's own rule: a handler never raises
            self.handleError(record)


def _handled(logger: logging.Logger, level: int) -> None:
    """``logger`` with a ``_Stderr`` handler (once), at ``level`` unless the program chose one."""
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
    if logger.level == logging.NOTSET:
        logger.setLevel(level)


def verbose() -> None:
    """Every stage logged with its seconds (``autopar -v``): the ``autopar`` logger at DEBUG, the
    cost model's, code generator's and solver's at INFO."""
    _handled(log, logging.DEBUG)
    log.setLevel(logging.DEBUG)
    for name in ("cost_models", "codegen", "solver"):
        _handled(logging.getLogger(name), logging.INFO)


_handled(log, logging.INFO)

"""What autopar tells while it works (``autopar.core.progress``) and the report's figures agreeing.

* The planning call's status line shows on a terminal (a pty) with its stages and the time left,
  and nowhere else: not on a pipe, not with ``progress=False`` or ``AUTOPAR_PROGRESS=0``, not on a
  rank other than 0.
* ``compile`` logs a summary of its plan (logger ``autopar``) on rank 0 only (2 gloo processes).
* The report agrees with itself: the planning time is the call's wall time; a pipeline plan's
  microbatch counts are one; its per-device parameter table adds up to its peak rank's state, no
  more than the peak; tiny parts of the step are said to be negligible, not given in nanoseconds.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
import sys
import termios
import threading
import time

import pytest
import torch

import autopar
from autopar import Plan
from autopar.core import progress
from autopar.core.mesh import MeshSpec
from autopar.core.plan import NodePlan, Prediction
from autopar.core.units import fmt
from autopar.profiling.launch import run_on_gloo_mesh
from tests.equivalence import build, make_batches, meta_model
from tests.tiers import slow

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _plan_tiny(**options) -> Plan:
    model, args, kwargs = meta_model("gpt-tiny")
    return autopar.plan(model, MeshSpec((2,), hardware="h100-80gb"), args, kwargs, profile=None, **options)


class _Terminal:
    """A pty as stderr: what autopar draws on it, read as it comes (a full pty would block it)."""

    def __init__(self, monkeypatch, columns: int = 120) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        self.tty = os.fdopen(slave, "w", buffering=1, encoding="utf-8")
        monkeypatch.setattr(sys, "stderr", self.tty)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:   # the slave closed
                return
            if not chunk:
                return
            self.chunks.append(chunk)

    def text(self) -> str:
        self.tty.flush()
        time.sleep(0.2)
        self.tty.close()
        self.reader.join(5)
        os.close(self.master)
        return b"".join(self.chunks).decode("utf-8", "replace")


def test_planning_shows_a_status_line_on_a_terminal(monkeypatch):
    monkeypatch.setattr(progress, "REFRESH_S", 0.02)
    monkeypatch.delenv(progress.ENV, raising=False)
    terminal = _Terminal(monkeypatch)
    _plan_tiny(time_limit=60)
    shown = terminal.text()
    assert "autopar: planning: capturing the model" in shown
    assert "autopar: planning: costing the hand plan 'ddp'" in shown and "solving the plan 'auto'" in shown
    assert re.search(r"\d+ s, \d+ s left of 60 s", shown) and "\r" in shown, shown   # redrawn in place
    assert progress._active is None


def _work_shown(work) -> str:
    """What ``work()`` draws on stderr, a pipe here."""
    read, write = os.pipe()
    stderr, sys.stderr = sys.stderr, os.fdopen(write, "w")
    try:
        work()
    finally:
        sys.stderr.close()
        sys.stderr = stderr
    shown = os.read(read, 1 << 16)
    os.close(read)
    return shown.decode()


def test_planning_is_quiet_when_asked(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    terminal = _Terminal(monkeypatch)
    _plan_tiny(progress=False)
    assert terminal.text() == ""


@pytest.mark.parametrize("quiet", ["environment", "pipe", "other rank"])
def test_a_status_line_is_drawn_only_on_rank_0_of_a_terminal(monkeypatch, quiet):
    monkeypatch.delenv(progress.ENV, raising=False)

    def work():
        with progress.working("planning", limit=60.0) as line:
            with progress.doing("solving", line):
                time.sleep(0.05)
        return line

    if quiet == "pipe":
        assert _work_shown(work) == ""
        return
    terminal = _Terminal(monkeypatch)
    if quiet == "environment":
        monkeypatch.setenv(progress.ENV, "0")
    if quiet == "other rank":
        monkeypatch.setattr(progress, "first_rank", lambda: False)
    assert work() is None and terminal.text() == ""


def test_a_status_line_trims_what_runs_to_the_terminal_width(monkeypatch):
    terminal = _Terminal(monkeypatch, columns=60)
    with progress.working("planning", limit=10.0) as line:
        with progress.doing("x" * 200, line):
            line.draw()
    shown = terminal.text()
    assert "…" in shown and max(len(part) for part in re.split(r"[\r\n]", shown)) <= 60 + 10   # escapes


def _compile_logged(mesh, batch):
    """One rank: compile gpt-tiny (planned on rank 0, shared), keeping what the autopar logger says."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("autopar").addHandler(Keep())
    torch.manual_seed(0)
    pmodel = autopar.compile(build("gpt-tiny"), mesh, *batch, profile=None, time_limit=60)
    return said, pmodel.plan.name


@slow
def test_compile_logs_a_summary_on_rank_0_only():
    batch = make_batches("gpt-tiny", 8, 32, steps=1)[0]
    (said0, name), (said1, _) = run_on_gloo_mesh(_compile_logged, (2,), batch, start_method="forkserver")
    summary = [line for line in said0 if line.startswith("autopar: ")]
    assert said1 == [] and len(summary) == 3, said0
    assert re.search(r"^autopar: GPT on 2 devices \(\w+=2\) of cpu runs the (solver's|hand) plan.*: parameters \w",
                     summary[0]) and name == "auto", summary
    assert re.search(r"predicted step [\d.]+ \w+.*peak memory [\d.]+ \w+ per device", summary[1]), summary
    assert "planned in" in summary[2] and "plan.report()" in summary[2]


def test_the_planning_time_is_the_calls_wall_time():
    model, args, kwargs = meta_model("gpt-tiny")
    plan = autopar.plan   # loaded before the clock starts, as a second call finds it
    t0 = time.perf_counter()
    planned = plan(model, MeshSpec((2, 2), hardware="h100-80gb"), args, kwargs, profile=None)
    wall = time.perf_counter() - t0
    assert planned.planning_s == pytest.approx(wall, abs=0.05), (planned.timings, wall)
    assert f"Planning time   {fmt(planned.planning_s, 's')} (" in planned.report()


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


@pytest.fixture(scope="module")
def pipelined():
    """A pipeline plan of a four-block GPT-2 (tied embeddings: held by the first and last stages),
    4 stages on 2 ranks (interleaved 1F1B), 4 microbatches."""
    model, args, kwargs = meta_model("tests.pipeline_models:gpt2", 8, 16)
    return autopar.plan(model, MeshSpec((2, 2), ("pp", "tp"), hardware="h100-80gb"), args, kwargs, profile=None,
                        pipeline={"axis": "pp", "schedule": "ScheduleInterleaved1F1B", "microbatches": 4,
                                  "virtual_stages": 2})


def test_a_pipeline_report_says_one_microbatch_count(pipelined):
    plan, report = pipelined, pipelined.report(top=0)
    assert plan.microbatches == plan.pipeline.num_microbatches == 4
    assert "8 rows per step in 4 microbatches of 2" in report and "4 microbatches of 2 rows" in report
    said = re.search(r"the activations of (\d+) microbatches in flight over its 2 stages \(at most (\d+) on each\)",
                     report)
    assert said and int(said.group(2)) == 4 and int(said.group(1)) <= 2 * 4, report


def test_a_pipeline_parameter_table_is_per_device(pipelined):
    plan, report = pipelined, pipelined.report(top=0)
    rank = plan.pipeline.peak_rank()
    assert f"on one device of pipeline rank {rank}, the rank of the peak" in report
    table = report[report.index("Parameters ("):report.index("\nOps (")]
    rows = re.findall(r"^  \S+\s+(?:x\d+\s+)?.*?\)\s+(-|[\d.]+ \w+)\s+([\d,-]+)$", table, re.M)
    assert len(rows) >= 10 and any(memory == "-" for memory, _ in rows), table
    total = sum(_bytes(memory) for memory, _ in rows if memory != "-")
    state = plan.predicted.memory_breakdown["state"]
    assert total == pytest.approx(state, rel=0.01) and total <= plan.predicted.peak_memory_bytes
    stages = re.findall(r"^  (\d+)\s+(\d+)\s+\d+-\d+\s+.*?([\d.]+ \w+)\s+([\d.]+ \w+)$",
                        report[report.index("Pipeline over"):report.index("Solver")], re.M)
    on_rank = sum(_bytes(held) for _, r, held, _ in stages if int(r) == rank)
    assert len(stages) == 4 and on_rank == pytest.approx(state, rel=0.01)


def _synthetic(overlapped: float, exposed: float, comm: float = 0.0) -> Plan:
    predicted = Prediction(step_time_s=0.2, peak_memory_bytes=1e6, comm_bytes={}, compute_s=0.2 - comm, comm_s=comm,
                           memory_breakdown={}, overlapped_comm_s=overlapped, exposed_comm_s=exposed)
    node = NodePlan(name="linear", op="aten.linear.default", layer="", strategy="batch", out=(), ins=(),
                    storage=None, fqn=None, compute_s=0.2, comm_s=0.0, memory_bytes=0.0)
    return Plan(mesh=MeshSpec((2,), hardware="h100-80gb"), model_name="M", fingerprint="0", nodes=[node],
                predicted=predicted, memory_budget=64 * 2**30)


@pytest.mark.parametrize("overlapped, exposed, comm, said", [
    (660e-9, 0.0, 0.0, "compute 200 ms (100%), no blocking communication, gradient sync negligible (under 0.1% of "
                       "the step)"),
    (0.05, 0.0, 1e-6, "blocking communication 1.00 us (under 1%), gradient sync 50.0 ms hidden under the backward"),
    (0.05, 0.01, 0.02, "blocking communication 20.0 ms (10%), exposed gradient sync 10.0 ms of 50.0 ms queued"),
    (0.0, 0.0, 0.0, "no gradient sync"),
])
def test_tiny_parts_of_the_step_are_said_as_such(overlapped, exposed, comm, said):
    report = _synthetic(overlapped, exposed, comm).report(top=0)
    assert said in report, report
    assert not re.search(r"\b0 s of", report) and "under 0.1% of the budget" in report


def test_the_command_line_is_silent_with_q(monkeypatch, capsys):
    import autopar.cli as cli

    monkeypatch.setenv(progress.ENV, "1")
    level = logging.getLogger("autopar").level
    assert cli.main(["plan", "--model", "gpt-tiny", "--mesh", "2", "--no-hand-plans", "--profile", "none",
                     "--top", "0", "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "autopar plan: GPT on 2 devices" in out
    # quiet for the command only: main called from Python leaves the process as it found it
    assert os.environ[progress.ENV] == "1" and not cli._quiet and logging.getLogger("autopar").level == level


def test_a_countdown_says_the_time_left_at_the_pace_so_far():
    clock = [100.0]
    countdown = progress.Countdown(10, now=lambda: clock[0])
    assert progress.Countdown(3, "built").text() == "0 of 3 built, 0 s"
    assert countdown.left_s() is None and countdown.text() == "0 of 10 steps, 0 s"
    clock[0] += 8.0
    countdown.tick(4)
    assert countdown.left_s() == pytest.approx(12.0)
    assert countdown.text() == "4 of 10 steps, 8 s, about 12 s left"

"""``autopar compare`` (autopar/compare.py): strategies planned side by side, and measured."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.compare import Comparison, Strategy, measure
from autopar.models.zoo import get_model
from tests.tiers import slow

UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def _seconds(cell: str) -> float:
    value, unit = re.match(r"([\d.]+) (ns|us|ms|s)\b", cell).groups()
    return float(value) * UNITS[unit]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """``autopar compare`` of gpt-tiny on 2 devices (no pipelines), with a forced variant: (stdout, html)."""
    path = tmp_path_factory.mktemp("compare") / "compare.html"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["compare", "--model", "gpt-tiny", "--mesh", "2", "--pipeline", "none",
                   "--variant=--recompute full", "--html", str(path)])
    assert rc == 0, err.getvalue()
    return out.getvalue(), path.read_text()


def test_compare_table_sorted_with_auto_and_hand_plans(compared):
    out, html = compared
    lines = out.splitlines()
    assert lines[0] == "gpt-tiny on 2 devices (x=2) of h100-80gb: predicted per training step, fastest first"
    header = lines[2].split()
    assert header[:3] == ["strategy", "predicted", "step"] and header[-1] == "fits"
    rows = {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line)[1:] for line in lines[4:] if line}
    names = {name.split(" (= ")[0] for name in rows}
    assert {"auto", "ddp", "fsdp", "zero1", "zero2", "tp", "tp+sp", "auto, --recompute full"} <= names, names
    steps = [_seconds(cells[0]) for cells in rows.values()]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    assert all(cells[-1] == "yes" for cells in rows.values()), rows   # every plan fits 80 GB
    assert "<table>" in html and html.count("<svg") == 1 and "auto, --recompute full" in html


def test_verdict_says_why_not():
    plan = autopar.plan(torch.nn.Linear(4, 4, device="meta"), autopar.MeshSpec((2,)), torch.randn(8, 4, device="meta"),
                        hand_plans=False)
    over = dataclasses.replace(plan, feasible=False, shortfall_bytes=2**20, memory_budget=2**20)
    assert Strategy("ddp", "hand plan", plan).verdict() == "yes"
    assert re.fullmatch(r"no: needs .+ per device, 1.00 MiB over the budget of 1.00 MiB",
                        Strategy("x", "hand plan", over).verdict())
    assert Strategy("auto", "auto", why_not="no plan fits").verdict() == "no: no plan fits"


@slow
def test_measure_fills_measured_columns():
    """One launch of 2 gloo processes: the auto plan and torch DDP, one round of 1 + 2 steps."""
    entry = get_model("gpt-tiny")
    spec = autopar.MeshSpec((2,), hardware="cpu")
    torch.manual_seed(1234)
    plan = autopar.plan(entry.build(), spec, *entry.example(4, 16), hand_plans=False, profile=None)
    comparison = Comparison("gpt-tiny", spec, [Strategy("auto", "auto", plan)])
    measure(comparison, "gpt-tiny", 4, 16, rounds=1, warmup=1, steps=2, torch_wrappers=("torch DDP",),
            progress=False, timeout_s=120)
    assert [s.name for s in comparison.strategies] == ["auto", "torch DDP"]
    for s in comparison.strategies:
        assert s.measured_step_s and s.measured_step_s > 0 and s.measured_peak_bytes and s.measured_peak_bytes > 0, s
    assert "measured step" in comparison.table() and comparison.sorted()[-1].name == "torch DDP"


@pytest.mark.parametrize("argv, said", [
    (["--variant=--recompute sometimes"], "bad --variant '--recompute sometimes'"),
    (["--variant=--no-such-flag"], "unknown --no-such-flag"),
    (["--measure", "--hardware", "h100-80gb"], "--measure trains on this host's CPU"),
])
def test_compare_says_what_was_wrong(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--model", "gpt-tiny", "--mesh", "2", *argv])
    assert exc.value.code == 2 and said in capsys.readouterr().err

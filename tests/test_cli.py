"""Tests of the ``autopar`` command line (autopar/cli.py) and the planning report (autopar/report.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys

import pytest

from autopar import Plan
from autopar.cli import main, parse_mesh
from autopar.core.errors import MeshError
from autopar.core.report import fmt, param_pattern
from tests.tiers import slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """``autopar plan --model gpt-tiny --mesh 2x2 --reduce-precision bf16 --json FILE`` once for the
    module: (stdout, stderr, json path)."""
    path = tmp_path_factory.mktemp("plan") / "gpt-tiny-2x2.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", "--model", "gpt-tiny", "--mesh", "2x2", "--reduce-precision", "bf16", "--json", str(path)])
    assert rc == 0, err.getvalue()
    return out.getvalue(), err.getvalue(), path


def test_plan_prints_report(planned):
    out, err, _ = planned
    assert "building gpt-tiny" in err and "planning for 4 devices" in err
    planned_in = re.search(r"^planned in (.+) \(the report's planning time\)$", err, re.M)
    assert planned_in and f"Planning time   {planned_in.group(1)} (" in out, err   # one figure, said twice
    assert "GPT on 4 devices (dp=2 x tp=2) of h100-80gb" in out
    assert re.search(r"step time\s+[\d.]+ (ns|us|ms|s)\b", out), out
    assert re.search(r"peak memory\s+[\d.]+ (B|KiB|MiB|GiB)\b", out), out
    assert "bf16 compute; fp32 parameters, gradients (summed over ranks in bf16)" in out
    for section in ("activations", "communication", "Solver", "Planning time", "Parameters (29",
                    "Top 12 nodes by predicted time", "Warnings"):
        assert section in out, section


def test_plan_json_round_trips(planned):
    out, _, path = planned
    plan = Plan.from_json(str(path))
    assert plan.model_name == "GPT" and plan.mesh.shape == (2, 2) and plan.mesh.hardware == "h100-80gb"
    assert len(plan.parameters) == 29 and plan.reduce_precision == "bf16"
    # The report is made from the plan alone: the reloaded plan reports the same.
    assert plan.report() == out.rstrip("\n")


def test_bad_mesh_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "gpt-tiny", "--mesh", "2y2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad mesh '2y2'") and "2x2" in err and "Traceback" not in err


def test_unknown_model_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "gpt-tinyy", "--mesh", "2x2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'gpt-tinyy'") and "gpt-tiny" in err and "Traceback" not in err


def test_a_pipeline_with_extra_fields_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "gpt-tiny", "--mesh", "2x2", "--pipeline", "Schedule1F1B:pp:4:1:8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--pipeline takes at most" in err and "Traceback" not in err


def test_a_router_measured_on_the_command_line(capsys):
    """``--expert-skew measured`` builds a model small enough on the CPU and reports the factor it
    priced; one too large to build here is refused before anything is built, and so is a bad value."""
    assert main(["plan", "--model", "mixtral-tiny", "--mesh", "4", "--expert-parallel", "x", "--expert-skew", "measured",
                 "--time-limit", "30"]) == 0
    assert re.search(r"busiest rank receiving 1\.\d+x the mean of the rows routed", capsys.readouterr().out)
    for flag, said in (("measured", "do not fit in half of this host's memory"), ("0.5", "expert_skew is the busiest")):
        with pytest.raises(SystemExit) as exc:
            main(["plan", "--model", "mixtral-8x7b", "--mesh", "8x8", "--expert-skew", flag])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and said in err and "Traceback" not in err and "building" not in err, err


def test_models_lists_zoo(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^gpt-tiny\s+137K", out, re.M) and "llama-7b" in out


def test_parse_mesh_and_units():
    assert parse_mesh("2x2") == (2, 2) and parse_mesh("8") == (8,) and parse_mesh("2x4x8") == (2, 4, 8)
    for bad in ("", "x", "2x", "0x2", "-2", "two", "2.5"):
        with pytest.raises(MeshError):
            parse_mesh(bad)
    assert fmt(512, "B") == "512 B" and fmt(5151236, "B") == "4.91 MiB" and fmt(80 * 2**30, "B") == "80.0 GiB"
    assert fmt(0.0030029, "s") == "3.00 ms" and fmt(2.5e-5, "s") == "25.0 us" and fmt(134.2, "s") == "134 s"
    assert param_pattern("transformer.h.11.ln_1.weight") == "transformer.h.*.ln_1.weight"


def _synthetic_plan(layers: int) -> Plan:
    from torch.distributed.tensor import Replicate, Shard

    from autopar.core.mesh import MeshSpec
    from autopar.core.plan import NodePlan, Prediction

    R, S0 = Replicate(), Shard(0)
    nodes = []
    for i in range(layers):
        for leaf in ("attn.weight", "mlp.weight"):
            odd = leaf == "mlp.weight" and i in (5, 6, 9)  # three layers chose differently
            nodes.append(NodePlan(
                name=f"p_h_{i}_{leaf.replace('.', '_')}", op="parameter", layer="", fqn=f"h.{i}.{leaf}",
                strategy="zero3 (stored (S(0), R), gathered on use)" if odd else "batch x column",
                out=(R, R) if odd else (R, S0), ins=(), storage=(S0, R) if odd else (R, S0),
                compute_s=1e-6, comm_s=2e-3 if odd else 0.0, memory_bytes=3 * 2**20))
    nodes.append(NodePlan(name="linear", op="aten.linear.default", layer="h.0.attn", strategy="batch x column",
                          out=(S0, R), ins=((S0, R), (R, S0)), storage=None, fqn=None, compute_s=0.5,
                          comm_s=0.25, memory_bytes=0.0))
    predicted = Prediction(step_time_s=0.8, peak_memory_bytes=70 * 2**30, comm_bytes={"dp": 2**30, "tp": 0.0},
                           compute_s=0.5, comm_s=0.25, memory_breakdown={"state": 70 * 2**30},
                           overlapped_comm_s=0.1, exposed_comm_s=0.05, peak_at="backward: linear",
                           cost_source="no profile: 0% of compute time measured", basis="tables",
                           band_low=0.8, band_high=1.25, model_flops=8e15, hardware_flops=1e16, peak_flops=2e16)
    return Plan(mesh=MeshSpec((8, 8), hardware="h100-80gb"), model_name="Synthetic", fingerprint="0" * 16,
                nodes=nodes, predicted=predicted, memory_budget=64 * 2**30,
                warnings=["no sharding rule for aten.foo.default (1 node): it runs replicated"])


def test_a_roofline_prediction_says_it_is_a_lower_bound_and_gives_no_band():
    plan = _synthetic_plan(2)
    plan.predicted = dataclasses.replace(plan.predicted, basis="roofline", band_low=0.0, band_high=0.0)
    text = plan.report(top=0)
    assert "step time       800 ms (a lower bound: see 'rests on')" in text
    assert "rests on        an uncalibrated roofline (datasheet peaks): a lower bound, not a prediction" in text
    assert plan.predicted.band_s is None


def test_report_groups_layers():
    text = _synthetic_plan(96).report(top=3)
    assert re.search(r"^  h\.\*\.attn\.weight\s+x96\s+batch x column\s+\(R, S\(0\)\)\s+288 MiB$", text, re.M), text
    assert re.search(r"^  h\.\[0-4,7-8,10-95\]\.mlp\.weight\s+x93\s+batch x column", text, re.M), text
    assert re.search(r"^  h\.\[5-6,9\]\.mlp\.weight\s+x3\s+zero3\s+\(S\(0\), R\)", text, re.M), text
    assert len([ln for ln in text.splitlines() if ln.startswith("  h.")]) == 3
    assert ("step time       800 ms (likely 640 ms-1.00 s)  (compute 500 ms (62%), blocking communication 250 ms "
            "(31%), exposed gradient sync 50.0 ms of 100 ms queued during the backward)") in text
    assert "utilisation     MFU 50%, HFU 62%" in text
    assert "rests on        the preset's efficiency tables" in text
    assert "peak memory     70.0 GiB per device, 109.4% of the budget, at backward: linear" in text
    assert "costs from      no profile: 0% of compute time measured" in text
    assert "dp: 1.00 GiB, tp: 0 B" in text
    assert "Top 3 nodes" in text and re.search(r"^  linear\s+linear\s+h\.0\.attn", text, re.M)
    assert "no sharding rule for aten.foo.default" in text and "exceeds the budget" in text


@slow
def test_demo_end_to_end():
    """`autopar demo --mesh 2 --steps 2` (2 gloo processes): the sharded and single-device losses agree."""
    proc = subprocess.run([sys.executable, "-m", "autopar", "demo", "--mesh", "2", "--steps", "2"],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "starting 2 gloo processes" in proc.stderr
    assert "autopar plan: GPT on 2 devices" in out
    rows = re.findall(r"^\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \|\s+(\S+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1], out
    for _, a, b, _ in rows:
        assert abs(float(a) - float(b)) < 1e-4
    m = re.search(r"max abs diff: (\S+) \(OK", out)
    assert m and float(m.group(1)) < 1e-4, out
    assert "def forward(self, mesh, device" in out and "more lines" in out

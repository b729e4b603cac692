"""compile on a live mesh measures the op calls of the model being planned that the profile lacks
(``autopar.profiling.missing_ops``), so a user's own model is planned on measured costs: the
profile ends up holding every call of the model's strategy space, the plan's compute is all
measured, and nothing is measured when turned off or without a profile. ``autopar profile
--model pkg.module:factory`` measures a user's model ahead of time. With ``profile="auto"`` and
an empty cache, compile measures a first profile of the host (collectives, overheads) and caches
it; turned off, the plan says it rests on an uncalibrated roofline."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import autopar
from autopar.cli import main
from autopar.core.capture import capture
from autopar.core.mesh import MeshSpec, as_mesh_spec
from autopar.core.strategies import build_space
from autopar.profiling.launch import run_on_gloo_mesh, run_on_local_tensor_mesh
from autopar.profiling.missing_ops import quiet
from cost_models.comm import COLLECTIVE_KINDS, Link
from cost_models.profile import OVERHEADS, OpTime, Profile, calibration_key, collective_key, local_fingerprint
from cost_models.profile_ops import op_calls
from tests.tiers import slow

#: A profile entry that no measurement would give: present ops must keep it (not measured again).
SENTINEL = OpTime(1.0, 2.0)
NOT_OPS = ("parameter", "input", "buffer", "output")


class ErfMLP(nn.Module):
    """A user's model with an op no zoo model runs (erf)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.erf(self.up(x))).square().mean()


def factory() -> nn.Module:
    """``autopar profile --model tests.test_missing_ops:factory``."""
    return ErfMLP()


def example_inputs(batch: int, seq: int, device: torch.device) -> tuple:
    return (torch.randn(batch, seq, 16, device=device),)


def _model_keys(spec: MeshSpec) -> list[str]:
    """The op keys of every call of the model's strategy space on ``spec``."""
    captured = capture(factory(), example_inputs(8, 4, torch.device("cpu")))
    with quiet("autopar.core.strategies"):   # the planner already says which ops have no rule
        return [c.key for c in op_calls(build_space(captured, spec), spec.shape)]


def _partial_profile(spec: MeshSpec) -> Profile:
    """A profile of this host and mesh size holding one of the model's calls (the sentinel)."""
    return Profile(local_fingerprint(spec), {_model_keys(spec)[0]: SENTINEL})


def _compile(mesh: Any, profile: str | None, measure: bool) -> dict[str, Any]:
    """Compile the model on ``mesh`` with ``profile`` ("object": a partial ``Profile``; "file:PATH":
    that file; else the option as is), counting the calls this rank times."""
    import autopar
    import autopar.profiling.missing_ops as missing_ops

    spec = as_mesh_spec(mesh)
    timed: list[int] = []
    time_op_calls = missing_ops.time_op_calls

    def counting(calls: Any, **kwargs: Any) -> dict[str, OpTime]:
        calls = list(calls)
        timed.append(len(calls))
        return time_op_calls(calls, **kwargs)

    missing_ops.time_op_calls = counting
    option: Any = _partial_profile(spec) if profile == "object" else profile
    if profile is not None and profile.startswith("file:"):
        option = profile.removeprefix("file:")
    torch.manual_seed(0)
    try:
        module = autopar.compile(factory(), mesh, example_inputs(8, 4, torch.device("cpu")), profile=option,
                                 measure_missing_ops=measure, time_limit=10)
    finally:
        missing_ops.time_op_calls = time_op_calls
    keys = _model_keys(spec)
    held = option.ops if isinstance(option, Profile) else {}
    return {"timed": sum(timed), "keys": len(keys), "missing": sum(k not in held for k in keys),
            "sentinel": held.get(keys[0]), "cost_source": module.plan.predicted.cost_source,
            "roofline_ops": [n.name for n in module.plan.nodes if n.op not in NOT_OPS and n.source.startswith("roofline")]}


@slow
def test_compile_measures_the_ops_the_profile_lacks_on_every_rank():
    results = run_on_gloo_mesh(_compile, (2,), "object", True, timeout_s=120, start_method="forkserver")
    for rank, r in enumerate(results):
        assert r["missing"] == 0, (rank, r)                      # every call of the space is in the profile now
        assert r["timed"] == r["keys"] - 1, (rank, r)            # each rank timed all the missing ones, no others
        assert r["sentinel"] == SENTINEL, (rank, r)              # a call the profile held is not measured again
        assert r["roofline_ops"] == [], (rank, r)              # the plan prices every op as measured


@slow
def test_measured_ops_are_saved_to_the_profile_file(tmp_path):
    path = tmp_path / "profile.json"
    _partial_profile(MeshSpec((2,), hardware="cpu")).to_json(path)
    results = run_on_gloo_mesh(_compile, (2,), f"file:{path}", True, timeout_s=120, start_method="forkserver")
    saved = Profile.from_json(path)
    assert all(k in saved.ops for k in _model_keys(MeshSpec((2,), hardware="cpu")))
    assert saved.ops[_model_keys(MeshSpec((2,), hardware="cpu"))[0]] == SENTINEL
    assert all(r["timed"] == r["keys"] - 1 for r in results), results


@slow
def test_turned_off_nothing_is_measured():
    results = run_on_gloo_mesh(_compile, (2,), "object", False, timeout_s=120, start_method="forkserver")
    for r in results:
        assert r["timed"] == 0 and r["missing"] == r["keys"] - 1, r
        assert r["roofline_ops"], r


@slow
def test_without_a_profile_nothing_is_measured():
    for r in run_on_gloo_mesh(_compile, (2,), None, True, timeout_s=120, start_method="forkserver"):
        assert r["timed"] == 0 and r["cost_source"].startswith("no profile"), r


def test_simulated_ranks_measure_here_and_save_nothing(tmp_path):
    """One process simulating two ranks times the calls alone: the plan uses them, the file is
    left as it was (times taken alone do not describe two processes sharing the cores)."""
    path = tmp_path / "profile.json"
    _partial_profile(MeshSpec((2,), hardware="cpu")).to_json(path)
    before = json.loads(Path(path).read_text())
    simulated = run_on_local_tensor_mesh(_compile, (2,), "object", True)
    assert simulated["missing"] == 0 and simulated["timed"] == simulated["keys"] - 1, simulated
    from_file = run_on_local_tensor_mesh(_compile, (2,), f"file:{path}", True)
    assert from_file["timed"] == from_file["keys"] - 1, from_file
    assert json.loads(Path(path).read_text()) == before


@slow
def test_profile_command_measures_a_user_factory_model(tmp_path, capsys):
    """``autopar profile --model pkg.module:factory`` on a profile already calibrated, with its
    collectives and overheads (so only the model's ops are timed): the file gains every call."""
    spec = MeshSpec((2,), hardware="cpu")
    path = tmp_path / "profile.json"
    link = Link(bandwidth=1e9, latency=1e-4)
    Profile(local_fingerprint(spec), collectives={collective_key(kind, 2): link for kind in COLLECTIVE_KINDS},
            overheads={key: 1e-6 for key in OVERHEADS},
            calibration={"ops": 1.0, "overheads": 1.0, calibration_key("comm", (2,)): 1.0,
                         calibration_key("sync", (2,)): 1.0}).to_json(path)
    assert main(["profile", "--model", "tests.test_missing_ops:factory", "--mesh", "2", "--batch", "8", "--seq", "4",
                 "--out", str(path)]) == 0
    saved = Profile.from_json(path)
    assert all(k in saved.ops for k in _model_keys(spec)), capsys.readouterr().err


def _first_compiles(mesh: Any, profile_dir: str, first_profile: str, options: list[dict]) -> list[dict[str, Any]]:
    """Compile the model on ``mesh`` once with each of ``options`` in turn (default options
    otherwise: ``profile="auto"``), the profile cache at ``profile_dir`` and
    ``FIRST_PROFILE_ENV`` set to ``first_profile``; per compile, what it measured (op calls
    timed, collective sweeps, overhead runs) and how its plan was priced."""
    import autopar
    import autopar.profiling.missing_ops as missing_ops
    import autopar.profiling.profile_comm as profile_comm

    os.environ["AUTOPAR_PROFILE_DIR"] = profile_dir
    os.environ[missing_ops.FIRST_PROFILE_ENV] = first_profile
    counts = {"ops": 0, "collectives": 0, "overheads": 0}
    real = {"ops": (missing_ops, "time_op_calls"), "collectives": (profile_comm, "time_collectives"),
            "overheads": (profile_comm, "time_overheads")}
    originals = {what: getattr(module, name) for what, (module, name) in real.items()}

    def counting(what: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            counts[what] += len(list(args[0])) if what == "ops" else 1
            return originals[what](*args, **kwargs)
        return run

    for what, (module, name) in real.items():
        setattr(module, name, counting(what))
    results = []
    try:
        for option in options:
            counts.update(ops=0, collectives=0, overheads=0)
            torch.manual_seed(0)
            plan = autopar.compile(factory(), mesh, example_inputs(8, 4, torch.device("cpu")), time_limit=10,
                                   **option).plan
            results.append({**counts, "cost_source": plan.predicted.cost_source, "profiled": plan.predicted.profiled,
                            "report": plan.report(top=0), "files": sorted(os.listdir(profile_dir)),
                            "roofline_ops": [n.name for n in plan.nodes
                                             if n.op not in NOT_OPS and n.source.startswith("roofline")]})
    finally:
        for what, (module, name) in real.items():
            setattr(module, name, originals[what])
    return results


@slow
def test_compile_with_no_cached_profile_measures_one_and_caches_it(tmp_path):
    """The first compile with default options measures the collectives, the runtime overheads and
    every op call of the model on both ranks and caches them; a second compile measures nothing."""
    spec = MeshSpec((2,), hardware="cpu")
    results = run_on_gloo_mesh(_first_compiles, (2,), str(tmp_path), "1", [{}, {}], timeout_s=240,
                               start_method="forkserver")
    saved = Profile.from_json(tmp_path / os.listdir(tmp_path)[0])
    assert saved.fingerprint == local_fingerprint(spec)
    assert {collective_key(kind, 2) for kind in COLLECTIVE_KINDS if kind != "broadcast"} <= saved.collectives.keys()
    assert set(OVERHEADS) <= saved.overheads.keys() and "overlap" in saved.calibration
    assert all(k in saved.ops for k in _model_keys(spec))
    for rank, (first, second) in enumerate(results):
        assert first["collectives"] == 1 and first["overheads"] == 1, (rank, first)
        assert first["ops"] == len(_model_keys(spec)), (rank, first)
        assert first["profiled"] and first["roofline_ops"] == [], (rank, first)
        assert len(first["files"]) == 1, (rank, first)
        assert (second["ops"], second["collectives"], second["overheads"]) == (0, 0, 0), (rank, second)
        assert second["profiled"], (rank, second)


@slow
def test_turned_off_compile_measures_no_first_profile_and_says_roofline(tmp_path):
    """With ``AUTOPAR_MEASURE_FIRST_PROFILE=0``, or ``measure_missing_ops=False``, an empty cache
    stays empty and the plan says it rests on an uncalibrated roofline, not on measurements."""
    results = run_on_gloo_mesh(_first_compiles, (2,), str(tmp_path), "0", [{}], timeout_s=240,
                               start_method="forkserver")
    results += run_on_gloo_mesh(_first_compiles, (2,), str(tmp_path), "1", [{"measure_missing_ops": False}],
                                timeout_s=240, start_method="forkserver")
    assert os.listdir(tmp_path) == []
    for rank, (r,) in enumerate(results):
        assert (r["ops"], r["collectives"], r["overheads"]) == (0, 0, 0), (rank, r)
        assert not r["profiled"] and r["cost_source"].startswith("no profile"), (rank, r)
        _says_uncalibrated_roofline(r["report"], r["cost_source"])


def _says_uncalibrated_roofline(report: str, cost_source: str) -> None:
    """The report of a plan priced without a profile says so: its costs come from the roofline,
    nothing measured, and it rests on an uncalibrated roofline."""
    assert "roofline" in cost_source and "0% of compute time measured" in cost_source, cost_source
    assert f"  costs from      {cost_source}" in report, report
    assert "uncalibrated roofline" in report, report


def test_a_plan_priced_without_a_profile_says_it_is_an_uncalibrated_roofline():
    plan = autopar.plan(factory(), MeshSpec((2,), hardware="cpu"), example_inputs(8, 4, torch.device("cpu")),
                        profile=None, time_limit=10)
    assert not plan.predicted.profiled and plan.predicted.cost_source.startswith("no profile")
    _says_uncalibrated_roofline(plan.report(top=0), plan.predicted.cost_source)

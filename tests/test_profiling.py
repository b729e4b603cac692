"""Profiles: JSON that refuses what it should, a cache keyed by hardware fingerprint, and the
planner using measured numbers when (and only when) a profile of this host matches."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

import autopar
from autopar import MeshSpec
from autopar.models.zoo import get_model
from autopar.profiling.profiler import profile_model
from cost_models.comm import Link
from cost_models.profile import (
    MEASURED_KINDS,
    OVERHEADS,
    PROFILE_VERSION,
    OpTime,
    Profile,
    ProfileError,
    default_profile_path,
    find_profile,
    local_fingerprint,
    missing_kinds,
    resolve_profile,
)
from tests.tiers import slow


def _profile(fingerprint: dict) -> Profile:
    return Profile(fingerprint, ops={"aten.neg.default(float32[2],){}": OpTime(1e-5, 2e-5)},
                   collectives={"all_reduce@2": Link(bandwidth=1e9, latency=1e-4)}, overheads={"local_op": 1e-4})


def test_json_round_trip_is_exact(tmp_path):
    p = _profile(local_fingerprint(MeshSpec((2,), hardware="cpu")))
    path = tmp_path / "p.json"
    p.to_json(path)
    back = Profile.from_json(path)
    assert back == p and Profile.from_json(p.to_json()) == p


@pytest.mark.parametrize("text, needle", [
    ('{"autopar_profile_version": 99}', "version-99"),
    ('{"autopar_profile_version": %d, "fingerprint": {}}' % PROFILE_VERSION, "not an autopar profile"),
    ("[1, 2]", "not an autopar profile"),
])
def test_foreign_or_stale_profiles_are_refused(tmp_path, text, needle):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=needle):
        Profile.from_json(path)


def test_a_profile_of_other_hardware_is_refused_for_this_host():
    mesh = MeshSpec((2,), hardware="cpu")
    other = _profile({**local_fingerprint(mesh), "device_name": "some other CPU"})
    with pytest.raises(ProfileError, match="other hardware"):
        resolve_profile(other, mesh)
    # planning for hardware that is not at hand uses its preset, whatever the cache holds
    assert resolve_profile("auto", MeshSpec((8,), hardware="h100-80gb")) is None
    assert resolve_profile(None, mesh) is None


@slow
def test_profile_then_plan_uses_measured_numbers(tmp_path, monkeypatch, caplog):
    """End to end on one local process: profile the tiny GPT, find it in the cache, plan with it;
    profiling again measures nothing new."""
    monkeypatch.setenv("AUTOPAR_PROFILE_DIR", str(tmp_path))
    entry = get_model("gpt-tiny")
    model = entry.build()
    args, kwargs = entry.example(2, 8)
    mesh = MeshSpec((1,), hardware="cpu")
    assert find_profile(mesh) is None
    roofline = autopar.plan(model, mesh, args, kwargs)
    assert roofline.predicted.cost_source.startswith("no profile")

    stale = default_profile_path(local_fingerprint(mesh))   # left by an older autopar: measured afresh
    stale.write_text('{"autopar_profile_version": %d}' % (PROFILE_VERSION - 1))
    with caplog.at_level("WARNING"):   # and meanwhile, plans use the presets
        assert autopar.plan(model, mesh, args, kwargs).predicted.cost_source.startswith("no profile")
    assert "version" in caplog.text and "autopar profile" in caplog.text
    profile, path = profile_model(model, mesh, args, kwargs, progress=None)
    assert "no sharding rule" not in caplog.text   # bert-tiny's gather, in calibration, is not the user's
    assert path == stale and json.loads(path.read_text())["autopar_profile_version"] == PROFILE_VERSION
    assert path.parent == tmp_path and json.loads(path.read_text())["fingerprint"] == local_fingerprint(mesh)
    assert profile.ops and all(t.fwd_s > 0 for t in profile.ops.values())
    assert set(OVERHEADS) == set(profile.overheads)
    assert set(profile.calibration) == {"ops", "overheads"}   # fitted on the calibration workloads
    assert find_profile(mesh) == profile

    measured = autopar.plan(model, mesh, args, kwargs)
    assert measured.predicted.cost_source.startswith("profile")
    linears = [n for n in measured.nodes if n.op == "aten.linear.default"]
    assert linears and all(n.source.startswith("measured") for n in linears)
    assert measured.predicted.step_time_s != roofline.predicted.step_time_s

    lines = []
    again, _ = profile_model(model, mesh, args, kwargs, progress=lines.append)
    assert lines[0].startswith("0 op calls to time") and again == profile


def test_a_second_mesh_shape_keeps_the_overheads_its_calibration_was_fitted_on(monkeypatch, tmp_path):
    """2x2 after 4 (as many processes, one profile) times the collectives it lacks, not the runtime
    overheads and overlap again: the "overheads" factor was fitted against the first numbers, and on
    shared cores a second measurement can differ by half."""
    from autopar.profiling import profiler as profiling

    square = MeshSpec((2, 2), hardware="cpu")
    path = tmp_path / "p.json"
    fitted = {"ops": 1.3, "overheads": 0.6, "overlap": 0.25, "comm@4": 1.4, "sync@4": 0.5}
    Profile(local_fingerprint(square), collectives={f"{k}@4": Link(bandwidth=1e9, latency=1e-4) for k in
                                                    ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")},
            overheads={k: 1e-4 for k in OVERHEADS}, calibration=fitted).to_json(path)
    asked = []

    def fake_mesh_run(worker, shape, portable, need_comm, need_overheads, *rest, **kw):
        asked.append((shape, need_comm, need_overheads))
        links = {f"{k}@2": Link(bandwidth=2e9, latency=5e-5) for k in ("all_gather", "all_reduce")}
        return [({}, links, {}, {})]

    monkeypatch.setattr(profiling, "run_on_gloo_mesh", fake_mesh_run)
    entry = get_model("gpt-tiny")
    args, kwargs = entry.example(2, 8)
    profile, _ = profile_model(entry.build(), square, args, kwargs, path=path, progress=None, calibrate=False)
    assert asked == [((2, 2), MEASURED_KINDS, False)]   # every kind: the profile has none on 2 ranks
    assert profile.overheads == {k: 1e-4 for k in OVERHEADS} and profile.calibration == fitted
    assert profile.link("all_reduce", 2).bandwidth == 2e9 and profile.link("all_reduce", 4).bandwidth == 1e9


def test_a_profile_measured_before_a_collective_kind_existed_gets_that_kind_alone():
    """Measuring again for a profile that lacks a kind times only what it lacks (the links held
    are those its calibration was fitted against); meanwhile it prices the kind on its stand-in."""
    fingerprint = local_fingerprint(MeshSpec((2, 2), hardware="cpu"))
    link = Link(bandwidth=1e9, latency=1e-4)
    older = Profile(fingerprint, collectives={f"{k}@2": link for k in MEASURED_KINDS if k != "all_to_all_single"})
    assert missing_kinds(older, (2, 1)) == ("all_to_all_single",) and missing_kinds(older, (1, 1)) == ()
    assert missing_kinds(None, (4,)) == MEASURED_KINDS
    assert older.link("all_to_all_single", 2) == older.link("all_to_all", 2) == link
    assert older.link("all_to_all_single", 4) is None


def test_a_measuring_launch_has_time_for_every_op_call_it_times(monkeypatch, tmp_path):
    """A model's few hundred op calls take minutes on shared cores before the collectives: the
    launch's time limit grows with the calls (gpt2-125m's 367 on 4 processes timed out at a
    fixed 300 s)."""
    from autopar.profiling import profiler as profiling

    limits = []

    def fake_mesh_run(worker, shape, portable, *rest, timeout_s, **kw):
        limits.append((len(portable), timeout_s))
        return [({}, {}, {}, {})]

    monkeypatch.setattr(profiling, "run_on_gloo_mesh", fake_mesh_run)
    entry = get_model("gpt-tiny")
    args, kwargs = entry.example(2, 8)
    profile_model(entry.build(), MeshSpec((2,), hardware="cpu"), args, kwargs, path=tmp_path / "p.json",
                  progress=None, calibrate=False)
    [(calls, limit)] = limits
    assert calls > 10 and limit == profiling.MEASURE_TIMEOUT_S + profiling.OP_CALL_TIMEOUT_S * calls


def test_collectives_are_calibrated_per_mesh_shape(monkeypatch, tmp_path):
    """A second mesh shape of as many processes (2x2 after 4) fits its own collective factors and
    reuses the ops and overheads factors, timing no replicated plan again; a calibrated shape is
    not calibrated again."""
    from autopar.profiling import profiler as profiling
    from autopar.profiling.profiler import _calibrate, _Row, _uncalibrated

    asked = []

    def rows(spec, path, workloads, replicated, collective_workloads, expert_workloads):
        asked.append(replicated)
        talking = [_Row(f"{name} {batch}x{seq} ddp", "ddp", 0.02 + 1.2 * 0.01 + 1.0 * 0.005 + 3.0 * comm + 2.0 * sync,
                        ops=0.01, overheads=0.005, comm=comm, sync=sync, rest=0.02)
                   for name, sizes in (*workloads, *collective_workloads) for batch, seq in sizes
                   for comm, sync in [(0.001 * batch, 0.0005 * seq)]]
        # the experts' all-to-alls at 1.7x beside other collectives at the factors above
        routed = [_Row(f"{name} {batch}x{seq} ddp", "ddp", 0.02 + 1.2 * 0.01 + 1.0 * 0.005 + 3.0 * 0.002 + 2.0 * 0.001
                       + 1.7 * experts, ops=0.01, overheads=0.005, comm=0.002, sync=0.001, rest=0.02, experts=experts)
                  for name, sizes in expert_workloads for batch, seq in sizes for experts in [0.0004 * batch]]
        return talking + routed

    monkeypatch.setattr(profiling, "_calibration_rows", rows)
    known = {"ops": 1.2, "overheads": 1.0, "comm@4": 1.5, "sync@4": 0.7, "overlap": 0.3}
    square = MeshSpec((2, 2), hardware="cpu")
    assert _uncalibrated(Profile({}, calibration=known), square)
    assert not _uncalibrated(Profile({}, calibration=known), MeshSpec((4,), hardware="cpu"))
    factors = _calibrate(square, tmp_path / "p.json", lambda line: None, known)
    assert asked and not any(asked)   # ops and overheads known: no replicated plan timed
    assert factors == pytest.approx({"ops": 1.2, "overheads": 1.0, "comm@2x2": 3.0, "sync@2x2": 2.0,
                                     "experts@2x2": 1.7})
    assert not _uncalibrated(Profile({}, calibration={**known, **factors}), square)


def test_calibration_fit_recovers_in_step_factors():
    """The two-stage calibration fit: factors that generated the steps come back; a factor the
    data cannot see stays 1; one far outside [0.5, 4] is clamped (noise, not the machine)."""
    from autopar.profiling.profiler import _fit, _Row

    rows = [_Row(f"r{k}", "ddp", measured=0.0, ops=o, overheads=h, comm=c, sync=y, rest=0.01)
            for k, (o, h, c, y) in enumerate([(0.01, 0.02, 0.03, 0.0), (0.04, 0.02, 0.05, 0.02),
                                              (0.09, 0.02, 0.01, 0.06)])]
    rows = [replace(r, measured=r.rest + 1.5 * r.ops + 0.75 * r.overheads + 2 * r.comm + 0.6 * r.sync) for r in rows]
    a, b = _fit(rows, lambda r: (r.ops, r.overheads), lambda r: r.unfitted - 2 * r.comm - 0.6 * r.sync)
    c, d = _fit(rows, lambda r: (r.comm, r.sync), lambda r: r.unfitted - a * r.ops - b * r.overheads)
    assert (a, b, c, d) == pytest.approx((1.5, 0.75, 2.0, 0.6))
    assert _fit(rows, lambda r: (r.comm, 0.0), lambda r: 2 * r.comm) == pytest.approx((2.0, 1.0))
    assert _fit(rows, lambda r: (r.comm, r.sync), lambda r: 100 * r.comm) == pytest.approx((4.0, 0.5))


def test_calibration_fits_in_error_relative_to_each_step():
    """Steps of 2 ms and of 300 ms count alike, as cost_accuracy scores them: the short step's
    factor (2) is not drowned by the long one's (3), as it is in absolute seconds (3.0)."""
    from autopar.profiling.profiler import _fit, _Row

    rows = [_Row(f"r{k}", "ddp", measured=y, ops=0.0, overheads=0.0, comm=x, sync=0.0, rest=0.0)
            for k, (x, y) in enumerate([(0.001, 0.002), (0.1, 0.3)])]
    relative = [(x / y, 1.0) for x, y in ((0.001, 0.002), (0.1, 0.3))]
    expected = sum(a * b for a, b in relative) / sum(a * a for a, _ in relative)
    assert _fit(rows, lambda r: (r.comm, 0.0), lambda r: r.measured)[0] == pytest.approx(expected)
    assert 2.2 < expected < 2.4


@slow
def test_collective_factors_are_fitted_on_a_heavier_workload_too(monkeypatch, tmp_path):
    """On several devices calibration also times a heavier workload's data- and tensor-parallel
    plans (its stretches of compute between collectives are real models'), not its replicated
    plan: that one would weigh in the ops factor, fitted on the tiny workloads."""
    from autopar.profiling import profiler as profiling
    from cost_models.profile import calibration_key

    spec = MeshSpec((2,), hardware="cpu")
    path = tmp_path / "p.json"
    Profile(local_fingerprint(spec)).to_json(path)
    timed = []

    def fake_mesh_run(worker, shape, plans, **kw):
        timed.extend(key for key, _ in plans)
        return [{key: [0.1] for key, _ in plans}]

    monkeypatch.setattr(profiling, "run_on_gloo_mesh", fake_mesh_run)
    monkeypatch.setattr(profiling, "_measure", lambda *args, **kwargs: None)
    factors = profiling._calibrate(spec, path, lambda line: None, {})
    (heavy_model, heavy_sizes), = profiling.COLLECTIVE_CALIBRATION
    heavy = {key[3] for key in timed if (key[0], (key[1], key[2])) in {(heavy_model, s) for s in heavy_sizes}}
    assert heavy == {"ddp", "tp"}
    assert {key[3] for key in timed} == {"replicated", "ddp", "tp"}
    assert {"ops", "overheads", *(calibration_key(f, (2,)) for f in ("comm", "sync", "experts"))} <= set(factors)
    (moe_model, moe_sizes), = profiling.EXPERT_CALIBRATION
    assert {key[1:] for key in timed if key[0] == moe_model} == {(*s, "ddp") for s in moe_sizes}

"""The host probe: seconds measured while the host ran slow are scaled to its typical speed, in
every measurement that takes turns with the probe and in every profile that merges them."""
from __future__ import annotations

import time

import pytest
import torch

from benchmarks.cost_accuracy import finish_record, format_summary, summarize
from cost_models import profile_ops
from cost_models.comm import Link
from cost_models.host_speed import NOMINAL_PROBE_S, HostClock, typical_probe_s
from cost_models.profile import OpTime, Profile
from cost_models.profile_comm import _mean_seconds
from cost_models.profile_ops import OpCall, time_op_calls

KEY = "op"


def test_scaling_divides_by_how_much_slower_the_probe_ran():
    clock = HostClock()
    assert clock.calls >= 1
    slow_run = 2 * NOMINAL_PROBE_S * clock.calls   # the probe took twice the nominal time
    assert clock.scaled([0.5, 0.25], slow_run) == pytest.approx([0.25, 0.125])
    assert clock.scaled([0.5], slow_run, to=3 * NOMINAL_PROBE_S) == pytest.approx([0.75])
    assert clock.samples == pytest.approx([2 * NOMINAL_PROBE_S] * 2)
    assert typical_probe_s([3.0, 1.0, 2.0]) == 2.0 and typical_probe_s([]) is None


def test_op_timings_are_scaled_by_the_probe_run_beside_them(monkeypatch):
    """Every batch of op calls is followed by a probe run; a probe four times slower than nominal
    divides the op's median by four."""
    clock = HostClock()
    clock.calls = 10

    def batch_seconds(fn, n, device):
        return 4 * NOMINAL_PROBE_S * clock.calls if fn == clock.probe else 1e-3 * n

    monkeypatch.setattr(profile_ops, "_batch_seconds", batch_seconds)
    call = OpCall(torch.ops.aten.neg.default, (torch.empty(4, device="meta"),), {})
    times = time_op_calls([call], min_time_s=1e-3, repeats=3, clock=clock)
    assert times[call.key].fwd_s == pytest.approx(1e-3 / 4) and times[call.key].bwd_s == pytest.approx(1e-3 / 4)
    assert clock.samples == pytest.approx([4 * NOMINAL_PROBE_S] * 2)   # one per forward, one per backward


def test_lockstep_timings_take_turns_with_the_probe():
    clock = HostClock()
    clock.calls = 1
    clock.probe = lambda: time.sleep(4e-3)   # a probe call 40x the nominal one
    (scaled,) = _mean_seconds([lambda: time.sleep(2e-3)], repeats=5, clock=clock)
    assert scaled == pytest.approx(2e-3 / 40, rel=0.3)   # sleeps overshoot a little, alike
    assert len(clock.samples) == 1


def _profile(op_s: float, probes: list[float]) -> Profile:
    return Profile({"device": "cpu"}, ops={KEY: OpTime(op_s, 2 * op_s)},
                   collectives={"all_reduce@2": Link(bandwidth=1e9, latency=op_s)}, overheads={"local_op": op_s},
                   host_probe_s=probes)


def test_a_profile_measured_at_the_nominal_speed_is_kept_at_its_samples_typical_speed():
    p = Profile.measured({"device": "cpu"}, {KEY: OpTime(1.0, 2.0)}, {}, {"step": 1.0}, {},
                         [NOMINAL_PROBE_S, 3 * NOMINAL_PROBE_S, 3 * NOMINAL_PROBE_S])
    assert p.ops[KEY] == OpTime(3.0, 6.0) and p.overheads["step"] == 3.0
    cuda = Profile.measured({"device": "cuda"}, {KEY: OpTime(1.0, 2.0)}, {}, {}, {}, [])
    assert cuda.ops[KEY] == OpTime(1.0, 2.0)


def test_merging_brings_both_profiles_to_the_typical_speed_of_all_samples():
    """Three samples at speed 1, one at a spell three times slower: the typical speed is 1, so the
    numbers measured in the slow spell (3x larger) come back to 1; bandwidths go the other way."""
    fast = _profile(1.0, [1e-4] * 3)
    slow = _profile(3.0, [3e-4])
    slow.ops["other"] = OpTime(6.0, 0.0)
    fast.merge(slow)
    assert fast.ops[KEY].fwd_s == pytest.approx(1.0) and fast.ops["other"].fwd_s == pytest.approx(2.0)
    assert fast.overheads["local_op"] == pytest.approx(1.0)
    assert fast.collectives["all_reduce@2"].bandwidth == pytest.approx(3e9)   # measured fast, then the slow copy won
    assert sorted(fast.host_probe_s) == [1e-4] * 3 + [3e-4]
    # The typical speed moved: the fast profile's own numbers move with it.
    half = _profile(1.0, [1e-4])
    half.merge(Profile({"device": "cpu"}, ops={"other": OpTime(1.0, 0.0)}, host_probe_s=[3e-4, 3e-4]))
    assert half.ops[KEY].fwd_s == pytest.approx(3.0) and half.ops["other"].fwd_s == pytest.approx(1.0)
    assert half.host_probe_s.count(3e-4) == 2
    assert Profile.from_json(half.to_json()) == half


def test_the_benchmark_separates_host_drift_from_model_error():
    """A launch run while the probe took twice its typical time: the host ran at 50%, and its
    steps at the typical speed match the prediction exactly."""
    record = {"label": "m", "status": "ok", "plan_json": "{}", "typical_probe_s": 1e-4,
              "predicted": {"step_time_s": 0.1, "peak_memory_bytes": 100},
              "launches": [{"step_s": 0.2, "slowest_rank_steps_s": [0.2, 0.2], "peak_bytes": 100, "probe_s": 2e-4}]}
    finish_record(record)
    assert record["step_error_pct"] == pytest.approx(-50) and record["host_speed_pct"] == pytest.approx(50)
    assert record["step_error_at_typical_speed_pct"] == pytest.approx(0)
    summary = summarize([record])
    assert summary["step_at_typical_speed_worst_abs_pct"] == pytest.approx(0)
    assert "host drift" in format_summary(summary)

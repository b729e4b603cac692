"""Fast unit tests of the v0 cost-model primitives (hardware, comm, compute)."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
import torch

from autopar.core.errors import HardwareError
from autopar.core.hardware import PRESETS, Hardware, get_hardware, hardware_from_dict, hardware_to_dict
from cost_models.comm import COLLECTIVE_KINDS, Link, collective_time, crosses_nodes, link_for_axis
from cost_models.compute import compute_time
from cost_models.efficiency import efficiency_of

GiB = 2**30
BIG = 4 * GiB  # bandwidth-dominated on every link below
LINK = Link(bandwidth=100e9, latency=5e-6)


# --------------------------------------------------------------------------- comm


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_doubling_bytes_roughly_doubles_bandwidth_bound_time(kind):
    t1 = collective_time(kind, BIG, 8, LINK)
    t2 = collective_time(kind, 2 * BIG, 8, LINK)
    assert t2 / t1 == pytest.approx(2.0, rel=1e-3)


def test_all_reduce_is_twice_all_gather_at_large_sizes():
    for n in (2, 4, 8, 64):
        ar = collective_time("all_reduce", BIG, n, LINK)
        ag = collective_time("all_gather", BIG, n, LINK)
        rs = collective_time("reduce_scatter", BIG, n, LINK)
        assert ar / ag == pytest.approx(2.0, rel=1e-3)
        assert rs == ag
        assert ar == pytest.approx(ag + rs)  # ring all_reduce = reduce_scatter + all_gather


def test_exact_ring_formulas():
    a, bw, N, n = LINK.latency, LINK.bandwidth, 3e6, 4
    assert collective_time("all_reduce", N, n, LINK) == pytest.approx(2 * 3 * a + 2 * 3 / 4 * N / bw)
    assert collective_time("all_gather", N, n, LINK) == pytest.approx(3 * a + 3 / 4 * N / bw)
    assert collective_time("reduce_scatter", N, n, LINK) == pytest.approx(3 * a + 3 / 4 * N / bw)
    assert collective_time("all_to_all", N, n, LINK) == pytest.approx(3 * a + 3 / 4 * N / bw)
    assert collective_time("broadcast", N, n, LINK) == pytest.approx(3 * a + N / bw)
    assert collective_time("send_recv", N, n, LINK) == pytest.approx(a + N / bw)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_large_message_time_grows_with_n_by_n_minus_1_over_n(kind):
    no_latency = Link(bandwidth=LINK.bandwidth, latency=0.0)
    base = collective_time(kind, BIG, 2, no_latency)  # factor (2-1)/2
    for n in (4, 8, 16, 1024):
        t = collective_time(kind, BIG, n, no_latency)
        assert t / base == pytest.approx(((n - 1) / n) / (1 / 2))
    # with latency, at large messages the same ratio holds approximately
    t2, t8 = collective_time(kind, BIG, 2, LINK), collective_time(kind, BIG, 8, LINK)
    assert t8 / t2 == pytest.approx((7 / 8) / (1 / 2), rel=1e-3)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"])
def test_tiny_message_time_is_linear_in_latency_steps(kind):
    tiny = 8.0
    t = {n: collective_time(kind, tiny, n, LINK) for n in (2, 3, 5, 9, 17)}
    steps = {n: t[n] / LINK.latency for n in t}
    per_step = 2 if kind == "all_reduce" else 1
    for n in t:
        assert steps[n] == pytest.approx(per_step * (n - 1), rel=1e-3)
    # equal increments in n -> equal increments in time (linear)
    assert t[17] - t[9] == pytest.approx(2 * (t[9] - t[5]), rel=1e-3)


def test_n_equal_1_and_zero_bytes_cost_nothing():
    for kind in COLLECTIVE_KINDS:
        assert collective_time(kind, BIG, 1, LINK) == 0.0
        assert collective_time(kind, 0, 8, LINK) == 0.0


def test_collective_bad_inputs():
    with pytest.raises(ValueError) as ei:
        collective_time("allreduce", 1.0, 2, LINK)
    for kind in COLLECTIVE_KINDS:
        assert kind in str(ei.value)
    with pytest.raises(ValueError):
        collective_time("all_reduce", -1.0, 2, LINK)
    with pytest.raises(ValueError):
        collective_time("all_reduce", 1.0, 0, LINK)
    with pytest.raises(ValueError):
        Link(bandwidth=0.0, latency=1e-6)
    with pytest.raises(ValueError):
        Link(bandwidth=1e9, latency=-1.0)


def test_link_for_axis_128x8_on_h100():
    hw = get_hardware("h100-80gb")
    links = efficiency_of(hw).links   # what NCCL reaches of each link's datasheet bandwidth
    inner = link_for_axis(hw, (128, 8), 1)
    outer = link_for_axis(hw, (128, 8), 0)
    assert inner == Link(hw.intra_node_bandwidth * links["intra_node"], hw.intra_node_latency)
    assert outer == Link(hw.inter_node_bandwidth * links["inter_node"], hw.inter_node_latency)
    assert link_for_axis(hw, (128, 8), -1) == inner
    assert inner.bandwidth > outer.bandwidth


def test_link_for_axis_edge_cases():
    hw = get_hardware("h100-80gb")  # 8 devices per node
    links = efficiency_of(hw).links
    intra = Link(hw.intra_node_bandwidth * links["intra_node"], hw.intra_node_latency)
    inter = Link(hw.inter_node_bandwidth * links["inter_node"], hw.inter_node_latency)
    # (2, 4): axis 0 spans 8 ranks -> still one node
    assert link_for_axis(hw, (2, 4), 0) == intra
    assert link_for_axis(hw, (4, 2, 4), 1) == intra
    assert link_for_axis(hw, (4, 2, 4), 0) == inter
    # a 3-wide axis on 8-GPU nodes: groups {6,7,8} straddle a node boundary
    assert link_for_axis(hw, (4, 3), 1) == inter
    # ... but not when the whole mesh is inside one node
    assert link_for_axis(hw, (2, 3), 1) == intra
    assert [crosses_nodes(hw, (4, 2, 4), a) for a in range(3)] == [True, False, False]
    assert link_for_axis(get_hardware("cpu"), (3,), 0).bandwidth == PRESETS["cpu"].intra_node_bandwidth
    with pytest.raises(ValueError):
        link_for_axis(hw, (128, 8), 2)


# --------------------------------------------------------------------------- compute


def test_compute_time_is_max_of_roofline_terms_plus_overhead():
    hw = get_hardware("a100-80gb")
    peak, bw, ovh = hw.flops_for(torch.bfloat16), hw.memory_bandwidth, hw.op_overhead_s
    # compute bound
    flops, nbytes = 1e13, 1e6
    assert compute_time(flops, nbytes, hw, torch.bfloat16) == pytest.approx(flops / peak + ovh)
    # memory bound
    flops, nbytes = 1e6, 1e10
    assert compute_time(flops, nbytes, hw, torch.bfloat16) == pytest.approx(nbytes / bw + ovh)
    # general: max of the two
    for flops, nbytes in ((3e11, 2e9), (5e12, 1e8), (1.0, 1.0)):
        expect = max(flops / peak, nbytes / bw) + ovh
        assert compute_time(flops, nbytes, hw, torch.bfloat16) == pytest.approx(expect)
    assert compute_time(0, 0, hw, torch.bfloat16) == 0.0
    assert compute_time(0, 8, hw, torch.bfloat16) == pytest.approx(8 / bw + ovh)
    # dtype matters when compute bound: fp32 is 16x slower than bf16 on A100
    assert compute_time(1e13, 0, hw, torch.float32) > 10 * compute_time(1e13, 0, hw, torch.bfloat16)
    assert compute_time(1e13, 0, hw, torch.float32, allow_tf32=True) == pytest.approx(1e13 / 156e12 + ovh)
    with pytest.raises(ValueError):
        compute_time(-1, 0, hw, torch.float32)


def test_flops_for_fallbacks():
    a100, h100, cpu = get_hardware("a100-80gb"), get_hardware("h100-80gb"), get_hardware("cpu")
    assert a100.flops_for(torch.float32) == 19.5e12
    assert a100.flops_for(torch.bfloat16) == 312e12
    assert a100.flops_for(torch.float16) == 312e12
    assert a100.flops_for(torch.float64) == 9.7e12
    assert h100.flops_for(torch.bfloat16) == pytest.approx(989.5e12)
    assert h100.flops_for(torch.float8_e4m3fn) == pytest.approx(1979e12)
    assert a100.flops_for(torch.float8_e4m3fn) == 312e12  # no fp8 on A100 -> bf16 rate
    assert a100.flops_for(torch.int64) == 19.5e12
    assert a100.flops_for(torch.complex64) == pytest.approx(19.5e12 / 4)
    assert cpu.flops_for(torch.float32) == cpu.peak_flops["float32"]
    assert cpu.flops_for(torch.float32, allow_tf32=True) == cpu.peak_flops["float32"]  # no tf32 on cpu
    only_fp32 = dataclasses.replace(cpu, peak_flops={"float32": 1e11})
    assert only_fp32.flops_for(torch.float64) == 0.5e11
    assert only_fp32.flops_for(torch.bfloat16) == 1e11


# --------------------------------------------------------------------------- hardware


def test_presets_exist_and_are_sane():
    for name in ("cpu", "a100-40gb", "a100-80gb", "h100-80gb", "h200"):
        hw = get_hardware(name)
        assert hw is PRESETS[name] and hw.name == name
        assert hw.source
        assert hw.intra_node_bandwidth >= hw.inter_node_bandwidth
        assert hw.intra_node_latency <= hw.inter_node_latency
        for key in ("float32", "bfloat16", "float16"):
            assert key in hw.peak_flops
    assert get_hardware("H100") is PRESETS["h100-80gb"]  # case-insensitive alias
    assert PRESETS["h200"].peak_flops == PRESETS["h100-80gb"].peak_flops
    assert PRESETS["h200"].memory_bandwidth > PRESETS["h100-80gb"].memory_bandwidth
    assert "measured" in PRESETS["cpu"].source.lower() and "2026-11-21" in PRESETS["cpu"].source


def test_unknown_hardware_lists_valid_names():
    with pytest.raises(HardwareError) as ei:
        get_hardware("tpu-v5")
    msg = str(ei.value)
    for name in PRESETS:
        assert name in msg
    with pytest.raises(HardwareError) as ei:
        get_hardware("/nonexistent/dir/hw.json")
    assert "h100-80gb" in str(ei.value)


def test_json_override_file(tmp_path):
    p = tmp_path / "my_cluster.json"
    p.write_text(json.dumps({"base": "h100-80gb", "memory_bytes": 40e9, "devices_per_node": 4,
                             "peak_flops": {"bfloat16": 7e14}}))
    hw = get_hardware(str(p))
    base = PRESETS["h100-80gb"]
    assert hw.memory_bytes == 40e9
    assert hw.devices_per_node == 4
    assert hw.peak_flops["bfloat16"] == 7e14
    assert hw.peak_flops["float32"] == base.peak_flops["float32"]  # merged, not replaced
    assert hw.memory_bandwidth == base.memory_bandwidth
    assert "my_cluster.json" in hw.source and "memory_bytes" in hw.source
    assert get_hardware(p) == hw  # PathLike works too

    # a full description without "base"
    full = hardware_to_dict(PRESETS["cpu"]) | {"name": "my-cpu"}
    q = tmp_path / "full.json"
    q.write_text(json.dumps(full))
    assert get_hardware(str(q)) == dataclasses.replace(PRESETS["cpu"], name="my-cpu")


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"base": "h100-80gb", "memory_byte": 1}', "memory_bytes"),  # typo -> lists valid fields
        ('{"base": "nope"}', "h100-80gb"),
        ('{"base": "h100-80gb", "memory_bytes": -1}', "memory_bytes"),
        ('{"base": "h100-80gb", "devices_per_node": 2.5}', "devices_per_node"),
        ('{"name": "x"}', "missing"),
        ("not json", "JSON"),
    ],
)
def test_bad_json_override_files(tmp_path, content, needle):
    p = tmp_path / "hw.json"
    p.write_text(content)
    with pytest.raises(HardwareError) as ei:
        get_hardware(str(p))
    assert needle in str(ei.value)


def test_hardware_dict_round_trip_is_exact():
    for hw in PRESETS.values():
        d = hardware_to_dict(hw)
        back = hardware_from_dict(json.loads(json.dumps(d)))
        assert back == hw
        assert hardware_to_dict(back) == d
        assert type(d["peak_flops"]) is dict
        for f in dataclasses.fields(hw):
            assert getattr(back, f.name) == getattr(hw, f.name)


def test_hardware_is_immutable_hashable_picklable():
    hw = PRESETS["h100-80gb"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        hw.peak_flops["float32"] = 1.0  # type: ignore[index]
    assert hash(hw) == hash(hardware_from_dict(hardware_to_dict(hw)))
    assert pickle.loads(pickle.dumps(hw)) == hw
    assert copy.deepcopy(hw) == hw
    with pytest.raises(HardwareError):
        Hardware(**(hardware_to_dict(hw) | {"peak_flops": {"bfloat16": 1e15}}))  # no float32 fallback

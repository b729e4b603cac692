"""The GPU efficiency tables (``cost_models.efficiency``): loading, GEMM tiles and waves, attention,
and a GPU preset's plan priced below what real kernels reach, never at the datasheet peak."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from autopar.core.errors import HardwareError
from autopar.core.hardware import PRESETS, get_hardware
from cost_models.efficiency import (
    TABLES,
    GemmShape,
    attention_seconds,
    efficiency_of,
    gemm_seconds,
    load_table,
    op_seconds,
)

aten = torch.ops.aten
GPUS = [name for name, hw in PRESETS.items() if name != "cpu"]


@pytest.mark.parametrize("name", GPUS)
def test_every_gpu_preset_has_a_table_of_fractions_with_sources(name):
    eff = efficiency_of(get_hardware(name))
    assert eff is not None and eff.sms > 0
    fractions = [*eff.gemm.values(), eff.backward_gemm, eff.memory, eff.sustained,
                 *(f for kernel in eff.attention.values() for f in kernel.values())]
    assert all(0 < f <= 1 for f in fractions), fractions
    assert all(part.split(": ", 1)[1].strip() for part in eff.source.split(" | "))   # each section says where from


def test_the_cpu_preset_has_no_table_and_a_bad_table_is_a_clear_error(tmp_path):
    assert efficiency_of(get_hardware("cpu")) is None
    data = json.loads((TABLES / "a100.json").read_text())
    del data["memory"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(HardwareError, match="malformed.*memory"):
        load_table(bad)


def _rate(shape: GemmShape, hw, eff, **kw) -> float:
    return 2 * shape.m * shape.n * shape.k * shape.batch / gemm_seconds(shape, eff, hw, torch.bfloat16, **kw)


def test_a_large_gemm_runs_at_the_tables_fraction_of_peak():
    hw = get_hardware("a100-80gb")
    eff = efficiency_of(hw)
    big = GemmShape(128 * eff.sms * 8, 256, 8192)   # whole tiles in whole waves
    assert _rate(big, hw, eff) == pytest.approx(hw.flops_for(torch.bfloat16) * eff.gemm["bfloat16"])
    assert _rate(big, hw, eff, pass_="backward") == pytest.approx(_rate(big, hw, eff) * eff.backward_gemm)


def test_tile_and_wave_quantisation_slow_a_gemm_that_just_misses_them():
    hw = get_hardware("h100-80gb")
    eff = efficiency_of(hw)
    full = GemmShape(128 * eff.sms, 256, 4096)            # one whole wave of the largest tile
    one_more = GemmShape(128 * eff.sms + 1, 256, 4096)    # one more row: a second, almost empty wave
    assert gemm_seconds(one_more, eff, hw, torch.bfloat16) > 1.05 * gemm_seconds(full, eff, hw, torch.bfloat16)
    small = GemmShape(64, 64, 4096)                       # one small tile: a sliver of the GPU busy
    assert _rate(small, hw, eff) < 0.05 * _rate(full, hw, eff)


def test_causal_attention_does_about_half_the_work_and_short_sequences_run_slower():
    hw = get_hardware("h100-80gb")
    eff = efficiency_of(hw)
    flops = 4 * 8 * 16 * 8192 ** 2 * 128
    args = dict(kernel="flash", pass_="forward")
    whole = attention_seconds(flops, 8192, eff, hw, torch.bfloat16, causal=False, **args)
    causal = attention_seconds(flops, 8192, eff, hw, torch.bfloat16, causal=True, **args)
    assert 0.5 < causal / whole < 0.52
    short = attention_seconds(flops, 256, eff, hw, torch.bfloat16, causal=False, **args)
    assert short > 1.3 * whole
    masked = attention_seconds(flops, 8192, eff, hw, torch.bfloat16, kernel="masked", causal=False, pass_="forward")
    assert masked > whole


def test_op_seconds_prices_a_linear_by_its_gemms_and_other_ops_by_bandwidth():
    hw = get_hardware("a100-80gb")
    eff = efficiency_of(hw)
    m, n, k = 8192, 4096, 4096
    node = SimpleNamespace(target=aten.linear.default, args=(), kwargs={})
    fwd, bwd = op_seconds(node, [(m, k), (n, k)], 2 * m * n * k, 2 * (m * k + n * k + m * n), eff, hw, torch.bfloat16)
    gemm = gemm_seconds(GemmShape(m, n, k), eff, hw, torch.bfloat16)
    assert fwd == pytest.approx(gemm / eff.sustained + hw.op_overhead_s)
    assert bwd == pytest.approx(2 * gemm / eff.backward_gemm / eff.sustained + hw.op_overhead_s, rel=1e-6)
    add = SimpleNamespace(target=aten.add.Tensor, args=(), kwargs={})
    nbytes = 3 * m * n * 2
    fwd, _ = op_seconds(add, [(m, n), (m, n)], m * n, nbytes, eff, hw, torch.bfloat16)
    assert fwd == pytest.approx(nbytes / (hw.memory_bandwidth * eff.memory * eff.sustained) + hw.op_overhead_s)


def test_experts_are_priced_as_their_grouped_gemms_fewer_rows_each_at_a_lower_rate():
    """The MoE op runs one GEMM pair per local expert over its share of the rows routed (uniform):
    the same FLOPs spread over more experts (fewer tokens each, each expert's rows cut into tiles
    on their own) take longer, and never less than the large-GEMM rate allows."""
    from autopar.core.ops.moe import MOE

    hw = get_hardware("h100-80gb")
    eff = efficiency_of(hw)
    node = SimpleNamespace(target=MOE, args=(), kwargs={})
    hidden, inner, k, tokens = 4096, 1408, 6, 4096

    def seconds(experts: int) -> float:
        shapes = [(tokens, hidden), (tokens, k), (tokens, k), (experts, 2 * inner, hidden), (experts, hidden, inner)]
        flops = 2 * tokens * k * 3 * inner * hidden
        return op_seconds(node, shapes, flops, 0.0, eff, hw, torch.bfloat16)[0]

    few, many = seconds(2), seconds(60)   # 12288 rows an expert against 410
    floor = 2 * tokens * k * 3 * inner * hidden / (hw.flops_for(torch.bfloat16) * eff.gemm_fraction(torch.bfloat16, False))
    assert floor / eff.sustained <= few < many, (few, many)


def test_a_gpu_plan_is_priced_below_what_real_kernels_reach():
    """Model FLOPs over the predicted step stay below the table's large-GEMM rate sustained: no
    plan is predicted faster than any real GPU could run it (without the table, at the peak, it was)."""
    import autopar
    from autopar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32000, block_size=2048, n_layer=2, n_head=16, n_embd=2048)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.empty(64, 2048, dtype=torch.long, device="meta")
    hw = get_hardware("a100-80gb")
    eff = efficiency_of(hw)
    # PaLM's count: 6 per weight used in a matmul (not the embeddings' lookups) and token, and attention's
    matmul_weights = cfg.num_params() - (cfg.vocab_size + cfg.block_size) * cfg.n_embd
    flops = (6 * matmul_weights + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size) * tokens.numel()
    mfu = {}
    for name, spec_hw in (("table", hw), ("peak", dataclasses.replace(hw, name="a100-peak", efficiency=""))):
        plan = autopar.plan(model, autopar.MeshSpec((8,), hardware=spec_hw), (tokens, tokens), precision="bf16",
                            gather_outputs=False, time_limit=20)
        mfu[name] = flops / (8 * hw.flops_for(torch.bfloat16) * plan.predicted.step_time_s)
        if name == "table":
            predicted = plan.predicted
    assert mfu["table"] < eff.gemm["bfloat16"] * eff.sustained
    assert mfu["peak"] > 1.2 * mfu["table"]
    # the prediction says what it rests on, its band and its MFU (PaLM's count is within a few
    # percent of the graph's FLOPs)
    assert predicted.basis == "tables" and predicted.band_s is not None
    assert predicted.band_s[0] < predicted.step_time_s < predicted.band_s[1]
    assert predicted.mfu == pytest.approx(mfu["table"], rel=0.1) and predicted.hfu >= predicted.mfu


def test_a_cpu_plan_without_a_profile_rests_on_the_roofline_and_has_no_band():
    import autopar
    from tests.equivalence import meta_model

    model, args, kwargs = meta_model("gpt-tiny", 8, 32)
    plan = autopar.plan(model, autopar.MeshSpec((2,)), args, kwargs, profile=None, time_limit=20)
    assert plan.predicted.basis == "roofline" and plan.predicted.band_s is None
    assert "a lower bound" in plan.report(top=0) and 0 < plan.predicted.mfu < 1


def test_the_basis_of_a_prediction_and_its_band():
    from cost_models.confidence import band_of, basis_of

    calibrated, first = SimpleNamespace(calibration={"ops": 1.1}), SimpleNamespace(calibration={"overlap": 0.5})
    cpu, gpu = get_hardware("cpu"), get_hardware("a100-80gb")
    assert basis_of(0.9, cpu, calibrated) == "profile" and basis_of(0.9, cpu, first) == "first-profile"
    assert basis_of(0.1, gpu, first) == "tables" and basis_of(0.1, cpu, None) == "roofline"
    for basis in ("profile", "first-profile", "tables"):
        low, high = band_of(basis)
        assert 0 < low < high
    assert band_of("roofline") == (0.0, 0.0)

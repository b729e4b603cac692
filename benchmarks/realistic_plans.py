"""Plans for real training configurations (issue 19): global batches of hundreds to thousands of
sequences on clusters that do not exist here, models built on ``meta``, in bf16 (fp32 master
weights and optimizer states).

For each config: planning time (capture included), whether a plan fits the memory budget (else
the least memory any plan needs, from the planner's error), the microbatches, recomputation and
offload the planner chose, the predicted step time and peak memory, and the predicted
MFU: model FLOPs (6 N per token for N parameters, plus 12 L d s per token for attention over a
sequence of s tokens in L layers of width d, as PaLM counts them) over devices x the preset's bf16
peak x the predicted step. Planned as a training loop runs (``gather_outputs=False``: the loop
reads the loss, the logits stay sharded; gathering them whole would take batch x sequence x
vocabulary values per device). Saves benchmarks/results/realistic_plans.json.

    python benchmarks/realistic_plans.py                       # every config (a few minutes)
    python benchmarks/realistic_plans.py --only llama-7b@8x8   # one config
"""
from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from pathlib import Path

import torch

import autopar
from autopar.core.errors import InfeasibleError
from autopar.core.hardware import get_hardware
from autopar.core.units import fmt
from machine import save_results
from variants import build_meta

RESULTS = Path(__file__).parent / "results" / "realistic_plans.json"
TIME_LIMIT_S = 60.0
PRECISION = "bf16"
# (model, global batch, sequence, mesh, hardware): the four training configurations, and
# Llama-2 70B on one 8-GPU node, whose fp32 weights, gradients and Adam states (1.1 TB) do not fit
# its 640 GB of device memory however they are sharded: only offloading them to host memory fits.
CONFIGS = (
    ("gpt-1.3b", 64, 2048, (8,), "h100-80gb"),
    ("llama-7b", 256, 4096, (8, 8), "h100-80gb"),
    ("llama-70b", 512, 4096, (16, 8), "h100-80gb"),
    ("gpt-175b", 1536, 2048, (128, 8), "a100-80gb"),
    ("llama-70b", 64, 4096, (8,), "h100-80gb"),
)


def model_flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """6 N + 12 L d s: the training FLOPs per token of the matmuls with the weights and of attention."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    width = getattr(config, "hidden_size", None) or config.n_embd
    params = sum(p.numel() for p in model.parameters())   # tied weights once
    return 6 * params + 12 * layers * width * seq


def run(name: str, batch: int, seq: int, mesh: tuple[int, ...], hardware: str, time_limit: float) -> dict:
    model, args, kwargs = build_meta(name, batch, seq)
    spec = autopar.MeshSpec(mesh, hardware=hardware)
    record = {"model": name, "batch": batch, "seq": seq, "mesh": list(mesh), "hardware": hardware,
              "precision": PRECISION, "time_limit_s": time_limit}
    start = time.perf_counter()
    try:
        plan = autopar.plan(model, spec, args, kwargs, precision=PRECISION, time_limit=time_limit,
                            gather_outputs=False)
    except InfeasibleError as e:
        return {**record, "plan_s": time.perf_counter() - start, "fits": False,
                "least_memory_bytes": e.min_memory_bytes, "error": str(e)}
    step = plan.predicted.step_time_s
    peak = get_hardware(hardware).flops_for(torch.bfloat16)
    mfu = batch * seq * model_flops_per_token(model, seq) / (math.prod(mesh) * peak * step)
    return {**record, "plan_s": time.perf_counter() - start, "fits": plan.feasible, "plan": plan.name,
            "predicted_step_s": step, "predicted_peak_bytes": plan.predicted.peak_memory_bytes,
            "memory_budget_bytes": plan.memory_budget, "predicted_mfu": mfu,
            "microbatches": plan.microbatches, "recompute": sorted(set(plan.recompute.values())) or ["none"],
            "pipeline": None if plan.pipeline is None else {
                "schedule": plan.pipeline.schedule, "stages": plan.pipeline.num_stages,
                "mesh": plan.mesh.describe(), "bubble": plan.pipeline.bubble_fraction},
            "offloaded_parameters": len(plan.offloaded),
            "memory_breakdown": plan.predicted.memory_breakdown, "peak_at": plan.predicted.peak_at,
            "timings": plan.timings,
            "parameter_strategies": dict(Counter(n.strategy for n in plan.parameters.values()).most_common()),
            "solver": {k: v for k, v in plan.solver.items() if k != "hand_plans"}}


def line(r: dict) -> str:
    where = f"{r['model']} {r['batch']}x{r['seq']} on {'x'.join(map(str, r['mesh']))} {r['hardware']}"
    if not r["fits"] and "least_memory_bytes" in r:
        return f"{where}: no plan fits; the least any plan needs is {fmt(r['least_memory_bytes'], 'B')} per device " \
               f"({r['plan_s']:.1f} s)"
    piped = r.get("pipeline")
    return (f"{where}: {r['plan']} plan in {r['plan_s']:.1f} s, "
            + (f"pipeline of {piped['stages']} stages ({piped['schedule']}, {piped['mesh']}), " if piped else "")
            + f"{r['microbatches']} microbatch(es), recompute "
            f"{'+'.join(r['recompute'])}"
            + (f", optimizer states of {r['offloaded_parameters']} parameters offloaded" if r.get("offloaded_parameters") else "")
            + f", step {fmt(r['predicted_step_s'], 's')}, "
            f"peak {fmt(r['predicted_peak_bytes'], 'B')}{'' if r['fits'] else ' (over the budget)'}, "
            f"predicted MFU {100 * r['predicted_mfu']:.0f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="MODEL@MESH",
                    help="run only these configs, e.g. llama-7b@8x8 (repeatable)")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    a = ap.parse_args()
    configs = [c for c in CONFIGS if not a.only or f"{c[0]}@{'x'.join(map(str, c[3]))}" in a.only]
    results = []
    for config in configs:
        results.append(run(*config, a.time_limit))
        print(line(results[-1]), flush=True)
    save_results(RESULTS, "python benchmarks/realistic_plans.py" + "".join(f" --only {o}" for o in a.only),
                 {"results": results})


if __name__ == "__main__":
    main()

"""The auto plan against every hand plan (``autopar.planning.baselines``), by predicted step time.

For each model, mesh and memory budget: every standard strategy (DDP, FSDP, HSDP, Megatron TP
with and without sequence parallelism, data x tensor mixes) with its predicted step time and
peak memory (or its shortfall when it does not fit), the auto plan, and the ratio of the auto
plan's step to the best hand plan that fits. Targets: the ratio is never above 1.00, and at
least one realistic case is >= 10% better. Saves benchmarks/results/plan_quality.json.

    python benchmarks/plan_quality.py            # every case (a few minutes, planning only)
    python benchmarks/plan_quality.py --only gpt-1.3b-256k-vocab@8
"""
from __future__ import annotations

import argparse
import math
import platform
import time
from pathlib import Path

import autopar
from autopar.core.units import fmt
from machine import save_results
from realistic_plans import CONFIGS as REALISTIC
from variants import build_meta

RESULTS = Path(__file__).parent / "results" / "plan_quality.json"
HARDWARE = "h100-80gb"
GIB = 2**30
# (model, mesh, memory budget in GiB or None for the whole device, batch): GPT-3 sizes and
# Llama-2 70B; a 256k vocabulary (embedding and head as large as the layers); tight budgets.
CASES = (
    ("gpt-1.3b", (8,), None, 8), ("gpt-1.3b", (8, 8), None, 8), ("gpt-1.3b", (8, 8), 8, 8),
    ("gpt-13b", (8, 8), None, 8), ("gpt-13b", (8, 8), 24, 8),
    ("llama-70b", (8, 8), None, 8), ("gpt-175b", (128, 8), None, 8),
    ("gpt-1.3b-256k-vocab", (8,), None, 8), ("gpt-1.3b-256k-vocab", (8, 8), None, 64),
    ("llama-7b", (8,), None, 8), ("llama-7b", (4, 2), 40, 8),
    # the training configurations of benchmarks/realistic_plans.py: bf16, microbatches and
    # recomputation as the planner chooses them (the hand plans get the same), logits left sharded
    *((m, mesh, None, b, {"seq": s, "hardware": hw, "precision": "bf16", "gather_outputs": False})
      for m, b, s, mesh, hw in REALISTIC),
)
BETTER = 0.10


def case_label(model: str, mesh: tuple[int, ...], budget: float | None, batch: int) -> str:
    return f"{model} on {'x'.join(map(str, mesh))}, batch {batch}, budget {fmt(budget, 'B')}"


def run_case(model_name: str, mesh: tuple[int, ...], budget_gib: float | None, batch: int, time_limit: float,
             extra: dict | None = None) -> dict:
    """``extra``: the sequence length (``seq``), hardware and planning options of a training configuration."""
    options = dict(extra or {})
    hardware = options.pop("hardware", HARDWARE)
    model, args, kwargs = build_meta(model_name, batch, options.pop("seq", None))
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, autopar.MeshSpec(mesh, hardware=hardware), args, kwargs, time_limit=time_limit,
                            memory_budget=budget_gib * GIB if budget_gib else None, **options)
    except autopar.InfeasibleError as e:   # no plan at all fits: nothing to compare
        return {"model": model_name, "mesh": list(mesh), "batch": batch, "infeasible": str(e),
                "min_memory_bytes": e.min_memory_bytes, "ratio_auto_over_best_hand": None}
    hands = plan.solver.get("hand_plans", {})   # none where only a pipeline fits
    fitting = {k: v for k, v in hands.items() if v["feasible"]}
    best = min(fitting, key=lambda k: fitting[k]["step_time_s"], default=None)
    ratio = plan.predicted.step_time_s / fitting[best]["step_time_s"] if best else None
    return {
        "model": model_name, "mesh": list(mesh), "memory_budget_bytes": plan.memory_budget, "batch": batch,
        "plan_s": time.perf_counter() - t0, "auto_step_s": plan.predicted.step_time_s,
        "auto_peak_bytes": plan.predicted.peak_memory_bytes, "auto_kept_hand_plan": plan.solver.get("kept_hand_plan"),
        "best_hand_plan": best, "ratio_auto_over_best_hand": ratio, "hand_plans": hands,
        "microbatches": plan.microbatches, "recompute": sorted(set(plan.recompute.values())) or ["none"],
        "options": extra or {},
        "parameters": {n.fqn: n.strategy for n in plan.parameters.values()},
    }


def show(r: dict) -> None:
    if "infeasible" in r:
        print(f"\n{r['model']} on {'x'.join(map(str, r['mesh']))}: no plan fits ({r['infeasible']})")
        return
    knobs = f", {r['microbatches']} microbatch(es), recompute {'+'.join(r['recompute'])}, {r['options']}" \
        if r["options"] else ""
    print(f"\n{case_label(r['model'], tuple(r['mesh']), r['memory_budget_bytes'], r['batch'])}{knobs} "
          f"(planned in {fmt(r['plan_s'], 's')})")
    for name, h in sorted(r["hand_plans"].items(), key=lambda kv: kv[1].get("step_time_s", math.inf)):
        if "least_memory_bytes" in h:   # no plan of this family fits: not costed
            print(f"  {name:28s} does not fit: needs at least {fmt(h['least_memory_bytes'], 'B')}")
            continue
        fits = "fits" if h["feasible"] else f"short by {fmt(h['peak_memory_bytes'] - r['memory_budget_bytes'], 'B')}"
        print(f"  {name:28s} step {fmt(h['step_time_s'], 's'):>9}  peak {fmt(h['peak_memory_bytes'], 'B'):>9}  {fits}")
    kept = f" (= {r['auto_kept_hand_plan']})" if r["auto_kept_hand_plan"] else ""
    print(f"  {'auto' + kept:28s} step {fmt(r['auto_step_s'], 's'):>9}  peak {fmt(r['auto_peak_bytes'], 'B'):>9}")
    if r["ratio_auto_over_best_hand"] is None:
        print("  no hand plan fits")
    else:
        print(f"  auto / best hand plan ({r['best_hand_plan']}): {r['ratio_auto_over_best_hand']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="MODEL@MESH", help="e.g. gpt-13b@8x8 (repeatable)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    a = ap.parse_args()
    wanted = {(m, s) for m, s in (o.split("@") for o in a.only)}
    cases = [c for c in CASES if not wanted or (c[0], "x".join(map(str, c[1]))) in wanted]
    results = []
    for model, mesh, budget, batch, *extra in cases:
        results.append(run_case(model, mesh, budget, batch, a.time_limit, *extra))
        show(results[-1])
    ratios = [r["ratio_auto_over_best_hand"] for r in results if r["ratio_auto_over_best_hand"] is not None]
    worst, best = max(ratios), min(ratios)
    never_worse = worst <= 1.0 + 1e-9
    better = best <= 1.0 - BETTER
    print(f"\n{'PASS' if never_worse else 'FAIL'}  auto never worse than the best hand plan: worst ratio {worst:.3f}")
    print(f"{'PASS' if better else 'FAIL'}  auto >= {BETTER:.0%} better somewhere: best ratio {best:.3f}")
    save_results(RESULTS, "python benchmarks/plan_quality.py" + "".join(f" --only {o}" for o in a.only),
                 {"hardware": HARDWARE, "cases": results, "worst_ratio": worst, "best_ratio": best,
                  "targets": {"never_worse": never_worse, "better_by_10pct_somewhere": better}},
                 machine=f"{platform.node()} ({platform.processor() or platform.machine()}), planning only")


if __name__ == "__main__":
    main()

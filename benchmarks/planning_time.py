"""Planning time of zoo models on meshes that do not exist here (models built on ``meta``).

Prints, per (model, mesh): end-to-end time, time per stage, ILP size and status, peak RSS, and
saves the figures to benchmarks/results/planning_time.json.

    python benchmarks/planning_time.py                      # gpt-175b on 128x8 (h100-80gb)
    python benchmarks/planning_time.py --model gpt-1.3b --mesh 8x8 --time-limit 60
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch

import autopar
from autopar.units import fmt
from autopar.zoo import get_model

RESULTS = Path(__file__).parent / "results" / "planning_time.json"


def measure(model_name: str, mesh: tuple[int, ...], hardware: str, time_limit: float | None) -> dict:
    entry = get_model(model_name)
    start = time.perf_counter()
    with torch.device("meta"):
        model = entry.build()
    args, kwargs = entry.example(device="meta")
    built = time.perf_counter() - start
    plan = autopar.plan(model, autopar.MeshSpec(mesh, hardware=hardware), args, kwargs, time_limit=time_limit)
    total = time.perf_counter() - start
    return {
        "model": model_name, "mesh": list(mesh), "hardware": hardware, "time_limit_s": time_limit,
        "total_s": total, "build_s": built, "stages_s": plan.timings, "solver": plan.solver,
        "predicted_step_s": plan.predicted.step_time_s, "predicted_peak_bytes": plan.predicted.peak_memory_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-175b")
    ap.add_argument("--mesh", default="128x8")
    ap.add_argument("--hardware", default="h100-80gb")
    ap.add_argument("--time-limit", type=float, default=120.0)
    a = ap.parse_args()
    mesh = tuple(int(x) for x in a.mesh.split("x"))
    r = measure(a.model, mesh, a.hardware, a.time_limit)
    stages = ", ".join(f"{k} {fmt(v, 's')}" for k, v in r["stages_s"].items())
    print(f"{r['model']} on {a.mesh} ({r['hardware']}): {fmt(r['total_s'], 's')} end to end "
          f"(build {fmt(r['build_s'], 's')}, {stages}); ILP {r['solver']['variables']} variables, "
          f"{r['solver']['constraints']} constraints, {r['solver']['status']} (gap {r['solver']['gap']}); "
          f"peak RSS {fmt(r['peak_rss_bytes'], 'B')}; predicted step {fmt(r['predicted_step_s'], 's')}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    old = [o for o in old if (o["model"], o["mesh"], o["hardware"]) != (r["model"], r["mesh"], r["hardware"])]
    RESULTS.write_text(json.dumps(old + [r], indent=1))


if __name__ == "__main__":
    main()

"""Planning time of large models on meshes that do not exist here (models built on ``meta``).

Each (model, mesh) is planned in a fresh process, so its peak RSS is its own. Prints end-to-end
time, time per stage, ILP size and status, peak RSS and the predicted step; checks the targets
(GPT-3 175B on 128x8 within 60 s, 48 -> 96 layers at most doubling the time, peak RSS within
4 GiB) and saves everything to benchmarks/results/planning_time.json.

    python benchmarks/planning_time.py                       # the whole matrix (a few minutes)
    python benchmarks/planning_time.py --only gpt-175b@128x8 # one config
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time
from pathlib import Path

from machine import save_results
from variants import build_meta

RESULTS = Path(__file__).parent / "results" / "planning_time.json"
HARDWARE = "h100-80gb"
TIME_LIMIT_S = 60.0
# (model, mesh): GPT-3 sizes and a Llama-2 70B on 8, 64 and 1024 devices, and 3-D meshes.
CONFIGS = (
    ("gpt-125m", (8,)), ("gpt-125m", (8, 8)),
    ("gpt-1.3b", (8,)), ("gpt-1.3b", (8, 8)), ("gpt-1.3b", (128, 8)),
    ("gpt-13b", (8, 8)), ("gpt-13b", (128, 8)),
    ("gpt-175b-48l", (128, 8)), ("gpt-175b", (8, 8)), ("gpt-175b", (128, 8)),
    ("llama-70b", (8, 8)), ("llama-70b", (128, 8)),
    ("gpt-13b", (4, 2, 8)), ("gpt-175b", (16, 8, 8)),
)
TARGETS = {"175b_1024_s": 60.0, "layers_96_over_48": 2.0, "peak_rss_gib": 4.0}


def measure(name: str, mesh: tuple[int, ...], time_limit: float, out: mp.Queue) -> None:
    import autopar

    start = time.perf_counter()
    model, args, kwargs = build_meta(name)
    built = time.perf_counter() - start
    plan = autopar.plan(model, autopar.MeshSpec(mesh, hardware=HARDWARE), args, kwargs, time_limit=time_limit)
    out.put({
        "model": name, "mesh": list(mesh), "hardware": HARDWARE, "time_limit_s": time_limit,
        "total_s": time.perf_counter() - start, "stages_s": {"build model": built, **plan.timings},
        "solver": {k: v for k, v in plan.solver.items() if k != "hand_plans"},
        "best_hand_plan": min(((n, h) for n, h in plan.solver["hand_plans"].items() if h["feasible"]),
                              key=lambda kv: kv[1]["step_time_s"], default=(None,))[0],
        "predicted_step_s": plan.predicted.step_time_s, "predicted_peak_bytes": plan.predicted.peak_memory_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    })


def run(name: str, mesh: tuple[int, ...], time_limit: float) -> dict:
    queue: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=measure, args=(name, mesh, time_limit, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def line(r: dict) -> str:
    from autopar.core.units import fmt

    stages = ", ".join(f"{k} {fmt(v, 's')}" for k, v in r["stages_s"].items())
    s = r["solver"]
    return (f"{r['model']:>13} on {'x'.join(map(str, r['mesh'])):>7}: {fmt(r['total_s'], 's'):>8} ({stages}); "
            f"{s['problem']}; ILP {s['variables']} variables, {s['constraints']} constraints, {s['status']} "
            f"(gap {'?' if s['gap'] is None else format(s['gap'], '.2g')}); peak RSS {fmt(r['peak_rss_bytes'], 'B')}; step {fmt(r['predicted_step_s'], 's')}, "
            f"best hand plan {r['best_hand_plan']}")


def check(results: list[dict]) -> list[tuple[str, float, float, bool]]:
    """(target, value, limit, met) for the targets whose configs ran."""
    by = {(r["model"], tuple(r["mesh"])): r for r in results}
    out = []
    if ("gpt-175b", (128, 8)) in by:
        t = by[("gpt-175b", (128, 8))]["total_s"]
        out.append(("GPT-3 175B on 128x8, seconds end to end", t, TARGETS["175b_1024_s"], t <= TARGETS["175b_1024_s"]))
        if ("gpt-175b-48l", (128, 8)) in by:
            ratio = t / by[("gpt-175b-48l", (128, 8))]["total_s"]
            out.append(("96 layers / 48 layers, planning time", ratio, TARGETS["layers_96_over_48"],
                        ratio <= TARGETS["layers_96_over_48"]))
    rss = max(r["peak_rss_bytes"] for r in results) / 2**30
    out.append(("largest peak RSS, GiB", rss, TARGETS["peak_rss_gib"], rss <= TARGETS["peak_rss_gib"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="MODEL@MESH",
                    help="run only these configs, e.g. gpt-175b@128x8 (repeatable)")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    a = ap.parse_args()
    configs = [(m, tuple(int(x) for x in s.split("x"))) for m, s in (o.split("@") for o in a.only)] or CONFIGS
    results = []
    for name, mesh in configs:
        results.append(run(name, mesh, a.time_limit))
        print(line(results[-1]), flush=True)
    targets = check(results)
    for what, value, limit, met in targets:
        print(f"{'PASS' if met else 'FAIL'}  {what}: {value:.2f} (target <= {limit:g})")
    save_results(RESULTS, "python benchmarks/planning_time.py" + "".join(f" --only {o}" for o in a.only),
                 {"results": results,
                  "targets": [{"target": w, "value": v, "limit": l, "met": m} for w, v, l, m in targets]})


if __name__ == "__main__":
    main()

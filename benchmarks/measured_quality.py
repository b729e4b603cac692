"""The auto plan against every hand plan, by measured step time on this machine's CPU mesh.

For each zoo model on 4 gloo processes (mesh 4; --meshes 4,2x2 adds the 2-D one): profile the host (cached), plan the
auto plan and every hand plan (``autopar.planning.baselines.candidates``) with that profile, then compile
them all in one run of the mesh and time them side by side: rounds of every plan in turn (so
that the machine's slow and fast moments fall on all of them), each round's step time is the
median of its steps on the slowest rank, and a plan's figure is its fastest round. An auto plan
that kept a hand plan (``plan.solver["kept_hand_plan"]``) is that plan and is not timed twice:
two timings of one plan differ only by the machine's noise. torch DDP and FSDP2 on the same
processes take their turns too (``autopar.profiling.peers``; every optimizer AdamW with
foreach=True). Prints the ratio of the auto plan to the best measured hand plan (target <= 1.05)
and to the best torch variant, and saves benchmarks/results/measured_quality.json.

    python benchmarks/measured_quality.py                     # gpt-tiny, gpt2-tiny, llama-tiny (a few minutes)
    python benchmarks/measured_quality.py --models gpt-tiny --meshes 4
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import autopar
from autopar.models.zoo import get_model
from autopar.planning.baselines import candidates
from autopar.profiling import peers
from autopar.profiling.launch import run_on_gloo_mesh
from autopar.profiling.measure import slowest_rank_steps, time_in_turns
from autopar.profiling.profiler import profile_model
from machine import machine_line, save_results

RESULTS = Path(__file__).parent / "results" / "measured_quality.json"
MODELS = ("gpt-tiny", "gpt2-tiny", "llama-tiny")
MESHES = ((4,),)
BATCH, SEQ = 16, 64
ROUNDS, WARMUP, STEPS = 5, 2, 8
SEED = 1234
TARGET = 1.05
# What users run instead, on the same processes (each rank its part of the batch).
TORCH = {"torch DDP": peers.ddp, "torch FSDP2": peers.fsdp2}


def _worker(mesh, name: str, plans: dict[str, str], rounds: int) -> dict[str, list[float]]:
    """On every rank: compile every plan, then time them in turn, ``rounds`` times."""
    entry = get_model(name)
    args, kwargs = entry.example(BATCH, SEQ)

    def build():
        torch.manual_seed(SEED)
        return entry.build()

    runs = {}
    for label, text in plans.items():
        pmodel = autopar.compile(build(), mesh, args, kwargs, plan=autopar.Plan.from_json(text))
        runs[label] = (pmodel, torch.optim.AdamW(pmodel.parameters(), lr=1e-3, foreach=True), (args, kwargs))
    for label, wrap in TORCH.items():
        model, batch = wrap(build(), (args, kwargs))
        runs[label] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), batch)
    times = time_in_turns(runs, rounds=rounds, warmup=WARMUP, steps=STEPS)
    return {label: [statistics.median(steps) for steps in per_round] for label, per_round in times.items()}


def run(name: str, mesh: tuple[int, ...], rounds: int) -> dict:
    entry = get_model(name)
    torch.manual_seed(SEED)
    model = entry.build()
    args, kwargs = entry.example(BATCH, SEQ)
    spec = autopar.MeshSpec(mesh, hardware="cpu")
    profile_model(model, spec, args, kwargs, progress=None)
    t0 = time.perf_counter()
    auto = autopar.plan(model, spec, args, kwargs)
    hands = candidates(model, spec, args, kwargs)
    plan_s = time.perf_counter() - t0
    plans = {"auto": auto, **hands}
    kept = auto.solver.get("kept_hand_plan")
    timed = {k: p for k, p in plans.items() if not (kept and k == "auto")}
    ranks = run_on_gloo_mesh(_worker, mesh, name, {k: p.to_json() for k, p in timed.items()}, rounds,
                             start_method="forkserver")
    # per plan: each round's slowest rank, then the fastest round
    rounds_s = {k: slowest_rank_steps([r[k] for r in ranks]) for k in ranks[0]}
    rounds_s["auto"] = rounds_s[kept or "auto"]
    measured = {k: min(v) for k, v in rounds_s.items()}
    best = min(hands, key=lambda k: measured[k])
    best_torch = min(TORCH, key=lambda k: measured[k])
    return {
        "model": name, "mesh": list(mesh), "batch": BATCH, "seq": SEQ, "plan_s": plan_s,
        "auto_kept_hand_plan": kept,
        "plans": {k: {"measured_step_s": measured[k], "predicted_step_s": p.predicted.step_time_s,
                      "rounds_s": rounds_s[k]} for k, p in plans.items()},
        "torch": {k: {"measured_step_s": measured[k], "rounds_s": rounds_s[k]} for k in TORCH},
        "best_hand_plan": best, "ratio_auto_over_best_hand": measured["auto"] / measured[best],
        "best_torch": best_torch, "ratio_auto_over_best_torch": measured["auto"] / measured[best_torch],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--meshes", default=",".join("x".join(map(str, m)) for m in MESHES))
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    a = ap.parse_args()
    meshes = [tuple(int(x) for x in m.split("x")) for m in a.meshes.split(",")]
    results = []
    for mesh in meshes:
        for name in a.models.split(","):
            r = run(name, mesh, a.rounds)
            results.append(r)
            kept = f" (= {r['auto_kept_hand_plan']})" if r["auto_kept_hand_plan"] else ""
            print(f"\n{name} on {'x'.join(map(str, mesh))} gloo processes, batch {BATCH}x{SEQ}:")
            for k, v in sorted(r["plans"].items(), key=lambda kv: kv[1]["measured_step_s"]):
                print(f"  {k + (kept if k == 'auto' else ''):28s} measured {v['measured_step_s'] * 1e3:7.1f} ms  "
                      f"predicted {v['predicted_step_s'] * 1e3:7.1f} ms")
            for k, v in r["torch"].items():
                print(f"  {k:28s} measured {v['measured_step_s'] * 1e3:7.1f} ms")
            print(f"  auto / best measured hand plan ({r['best_hand_plan']}): {r['ratio_auto_over_best_hand']:.3f}; "
                  f"auto / best torch ({r['best_torch']}): {r['ratio_auto_over_best_torch']:.3f}", flush=True)
    worst = max(r["ratio_auto_over_best_hand"] for r in results)
    print(f"\n{'PASS' if worst <= TARGET else 'FAIL'}  auto within {TARGET:.2f}x the best measured hand plan: "
          f"worst ratio {worst:.3f}")
    save_results(RESULTS, f"python benchmarks/measured_quality.py --models {a.models} --meshes {a.meshes} --rounds {a.rounds}",
                 {"results": results, "worst_ratio": worst, "target": TARGET}, machine=machine_line(load=True))


if __name__ == "__main__":
    main()

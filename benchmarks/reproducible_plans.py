"""Does the planner keep its word: every call within ``time_limit`` (5% over at most), and the same
plan from two runs of the same call (``deterministic=True``; ``--wall-clock``: the default search)?

Plans each configuration of ``planning_time.py``, ``plan_quality.py`` and ``realistic_plans.py``,
and GPT-3 175B written with Hugging Face's ``GPT2LMHeadModel`` (1536 x 2048, bf16, 128x8 A100:
a 175B model no zoo entry builds), twice in a row, each call in a fresh process (capture
included in its wall time). Two plans are the same where their JSON is, less what records how
long the call took. Prints per configuration the two walls, whether the plans match and what the
limit cut short; saves benchmarks/results/reproducible_plans.json.

    python benchmarks/reproducible_plans.py                   # every configuration (about 40 min)
    python benchmarks/reproducible_plans.py --only planning_time --limit 3
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import time
from pathlib import Path

from machine import machine_line, save_results

RESULTS = Path(__file__).parent / "results" / "reproducible_plans.json"
TIME_LIMIT_S = 60.0
OVER = 0.05
GIB = 2**30


def configurations() -> list[tuple[str, dict]]:
    """(label, what ``plan_one`` builds and plans) of every configuration, benchmark by benchmark."""
    from plan_quality import CASES
    from planning_time import CONFIGS as TIMING, HARDWARE
    from realistic_plans import CONFIGS as REALISTIC

    out = [(f"planning_time {m}@{'x'.join(map(str, mesh))}", {"model": m, "mesh": mesh, "hardware": HARDWARE})
           for m, mesh in TIMING]
    for m, mesh, budget, batch, *extra in CASES:
        options = dict(extra[0]) if extra else {}
        seq, hardware = options.pop("seq", None), options.pop("hardware", HARDWARE)
        if budget:
            options["memory_budget"] = budget * GIB
        out.append((f"plan_quality {m}@{'x'.join(map(str, mesh))} batch {batch} budget {budget}",
                    {"model": m, "mesh": mesh, "hardware": hardware, "batch": batch, "seq": seq, "options": options}))
    out += [(f"realistic_plans {m}@{'x'.join(map(str, mesh))} {b}x{s}",
             {"model": m, "mesh": mesh, "hardware": hw, "batch": b, "seq": s,
              "options": {"precision": "bf16", "gather_outputs": False}}) for m, b, s, mesh, hw in REALISTIC]
    out.append(("hf gpt2-175b@128x8 1536x2048", {"model": "hf-gpt2-175b", "mesh": (128, 8), "hardware": "a100-80gb",
                                                 "options": {"precision": "bf16", "gather_outputs": False}}))
    return out


def build(what: dict):
    """(model, args, kwargs) on ``meta``."""
    if what["model"] != "hf-gpt2-175b":
        from variants import build_meta
        return build_meta(what["model"], what.get("batch"), what.get("seq"))
    import torch
    import transformers

    config = transformers.GPT2Config(n_embd=12288, n_layer=96, n_head=96, n_positions=2048, vocab_size=50257)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.empty(1536, 2048, dtype=torch.long)
    return model, (ids,), {"labels": ids}


def plan_one(what: dict, time_limit: float, deterministic: bool, out: mp.Queue) -> None:
    import autopar

    model, args, kwargs = build(what)
    start = time.perf_counter()
    try:
        plan = autopar.plan(model, autopar.MeshSpec(what["mesh"], hardware=what["hardware"]), args, kwargs,
                            time_limit=time_limit, deterministic=deterministic, **what.get("options", {}))
    except autopar.AutoparError as e:
        out.put({"wall_s": time.perf_counter() - start, "error": f"{type(e).__name__}: {e}"})
        return
    wall = time.perf_counter() - start
    decisions = json.loads(plan.to_json())
    decisions.pop("timings")
    limit = decisions["solver"].pop("time_limit", {})
    out.put({"wall_s": wall, "step_s": plan.predicted.step_time_s, "feasible": plan.feasible,
             "digest": hashlib.sha256(json.dumps(decisions, sort_keys=True).encode()).hexdigest()[:16],
             "charged_s": limit.get("charged_s"), "reproducible": limit.get("reproducible"),
             "cut_short": limit.get("cut_short", [])})


def run(what: dict, time_limit: float, deterministic: bool) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=plan_one, args=(what, time_limit, deterministic, queue))
    proc.start()
    try:
        return queue.get(timeout=10 * time_limit + 120)
    except Exception as e:   # the process died (out of memory, a crash): said, not hung on
        return {"error": f"no result: {type(e).__name__} (exit code {proc.exitcode})"}
    finally:
        proc.join(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], help="labels starting with this (repeatable)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many configurations")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    ap.add_argument("--wall-clock", action="store_true", help="plan with deterministic=False (the default search)")
    a = ap.parse_args()
    chosen = [(label, what) for label, what in configurations()
              if not a.only or any(label.startswith(o) for o in a.only)][:a.limit]
    results = []
    for label, what in chosen:
        first, second = (run(what, a.time_limit, not a.wall_clock) for _ in range(2))
        same = "digest" in first and first.get("digest") == second.get("digest")
        worst = max(first.get("wall_s", 0.0), second.get("wall_s", 0.0)) / a.time_limit
        results.append({"config": label, "runs": [first, second], "same_plan": same, "worst_wall_over_limit": worst})
        print(f"{label}: {'same plan' if same else 'DIFFERENT'}, walls {first.get('wall_s', 0):.1f} / "
              f"{second.get('wall_s', 0):.1f} s ({worst:.2f} of the limit)"
              + "".join(f"; run {i + 1}: {r['error'][:150]}" for i, r in enumerate((first, second)) if "error" in r)
              + (f"; cut short: {'; '.join(first['cut_short'])[:200]}" if first.get("cut_short") else ""), flush=True)
    same = sum(r["same_plan"] for r in results)
    kept = sum(r["worst_wall_over_limit"] <= 1 + OVER for r in results)
    print(f"same plan twice: {same} of {len(results)}; within {OVER:.0%} of the limit: {kept} of {len(results)}")
    save_results(RESULTS, "python benchmarks/reproducible_plans.py" + "".join(f" --only '{o}'" for o in a.only)
                 + (" --wall-clock" if a.wall_clock else ""),
                 {"time_limit_s": a.time_limit, "deterministic": not a.wall_clock, "results": results, "same_plan": same, "kept_limit": kept},
                 machine=machine_line(load=True))


if __name__ == "__main__":
    main()

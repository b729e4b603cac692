"""Fit and check the planner's work rates (``autopar.planning.work.RATES``): the seconds each piece
of planning work is charged, from its size, which the search decides on instead of the wall clock.

Runs the planning benchmarks with ``AUTOPAR_WORK_LOG`` set (every capture, build stage, solve and
schedule simulation logged with its size and wall seconds), fits each kind's rates by
non-negative least squares on the FIT benchmark's log only, and checks them on the CHECK
benchmarks' logs: per kind, and per planning call (what its work was charged, before ``MARGIN``,
over its wall seconds). Saves benchmarks/results/planner_work.json; paste the printed rates
into ``RATES`` (and name the host in ``FITTED_ON``).

    python benchmarks/planner_work.py                        # run FIT and CHECK, fit, check
    python benchmarks/planner_work.py --logs fit.jsonl check.jsonl   # fit and check existing logs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from autopar.planning import work
from machine import save_results

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "planner_work.json"
#: The benchmark the rates are fitted on, and those they are checked on (never fitted).
FIT = "planning_time.py"
CHECK = ("realistic_plans.py", "plan_quality.py")


def logged(script: str, path: Path) -> None:
    """Run one planning benchmark with every piece of work logged to ``path``."""
    env = {**os.environ, work.LOG_ENV: str(path)}
    subprocess.run([sys.executable, str(HERE / script)], env=env, check=True, stdout=subprocess.DEVNULL)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fit(log: list[dict]) -> dict[str, tuple[float, dict[str, float]]]:
    """Per kind, (fixed seconds, seconds per unit of each feature ``RATES`` names), fitted by
    non-negative least squares on the wall seconds (less what ``PINNED`` rates account for)."""
    out = {}
    for kind, (_, per) in work.RATES.items():
        mine = [r for r in log if r["kind"] == kind]
        pinned = {n: per[n] for n in per if (kind, n) in work.PINNED}
        if not mine:
            out[kind] = work.RATES[kind]
            continue
        names = [n for n in per if (kind, n) not in work.PINNED]
        a = np.array([[1.0] + [float(r.get(n, 0.0)) for n in names] for r in mine])
        scale = np.maximum(a.max(axis=0), 1e-12)
        wall = np.array([r["wall_s"] - sum(rate * float(r.get(n, 0.0)) for n, rate in pinned.items()) for r in mine])
        coef, _ = nnls(a / scale, wall)
        coef = coef / scale
        fitted = dict(zip(names, coef[1:], strict=True))
        out[kind] = (float(coef[0]), {n: float(fitted.get(n, rate)) for n, rate in per.items()})
    return out


def charged(rates: dict, r: dict) -> float:
    """What ``rates`` charge one logged piece of work, before ``MARGIN``."""
    fixed, per = rates[r["kind"]]
    return fixed + sum(rate * float(r.get(n, 0.0)) for n, rate in per.items())


def report(rates: dict, log: list[dict], label: str) -> dict:
    """Per kind and per planning call: charged (before ``MARGIN``) over wall seconds."""
    kinds = {}
    for kind in rates:
        mine = [r for r in log if r["kind"] == kind]
        if mine:
            wall, got = sum(r["wall_s"] for r in mine), sum(charged(rates, r) for r in mine)
            kinds[kind] = {"n": len(mine), "wall_s": wall, "charged_s": got, "ratio": got / max(wall, 1e-9)}
    calls = defaultdict(lambda: [0.0, 0.0])
    for r in log:
        c = calls[r.get("call", r.get("pid"))]
        c[0] += r["wall_s"]
        c[1] += charged(rates, r)
    ratios = sorted(got / max(wall, 1e-9) for wall, got in calls.values() if wall > 1.0)
    print(f"{label}: " + "; ".join(f"{k} {v['ratio']:.2f} ({v['n']})" for k, v in kinds.items()))
    if ratios:
        print(f"  per call (charged / wall, {len(ratios)} calls over 1 s): min {ratios[0]:.2f}, "
              f"median {ratios[len(ratios) // 2]:.2f}, max {ratios[-1]:.2f}")
    return {"kinds": kinds, "call_ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs", nargs=2, metavar=("FIT_LOG", "CHECK_LOG"), help="fit and check these logs")
    a = ap.parse_args()
    if a.logs:
        fit_log, check_log = (Path(p) for p in a.logs)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="autopar-work-"))
        fit_log, check_log = tmp / "fit.jsonl", tmp / "check.jsonl"
        logged(FIT, fit_log)
        for script in CHECK:
            logged(script, check_log)
    rates = fit(rows(fit_log))
    print("RATES =", json.dumps(rates, indent=1))
    results = {"fit_on": FIT, "checked_on": list(CHECK), "rates": rates,
               "fit": report(rates, rows(fit_log), f"fit ({FIT})"),
               "check": report(rates, rows(check_log), f"check ({', '.join(CHECK)})")}
    save_results(RESULTS, "python benchmarks/planner_work.py", results)


if __name__ == "__main__":
    main()

"""The standard strategies and autopar's plan side by side: predicted step time and memory.

    python examples/compare_strategies.py                             # GPT 1.3B on 4x2 H100 80GB
    python examples/compare_strategies.py --model llama-7b --mesh 8x8 --batch 64 --seq 4096

``autopar.planning.baselines.candidates`` returns every hand plan for the mesh (DDP, FSDP,
ZeRO-1/2, Megatron tensor parallel with and without sequence parallelism, their data x tensor
mixes, and Megatron's pipeline plans where the first axis can carry stages), each the planner's
own problem with the choices its role forbids removed, so each is priced by the same cost model
as the auto plan and can be compiled like it. ``autopar.plan`` then returns the auto plan: the
solver's, or the best hand plan where the solver's is not ``min_gain`` (5%) faster. A hand plan
that does not fit the memory budget is listed with how far over it is.
"""
from __future__ import annotations

import argparse

import torch

import autopar
from autopar.cli import default_precision, parse_mesh
from autopar.core.units import fmt
from autopar.models.zoo import get_model
from autopar.planning.baselines import candidates


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-1.3b", help="zoo model (`autopar models`), default gpt-1.3b")
    p.add_argument("--mesh", default="4x2", help="mesh shape (default 4x2)")
    p.add_argument("--hardware", default="h100-80gb", help="preset: a100-40gb, a100-80gb, h100-80gb, h200, cpu")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the zoo entry's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the zoo entry's)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds for each of the two calls (default 60)")
    return p.parse_args()


def row(name: str, plan: autopar.Plan, width: int) -> str:
    """One line of the table: the plan's predicted step, peak memory per device, MFU, and fit."""
    p = plan.predicted
    fits = "yes" if plan.feasible else f"no, {fmt(plan.shortfall_bytes, 'B')} over"
    return f"{name:<{width}} {fmt(p.step_time_s, 's'):>10} {fmt(p.peak_memory_bytes, 'B'):>11} {p.mfu:>5.0%}  {fits}"


def chosen(plan: autopar.Plan) -> str:
    """Which plan ``autopar.plan`` returned: the solver's, or the hand plan it kept."""
    kept = plan.solver.get("kept_hand_plan")
    return f"hand plan {kept!r}" if kept else "the solver's plan"


def main() -> None:
    args = parse_args()
    entry = get_model(args.model)
    with torch.device("meta"):                    # planning only: no weights allocated
        model = entry.build()
    example = entry.example(args.batch, args.seq, device="meta")
    mesh = autopar.MeshSpec(parse_mesh(args.mesh), hardware=args.hardware)   # axes named dp, tp (2-D)
    options = autopar.PlanOptions(time_limit=args.time_limit, precision=default_precision(args.hardware))

    hand = candidates(model, mesh, *example, options=options)
    auto = autopar.plan(model, mesh, *example, options=options)
    print(f"{entry.name} on {mesh.describe()}, {options.precision}; predicted per training step:")
    last = f"autopar.plan ({chosen(auto)})"
    width = max(len(name) for name in [*hand, last, "plan"])
    print(f"{'plan':<{width}} {'step':>10} {'peak memory':>11} {'MFU':>5}  fits")
    for name, plan in sorted(hand.items(), key=lambda item: item[1].predicted.step_time_s):
        print(row(name, plan, width))
    print(row(last, auto, width))


if __name__ == "__main__":
    main()

"""Plan a large model for a cluster you do not have: built on ``meta``, priced for a preset.

    python examples/plan_cluster.py                                   # Llama-2 7B on 8x8 H100 80GB
    python examples/plan_cluster.py --model gpt-13b --mesh 16x8 --hardware a100-80gb --batch 64
    python examples/plan_cluster.py --report --json llama-7b-8x8.json

The model is built on the ``meta`` device (no weights are allocated) and planned for a
``MeshSpec``, a mesh that need not exist: nothing runs on the cluster, no collective is launched.
``--time-limit`` bounds the whole call, the capture included; the planner returns the best plan
it has found by then and says whether the limit cut anything short. The plan saved with
``--json`` compiles the real model later on the cluster (``autopar.compile(..., plan=
autopar.Plan.from_json(path))``), which checks that model and mesh are the ones planned for.
"""
from __future__ import annotations

import argparse

import torch

import autopar
from autopar.cli import default_precision, parse_mesh
from autopar.core.report import summary
from autopar.models.zoo import get_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-7b", help="zoo model (`autopar models`), default llama-7b")
    p.add_argument("--mesh", default="8x8", help="mesh shape: nodes x GPUs per node (default 8x8)")
    p.add_argument("--hardware", default="h100-80gb", help="preset: a100-40gb, a100-80gb, h100-80gb, h200, cpu")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the zoo entry's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the zoo entry's)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds for planning, capture included (default 60)")
    p.add_argument("--report", action="store_true", help="print the whole report, not only its summary")
    p.add_argument("--json", default=None, help="save the plan to this JSON file")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    entry = get_model(args.model)
    with torch.device("meta"):                    # no memory is allocated
        model = entry.build()
    example_args, example_kwargs = entry.example(args.batch, args.seq, device="meta")
    mesh = autopar.MeshSpec(parse_mesh(args.mesh), hardware=args.hardware)   # axes named dp, tp (2-D)
    plan = autopar.plan(model, mesh, example_args, example_kwargs, time_limit=args.time_limit,
                        precision=default_precision(args.hardware))   # bf16 on GPU presets
    print(plan.report() if args.report else "\n".join(summary(plan)))
    if args.json:
        plan.to_json(args.json)
        print(f"saved to {args.json}")


if __name__ == "__main__":
    main()

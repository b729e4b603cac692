"""A rank's experts on a GPU: autopar's per-expert loop against torch's grouped GEMM, and what the
cost model prices them at.

The experts of a mixture-of-experts layer split by expert run, on each rank, its local experts on
the rows routed to them. autopar's kernel (``expert_parallel.grouped_experts``) runs them as two
grouped GEMMs where ``torch._grouped_mm`` takes them (bf16 on Hopper), else one expert after
another (``looped_experts``); the cost model prices them as each expert's GEMMs run side by side
(``ops.moe.grouped_gemms``, batched in ``cost_models.efficiency``), as a grouped GEMM does. This
times, forward and backward in bf16 with uniform routing, the loop and autopar's kernel at Mixtral
8x7B's and DeepSeek-V2-Lite's expert shapes, and prices them with the device's efficiency table.

    python benchmarks/gpu_experts.py --out benchmarks/results/gpu_experts_h200.json   # on a GPU
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

from autopar.core.expert_parallel import grouped_experts, looped_experts
from autopar.core.hardware import get_hardware
from autopar.core.mesh import hardware_for_device
from autopar.core.ops.moe import MOE
from cost_models.efficiency import efficiency_of, op_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_op_tables import seconds  # noqa: E402

#: name: (local experts, hidden, inner) of a rank holding all the layer's experts or a share of them.
SHAPES = {"mixtral-8x7b, 8 experts": (8, 4096, 14336), "mixtral-8x7b, 1 expert (ep=8)": (1, 4096, 14336),
          "deepseek-v2-lite, 64 experts": (64, 2048, 1408), "deepseek-v2-lite, 8 experts (ep=8)": (8, 2048, 1408)}
ROWS = (1024, 8192, 32768)   # routed rows on the rank (tokens x top-k), spread evenly over its experts
#: autopar's loop over experts, and its kernel as it runs (the grouped GEMM where it takes them).
VARIANTS = ("loop", "autopar")


def priced(hw, experts: int, hidden: int, inner: int, rows: int) -> float:
    """Forward and backward seconds the cost model gives the experts op on ``rows`` routed rows
    (``op_seconds`` as the planner calls it: each expert's two GEMMs, or the time to move the
    op's bytes, its weights among them, where that is longer)."""
    node = torch.fx.Graph().call_function(MOE, ())
    shapes = [(rows, hidden), (rows, 1), (rows, 1), (experts, 2 * inner, hidden), (experts, hidden, inner)]
    nbytes = 2 * (2 * rows * hidden + 3 * experts * inner * hidden) + 12 * rows
    fwd, bwd = op_seconds(node, shapes, 0.0, nbytes, efficiency_of(hw), hw, torch.bfloat16)
    return fwd + bwd


def case(name: str, rows: int, hw, device: str) -> dict:
    experts, hidden, inner = SHAPES[name]
    counts = [rows // experts] * experts
    counts[-1] += rows - sum(counts)
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * inner, hidden, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
    down = (torch.randn(experts, hidden, inner, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
    flops = 3 * 2 * rows * hidden * 3 * inner   # forward and backward (3x), three [H, I] products a row
    grad = torch.ones(rows, hidden, device=device, dtype=torch.bfloat16)   # a whole tensor: grouped_mm needs one
    row = {"shape": name, "rows": rows, "priced_s": priced(hw, experts, hidden, inner, rows)}
    variants = {"loop": lambda *a: looped_experts(*a, "silu", None, None), "autopar": grouped_experts}
    leaves = (x, gate_up, down)

    def step(fn) -> None:   # a training step's backward: gradients set, not added to (zero_grad's default)
        for t in leaves:
            t.grad = None
        fn(x, counts, gate_up, down).backward(grad)

    for label in VARIANTS:
        fn = variants[label]
        try:
            took = seconds(lambda fn=fn: step(fn), device, 5)
            row[label] = {"s": took, "tflops": flops / took / 1e12}
        except Exception as e:   # a kernel this GPU or torch lacks: recorded, the rest still measured
            row[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            traceback.print_exc()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="on the CPU, one small shape priced as an H200's: "
                                                              "the code path, not a measurement")
    args = parser.parse_args()
    device = "cpu" if args.quick else "cuda"
    hw = get_hardware("h200" if args.quick else hardware_for_device(device))
    name = "cpu" if args.quick else torch.cuda.get_device_name()
    result = {"device": name, "torch": torch.__version__, "hardware": hw.name, "rows": []}
    if args.quick:
        SHAPES["tiny"] = (4, 64, 96)
    for name in ["tiny"] if args.quick else list(SHAPES):
        for rows in [256] if args.quick else ROWS:
            row = case(name, rows, hw, device)
            result["rows"].append(row)
            cells = [f"{k} {row[k]['s'] * 1e3:7.2f} ms ({row[k]['tflops']:4.0f} TFLOP/s)" if "s" in row[k] else
                     f"{k} failed" for k in VARIANTS]
            ratio = row["loop"].get("s", math.nan) / row["priced_s"]
            print(f"{name:<36} {rows:>6} rows  priced {row['priced_s'] * 1e3:7.2f} ms  {'  '.join(cells)}  "
                  f"loop/priced {ratio:.2f}", flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

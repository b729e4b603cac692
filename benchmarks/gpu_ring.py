"""One rank's share of ring attention on a GPU, measured against what the cost model prices it at.

Ring attention (``autopar.core.context_parallel``) over ``n`` ranks: each rank runs its queries
against every rank's key/value block with the fused kernels (FlashAttention in bf16) and merges
the partial results by their log-sum-exp. The cost model prices a rank's share as one unmasked
SDPA call of its queries against as many keys as its blocks hold (``ops.attention.context_call``)
and its memory as ``ring_held_bytes``. This times one rank's blocks (forward, then backward) in a
fake process group of ``n`` (messages complete at once, so only the computation is timed), beside
SDPA on the whole sequence, and prices both with the device's efficiency table.

    python benchmarks/gpu_ring.py --out benchmarks/results/gpu_ring_h200.json   # on a GPU
    python benchmarks/gpu_ring.py --device cpu --quick                           # the code path, on a CPU
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar.core.context_parallel as cp
from autopar.core.hardware import get_hardware
from autopar.core.mesh import hardware_for_device
from autopar.core.ops.attention import SDPA
from cost_models.efficiency import efficiency_of, op_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_op_tables import seconds  # noqa: E402

#: Llama-3 8B's attention: query heads, key/value heads, head dim.
HEADS, KV_HEADS, DIM = 32, 8, 128


def passes(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: str, repeat: int) -> dict:
    """Forward seconds, backward seconds and the most the backward allocated beyond the forward's
    output (bytes, on a GPU) of ``attend(q, k, v)``."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    forward = seconds(lambda: attend(*leaves), device, repeat)

    def both() -> None:   # gradients set, not added to, as after zero_grad
        for t in leaves:
            t.grad = None
        attend(*leaves).backward(torch.ones_like(q))

    total = seconds(both, device, repeat)
    peak = None
    if device.startswith("cuda"):
        out, grad = attend(*leaves), torch.ones_like(q)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out.backward(grad)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    return {"forward_s": forward, "backward_s": total - forward, "backward_peak_bytes": peak}


def priced(hw, q_rows: int, keys: float, causal: bool, dtype: torch.dtype) -> dict | None:
    """(forward, backward) seconds the cost model gives SDPA of ``q_rows`` queries against ``keys``
    keys (``op_seconds`` as the planner calls it); None where the hardware has no efficiency table
    (the CPU's times are profiled instead)."""
    eff = efficiency_of(hw)
    if eff is None:
        return None
    node = torch.fx.Graph().call_function(SDPA, (None, None, None, None, 0.0, causal))
    shapes = [(1, HEADS, q_rows, DIM), (1, KV_HEADS, keys, DIM), (1, KV_HEADS, keys, DIM)]
    flops = 4 * HEADS * q_rows * keys * DIM
    nbytes = dtype.itemsize * DIM * (2 * HEADS * q_rows + 2 * KV_HEADS * keys)   # q, k, v and the output
    fwd, bwd = op_seconds(node, shapes, flops, nbytes, eff, hw, dtype)
    return {"forward_s": fwd, "backward_s": bwd}


def ring_case(seq: int, n: int, layout: cp.Layout, device: str, dtype: torch.dtype, repeat: int,
              kernel: str | None = None) -> dict:
    """One rank's ring blocks (the last rank: under the contiguous layout it computes every one),
    on the block kernel SDPA would pick or on ``kernel``."""
    length = seq // n
    dist.init_process_group("fake", store=FakeStore(), rank=n - 1, world_size=n)
    chosen = cp._kernel_for
    if kernel is not None:
        cp._kernel_for = lambda query: kernel
    try:
        q = torch.randn(1, HEADS, length, DIM, device=device, dtype=dtype)
        k, v = (torch.randn(1, KV_HEADS, length, DIM, device=device, dtype=dtype) for _ in range(2))
        got = passes(lambda *t: cp.ring_attention(*t, is_causal=True, group=dist.group.WORLD, layout=layout),
                     q, k, v, device, repeat)
        got["kernel"] = cp._kernel_for(q)
        got["held_bytes"] = cp.ring_held_bytes(q.numel(), 2 * k.numel(), HEADS * length, dtype.itemsize, n)
    finally:
        cp._kernel_for = chosen
        dist.destroy_process_group()
    return got


def summary(row: dict) -> str:
    """One row as a line: sizes, kernel, passes and measured over priced."""
    price = row["priced"]
    ratio = "" if price is None else \
        f"  measured/priced {(row['forward_s'] + row['backward_s']) / (price['forward_s'] + price['backward_s']):.2f}"
    return (f"{row['seq']:>7} {row['ranks']} {row['what']:<30} {row['kernel']:<14} fwd {row['forward_s'] * 1e3:8.2f} ms "
            f"bwd {row['backward_s'] * 1e3:8.2f} ms{ratio}")


class Rows(list):
    """Rows printed as they come, and the result so far written to ``out`` after each (a kernel that
    fails later leaves what was measured)."""

    def __init__(self, out: Path | None, head: dict) -> None:
        super().__init__()
        self.out, self.head = out, head

    def append(self, row: dict) -> None:
        super().append(row)
        print(summary(row), flush=True)
        if self.out:
            self.out.write_text(json.dumps({**self.head, "rows": list(self)}, indent=1) + "\n")


def run(seqs: list[int], ranks: list[int], device: str, repeat: int, out: Path | None) -> dict:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    hw = get_hardware(hardware_for_device(device.split(":")[0]))
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    rows = Rows(out, {"device": name, "torch": torch.__version__, "dtype": str(dtype), "hardware": hw.name,
                      "heads": [HEADS, KV_HEADS, DIM]})
    for seq in seqs:
        q = torch.randn(1, HEADS, seq, DIM, device=device, dtype=dtype)
        k, v = (torch.randn(1, KV_HEADS, seq, DIM, device=device, dtype=dtype) for _ in range(2))
        whole = passes(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v,
                       device, repeat)
        rows.append({"seq": seq, "ranks": 1, "what": "sdpa, whole sequence", **whole, "kernel": cp._kernel_for(q),
                     "priced": priced(hw, seq, seq, True, dtype)})
        for n in ranks:
            for layout in ("balanced", "contiguous"):
                blocks = n / 2 if layout == "balanced" else n - 0.5
                got = ring_case(seq, n, layout, device, dtype, repeat)
                rows.append({"seq": seq, "ranks": n, "what": f"ring, {layout}, last rank", **got,
                             "priced": priced(hw, seq // n, seq // n * blocks, False, dtype)})
            if device.startswith("cuda") and seq == max(seqs):   # the 16-bit kernels, for comparison
                for kernel in ("flash_cuda", "cudnn_cuda"):
                    got = ring_case(seq, n, "balanced", device, dtype, repeat, kernel)
                    rows.append({"seq": seq, "ranks": n, "what": f"ring, balanced, {kernel}", **got,
                                 "priced": priced(hw, seq // n, seq // n * n / 2, False, dtype)})
    return {**rows.head, "rows": list(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes: the code path, not a measurement")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    seqs, ranks = ([256], [2]) if args.quick else ([16384, 65536], [2, 4, 8])
    run(seqs, ranks, args.device, 1 if args.quick else 5, args.out)


if __name__ == "__main__":
    main()

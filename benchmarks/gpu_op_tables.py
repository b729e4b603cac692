"""Measure a GPU's efficiency table (``cost_models/tables/<name>.json``) on the GPU itself.

Times, on the device this runs on: GEMMs over a sweep of shapes in bf16, fp16, tf32 and fp32
(forward and the backward's transposed operands), torch's SDPA forward and backward (flash: causal
and not; with an explicit mask: the memory-efficient kernel) over sequence lengths, and a large
copy. Each rate is divided by the preset's datasheet peak (``--preset``) and written as the
table's fractions, with the device, torch version and date as their source. What one GPU cannot
measure (the collectives' fractions, ``sustained``, fitted on published runs) is kept from the
table already there.

    python benchmarks/gpu_op_tables.py --preset h100-80gb            # on an H100: writes tables/h100.json
    python benchmarks/gpu_op_tables.py --preset h200 --out /tmp/h200.json
    python benchmarks/gpu_op_tables.py --device cpu --quick --out /tmp/t.json   # the code path, on a CPU
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from autopar.core.hardware import get_hardware
from cost_models.efficiency import TABLES, load_table

GEMM_SIZES = (1024, 2048, 4096, 6144, 8192, 12288, 16384)
SEQS = (512, 1024, 2048, 4096, 8192)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "tf32": torch.float32, "float32": torch.float32}


def seconds(fn, device: str, repeat: int = 10) -> float:
    """Median seconds of ``fn()`` after two warm-up calls (synchronised on a GPU)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gemm_rates(dtype_name: str, sizes, device: str) -> dict[str, float]:
    """Best FLOP/s over square GEMMs of ``sizes``, forward (A B) and as the backward runs them
    (A B^T and A^T B)."""
    dtype = DTYPES[dtype_name]
    torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
    best = {"forward": 0.0, "backward": 0.0}
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        flops = 2 * n ** 3
        best["forward"] = max(best["forward"], flops / seconds(lambda a=a, b=b: a @ b, device))
        bwd = max(flops / seconds(lambda a=a, b=b: a @ b.t(), device),
                  flops / seconds(lambda a=a, b=b: a.t() @ b, device))
        best["backward"] = max(best["backward"], bwd)
    return best


def attention_rates(seqs, device: str, heads: int = 16, dim: int = 128, tokens: int = 16384) -> dict:
    """FLOP/s of SDPA by kernel ("flash": causal, as FlashAttention counts causal work, half the
    scores; "masked": an explicit mask) and pass, at each sequence length (``tokens`` a batch)."""
    out: dict = {"flash": {}, "masked": {}}
    for seq in seqs:
        q, k, v = (torch.randn(max(tokens // seq, 1), heads, seq, dim, device=device, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        mask = torch.ones(seq, seq, device=device, dtype=torch.bool).tril()
        flops = 4 * q.shape[0] * heads * seq * seq * dim
        for kernel, kwargs, work in (("flash", {"is_causal": True}, 0.5), ("masked", {"attn_mask": mask}, 1.0)):
            def forward(q=q, k=k, v=v, kwargs=kwargs):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
            y = forward()
            grad = torch.ones_like(y)
            fwd = seconds(forward, device)

            def backward(forward=forward, q=q, k=k, v=v, grad=grad):
                return torch.autograd.grad(forward(), (q, k, v), grad)
            bwd = seconds(backward, device) - fwd
            out[kernel][seq] = {"forward": work * flops / fwd, "backward": 2.5 * work * flops / max(bwd, 1e-9)}
    return out


def copy_rate(device: str, nbytes: int) -> float:
    """Bytes/s of a large copy, counting bytes read and written."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds(lambda: dst.copy_(src), device)


def table(preset: str, device: str, quick: bool) -> dict:
    """The measured table, on the layout of the preset's existing one (its unmeasured parts kept)."""
    hw = get_hardware(preset)
    base = json.loads((TABLES / f"{hw.efficiency}.json").read_text())
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device.startswith("cuda") else base["sms"]
    where = f"measured on {name} by benchmarks/gpu_op_tables.py, torch {torch.__version__}, {datetime.date.today()}"
    sizes, seqs = ((256, 512), (128, 256)) if quick else (GEMM_SIZES, SEQS)
    peak = {d: hw.flops_for(torch.float32 if d == "tf32" else DTYPES[d], allow_tf32=d == "tf32") for d in DTYPES}
    gemm = {d: gemm_rates(d, sizes, device) for d in DTYPES}
    attention = attention_rates(seqs, device, tokens=512 if quick else 16384)
    longest, shortest = max(seqs), min(seqs)
    flash_long = attention["flash"][longest]["forward"]
    half = shortest * (flash_long / attention["flash"][shortest]["forward"] - 1) if len(seqs) > 1 else base["attention"]["half_at_seq"]
    base.update({"sms": sms, "device": name})
    base["gemm"].update(peak_fraction={d: min(gemm[d]["forward"] / peak[d], 1.0) for d in DTYPES},
                        backward=gemm["bfloat16"]["backward"] / gemm["bfloat16"]["forward"],
                        source=f"{where}: the best square GEMM of {list(sizes)} (forward; backward: transposed operands)")
    base["attention"].update(
        peak_fraction={k: {p: attention[k][longest][p] / peak["bfloat16"] for p in ("forward", "backward")}
                       for k in ("flash", "masked")},
        half_at_seq=max(half, 1.0), source=f"{where}: SDPA at head dim 128 over sequences {list(seqs)}")
    base["memory"].update(bandwidth_fraction=copy_rate(device, 2**24 if quick else 2**30) / hw.memory_bandwidth,
                          source=f"{where}: a {'16 MiB' if quick else '1 GiB'} copy, bytes read and written")
    return base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="h100-80gb", help="the preset whose peaks the rates are divided by")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small GEMMs and sequences: the code path only")
    ap.add_argument("--out", type=Path, help="where to write (default: the preset's table in cost_models/tables)")
    a = ap.parse_args()
    measured = table(a.preset, a.device, a.quick)
    out = a.out or TABLES / f"{get_hardware(a.preset).efficiency}.json"
    out.write_text(json.dumps(measured, indent=2) + "\n")
    load_table(out)   # the written table loads
    print(json.dumps({k: measured[k] for k in ("device", "gemm", "attention", "memory")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

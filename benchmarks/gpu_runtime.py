"""autopar on one GPU against what a user runs there instead: step time, memory and MFU.

One process, an NCCL process group of one rank, a (1,) mesh. For each model, the variants train
the same batch in turns (rounds of every variant; a variant's figure is the median of its rounds,
a round's the median of its steps; a ratio is the median over rounds of the two within a round):

* eager: the model in bf16 as autopar's ``precision="bf16"`` computes it (fp32 master parameters
  cast to bf16 where used, ``autopar.core.precision.ComputeIn``: FSDP2's mixed-precision policy);
* eager, autocast: the model under ``torch.autocast(bfloat16)``, what most single-GPU scripts do
  (some ops, softmax and the loss among them, stay fp32: not the same arithmetic, timed as the
  user's other choice);
* torch.compile: ``torch.compile`` of the eager variant;
* autopar: ``autopar.compile(model, mesh, precision="bf16")`` on the (1,) mesh;
* autopar + torch.compile: ``torch.compile`` of autopar's generated module.

Every variant trains with AdamW (``foreach``), gradients set to None after each step. MFU is the
model FLOPs of a step (``FlopCounterMode`` over one eager forward and backward, matmuls and
attention) over the step time and the GPU's dense bf16 peak (autopar's hardware preset); the
measured ceiling of one large bf16 matmul is printed beside it. Targets as ``peer_runtime``'s one
process: autopar / eager <= 1.05, and autopar + torch.compile / torch.compile <= 1.05.

    python benchmarks/gpu_runtime.py                 # gpt2-125m and pythia-1.4b, planned on the roofline
    python benchmarks/gpu_runtime.py --profile       # planned from ops timed on this GPU first
    python benchmarks/gpu_runtime.py --models gpt2-125m:8x1024 --rounds 3
    python benchmarks/gpu_runtime.py --variants 'eager;autopar'   # no torch.compile (minutes less)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar.core.hardware import get_hardware
from autopar.core.mesh import hardware_for_device
from autopar.core.precision import ComputeIn
from autopar.models.zoo import get_model
from autopar.profiling.measure import forward_backward, live_bytes, ratio_in_rounds, time_in_turns, training_step
from autopar.profiling.profiler import profile_model
from machine import save_results

RESULTS = Path(__file__).parent / "results" / "gpu_runtime.json"
MODELS = "gpt2-125m:8x1024,pythia-1.4b:8x1024"
ROUNDS = 5
WARMUP, STEPS = 3, 10
SEED = 1234
TARGETS = {"autopar / eager": 1.05, "autopar + torch.compile / torch.compile": 1.05}
VARIANTS = ("eager", "eager, autocast", "torch.compile", "autopar", "autopar + torch.compile")
RATIOS = (("autopar", "eager"), ("autopar + torch.compile", "torch.compile"), ("autopar", "eager, autocast"))


class Called(nn.Module):
    """``module`` trained by calling it and ``loss.backward()``: how a ``torch.compile`` wrapper
    runs compiled (its ``train_step``, were it read through the wrapper, runs the module
    uncompiled)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class Autocast(nn.Module):
    """``model`` under ``torch.autocast`` in bf16: the usual single-GPU mixed precision."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


def _init_one_rank() -> torch.distributed.DeviceMesh:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    return init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))


def _matmul_ceiling(n: int = 8192, reps: int = 20) -> float:
    """FLOP/s of an n x n x n bf16 matmul on random data, the GPU's reachable rate."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3)


def _step_flops(module: nn.Module, batch: tuple[tuple, dict]) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        forward_backward(module, batch)
    module.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def _peak_bytes(module: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[tuple, dict]) -> float:
    """Peak memory of one training step of this variant alone: what the step allocates above the
    bytes live before it (every variant's states), plus this variant's own parameters and
    optimizer states (the other variants' states are not its)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    training_step(module, batch, optimizer)
    torch.cuda.synchronize()
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return torch.cuda.max_memory_allocated() - before + live_bytes([*module.parameters(), *states])


def run(name: str, batch: int, seq: int, mesh, rounds: int, peak_flops: float, profile: bool,
        variants: tuple[str, ...] = VARIANTS) -> dict:
    entry = get_model(name)
    example = entry.example(batch, seq, device="cuda")

    def build() -> nn.Module:
        torch.manual_seed(SEED)
        with torch.device("cuda"):
            return entry.build()

    t0 = time.perf_counter()
    eager = ComputeIn(build(), "bf16")
    params = sum(p.numel() for p in eager.parameters())
    flops = _step_flops(eager, example)
    build_s = {"eager": time.perf_counter() - t0}
    t0 = time.perf_counter()
    model = build()
    if profile:   # the ops' times measured on this GPU, as ``autopar profile`` does on a CPU host
        spec = autopar.MeshSpec((1,), ("dp",), hardware=hardware_for_device("cuda"))
        profile_model(model, spec, *example, precision="bf16")
    pmodel = autopar.compile(model, mesh, *example, precision="bf16", profile="auto" if profile else None)
    build_s["autopar.compile"] = time.perf_counter() - t0
    predicted = pmodel.plan.predicted
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4, foreach=True)
    autopar_opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4, foreach=True)
    made = {"eager": lambda: eager, "eager, autocast": lambda: Autocast(eager.model),
            "torch.compile": lambda: torch.compile(eager), "autopar": lambda: pmodel,
            "autopar + torch.compile": lambda: Called(torch.compile(pmodel))}
    runs = {v: (made[v](), autopar_opt if v.startswith("autopar") else eager_opt, example) for v in variants}
    graphs = {}
    for label in {"torch.compile", "autopar + torch.compile"} & set(variants):   # compile outside the timed steps
        counters.clear()
        t0 = time.perf_counter()
        module, optimizer, b = runs[label]
        for _ in range(2):
            forward_backward(module, b)
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        build_s[label] = time.perf_counter() - t0
        graphs[label] = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}
    times = time_in_turns(runs, rounds=rounds, warmup=WARMUP, steps=STEPS)
    memory = {label: _peak_bytes(*runs[label]) for label in ("eager", "autopar") if label in runs}
    rounds_s = {k: [statistics.median(r) for r in v] for k, v in times.items()}
    step = {k: statistics.median(v) for k, v in rounds_s.items()}
    ratios = {f"{a} / {b}": ratio_in_rounds(rounds_s[a], rounds_s[b]) for a, b in RATIOS if a in runs and b in runs}
    return {"model": name, "params": params, "batch": batch, "seq": seq, "precision": "bf16",
            "step_flops": flops, "build_s": build_s, "compiled_graphs": graphs, "step_s": step, "rounds_s": rounds_s,
            "mfu": {k: flops / s / peak_flops for k, s in step.items()},
            "peak_memory_gib": {k: v / 2 ** 30 for k, v in memory.items()},
            "predicted": {"step_s": predicted.step_time_s, "peak_memory_gib": predicted.peak_memory_bytes / 2 ** 30,
                          "cost_source": predicted.cost_source},
            "ratios": {k: {"ratio": r, "limit": TARGETS.get(k), "met": r <= TARGETS[k] if k in TARGETS else None}
                       for k, r in ratios.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=MODELS, help="name:BATCHxSEQ,... (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--profile", action="store_true",
                    help="plan from ops timed on this GPU (autopar.profiling.profile_model) instead of the roofline")
    ap.add_argument("--variants", default=";".join(VARIANTS),
                    help="which of %(default)s to time (';'-separated; eager and autopar always are)")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_runtime needs a CUDA GPU; on the CPU, peer_runtime.py times the one-process case")
    mesh = _init_one_rank()
    hardware = get_hardware(hardware_for_device("cuda"))
    peak = hardware.peak_flops["bfloat16"]
    ceiling = _matmul_ceiling()
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    print(f"{device}: bf16 peak {peak / 1e12:.0f} TFLOP/s ({hardware.name} preset), "
          f"8192^3 matmul {ceiling / 1e12:.0f} TFLOP/s", flush=True)
    variants = tuple(dict.fromkeys(("eager", "autopar", *(v.strip() for v in a.variants.split(";")))))
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; the variants are {', '.join(VARIANTS)}")
    command = (f"python benchmarks/gpu_runtime.py --models {a.models} --rounds {a.rounds} --variants '{a.variants}'"
               + " --profile" * a.profile)
    results = []
    for spec in a.models.split(","):
        name, shape = spec.split(":")
        batch, seq = (int(x) for x in shape.split("x"))
        r = run(name, batch, seq, mesh, a.rounds, peak, a.profile, variants)
        results.append(r)
        p = r["predicted"]
        print(f"\n{name} ({r['params'] / 1e6:.0f}M params), {batch}x{seq} tokens, bf16, "
              f"{r['step_flops'] / 1e12:.1f} TFLOP a step; peak memory: eager {r['peak_memory_gib']['eager']:.1f} GiB, "
              f"autopar {r['peak_memory_gib']['autopar']:.1f} GiB (predicted {p['peak_memory_gib']:.1f}); "
              f"autopar's predicted step {p['step_s'] * 1e3:.1f} ms ({p['cost_source']}):")
        for k, v in sorted(r["step_s"].items(), key=lambda kv: kv[1]):
            print(f"  {k:26s} {v * 1e3:8.1f} ms   MFU {r['mfu'][k]:6.1%}")
        print("  built in " + ", ".join(f"{k} {v:.0f} s" for k, v in r["build_s"].items()) + "; compiled: "
              + ", ".join(f"{k} {v['graphs']} graphs, {v['breaks']} breaks" for k, v in r["compiled_graphs"].items()))
        for k, v in r["ratios"].items():
            verdict = f"  ({'PASS' if v['met'] else 'FAIL'}: <= {v['limit']:.2f})" if v["limit"] else ""
            print(f"  {k:44s} {v['ratio']:.3f}{verdict}", flush=True)
        save_results(a.out, command, {"device": device, "peak_bf16_flops": peak, "matmul_ceiling_flops": ceiling,
                                      "results": results, "targets": TARGETS,
                                      "all_met": all(v["met"] is not False for r in results
                                                     for v in r["ratios"].values())},
                     machine=device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

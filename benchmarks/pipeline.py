"""Pipeline parallelism (issue 20): autopar's pipeline plans against pipelines written by hand
with ``torch.distributed.pipelining``, and the planner's pipelines for clusters that do not exist here.

(a) Measured, on local gloo processes: one GPT (8 blocks), the same schedule, microbatches and
    mesh. The hand-written pipeline is what PyTorch's pipelining tutorial has a user write: each
    rank builds its stage as a module of the model's own submodules (blocks cut evenly, the
    embeddings on the first stage, the head on the last, the loss in the schedule's ``loss_fn``),
    wraps it in ``PipelineStage`` (and DDP over the data-parallel axis, when there is one) and runs
    the schedule on its part of the batch. autopar compiles the unmodified model with its pipeline
    hand plan (``baselines.pipeline_hand_plans``; each stage DDP-like on the other axis) and
    trains through ``train_step`` on the global batch. Variants are timed in turns
    (``time_in_turns``); the ratio autopar / hand-written is the target (<= 1.10).
(b) Planned on ``meta`` (bf16, as ``realistic_plans.py``): GPT-3 175B at 1536 x 2048 on 1024
    A100 (128 nodes x 8) and Llama-2 70B at 512 x 4096 on 128 H100 (16 x 8), the pipeline in the
    planner's search: planning time, the plan kept, its predicted step and MFU, against Megatron's
    3-D hand plans (pipeline over a factor of the node axis, 1F1B and interleaved 1F1B, each
    stage a hand plan of data x tensor parallelism), which the auto plan must not be slower than.

Saves benchmarks/results/pipeline.json.

    python benchmarks/pipeline.py                 # both parts (several minutes)
    python benchmarks/pipeline.py --part measured
    python benchmarks/pipeline.py --part planned
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, schedules as torch_schedules
from torch.nn.parallel import DistributedDataParallel

import autopar
from autopar.core.capture import capture
from autopar.core.errors import InfeasibleError
from autopar.core.hardware import get_hardware
from autopar.core.microbatch import microbatch_capture
from autopar.models.gpt import GPT, GPTConfig
from autopar.planning.baselines import pipeline_hand_plans
from autopar.planning.options import PlanOptions
from autopar.profiling.launch import run_on_gloo_mesh
from autopar.profiling.measure import slowest_rank_steps, time_in_turns
from machine import machine_line, save_results
from realistic_plans import model_flops_per_token
from variants import build_meta

RESULTS = Path(__file__).parent / "results" / "pipeline.json"
CONFIG = GPTConfig(n_layer=8, n_embd=128, n_head=4, vocab_size=2048, block_size=128)
BATCH, SEQ, MICROBATCHES = 16, 64, 4
# (mesh (pp, dp), schedule, stages per rank)
MEASURED = (((2, 1), "ScheduleGPipe", 1), ((2, 1), "Schedule1F1B", 1), ((2, 1), "ScheduleInterleaved1F1B", 2),
            ((2, 2), "Schedule1F1B", 1))
ROUNDS, WARMUP, STEPS = 5, 2, 5
SEED = 1234
TARGET = 1.10
PLANNED = (("gpt-175b", 1536, 2048, (128, 8), "a100-80gb"), ("llama-70b", 512, 4096, (16, 8), "h100-80gb"))
TIME_LIMIT_S = 60.0


def build() -> GPT:
    torch.manual_seed(SEED)
    return GPT(CONFIG)


def example(rows: int = BATCH) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(SEED)
    idx = torch.randint(0, CONFIG.vocab_size, (rows, SEQ), generator=gen)
    return (idx, torch.roll(idx, -1, 1)), {}


# ---------------------------------------------------------------------------- (a) measured
class HandStage(nn.Module):
    """One stage of the GPT as a user writes it for ``torch.distributed.pipelining``: the model's
    own submodules for blocks ``first``..``last - 1``, with the embeddings and the head where they fall."""

    def __init__(self, model: GPT, first: int, last: int) -> None:
        super().__init__()
        self.embed = first == 0
        self.head = last == len(model.transformer.h)
        if self.embed:
            self.wte, self.wpe = model.transformer.wte, model.transformer.wpe
        self.blocks = nn.ModuleList(model.transformer.h[first:last])
        if self.head:
            self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.head else x


class HandPipeline(nn.Module):
    """This rank's stages and the schedule; ``train_step`` runs one step on this rank's rows."""

    def __init__(self, mesh, schedule: str, virtual: int) -> None:
        super().__init__()
        pp, dp = mesh.size(0), mesh.size(1)
        model = build()
        total = pp * virtual
        per = CONFIG.n_layer // total
        rank = mesh.get_local_rank(0)
        held = list(range(rank, total, pp))
        stages = []
        for s in held:
            module = HandStage(model, s * per, (s + 1) * per)
            if dp > 1:
                module = DistributedDataParallel(module, process_group=mesh.get_group(1))
            self.add_module(f"stage{s}", module)
            shape = (BATCH // MICROBATCHES // dp, SEQ)
            inputs = torch.empty(shape, dtype=torch.long) if s == 0 else \
                torch.empty(*shape, CONFIG.n_embd, requires_grad=True)
            outputs = torch.empty(*shape, CONFIG.vocab_size if s == total - 1 else CONFIG.n_embd, requires_grad=True)
            stages.append(PipelineStage(module, s, total, torch.device("cpu"), input_args=inputs,
                                        output_args=outputs, group=mesh.get_group(0)))
        cls = getattr(torch_schedules, schedule)
        self.first, self.last = 0 in held, total - 1 in held
        self.schedule = cls(stages if virtual > 1 else stages[0], MICROBATCHES, loss_fn=_loss)
        self.dp_rank, self.dp = mesh.get_local_rank(1), dp

    def train_step(self, idx: torch.Tensor, targets: torch.Tensor) -> None:
        rows = slice(self.dp_rank * BATCH // self.dp, (self.dp_rank + 1) * BATCH // self.dp)
        self.schedule.step(*((idx[rows],) if self.first else ()), target=targets[rows] if self.last else None,
                           return_outputs=False)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _worker(mesh, schedule: str, virtual: int, plan: str, rounds: int) -> dict[str, list[float]]:
    runs = {"torch, hand-written": HandPipeline(mesh, schedule, virtual)}
    args, kwargs = example()
    runs["autopar"] = autopar.compile(build(), mesh, args, kwargs, plan=autopar.Plan.from_json(plan))
    timed = {label: (module, torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=True), (args, kwargs))
             for label, module in runs.items()}
    times = time_in_turns(timed, rounds=rounds, warmup=WARMUP, steps=STEPS)
    return {label: [statistics.median(steps) for steps in per_round] for label, per_round in times.items()}


def measured(mesh: tuple[int, ...], schedule: str, virtual: int, rounds: int) -> dict:
    spec = autopar.MeshSpec(mesh, ("pp", "dp"))
    args, kwargs = example()
    model = build()
    options = PlanOptions(profile=None, gather_outputs=False,
                          pipeline={"axis": "pp", "schedule": schedule, "microbatches": MICROBATCHES,
                                    "virtual_stages": virtual})
    plans = pipeline_hand_plans(capture(model, args, kwargs), spec, options, microbatch_capture(model, args, kwargs, "fp32"))
    plan = plans[f"pp(pp, {schedule.removeprefix('Schedule')}) x ddp"]
    ranks = run_on_gloo_mesh(_worker, mesh, schedule, virtual, plan.to_json(), rounds, axis_names=spec.axis_names,
                             start_method="forkserver", timeout_s=1200)
    rounds_s = {k: slowest_rank_steps([r[k] for r in ranks]) for k in ranks[0]}
    step = {k: statistics.median(v) for k, v in rounds_s.items()}
    ratio = step["autopar"] / step["torch, hand-written"]
    predicted = plan.predicted.step_time_s
    return {"mesh": list(mesh), "schedule": schedule, "stages": plan.pipeline.num_stages,
            "microbatches": MICROBATCHES, "step_s": step, "rounds_s": rounds_s, "ratio": ratio,
            "met": ratio <= TARGET, "predicted_step_s": predicted,
            "step_error_pct": 100 * (predicted - step["autopar"]) / step["autopar"]}


# ---------------------------------------------------------------------------- (b) planned
def planned(name: str, batch: int, seq: int, mesh: tuple[int, ...], hardware: str) -> dict:
    model, args, kwargs = build_meta(name, batch, seq)
    spec = autopar.MeshSpec(mesh, hardware=hardware)
    record = {"model": name, "batch": batch, "seq": seq, "mesh": list(mesh), "hardware": hardware}
    options = PlanOptions(precision="bf16", time_limit=TIME_LIMIT_S, gather_outputs=False)
    start = time.perf_counter()
    try:
        plan = autopar.plan(model, spec, args, kwargs, options=options)
    except InfeasibleError as e:
        return {**record, "plan_s": time.perf_counter() - start, "fits": False, "error": str(e)}
    plan_s = time.perf_counter() - start
    peak = get_hardware(hardware).flops_for(torch.bfloat16)
    flops = batch * seq * model_flops_per_token(model, seq)

    def mfu(p: autopar.Plan) -> float:
        return flops / (math.prod(mesh) * peak * p.predicted.step_time_s)

    whole = capture(model, args, kwargs, precision="bf16")
    recapture = microbatch_capture(model, args, kwargs, "bf16")
    start = time.perf_counter()
    megatron = pipeline_hand_plans(whole, spec, replace(options, recompute="full"), recapture)   # as Megatron runs 175B
    hands_s = time.perf_counter() - start
    fitting = {k: p for k, p in megatron.items() if p.feasible}
    best = min(fitting.values(), key=lambda p: p.predicted.step_time_s, default=None)
    pipe = plan.pipeline
    return {**record, "plan_s": plan_s, "fits": plan.feasible, "plan_mesh": plan.mesh.describe(),
            "pipeline": None if pipe is None else {"schedule": pipe.schedule, "stages": pipe.num_stages,
                                                   "microbatches": pipe.num_microbatches,
                                                   "bubble": pipe.bubble_fraction},
            "recompute": sorted(set(plan.recompute.values())) or ["none"],
            "predicted_step_s": plan.predicted.step_time_s, "predicted_peak_bytes": plan.predicted.peak_memory_bytes,
            "predicted_mfu": mfu(plan), "megatron_s": hands_s,
            "megatron": {k: {"step_s": p.predicted.step_time_s, "mfu": mfu(p), "fits": p.feasible,
                             "peak_bytes": p.predicted.peak_memory_bytes} for k, p in megatron.items()},
            "best_megatron": None if best is None else best.name,
            "auto_vs_best_megatron": None if best is None else plan.predicted.step_time_s / best.predicted.step_time_s,
            "solver_pipeline": plan.solver.get("pipeline")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("measured", "planned", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    out: dict = {}
    if args.part in ("measured", "both"):
        out["measured"] = []
        for mesh, schedule, virtual in MEASURED:
            r = measured(mesh, schedule, virtual, args.rounds)
            out["measured"].append(r)
            print(f"{'x'.join(map(str, mesh)):>4} {schedule:<24} {r['stages']} stages: hand-written "
                  f"{r['step_s']['torch, hand-written'] * 1e3:7.1f} ms, autopar {r['step_s']['autopar'] * 1e3:7.1f} ms, "
                  f"ratio {r['ratio']:.3f} ({'met' if r['met'] else 'NOT met'} <= {TARGET}); predicted "
                  f"{r['predicted_step_s'] * 1e3:.1f} ms ({r['step_error_pct']:+.0f}%)", flush=True)
    if args.part in ("planned", "both"):
        out["planned"] = []
        for config in PLANNED:
            r = planned(*config)
            out["planned"].append(r)
            if not r["fits"]:
                print(f"{r['model']} on {r['mesh']}: no plan fits ({r['error'][:200]})")
                continue
            pipe = r["pipeline"]
            print(f"{r['model']} {r['batch']}x{r['seq']} on {r['plan_mesh']}: planned in {r['plan_s']:.1f} s; "
                  + (f"{pipe['schedule']}, {pipe['stages']} stages, {pipe['microbatches']} microbatches, "
                     f"bubble {100 * pipe['bubble']:.1f}%" if pipe else "no pipeline")
                  + f"; step {r['predicted_step_s']:.2f} s, MFU {100 * r['predicted_mfu']:.1f}%; best Megatron 3-D "
                  f"{r['best_megatron']} (auto / it = {r['auto_vs_best_megatron'] or float('nan'):.3f})", flush=True)
    if args.part != "both" and RESULTS.exists():   # the other part's figures stay, with their command
        kept = json.loads(RESULTS.read_text())
        out = {"commands": {**kept.get("commands", {}), **{part: f"python benchmarks/pipeline.py --part {part}"
                                                          for part in out}},
               **{k: v for k, v in kept.items() if k in ("measured", "planned")}, **out}
    save_results(RESULTS, "python benchmarks/pipeline.py" + (f" --part {args.part}" if args.part != "both" else ""),
                 out, machine_line(load=True))


if __name__ == "__main__":
    main()

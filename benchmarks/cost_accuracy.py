"""How close the cost model's predictions are to what a training step really costs here.

For each zoo model, mesh and batch x sequence size: plan once in this process (``autopar.plan``, with
``gather_outputs=False``: the ranks time ``train_step``, which gathers no output), then on every rank compile the plan, train with AdamW and measure the step
(:func:`autopar.profiling.measure.measure_training`: median step time without a profiler, peak tensor bytes
in a separate step). Prints predicted vs. measured step time (slowest rank) and peak memory
(largest rank), the error statistics and PASS/FAIL against the targets; saves everything as JSON.

    python benchmarks/cost_accuracy.py                        # all models, meshes 1, 2, 4, 2x2 (CPU, gloo)
    python benchmarks/cost_accuracy.py --quick                # smallest size of each model only
    python benchmarks/cost_accuracy.py --models gpt-tiny --meshes 2x2 --plan-arg time_limit=10
    python benchmarks/cost_accuracy.py --device cuda          # one process per GPU (nccl); bigger meshes skipped
    python benchmarks/cost_accuracy.py --knobs --models gpt-tiny,gpt2-tiny,llama-tiny --meshes 2,2x2 \
        --launches 1 --out benchmarks/results/cost_accuracy_knobs.json   # microbatches, recomputation, ZeRO-2
    python benchmarks/cost_accuracy.py --knobs --models bloom-tiny --meshes 2,2x2 --launches 1 \
        --out benchmarks/results/cost_accuracy_selective.json   # with selective recomputation (attention in ops)
    python benchmarks/cost_accuracy.py --knobs pipeline --models gpt-tiny,gpt2-tiny,llama-tiny --meshes 2x2 \
        --launches 1 --out benchmarks/results/cost_accuracy_pipeline.json   # 2 pipeline stages (1F1B, GPipe)
    python benchmarks/cost_accuracy.py --knobs context_parallel --meshes 2,2x2 --launches 1 \
        --out benchmarks/results/cost_accuracy_context.json   # by sequence: the ring in each layout, Ulysses
    python benchmarks/cost_accuracy.py --knobs expert_parallel --models mixtral-tiny --meshes 2,4,2x2 \
        --launches 1 --out benchmarks/results/cost_accuracy_experts.json   # experts split by expert (all-to-all)
                                                                           # or within each expert

On the CPU each device is one gloo process with one thread (``autopar.profiling.launch.run_on_gloo_mesh``),
so a mesh bigger than the core count time-shares the cores; other work on the machine slows the
ranks too (the JSON records the load average). Plans are made for ``--hardware`` (default: the
preset of this device type); ``--plan-arg`` passes further keyword arguments to ``autopar.plan``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import pickle
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import autopar
from autopar.cli import parse_mesh
from autopar.core.blocks import recompute_modes
from autopar.core.capture import capture
from autopar.core.errors import AutoparError
from autopar.core.mesh import hardware_for_device
from autopar.core.ops.moe import MOE
from autopar.core.units import fmt
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.zoo import ZooEntry, get_model
from autopar.planning.baselines import candidates
from autopar.planning.options import PlanOptions
from autopar.profiling.launch import run_on_gloo_mesh
from autopar.profiling.measure import measure_training, slowest_rank_steps
from autopar.profiling.profiler import CALIBRATION, profile_model

RESULTS = Path(__file__).parent / "results" / "cost_accuracy.json"
#: Corpus architectures (tests/test_corpus.py) no calibration runs, reported apart: learned
#: positions and ReLU (OPT), ALiBi (BLOOM), grouped-query attention with rotary embeddings (Qwen2).
CORPUS_MODELS = ("opt-tiny", "bloom-tiny", "qwen2-tiny")
MODELS = ("gpt-tiny", "gpt2-tiny", "llama-tiny", *CORPUS_MODELS)
MESHES = ((1,), (2,), (4,), (2, 2))
# Zoo default (8 x 32) up to 8x the tokens; every model here has 64 positions (BLOOM: none, ALiBi).
SIZES = ((8, 32), (16, 64), (32, 64))
#: ``expert_parallel``'s knob value: the experts split by expert over the mesh's last axis
#: (``{"axis": name}``); only for models with mixture-of-experts layers.
LAST_AXIS = "last axis"
#: ``expert_parallel``'s knob value: each expert split within over the mesh's last axis (``{"within": name}``).
WITHIN_LAST_AXIS = "within last axis"
# ``--knobs``: each config planned under each of these knobs (``autopar.PlanOptions``, a pipeline of
# two stages over the first axis on meshes of two axes; and
# ``hand_plan``: that standard plan, here ZeRO-2 or ZeRO-1), on the sizes with activations worth saving.
KNOBS = ((("microbatches", 2),), (("recompute", "full"),), (("microbatches", 2), ("recompute", "full")),
         (("hand_plan", "zero2"), ("microbatches", 2)), (("hand_plan", "zero1"), ("microbatches", 2)),
         (("recompute", "selective"),), (("pipeline", "Schedule1F1B"),), (("pipeline", "ScheduleGPipe"),),
         (("expert_parallel", LAST_AXIS),), (("expert_parallel", LAST_AXIS), ("recompute", "full")),
         (("expert_parallel", WITHIN_LAST_AXIS),))
KNOB_SIZES = SIZES[1:]
# ``--knobs context_parallel``: attention forced to split by sequence on the mesh's first axis
# (``PlanOptions.context_parallel``: that axis, this kind), the planner free on the others; on
# long sequences, where attention is most of the work, of models whose positions reach that far.
# A ring forced in each layout (``KIND:LOAD_BALANCE``): contiguous, and balanced (chunks r and
# 2n-1-r, equal causal work).
CONTEXT_KNOBS = ((("context_parallel", "ring:contiguous"),), (("context_parallel", "ring:balanced"),),
                 (("context_parallel", "ulysses"),))
CONTEXT_SIZES = ((1, 2048), (2, 1024))
CONTEXT_MODELS = ("gpt-tiny-long", "llama-tiny")
#: Models of this benchmark beyond the zoo: gpt-tiny with positions for 2048 tokens (Llama's
#: rotary positions reach any length as built).
LONG_MODELS = {"gpt-tiny-long": dataclasses.replace(
    get_model("gpt-tiny"), name="gpt-tiny-long", description="gpt-tiny with 2048 positions",
    build=lambda: GPT(GPTConfig(block_size=2048)), num_params=GPTConfig(block_size=2048).num_params())}
SEED = 1234
LR = 1e-3

# (name, summary key, limit in %): every figure must be at most its limit.
TARGETS = (
    ("median step-time error", "step_median_abs_pct", 15.0),
    ("worst step-time error", "step_worst_abs_pct", 35.0),
    ("worst memory under-prediction", "mem_worst_under_pct", 5.0),
    ("median memory error", "mem_median_abs_pct", 10.0),
    ("median step-time error, models calibration never runs", "held_out_step_median_abs_pct", 15.0),
    ("worst step-time error, models calibration never runs", "held_out_step_worst_abs_pct", 35.0),
)


@dataclasses.dataclass(frozen=True)
class Config:
    model: str
    mesh: tuple[int, ...]
    batch: int
    seq: int
    knobs: tuple[tuple[str, Any], ...] = ()   # planning options of the config (``KNOBS``)

    @property
    def label(self) -> str:
        knobs = "".join(f" {k}={v}" for k, v in self.knobs)
        return f"{self.model} {mesh_str(self.mesh)} {self.batch}x{self.seq}{knobs}"


def mesh_str(mesh: Sequence[int]) -> str:
    return "x".join(str(s) for s in mesh)


def model_entry(name: str) -> ZooEntry:
    """Zoo model ``name``, or one of ``LONG_MODELS``."""
    return LONG_MODELS.get(name) or get_model(name)


def select_configs(models: Sequence[str] | None = None, meshes: Sequence[tuple[int, ...]] | None = None,
                   quick: bool = False, max_devices: int | None = None, knobs: bool = False, knob: str | None = None
                   ) -> tuple[list[Config], list[str]]:
    """The configs to run (model-major) and a note for each mesh skipped for lack of devices.

    ``quick`` keeps the smallest size of each model; ``max_devices`` (the GPU count on CUDA) skips
    meshes that need more devices than exist; ``knobs`` runs each config under each of ``KNOBS``
    (at ``KNOB_SIZES``) instead of plain; ``knob``: only those setting that option, and
    "context_parallel": ``CONTEXT_KNOBS`` at ``CONTEXT_SIZES`` (on ``CONTEXT_MODELS`` by default,
    meshes of more than one device).
    """
    context = knobs and knob == "context_parallel"
    models = list(models or (CONTEXT_MODELS if context else MODELS))
    for m in models:
        model_entry(m)  # an unknown name fails here, before any run
    meshes = [m for m in meshes or MESHES if not context or math.prod(m) > 1]
    skipped = [f"mesh {mesh_str(m)} skipped: needs {math.prod(m)} devices, {max_devices} here"
               for m in meshes if max_devices is not None and math.prod(m) > max_devices]
    meshes = [m for m in meshes if max_devices is None or math.prod(m) <= max_devices]
    sizes = (CONTEXT_SIZES if context else KNOB_SIZES if knobs else SIZES)[:1 if quick else None]
    variants = list(CONTEXT_KNOBS) if context else \
        [k for k in KNOBS if knob is None or any(name == knob for name, _ in k)] if knobs else [()]
    cores = {m: has_attention_cores(m) for m in models} if knobs else {}
    moe = {m: has_experts(m) for m in models} if knobs else {}
    return [Config(model, mesh, b, s, k) for model in models for mesh in meshes for b, s in sizes for k in variants
            if (cores.get(model, True) or ("recompute", "selective") not in k)
            and (moe.get(model, True) or not any(name == "expert_parallel" for name, _ in k))
            and (len(mesh) > 1 or not any(name == "pipeline" for name, _ in k))], skipped   # stages need a second axis


def has_attention_cores(model: str) -> bool:
    """Does selective recomputation apply to zoo ``model`` (attention computed in ops, not SDPA)?
    Without cores it plans as no recomputation: not a config of its own."""
    entry = model_entry(model)
    with torch.device("meta"):
        graph = capture(entry.build(), *entry.example(1, 8, device="meta")).graph
    return bool(recompute_modes(graph, "selective"))


def has_experts(model: str) -> bool:
    """Does ``model`` have mixture-of-experts layers (``autopar::moe_experts`` in its capture),
    which ``expert_parallel`` can split by expert?"""
    entry = model_entry(model)
    with torch.device("meta"):
        graph = capture(entry.build(), *entry.example(1, 8, device="meta")).graph
    return any(n.target is MOE for n in graph.nodes)


def parse_plan_args(items: Sequence[str]) -> dict[str, Any]:
    """``["time_limit=10", "profile=p.json"]`` -> ``{"time_limit": 10, "profile": "p.json"}``:
    a value is JSON when it parses as JSON, else a string."""
    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise AutoparError(f"bad --plan-arg {item!r}: expected KEY=VALUE, e.g. time_limit=10")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


# --------------------------------------------------------------------------------------- statistics


def error_pct(predicted: float, measured: float) -> float:
    """Signed relative error in %: negative when the prediction is below the measurement."""
    return (predicted - measured) / measured * 100.0


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst absolute error of step time and peak memory over the successful rows
    (each with ``step_error_pct``, ``memory_error_pct``, ``launch_spread_pct``, ``peak_spread_pct``,
    ``label``), the worst memory under-prediction (0 when memory is never under-predicted), and
    the spread between launches of one config (the measurement's own noise): median and worst in
    step time, worst in peak memory; and the step-time errors of the models calibration does not
    run (``held_out``: gpt-tiny is a calibration model, at other sizes than the benchmark's), and
    of those, the corpus models' (``corpus``)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return {"n": 0}
    step = [abs(r["step_error_pct"]) for r in ok]
    mem = [abs(r["memory_error_pct"]) for r in ok]
    worst_step = max(ok, key=lambda r: abs(r["step_error_pct"]))
    worst_mem = max(ok, key=lambda r: abs(r["memory_error_pct"]))
    most_under = min(ok, key=lambda r: r["memory_error_pct"])
    calibrated_on = {name for name, _ in CALIBRATION}
    held_out = [abs(r["step_error_pct"]) for r in ok if r.get("model") not in calibrated_on]
    corpus = [abs(r["step_error_pct"]) for r in ok if r.get("model") in CORPUS_MODELS]
    return {
        "n": len(ok),
        "step_median_abs_pct": statistics.median(step), "step_worst_abs_pct": max(step),
        "step_worst_config": worst_step["label"],
        "mem_median_abs_pct": statistics.median(mem), "mem_worst_abs_pct": max(mem),
        "mem_worst_config": worst_mem["label"],
        "mem_worst_under_pct": max(0.0, -most_under["memory_error_pct"]),
        "mem_worst_under_config": most_under["label"] if most_under["memory_error_pct"] < 0 else None,
        "launch_spread_median_pct": statistics.median(r["launch_spread_pct"] for r in ok),
        "launch_spread_worst_pct": max(r["launch_spread_pct"] for r in ok),
        "peak_spread_worst_pct": max(r["peak_spread_pct"] for r in ok),
        "held_out_n": len(held_out),
        "held_out_step_median_abs_pct": statistics.median(held_out) if held_out else None,
        "held_out_step_worst_abs_pct": max(held_out, default=None),
        "corpus_n": len(corpus),
        "corpus_step_median_abs_pct": statistics.median(corpus) if corpus else None,
        "corpus_step_worst_abs_pct": max(corpus, default=None),
    }


def verdicts(summary: dict[str, Any]) -> list[tuple[str, bool, float | None, float]]:
    """(target name, passed, value % or None where no config measures it, limit %) for each target;
    nothing measured fails."""
    return [(name, summary.get("n", 0) > 0 and summary.get(key) is not None and summary[key] <= limit,
             summary.get(key), limit) for name, key, limit in TARGETS]


# --------------------------------------------------------------------------------------- ranks


def _rank_worker(mesh: DeviceMesh, model_name: str, batch: int, seq: int, plan_json: str, warmup: int,
                 steps: int) -> dict[str, Any]:
    """One rank: build the model (same seed everywhere), compile the parent's plan, measure.

    Module-level: it is pickled into every rank's process.
    """
    # DTensor logs a performance hint on every rank for each two-axis all-gather; kineto prints two
    # lines at every profiler start/stop below its level 6. Either would bury the progress lines.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device("cpu")
    entry = model_entry(model_name)
    torch.manual_seed(SEED)
    with device:
        model = entry.build()
    args, kwargs = entry.example(batch, seq, device=device)
    t0 = time.perf_counter()
    pmodel = autopar.compile(model, mesh, args, kwargs, plan=autopar.Plan.from_json(plan_json))
    compile_s = time.perf_counter() - t0
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    m = measure_training(pmodel, [(args, kwargs)], optimizer, warmup=warmup, steps=steps)
    return {"rank": dist.get_rank(), "compile_s": compile_s, "threads": torch.get_num_threads(),
            **dataclasses.asdict(m)}


def _cuda_rank(rank: int, n: int, port: int, shape: tuple[int, ...], names: tuple[str, ...], fn: Callable[..., Any],
               args: tuple, out_dir: str) -> None:
    """One nccl process per GPU (what run_on_gloo_mesh is for the CPU); the result goes to a file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=n, device_id=torch.device("cuda", rank))
    try:
        result = fn(init_device_mesh("cuda", shape, mesh_dim_names=names), *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_on_cuda_mesh(fn: Callable[..., Any], shape: tuple[int, ...], names: tuple[str, ...], *args: Any) -> list[Any]:
    import torch.multiprocessing as mp

    n = math.prod(shape)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="autopar-cuda-") as out_dir:
        try:
            mp.spawn(_cuda_rank, args=(n, port, shape, names, fn, args, out_dir), nprocs=n, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # one config fails, not the run
            raise AutoparError(f"a rank of the nccl run on mesh {shape} failed: {e}") from e
        results = []
        for r in range(n):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


# --------------------------------------------------------------------------------------- one config


def _plan_summary(plan: autopar.Plan) -> dict[str, Any]:
    return {"feasible": plan.feasible, "solver": plan.solver, "timings_s": plan.timings, "warnings": plan.warnings,
            "memory_budget": plan.memory_budget,
            "parameters": {fqn: n.strategy for fqn, n in plan.parameters.items()}}


def plan_config(cfg: Config, device: str, hardware: str, plan_kwargs: dict[str, Any], profile: bool
                ) -> dict[str, Any]:
    """Profile this host for ``cfg`` (``profile``) and plan it here: the record saved in the JSON,
    measurements to come (``measure_config``)."""
    entry = model_entry(cfg.model)
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    # Built on the ranks' device type: the plan's fingerprint must match their captures exactly.
    with torch.device(device):
        model = entry.build()
    args, kwargs = entry.example(cfg.batch, cfg.seq, device=device)
    spec = autopar.MeshSpec(cfg.mesh, None, hardware)
    # Each rank times ``train_step``, which returns only the loss and never gathers the other
    # outputs: planned likewise (the default plan prices a gather of the logits every step)
    options = {"gather_outputs": False, **plan_kwargs, **dict(cfg.knobs)}
    if isinstance(options.get("context_parallel"), str) and options["context_parallel"] != "auto":   # a kind
        kind, _, layout = options["context_parallel"].partition(":")
        options["context_parallel"] = {"axis": spec.axis_names[0], "kind": kind} | ({"load_balance": layout} if layout else {})
    hand = options.pop("hand_plan", None)
    if options.get("expert_parallel") in (LAST_AXIS, WITHIN_LAST_AXIS):
        options["expert_parallel"] = {("axis" if options["expert_parallel"] == LAST_AXIS else "within"):
                                      spec.axis_names[-1]}
    profile_s = 0.0
    if profile:   # measure this host (cached: ops already profiled, and the collectives, are reused)
        planned = PlanOptions.of(None, **options)
        profile_model(model, spec, args, kwargs, progress=None, precision=planned.precision, options=planned)
        profile_s = time.perf_counter() - t0
    plan = (candidates(model, spec, args, kwargs, **options)[hand] if hand else
            autopar.plan(model, spec, args, kwargs, **options))
    return {**dataclasses.asdict(cfg), "label": cfg.label, "status": "ok", "profile_s": profile_s,
            "plan_s": time.perf_counter() - t0 - profile_s, "predicted": dataclasses.asdict(plan.predicted),
            "plan": _plan_summary(plan), "plan_json": plan.to_json(), "launches": []}


def measure_config(record: dict[str, Any], device: str, warmup: int, steps: int, timeout_s: float) -> None:
    """One more launch of the planned config on every rank: appended to ``record["launches"]``."""
    t0 = time.perf_counter()
    worker_args = (record["model"], record["batch"], record["seq"], record["plan_json"], warmup, steps)
    names = autopar.Plan.from_json(record["plan_json"]).mesh.axis_names   # a pipeline plan runs on named axes
    if device == "cuda":
        ranks = _run_on_cuda_mesh(_rank_worker, tuple(record["mesh"]), names, *worker_args)
    else:
        ranks = run_on_gloo_mesh(_rank_worker, tuple(record["mesh"]), *worker_args, timeout_s=timeout_s,
                                 start_method="forkserver", axis_names=names)
    steps = slowest_rank_steps([r["step_s_all"] for r in ranks])
    record["launches"].append({"run_s": time.perf_counter() - t0, "ranks": ranks, "slowest_rank_steps_s": steps,
                               "step_s": statistics.median(steps), "peak_bytes": max(r["peak_bytes"] for r in ranks)})


def finish_record(record: dict[str, Any]) -> None:
    """Measured figures over the launches: the typical step (each timed step's slowest rank,
    pooled over all launches, the median: the figure the cost model predicts, its calibration
    measured the same way), the lowest launch's peak (a launch's: its busiest rank's typical step,
    ``measure_training``; the CPU measurement can only err high, see ``autopar.profiling.measure``:
    frees of blocks allocated before the step are not seen; CUDA's peak counter is exact and
    launches agree), and how far the launches' typical steps and peaks
    spread (``launch_spread_pct``: slowest over fastest, the noise floor; ``peak_spread_pct``).
    The plan's JSON is dropped: the record keeps its summary."""
    del record["plan_json"]
    launches = record["launches"]
    steps = [launch["step_s"] for launch in launches]
    peaks = [launch["peak_bytes"] for launch in launches]
    record["measured_step_s"] = statistics.median(s for launch in launches for s in launch["slowest_rank_steps_s"])
    record["measured_peak_bytes"] = min(peaks)
    record["launch_spread_pct"], record["peak_spread_pct"] = _spread_pct(steps), _spread_pct(peaks)
    record["step_error_pct"] = error_pct(record["predicted"]["step_time_s"], record["measured_step_s"])
    record["memory_error_pct"] = error_pct(record["predicted"]["peak_memory_bytes"], record["measured_peak_bytes"])


def _spread_pct(values: Sequence[float]) -> float:
    """How far the largest of ``values`` is above the smallest, in percent."""
    return (max(values) / min(values) - 1) * 100


# --------------------------------------------------------------------------------------- output

HEADERS = ("model", "mesh", "batch x seq [knobs]", "pred step ms", "meas step ms", "err %", "launch spread %",
           "pred peak MiB", "meas peak MiB", "err %")


def table_row(r: dict[str, Any]) -> tuple[str, ...]:
    knobs = " ".join(f"{k}={v}" for k, v in r.get("knobs") or ())
    head = (r["model"], mesh_str(r["mesh"]), f"{r['batch']}x{r['seq']}" + (f" {knobs}" if knobs else ""))
    if r["status"] != "ok":
        return head + ("refused" if r["status"] == "refused" else "failed",) + ("",) * 6
    p = r["predicted"]
    return head + (f"{p['step_time_s'] * 1e3:.2f}", f"{r['measured_step_s'] * 1e3:.1f}", f"{r['step_error_pct']:+.0f}",
                   f"{r['launch_spread_pct']:.0f}",
                   f"{p['peak_memory_bytes'] / 2**20:.2f}", f"{r['measured_peak_bytes'] / 2**20:.2f}",
                   f"{r['memory_error_pct']:+.0f}")


def format_table(rows: Sequence[tuple[str, ...]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADERS)]

    def line(cells: Sequence[str]) -> str:  # model, mesh and size left-aligned; numbers right-aligned
        return "  ".join(c.ljust(w[i]) if i < 3 else c.rjust(w[i]) for i, c in enumerate(cells))

    return "\n".join([line(HEADERS), line(["-" * x for x in w]), *(line(r) for r in rows)])


def format_summary(summary: dict[str, Any]) -> str:
    if not summary.get("n"):
        return "no config measured"
    s = summary
    under = (f"{s['mem_worst_under_pct']:.1f}% ({s['mem_worst_under_config']})" if s["mem_worst_under_config"]
             else "none (memory never under-predicted)")
    lines = [
        f"{s['n']} configs. step time error: median {s['step_median_abs_pct']:.1f}%, worst "
        f"{s['step_worst_abs_pct']:.1f}% ({s['step_worst_config']})",
        f"peak memory error: median {s['mem_median_abs_pct']:.1f}%, worst {s['mem_worst_abs_pct']:.1f}% "
        f"({s['mem_worst_config']}); worst under-prediction: {under}",
        f"noise floor: the launches of one config spread by {s['launch_spread_median_pct']:.1f}% (median), "
        f"{s['launch_spread_worst_pct']:.1f}% (worst) in step time, up to {s['peak_spread_worst_pct']:.1f}% in peak memory",
    ]
    if s["held_out_n"]:
        lines.append(f"models calibration does not run ({s['held_out_n']} configs): step time error median "
                     f"{s['held_out_step_median_abs_pct']:.1f}%, worst {s['held_out_step_worst_abs_pct']:.1f}%")
    if s.get("corpus_n"):
        lines.append(f"  of which corpus models ({', '.join(CORPUS_MODELS)}; {s['corpus_n']} configs): step time error "
                     f"median {s['corpus_step_median_abs_pct']:.1f}%, worst {s['corpus_step_worst_abs_pct']:.1f}%")
    lines += [f"{'PASS' if ok else 'FAIL'}: {name} "
              f"{'(no config measures it)' if value is None else f'{value:.1f}%'} (target <= {limit:g}%)"
              for name, ok, value, limit in verdicts(summary)]
    return "\n".join(lines)


def git_revision() -> dict[str, Any] | None:
    """The commit measured and whether tracked files had changes: predictions move with the cost model."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info(device: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "host": platform.node(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            # Other work on the machine slows the ranks down: the load says whether there was any.
            "load_avg_1_5_15min": os.getloadavg()}
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


# --------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help=f"comma-separated zoo models (default {','.join(MODELS)}; with "
                    f"--knobs context_parallel {','.join(CONTEXT_MODELS)})")
    ap.add_argument("--meshes", default=",".join(mesh_str(m) for m in MESHES),
                    help="comma-separated mesh shapes (default 1,2,4,2x2)")
    ap.add_argument("--quick", action="store_true", help=f"only the smallest size ({SIZES[0][0]}x{SIZES[0][1]})")
    ap.add_argument("--knobs", nargs="?", const="all", default=None, metavar="NAME",
                    help="plan each config under each knob (KNOBS: microbatches, recomputation, ZeRO, pipeline, "
                         "expert_parallel) instead of plain; NAME keeps the knobs of that option only, e.g. --knobs "
                         "pipeline; --knobs context_parallel: ring and Ulysses attention on long sequences (CONTEXT_KNOBS)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo processes; cuda: one nccl process per GPU (default cpu)")
    ap.add_argument("--hardware", default=None, help="hardware preset or JSON file to plan for (default: this device's)")
    ap.add_argument("--plan-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra keyword argument of autopar.plan (VALUE parsed as JSON if it can be); repeatable")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported (default 10)")
    ap.add_argument("--launches", type=int, default=3,
                    help="separate launches of each config, taking turns; the median of all their steps counts "
                         "(default 3)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per config (default 600)")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    ap.add_argument("--no-profile", action="store_true",
                    help="plan from the roofline presets only (default: run `autopar profile` for each config "
                         "first, cached, and plan with the measured costs)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every config ran (targets missed are reported, not an error)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    started = time.perf_counter()
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    gpus = torch.cuda.device_count() if a.device == "cuda" else None
    hardware = a.hardware or hardware_for_device(a.device)
    try:
        plan_kwargs = parse_plan_args(a.plan_arg)
        configs, skipped = select_configs([m for m in a.models.split(",") if m],
                                          [parse_mesh(m) for m in a.meshes.split(",") if m], a.quick, gpus,
                                          knobs=a.knobs is not None, knob=None if a.knobs == "all" else a.knobs)
    except AutoparError as e:
        parser.error(str(e))  # exits with status 2, as for any bad argument
    for note in skipped:
        print(note, file=sys.stderr)
    result: dict[str, Any] = {
        "machine": machine_info(a.device), "revision": git_revision(), "command": [sys.executable, *sys.argv],
        "settings": {"device": a.device, "hardware": hardware, "plan_kwargs": plan_kwargs, "profiled": not a.no_profile,
                     "warmup": a.warmup,
                     "steps": a.steps, "launches": a.launches, "optimizer": f"AdamW(lr={LR})", "seed": SEED},
        "skipped": skipped, "configs": [],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    # Launch k of every config runs after launch k-1 of all of them: a slow spell of the host
    # hits different configs in different launches, and the median pools the steps of all.
    records = result["configs"]
    for launch in range(a.launches):
        for i, cfg in enumerate(configs):
            if launch and records[i]["status"] != "ok":
                continue   # failed in an earlier launch
            print(f"[launch {launch + 1}/{a.launches}, {i + 1}/{len(configs)}] {cfg.label} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            planned = launch > 0
            try:
                if launch == 0:
                    records.append(plan_config(cfg, a.device, hardware, plan_kwargs, profile=not a.no_profile))
                planned = True
                measure_config(records[i], a.device, a.warmup, a.steps, a.timeout)
            except AutoparError as e:   # replaces (or, if planning failed, appends) this config's record
                # refused by the planner: a knob the model cannot take (a split within experts with biases)
                status = "error" if planned else "refused"
                records[i:i + 1] = [{**dataclasses.asdict(cfg), "label": cfg.label, "status": status, "error": str(e)}]
                print(f"  {'failed' if planned else 'refused by the planner'}: {str(e).splitlines()[0]}", file=sys.stderr)
            else:
                last = records[i]["launches"][-1]
                print(f"  {fmt(time.perf_counter() - t0, 's')}: measured step {fmt(last['step_s'], 's')}, "
                      f"peak {fmt(last['peak_bytes'], 'B')}", file=sys.stderr, flush=True)
            a.out.write_text(json.dumps(result, indent=1, default=str))  # an interrupted run keeps its results
    for record in records:
        if record["status"] == "ok":
            finish_record(record)
    result["summary"] = summary = summarize(result["configs"])
    result["targets"] = [{"name": n, "passed": ok, "value_pct": v, "limit_pct": lim} for n, ok, v, lim in verdicts(summary)]
    result["elapsed_s"] = time.perf_counter() - started
    result["load_avg_at_end"] = os.getloadavg()
    a.out.write_text(json.dumps(result, indent=1, default=str))

    load = result["machine"]["load_avg_1_5_15min"][0], result["load_avg_at_end"][0]
    print(f"Cost model accuracy on {result['machine']['cpu']} ({result['machine']['cores']} cores, load "
          f"{load[0]:.1f} at start, {load[1]:.1f} at end), torch {torch.__version__}, device {a.device}, planned for "
          f"{hardware}; median of {a.steps} timed steps (slowest rank) after {a.warmup} warm-up in each of {a.launches} launches, AdamW:")
    print(format_table([table_row(r) for r in result["configs"]]))
    print()
    print(format_summary(summary))
    print(f"\n{len(configs)} configs in {fmt(result['elapsed_s'], 's')}; results saved to {a.out}")
    return 0 if all(r["status"] == "ok" for r in result["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

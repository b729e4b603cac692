"""autopar's generated code against what users run instead, by measured step time, side by side.

For each model and mesh, one launch of local gloo processes builds every variant, then times them
in turns (rounds of every variant, so that the host's slow and fast spells fall on all of them;
a round's figure is the median of its steps on the slowest rank, a variant's the median of its
rounds). A ratio of two variants is the median over rounds of their ratio within the round: the
two ran a second apart, so a spell of load on this shared host (rounds of one variant vary by
+-20% here) slows both alike and cancels, where it does not in the ratio of the two medians:

* mesh 4: torch DDP, torch FSDP2 (``fully_shard`` per block, then the root); autopar's 'ddp' and
  'fsdp' hand plans and its auto plan.
* mesh 2x2 (dp x tp): the same, plus torch tensor parallel (``parallelize_module`` with
  ColwiseParallel/RowwiseParallel on tp, FSDP2 on dp) where torch's API can split the model
  unchanged (separate q/k/v projections in ``nn.Linear``: Llama), against autopar's
  'fsdp(dp) x tp(tp)' hand plan (``autopar.profiling.peers`` builds torch's variants).
* mixture-of-experts models (Mixtral; ``autopar.models.moe:build``, a hand-written list of
  experts), meshes 2, 4 and 2x2 (dp x ep): torch EP x DP
  (torchtitan-style expert parallelism written by hand: experts split by expert over the last
  axis, tokens sent to them by all-to-all, the rest under DDP) against autopar's plan with
  ``expert_parallel`` forced onto the same axis ("ep"); and torch DDP against autopar's 'ddp'
  (FSDP and the plain loop left out, to keep a launch of 4 ranks within its time limit).
* one process: eager PyTorch against autopar on a (1,) mesh.

Torch's wrappers get each rank's part of the global batch (DDP and FSDP2 a quarter, TP ranks their
dp group's half); autopar gets the global batch, as its API asks. Torch's wrappers return each
rank's part of the outputs (its rows of the logits); autopar's plans do the same
(``gather_outputs=False``: DTensor outputs, no communication), stepped by ``train_step`` and
AdamW with ``foreach=True``.

The plain loop (", plain loop" variants): the loop most users write, ``loss = model(*args,
**kwargs).loss; loss.backward(); opt.step(); opt.zero_grad()`` with ``AdamW(lr=...)`` as torch
defaults it, on torch DDP and on autopar's 'ddp' and auto plans made with default options (every
output returned whole on every rank; the loss's sum and the logits' gather are launched, waited
for only when read: the loop reads neither).

Prints each variant's step and the ratios: autopar hand plan / the torch wrapper doing the same
(target <= 1.10), autopar's expert-parallel plan / torch EP x DP (<= 1.10), auto / fastest torch variant (<= 1.05), the plain loop on autopar's 'ddp' and
auto plans / on torch DDP (<= 1.05), one process autopar / eager (<= 1.05), each with its 90%
bootstrap interval over the rounds (in brackets: how far other rounds could move it); saves
benchmarks/results/peer_runtime.json.

Where the auto plan is a hand plan (``kept_hand_plan``), that hand plan's module is timed once for
both. Where the variants' training states would not fit this host's memory together (gpt2-125m:
2 GB a rank for each replicated variant), each variant runs in a launch of its own and the
launches take turns, one round each (the plain loop's variants are left out there).

    python benchmarks/peer_runtime.py                              # every model, mesh 4, 2x2 and 1
    python benchmarks/peer_runtime.py --models gpt-tiny --meshes 4,1
    python benchmarks/peer_runtime.py --models mixtral-tiny --meshes 2,4,2x2
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

import autopar
from autopar.models.zoo import get_model
from autopar.planning.baselines import candidates
from autopar.profiling import peers
from autopar.profiling.launch import run_on_gloo_mesh
from autopar.profiling.measure import ratio_in_rounds, ratio_interval, slowest_rank_steps, time_in_turns
from autopar.profiling.profiler import profile_model
from machine import machine_line, save_results

RESULTS = Path(__file__).parent / "results" / "peer_runtime.json"
MODELS = {"gpt-tiny": (16, 64), "gpt2-tiny": (16, 64), "llama-tiny": (16, 64), "gpt2-125m": (8, 128),
          "mixtral-tiny": (16, 64), "autopar.models.moe:build": (16, 64)}
MESHES = ((4,), (2, 2), (1,))
ROUNDS = 15
#: A launch's time limit: building and compiling its variants, then a share for each round of them
#: (a round of every tiny model's variants takes seconds): more rounds, a longer launch.
LAUNCH_S, ROUND_S = 300, 20
WARMUP_STEPS = {"gpt2-125m": (1, 3)}   # (warmup, timed) steps a round; others (2, 20): its steps take seconds here
STATE_BYTES_PER_PARAM = 16   # fp32 parameter, gradient and AdamW's two states
SEED = 1234
TARGETS = {"hand / torch": 1.10, "EP / torch EP": 1.10, "auto / fastest torch": 1.05,
           "plain loop / torch DDP": 1.05, "autopar (1,) / eager": 1.05}
PLAIN = ", plain loop"   # a variant timed in the loop users write (``_PlainLoop``)
# autopar hand plan -> the torch variant doing the same thing
PEERS = {"ddp": "torch DDP", "fsdp": "torch FSDP2", "fsdp(dp) x tp(tp)": "torch TP x FSDP2", "ep": "torch EP x DP"}
EP = "ep"   # autopar's plan with its experts split by expert over the mesh's last axis (``expert_parallel`` forced)


def _worker(mesh, name: str, batch: int, seq: int, torch_variants: list[str], plans: dict[str, str], rounds: int
            ) -> dict[str, list[float]]:
    """On every rank: build the variants named (torch's, then autopar's plans), then time them in turns."""
    entry = get_model(name)
    example = entry.example(batch, seq)

    def build() -> nn.Module:
        torch.manual_seed(SEED)
        return entry.build()

    runs = {label: peers.wrap(label.removesuffix(PLAIN), build(), example, mesh) for label in torch_variants}
    for label, text in plans.items():
        runs[f"autopar {label}"] = (autopar.compile(build(), mesh, *example, plan=autopar.Plan.from_json(text)),
                                    example)
    # foreach=True for every variant but the plain loop's: torch picks its per-tensor loop for DTensor
    # parameters (autopar, FSDP2) and on the CPU, where the loop costs ~40 us per tensor and op
    timed = {label: (_PlainLoop(model), torch.optim.AdamW(model.parameters(), lr=1e-3), rank_batch)
             if label.endswith(PLAIN) else (model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True), rank_batch)
             for label, (model, rank_batch) in runs.items()}
    warmup, steps = WARMUP_STEPS.get(name, (2, 20))
    times = time_in_turns(timed, rounds=rounds, warmup=warmup, steps=steps)
    return {label: [statistics.median(steps) for steps in per_round] for label, per_round in times.items()}


class _PlainLoop(nn.Module):
    """A module called as users call it: its outputs' ``.loss``, then ``backward()`` (it hides a
    compiled module's ``train_step`` from ``autopar.profiling.measure.forward_backward``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _fit_together(variants: int, state_bytes: int, ranks: int) -> bool:
    """Do the training states of ``variants`` on ``ranks`` fit in half of this host's memory?"""
    return variants * ranks * state_bytes <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2


def run(name: str, mesh: tuple[int, ...], rounds: int, profile: str) -> dict:
    batch, seq = MODELS[name]
    entry = get_model(name)
    torch.manual_seed(SEED)
    model = entry.build()
    args, kwargs = entry.example(batch, seq)
    moe = peers.has_experts(model)
    spec = autopar.MeshSpec(mesh, ("dp",) if len(mesh) == 1 else ("dp", "ep" if moe else "tp"), hardware="cpu")
    if profile == "auto" and spec.size > 1:
        profile_model(model, spec, args, kwargs, progress=None)
    # torch's wrappers return each rank's part of the outputs: so do autopar's plans here
    options = autopar.PlanOptions(profile=None if profile == "none" else "auto", gather_outputs=spec.size == 1)
    t0 = time.perf_counter()
    auto = autopar.plan(model, spec, args, kwargs, options=options)
    torch_variants, plans = _variants(model, spec, args, kwargs, options, moe)
    kept = auto.solver.get("kept_hand_plan")
    if kept not in plans:   # a hand plan kept as the auto plan is timed once, as that hand plan
        plans["auto"] = auto
    state_bytes = STATE_BYTES_PER_PARAM * sum(p.numel() for p in model.parameters())
    plain = spec.size > 1 and not moe   # left out for one variant a launch (its peers would not share rounds)
    together = _fit_together(len(torch_variants) + len(plans) + 3 * plain, state_bytes, spec.size)
    if plain and together:   # the plans users get by default: outputs whole on every rank
        defaults = replace(options, gather_outputs=True)
        torch_variants.append("torch DDP" + PLAIN)
        plans["ddp" + PLAIN] = candidates(model, spec, args, kwargs, options=defaults)["ddp"]
        plans["auto" + PLAIN] = autopar.plan(model, spec, args, kwargs, options=defaults)
    plan_s = time.perf_counter() - t0
    rounds_s = _time_in_rounds(name, mesh, spec.axis_names, torch_variants, plans, rounds, together)
    step = {k: statistics.median(v) for k, v in rounds_s.items()}
    auto_label = f"autopar {kept}" if kept in plans else "autopar auto"
    ratios = _ratios(rounds_s, torch_variants, auto_label, spec.size)
    return {"model": name, "mesh": list(mesh), "batch": batch, "seq": seq, "plan_s": plan_s,
            "auto_plan": kept or "solver", "launches": "one" if together else "one per variant, in turns",
            "step_s": step, "rounds_s": rounds_s,
            "ratios": ratios, "parameters": _parameter_strategies(plans)}


def _parameter_strategies(plans: dict[str, autopar.Plan]) -> dict[str, dict[str, str]]:
    """Each timed plan's strategy per parameter: what a later run's figures are set beside
    (each run plans on its own host's profile)."""
    return {label: {n.fqn or n.name: n.strategy for n in plan.nodes if n.op == "parameter"}
            for label, plan in plans.items()}


def _variants(model: nn.Module, spec: autopar.MeshSpec, args: tuple, kwargs: dict, options: autopar.PlanOptions,
              moe: bool) -> tuple[list[str], dict[str, autopar.Plan]]:
    """torch's variants and autopar's hand plans to time (autopar's auto plan comes beside them).
    A mixture-of-experts model gets torch DDP and EP x DP against autopar's 'ddp' and expert-parallel
    plans only: with FSDP and the plain loop too, a launch of 4 ranks outlasts its limit here."""
    if spec.size == 1:
        return ["torch eager"], {}
    torch_variants = ["torch DDP", "torch EP x DP"] if moe else ["torch DDP", "torch FSDP2"]
    if spec.ndim == 2 and not moe and peers.tensor_parallel_plan(model) is not None:
        torch_variants.append("torch TP x FSDP2")
    hands = candidates(model, spec, args, kwargs, options=options)
    plans = {k: p for k, p in hands.items() if k in PEERS and (k == "ddp" or not moe)}
    if moe:
        plans[EP] = autopar.plan(model, spec, args, kwargs,
                                 options=replace(options, expert_parallel={"axis": spec.axis_names[-1]}))
    return torch_variants, plans


def _time_in_rounds(name: str, mesh: tuple[int, ...], axis_names: tuple[str, ...], torch_variants: list[str],
                    plans: dict, rounds: int, together: bool) -> dict[str, list[float]]:
    """Each variant's step times, every round: all variants in one launch (``together``), or one
    launch per variant, taking turns round by round."""
    batch, seq = MODELS[name]
    variants = [*torch_variants, *plans]
    launches = [variants] if together else [[v] for v in variants]
    rounds_s: dict[str, list[float]] = {}
    for r in range(1 if together else rounds):
        for group in launches[r % len(launches):] + launches[:r % len(launches)]:
            ranks = run_on_gloo_mesh(_worker, mesh, name, batch, seq, [v for v in group if v in torch_variants],
                                     {k: plans[k].to_json() for k in group if k in plans}, rounds if together else 1,
                                     axis_names=axis_names, start_method="forkserver",
                                     timeout_s=LAUNCH_S + ROUND_S * (rounds if together else 1))
            for k in ranks[0]:
                rounds_s.setdefault(k, []).extend(slowest_rank_steps([rank[k] for rank in ranks]))
    return rounds_s


def _ratios(rounds_s: dict[str, list[float]], torch_variants: list[str], auto_label: str,
            size: int) -> dict[str, dict]:
    """Each compared pair's target, ratio of step times in the same rounds, and that ratio's 90%
    bootstrap interval over the rounds (``ratio_interval``)."""
    pairs = {}
    for hand, peer in PEERS.items():
        if f"autopar {hand}" in rounds_s and peer in rounds_s:
            pairs[f"{hand} / {peer}"] = ("EP / torch EP" if hand == EP else "hand / torch", f"autopar {hand}", peer)
    for label in ("ddp" + PLAIN, "auto" + PLAIN):
        if f"autopar {label}" in rounds_s:
            pairs[f"{label} / torch DDP{PLAIN}"] = ("plain loop / torch DDP", f"autopar {label}", "torch DDP" + PLAIN)
    step = {k: statistics.median(v) for k, v in rounds_s.items()}
    fastest = min((v for v in torch_variants if not v.endswith(PLAIN)), key=step.__getitem__)
    pairs[f"auto / {fastest}"] = ("autopar (1,) / eager" if size == 1 else "auto / fastest torch", auto_label, fastest)
    ratios = {}
    for name, (kind, variant, peer) in pairs.items():
        r = ratio_in_rounds(rounds_s[variant], rounds_s[peer])
        ratios[name] = {"target": kind, "ratio": r, "interval_90": ratio_interval(rounds_s[variant], rounds_s[peer]),
                        "limit": TARGETS[kind], "met": r <= TARGETS[kind]}
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--meshes", default=",".join("x".join(map(str, m)) for m in MESHES))
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--profile", choices=("auto", "none"), default="auto",
                    help="plan with this host's profile (measured first if not cached; default) or the roofline")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    a = ap.parse_args()
    meshes = [tuple(int(x) for x in m.split("x")) for m in a.meshes.split(",")]
    command = (f"python benchmarks/peer_runtime.py --models {a.models} --meshes {a.meshes} "
               f"--rounds {a.rounds} --profile {a.profile} --out {os.path.relpath(a.out, Path(__file__).parent.parent)}")
    results = []
    for mesh in meshes:
        for name in a.models.split(","):
            r = run(name, mesh, a.rounds, a.profile)
            results.append(r)
            print(f"\n{name} on {'x'.join(map(str, mesh))} gloo process(es), global batch {r['batch']}x{r['seq']} "
                  f"(auto plan: {r['auto_plan']}):")
            for k, v in sorted(r["step_s"].items(), key=lambda kv: kv[1]):
                print(f"  {k:32s} {v * 1e3:8.1f} ms")
            for k, v in r["ratios"].items():
                low, high = v["interval_90"]
                print(f"  {k:48s} {v['ratio']:.2f} [{low:.2f}, {high:.2f}]  ({'PASS' if v['met'] else 'FAIL'}: "
                      f"<= {v['limit']:.2f})", flush=True)
            met = all(v["met"] for r in results for v in r["ratios"].values())
            save_results(a.out, command, {"results": results, "targets": TARGETS, "all_met": met,
                                            "complete": len(results) == len(meshes) * len(a.models.split(","))},
                         machine=machine_line(load=True))   # after each: a long run keeps what it measured
    print(f"\n{'PASS' if met else 'FAIL'}: every ratio within its target")

if __name__ == "__main__":
    main()

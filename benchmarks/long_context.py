"""Long-context plans (issue 42): Llama-3 8B as transformers builds it (``LlamaConfig`` with
Llama-3-8B's sizes, built on ``meta``), one sequence of 256k tokens on 8 H100 and of 1M tokens on
4 x 8 H100 (and on H200s), bf16 (fp32 master weights and optimizer states), planned with the default options
(``gather_outputs=False``, as a training loop reads only the loss).

For each: planning time (capture included), whether it fits, the predicted step and peak memory,
the plan's strategy (where attention is split by sequence and how, recomputation, microbatches),
and torchtitan's hand plans (FSDP x CP, FSDP x TP x CP) as the same cost model prices them.
Saves benchmarks/results/long_context.json.

    python benchmarks/long_context.py                    # both configs (about a minute each)
    python benchmarks/long_context.py --only 262144      # one
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import autopar
from autopar.core.errors import InfeasibleError, PlanningTimeout
from autopar.core.units import fmt
from machine import save_results

RESULTS = Path(__file__).parent / "results" / "long_context.json"
#: (sequence, mesh shape, axis names, hardware): one node, and four nodes as context x tensor
#: parallel, of H100 (the issue's) and of H200 (141 GB each).
CONFIGS = tuple((seq, shape, names, hw) for hw in ("h100-80gb", "h200")
                for seq, shape, names in ((262144, (8,), ("cp",)), (1048576, (4, 8), ("cp", "tp"))))
#: Llama-3 8B (Meta's config.json), its positions as long as the sequence planned.
LLAMA3_8B = dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)


def llama3_8b(seq: int) -> tuple[torch.nn.Module, tuple, dict]:
    """Llama-3 8B on ``meta``, and one sequence of ``seq`` tokens with its labels."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**LLAMA3_8B, max_position_embeddings=seq)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": torch.zeros_like(ids), "use_cache": False}


def run(seq: int, shape: tuple[int, ...], names: tuple[str, ...], hardware: str, time_limit: float) -> dict:
    model, args, kwargs = llama3_8b(seq)
    mesh = autopar.MeshSpec(shape, names, hardware=hardware)
    record: dict = {"model": "llama-3-8b", "seq": seq, "mesh": mesh.describe(), "precision": "bf16"}
    start = time.perf_counter()
    try:
        plan = autopar.plan(model, mesh, args, kwargs, precision="bf16", time_limit=time_limit, gather_outputs=False)
    except (InfeasibleError, PlanningTimeout) as e:
        return {**record, "plan_s": time.perf_counter() - start, "fits": False, "error": str(e)}
    plan_s = time.perf_counter() - start
    cp = plan.context_parallel
    hand = {name: h for name, h in plan.solver.get("hand_plans", {}).items() if "fsdp+cp" in name}
    if any("step_time_s" not in h for h in hand.values()):   # unfit where the plan recomputes fewer blocks
        hand.update(fully_recomputed(model, mesh, args, kwargs, [n for n, h in hand.items() if "step_time_s" not in h]))
    return {**record, "plan_s": plan_s, "fits": plan.feasible, "plan": plan.name,
            "predicted_step_s": plan.predicted.step_time_s, "tokens_per_s_per_device": seq / plan.predicted.step_time_s / mesh.size,
            "predicted_peak_bytes": plan.predicted.peak_memory_bytes, "mfu": plan.predicted.mfu,
            "context_parallel": None if cp is None else {"axis": cp.axis, "kind": cp.kind, "load_balance": cp.load_balance,
                                                         "nodes": len(cp.nodes)},
            "recompute": plan.recompute_mode, "recomputed_blocks": len(plan.recompute), "microbatches": plan.microbatches, "torchtitan_hand_plans": dict(hand),
            "hand_plans_costed": sorted(plan.solver.get("hand_plans", {})),
            "cut_short": plan.solver.get("time_limit", {}).get("cut_short", [])}


def fully_recomputed(model: torch.nn.Module, mesh: autopar.MeshSpec, args: tuple, kwargs: dict,
                     names: list[str]) -> dict:
    """torchtitan's hand plans ``names`` as it runs long contexts, every block recomputed (full
    activation checkpointing), priced by the same model: where the auto plan recomputes fewer
    blocks, its problem's hand plans may not fit."""
    from autopar.planning.baselines import candidates

    plans = candidates(model, mesh, args, kwargs, precision="bf16", recompute="full", gather_outputs=False)
    return {name: {"step_time_s": p.predicted.step_time_s, "peak_memory_bytes": p.predicted.peak_memory_bytes,
                   "feasible": p.feasible, "recompute": "every block"}
            for name, p in plans.items() if name in names}


def show(r: dict) -> None:
    head = f"llama-3-8b, 1 x {r['seq']} tokens on {r['mesh']}: planned in {fmt(r['plan_s'], 's')}"
    if "error" in r:
        print(f"{head}; NO PLAN: {r['error']}")
        return
    cp = r["context_parallel"]
    how = ("no context parallelism" if cp is None
           else f"{cp['kind']} ({cp['load_balance']}) over {cp['axis']} ({cp['nodes']} attention calls)")
    print(f"{head}; plan {r['plan']!r}{'' if r['fits'] else ' (DOES NOT FIT)'}: step {fmt(r['predicted_step_s'], 's')} "
          f"({r['tokens_per_s_per_device']:.0f} tokens/s/device, MFU {r['mfu']:.1%}), peak "
          f"{fmt(r['predicted_peak_bytes'], 'B')}; {how}; recompute {r['recompute']} ({r['recomputed_blocks']} blocks), "
          f"{r['microbatches']} microbatch(es)")
    for name, h in r["torchtitan_hand_plans"].items():
        if "step_time_s" in h:
            print(f"    hand plan {name}: step {fmt(h['step_time_s'], 's')}, peak {fmt(h['peak_memory_bytes'], 'B')}"
                  + ("" if h.get("feasible") else " (does not fit)")
                  + (f", {h['recompute']} recomputed" if "recompute" in h else ""))
        else:
            print(f"    hand plan {name}: no plan fits (needs {fmt(h.get('least_memory_bytes') or 0, 'B')})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, default=None, help="one sequence length of CONFIGS")
    parser.add_argument("--time-limit", type=float, default=60.0)
    a = parser.parse_args()
    results = []
    for seq, shape, names, hardware in CONFIGS:
        if a.only is None or a.only == seq:
            results.append(run(seq, shape, names, hardware, a.time_limit))
            show(results[-1])
    command = "python benchmarks/long_context.py" + (f" --only {a.only}" if a.only is not None else "")
    save_results(RESULTS, command, {"time_limit_s": a.time_limit, "configs": results})


if __name__ == "__main__":
    main()

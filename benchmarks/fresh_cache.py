"""A new user's first compile on this CPU: predicted against measured step, with an empty profile cache.

A model outside the zoo, built as Hugging Face ``transformers`` builds it from a small config
(GPT-2's ``GPT2LMHeadModel``, Llama's ``LlamaForCausalLM``), on real tensors, compiled with
``autopar.compile``'s default options on local gloo processes whose profile cache
(``AUTOPAR_PROFILE_DIR``) is a fresh empty folder, as on a machine where ``autopar profile`` never
ran. The first compile measures what it needs (``autopar.profiling.missing_ops.measure_host`` and
``measure_missing_ops``); a second compile of a fresh copy measures nothing (cached), and the
difference of the two is the first compile's extra time. Then the user's plain training loop
(AdamW; zero_grad, forward with labels, ``loss.backward()``, step) runs ``WARMUP`` untimed and
``STEPS`` timed steps; measured is the median step (rank 0's; the slowest rank's median beside it).

``--no-measure``: the same with the first profile turned off (``AUTOPAR_MEASURE_FIRST_PROFILE=0``):
the roofline's figure, which the plan calls an uncalibrated roofline.

    python benchmarks/fresh_cache.py                          # gpt2 and llama on 2 and 2x2
    python benchmarks/fresh_cache.py --models gpt2 --meshes 2x2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_line, save_results  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fresh_cache.json"
#: Small configs outside the zoo, batch x sequence: steps of tens to a few hundred ms here.
CONFIGS = {
    "gpt2": (dict(vocab_size=4096, n_positions=128, n_embd=128, n_layer=4, n_head=4, bos_token_id=0,
                  eos_token_id=0, use_cache=False), (8, 64)),
    "llama": (dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False), (8, 64)),
}
WARMUP, STEPS = 3, 20


def build(name: str) -> torch.nn.Module:
    """The model as ``transformers`` builds it from the config (seeded: every rank builds the same)."""
    import transformers

    config, _ = CONFIGS[name]
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def batches(name: str, count: int = 2) -> list[torch.Tensor]:
    """``count`` fixed random token batches (the same on every rank: compile takes global inputs)."""
    config, (batch, seq) = CONFIGS[name]
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, config["vocab_size"], (batch, seq), generator=gen) for _ in range(count)]


def _worker(mesh, name: str, profile_dir: str, measure: bool) -> dict:
    """One rank: compile twice (the first with the empty cache), then train with a plain loop."""
    import torch.distributed as dist

    import autopar

    os.environ["AUTOPAR_PROFILE_DIR"] = profile_dir
    os.environ["AUTOPAR_MEASURE_FIRST_PROFILE"] = "1" if measure else "0"
    data = batches(name)
    times = []
    for _ in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        pmodel = autopar.compile(build(name), mesh, (data[0],), {"labels": data[0]})
        times.append(time.perf_counter() - t0)
    load = {"load_after_compiles": os.getloadavg()[0]}
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
    steps = []
    for i in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = pmodel(data[i % len(data)], labels=data[i % len(data)])
        out.loss.backward()
        opt.step()
        steps.append(time.perf_counter() - t0)
    load["load_after_training"] = os.getloadavg()[0]
    p = pmodel.plan.predicted
    return {**load, "first_compile_s": times[0], "cached_compile_s": times[1], "median_s": statistics.median(steps[WARMUP:]),
            "predicted_s": p.step_time_s, "cost_source": p.cost_source, "plan": pmodel.plan.name or "auto",
            "predicted_parts_ms": {"compute": 1e3 * p.compute_s, "blocking_comm": 1e3 * p.comm_s,
                                   "exposed_sync": 1e3 * p.exposed_comm_s},
            "profiles": sorted(os.listdir(profile_dir)), "report": pmodel.plan.report() if dist.get_rank() == 0 else ""}


def run(name: str, shape: tuple[int, ...], measure: bool) -> dict:
    """One model on one mesh, a fresh profile cache: the figures of ``_worker``, rank 0's and the slowest."""
    from autopar.profiling.launch import run_on_gloo_mesh

    start_load = os.getloadavg()[0]   # the host is shared: its load moves both figures
    profile_dir = tempfile.mkdtemp(prefix="autopar-fresh-cache-")   # kept: the profile it measured, to read
    ranks = run_on_gloo_mesh(_worker, shape, name, profile_dir, measure, timeout_s=900, start_method="forkserver")
    r0 = ranks[0]
    measured = r0["median_s"]
    return {"model": name, "mesh": "x".join(map(str, shape)), "measure": measure, "plan": r0["plan"],
            "predicted_ms": 1e3 * r0["predicted_s"], "measured_ms": 1e3 * measured,
            "slowest_rank_measured_ms": 1e3 * max(r["median_s"] for r in ranks),
            "measured_over_predicted": measured / r0["predicted_s"],
            "first_compile_s": r0["first_compile_s"], "cached_compile_s": r0["cached_compile_s"],
            "extra_first_compile_s": r0["first_compile_s"] - r0["cached_compile_s"],
            "cost_source": r0["cost_source"], "predicted_parts_ms": r0["predicted_parts_ms"],
            "load_1min": {"before": start_load, "after_compiles": r0["load_after_compiles"],
                          "after_training": r0["load_after_training"]},
            "profile_dir": profile_dir, "profiles_cached": r0["profiles"], "report": r0["report"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--meshes", default="2,2x2")
    parser.add_argument("--no-measure", action="store_true", help="first profile off: the uncalibrated roofline")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        for mesh in args.meshes.split(","):
            row = run(name, tuple(int(n) for n in mesh.split("x")), not args.no_measure)
            rows.append(row)
            print(f"{name} on {row['mesh']} ({row['plan']}): predicted {row['predicted_ms']:.1f} ms, measured "
                  f"{row['measured_ms']:.1f} ms (slowest rank {row['slowest_rank_measured_ms']:.1f}), measured/predicted "
                  f"{row['measured_over_predicted']:.2f}; first compile {row['first_compile_s']:.1f} s, cached "
                  f"{row['cached_compile_s']:.1f} s (extra {row['extra_first_compile_s']:.1f} s); load {row['load_1min']}; "
                  f"{row['cost_source']}",
                  flush=True)
    save_results(Path(args.out), "python benchmarks/fresh_cache.py " + " ".join(sys.argv[1:]), {"rows": rows},
                 machine_line(load=True))


if __name__ == "__main__":
    main()

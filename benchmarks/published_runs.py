"""Predicted against published: public end-to-end training runs planned on the same cluster.

Each run is a model (built on ``meta`` by its dimensions), a global batch, a sequence length, a GPU
count of a preset and the step time the run published (given there, or derived from its tokens
per second or its achieved FLOP/s per GPU and its own FLOP count). autopar plans it as it would
for a user (bf16, defaults, ``gather_outputs=False``) and prints its predicted step beside the
published one. autopar picks its own plan: the ratio prices autopar's plan of the model, not the
published system's; both run the same model, batch and cluster.

Runs are split in two sets (``use``): "fit" is what the efficiency tables' few estimates may be
adjusted on (``cost_models/tables``); "check" is never used for adjusting anything. The targets
(issue 39) are on the check set: median of predicted / published within 15%, each within
[0.67, 1.5], and no plan's predicted MFU above the best MFU published on that hardware.

    python benchmarks/published_runs.py                    # every run (about a minute each)
    python benchmarks/published_runs.py --only megatron-1.7b --time-limit 30
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import autopar
from autopar.core.errors import AutoparError
from autopar.core.hardware import get_hardware
from autopar.models.gpt import GPT, CausalSelfAttention, GPTConfig
from machine import save_results

RESULTS = Path(__file__).parent / "results" / "published_runs.json"
TIME_LIMIT_S = 60.0
TARGETS = {"median_within": 0.15, "each_within": (0.67, 1.5)}
MEGATRON = ("Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
            "Megatron-LM', SC21, arXiv:2104.04473")
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7), MPT, FSDP, FlashAttention"


@dataclass(frozen=True)
class Run:
    """One published training run: a GPT of ``layers`` x ``width`` (``heads``), its vocabulary and
    sequence, ``gpus`` of ``hardware`` in nodes of 8, ``batch`` sequences a step, and what was
    published: ``step_s``, or ``tokens_per_gpu_s``, or ``tflops_per_gpu`` counted by Megatron's
    formula (with recomputation, ``megatron_flops``). The model is built as the run computed it
    (``build``): Megatron-LM's 2021 runs with its default dropout (0.1) and attention materialised."""

    name: str
    use: str                      # "fit" or "check"
    source: str
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    gpus: int
    hardware: str
    batch: int
    bias: bool = True
    dropout: float = 0.0
    attention: str = "sdpa"       # "sdpa" (a fused kernel) or "materialised" (Megatron-LM in 2021)
    tokens_per_gpu_s: float | None = None
    tflops_per_gpu: float | None = None

    def published_step_s(self) -> float:
        if self.tokens_per_gpu_s is not None:
            return self.batch * self.seq / (self.tokens_per_gpu_s * self.gpus)
        return megatron_flops(self) / (self.tflops_per_gpu * 1e12 * self.gpus)


def megatron_flops(r: Run) -> float:
    """FLOPs of one step as Megatron counts them (eq. 3, activation recomputation included)."""
    b, s, l, h, v = r.batch, r.seq, r.layers, r.width, r.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def model_flops(r: Run) -> float:
    """Model FLOPs of one step, as MFU counts them: 6 per parameter and token plus attention's
    12 L d s per token (PaLM's count; no recomputation)."""
    params = 12 * r.layers * r.width ** 2 + r.vocab * r.width
    return r.batch * r.seq * (6 * params + 12 * r.layers * r.width * r.seq)


def _megatron(params: str, heads: int, width: int, layers: int, gpus: int, batch: int, tflops: float,
              use: str = "check", table: str = "table 1") -> Run:
    return Run(f"megatron-{params}", use, f"{MEGATRON}, {table}: {tflops:g} TFLOP/s per GPU", layers, width, heads,
               51200, 2048, gpus, "a100-80gb", batch, dropout=0.1, attention="materialised", tflops_per_gpu=tflops)


def _foundry(size: str, dims: tuple[int, int, int], gpus: int, hardware: str, batch: int, tokens: float,
             use: str = "check") -> Run:
    layers, width, heads = dims
    return Run(f"mpt-{size}-{gpus}x{hardware}", use, f"{FOUNDRY}: {tokens:g} tokens/s per GPU", layers, width, heads,
               50368, 2048, gpus, hardware, batch, bias=False, tokens_per_gpu_s=tokens)


# MPT dimensions (layers, d_model, heads): mosaicml/llm-foundry's yamls/pretrain/mpt-*.yaml.
MPT = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
       "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 64), "70b": (80, 8192, 64)}

RUNS = (
    # fit: MPT on one node of A100 80GB (llm-foundry's table), sharded data parallel, no recomputation
    _foundry("1b", MPT["1b"], 8, "a100-80gb", 448, 20513, use="fit"),
    _foundry("7b", MPT["7b"], 8, "a100-80gb", 96, 4641, use="fit"),
    _foundry("350m", MPT["350m"], 8, "a100-80gb", 512, 58782, use="fit"),
    # fit: MPT on H100 80GB, the same table
    _foundry("760m", MPT["760m"], 8, "h100-80gb", 384, 63147, use="fit"),
    _foundry("3b", MPT["3b"], 16, "h100-80gb", 480, 24142, use="fit"),
    # check: Megatron-LM's weak-scaling table (A100 80GB, recomputation, tensor and pipeline parallelism)
    _megatron("1.7b", 24, 2304, 24, 32, 512, 137),
    _megatron("3.6b", 32, 3072, 30, 64, 512, 138),
    _megatron("7.5b", 32, 4096, 36, 128, 512, 142),
    _megatron("18b", 48, 6144, 40, 256, 1024, 135),
    _megatron("39b", 64, 8192, 48, 512, 1536, 138),
    _megatron("76b", 80, 10240, 60, 1024, 1792, 140),
    _megatron("146b", 96, 12288, 80, 1536, 2304, 148),
    _megatron("175b-384", 96, 12288, 96, 384, 1536, 153, table="table 2 (PTD-P)"),
    # check: MPT on other sizes and on H100
    _foundry("125m", MPT["125m"], 8, "a100-80gb", 640, 142830),
    _foundry("13b", MPT["13b"], 8, "a100-80gb", 48, 2262),
    _foundry("7b", MPT["7b"], 8, "h100-80gb", 48, 10643),
    _foundry("1b", MPT["1b"], 8, "h100-80gb", 112, 45455),
    _foundry("13b", MPT["13b"], 8, "h100-80gb", 16, 4792),
)


class MaterialisedAttention(CausalSelfAttention):
    """Attention as Megatron-LM ran it in 2021, before fused attention kernels: the scores
    materialised by a batched GEMM into the causal mask's bias (its ``baddbmm``), a softmax, dropout
    on the probabilities, a batched GEMM with the values."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.attn_dropout = torch.nn.Dropout(config.dropout)
        causal = torch.full((config.block_size, config.block_size), float("-inf")).triu(1)
        self.register_buffer("causal_bias", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        d = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, d).transpose(1, 2).reshape(B * self.n_head, T, d)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        scores = torch.baddbmm(self.causal_bias[:T, :T].to(q.dtype), q, k.transpose(1, 2), alpha=d ** -0.5)
        y = torch.bmm(self.attn_dropout(scores.softmax(-1)), v)
        return self.resid_dropout(self.c_proj(y.view(B, self.n_head, T, d).transpose(1, 2).reshape(B, T, C)))


def build(r: Run) -> torch.nn.Module:
    """The run's GPT on ``meta``, its output layer tied to the token embedding (as Megatron-LM
    and MPT tie them), attention as the run computed it."""
    cfg = GPTConfig(vocab_size=r.vocab, block_size=r.seq, n_layer=r.layers, n_head=r.heads, n_embd=r.width,
                    bias=r.bias, dropout=r.dropout)
    with torch.device("meta"):
        model = GPT(cfg)
        if r.attention == "materialised":
            for block in model.transformer.h:
                block.attn = MaterialisedAttention(cfg)
    model.lm_head.weight = model.transformer.wte.weight
    return model


def plan_run(r: Run, time_limit: float) -> dict:
    """Plan ``r`` as a user would and put its prediction beside the published step."""
    model = build(r)
    tokens = torch.empty(r.batch, r.seq, dtype=torch.long, device="meta")
    nodes = max(r.gpus // 8, 1)
    spec = autopar.MeshSpec((nodes, 8) if nodes > 1 else (r.gpus,), hardware=r.hardware)
    start = time.perf_counter()
    record = {**asdict(r), "published_step_s": r.published_step_s()}
    try:
        plan = autopar.plan(model, spec, (tokens, tokens), precision="bf16", gather_outputs=False,
                            time_limit=time_limit)
    except AutoparError as e:
        return {**record, "plan_s": time.perf_counter() - start, "error": str(e).splitlines()[0]}
    step = plan.predicted.step_time_s
    peak = get_hardware(r.hardware).flops_for(torch.bfloat16) * r.gpus
    return {**record, "plan_s": time.perf_counter() - start, "plan": plan.name, "fits": plan.feasible,
            "predicted_step_s": step, "ratio": step / r.published_step_s(),
            "predicted_mfu": model_flops(r) / (peak * step), "published_mfu": model_flops(r) / (peak * r.published_step_s()),
            "microbatches": plan.microbatches, "recompute": sorted(set(plan.recompute.values())) or ["none"],
            "pipeline": None if plan.pipeline is None else plan.pipeline.num_stages,
            "mesh": plan.mesh.describe(), "costs_from": plan.predicted.cost_source}


#: The best MFU published for a preset's GPU in bf16 that we know of, beside the runs above: a
#: predicted MFU above it is a figure no real system has reached (issue 39).
BEST_PUBLISHED_MFU = {
    "a100-80gb": (0.72, "FlashAttention-2 (arXiv:2307.08691), abstract: GPT training at up to 225 TFLOP/s "
                        "a GPU, 72% model FLOPs utilisation"),
    "h100-80gb": (0.48, "NVIDIA/Megatron-LM README, 'Training Speed and Scalability': GPT weak scaling on "
                        "H100, 41% (smallest) to 47-48% MFU (largest)"),
}


def summary(results: list[dict]) -> dict:
    """The targets on the check set, and the fit set's figures for reference."""
    out = {}
    best_mfu = {hw: mfu for hw, (mfu, _) in BEST_PUBLISHED_MFU.items()}
    for r in results:
        if "published_mfu" in r:
            best_mfu[r["hardware"]] = max(best_mfu.get(r["hardware"], 0.0), r["published_mfu"])
    for use in ("fit", "check"):
        ratios = [r["ratio"] for r in results if r["use"] == use and "ratio" in r]
        if not ratios:
            continue
        lo, hi = TARGETS["each_within"]
        out[use] = {"runs": len(ratios), "median_ratio": statistics.median(ratios), "min": min(ratios),
                    "max": max(ratios), "median_met": abs(statistics.median(ratios) - 1) <= TARGETS["median_within"],
                    "each_met": all(lo <= x <= hi for x in ratios)}
    out["mfu_above_best_published"] = [r["name"] for r in results
                                       if r.get("predicted_mfu", 0) > best_mfu.get(r["hardware"], math.inf)]
    out["best_published_mfu"] = best_mfu
    return out


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:<26} {r['use']:<5} no plan: {r['error']}"
    return (f"{r['name']:<26} {r['use']:<5} published {r['published_step_s']:8.2f} s  predicted "
            f"{r['predicted_step_s']:8.2f} s  ratio {r['ratio']:.2f}  MFU {100 * r['predicted_mfu']:.0f}% "
            f"(published {100 * r['published_mfu']:.0f}%)  {r['plan']}, {r['microbatches']} mb, "
            f"recompute {'+'.join(r['recompute'])}{', %d stages' % r['pipeline'] if r['pipeline'] else ''}"
            f"  [{r['plan_s']:.0f} s]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these (repeatable)")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    a = ap.parse_args()
    runs = [r for r in RUNS if not a.only or r.name in a.only]
    results = []
    for i, r in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] ", end="", flush=True)
        results.append(plan_run(r, a.time_limit))
        print(line(results[-1]), flush=True)
    totals = summary(results)
    for use in ("fit", "check"):
        if use in totals:
            t = totals[use]
            print(f"{use}: {t['runs']} runs, median predicted / published {t['median_ratio']:.2f} "
                  f"(range {t['min']:.2f}-{t['max']:.2f}); median within 15%: {t['median_met']}, "
                  f"each within [0.67, 1.5]: {t['each_met']}")
    print(f"predicted MFU above the best published on its hardware: {totals['mfu_above_best_published'] or 'none'}")
    save_results(RESULTS, "python benchmarks/published_runs.py" + "".join(f" --only {o}" for o in a.only)
                 + (f" --time-limit {a.time_limit:g}" if a.time_limit != TIME_LIMIT_S else ""),
                 {"time_limit_s": a.time_limit, "results": results, "summary": totals})


if __name__ == "__main__":
    main()

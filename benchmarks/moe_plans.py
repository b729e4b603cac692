"""Mixture-of-experts models planned with and without expert parallelism (issue 43): each built
on ``meta`` as transformers builds it (Mixtral 8x7B, DeepSeek-V2-Lite's shapes, gpt-oss-120b; and,
written by hand with a ModuleList of experts, Mixtral 8x7B's sizes and a fine-grained MoE of
DeepSeek-V2-Lite's routed experts: ``autopar.models.moe``), 256 x 4096 tokens a step in bf16 on 8x8 H100-80GB,
planned as a training loop runs (``gather_outputs=False``) under the default 60 s limit, once with
``expert_parallel="auto"`` and once with ``False``. Prints one row per plan.

    python benchmarks/moe_plans.py                  # both models (about 4 minutes)
    python benchmarks/moe_plans.py --only mixtral   # one
    python benchmarks/moe_plans.py --only mixtral --mesh 2x4 --batch 1 --expert-parallel auto tp
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers

import autopar
from autopar.core.mesh import MeshSpec
from autopar.models.moe import HandMoe, fine_grained, mixtral_8x7b
from autopar.models.zoo import get_model
from autopar.planning.options import _expert_parallel_from_text

BATCH, SEQ = 256, 4096


def deepseek_v2_lite() -> torch.nn.Module:
    """DeepSeek-V2-Lite's shapes (15.7B parameters: 27 layers, the first dense; 64 routed experts
    of 1408, 6 per token, 2 shared; MLA attention) as transformers' ``DeepseekV3Config`` builds them."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096)
    return transformers.AutoModelForCausalLM.from_config(cfg)


MODELS = {"mixtral": lambda: get_model("mixtral-8x7b").build(), "deepseek-v2-lite": deepseek_v2_lite,
          "gpt-oss-120b": lambda: get_model("gpt-oss-120b").build(),
          "mixtral-hand": mixtral_8x7b, "fine-grained-hand": fine_grained}


def plan_row(name: str, expert_parallel: str | bool | dict[str, str], mesh: tuple[int, ...] = (8, 8),
             batch: int = BATCH) -> str:
    with torch.device("meta"):
        model = MODELS[name]()
    ids = torch.empty(batch, SEQ, dtype=torch.long, device="meta")
    start = time.perf_counter()
    kwargs = {"labels": ids.clone()} | ({} if isinstance(model, HandMoe) else {"use_cache": False})
    plan = autopar.plan(model, MeshSpec(mesh, hardware="h100-80gb"), (ids,), kwargs,
                        precision="bf16", gather_outputs=False, expert_parallel=expert_parallel, progress=False)
    wall = time.perf_counter() - start
    pp = plan.pipeline
    pipeline = f"pipeline over {pp.axis} ({pp.num_stages} stages)" if pp is not None else "no pipeline"
    ep = plan.expert_parallel or {}
    by_expert = [f"EP over {ep['axis']} ({ep['experts_per_rank']} a rank)"] if "axis" in ep else []
    within = [f"experts split within over {ep['within']}"] if "within" in ep else []
    experts = ", ".join(by_expert + within) or "no EP"
    return (f"| {name} | {expert_parallel} | {plan.predicted.step_time_s:.2f} s | {'yes' if plan.feasible else 'no'} | "
            f"{100 * plan.predicted.mfu:.0f}% | {pipeline}, {plan.microbatches} mb, {experts} | {wall:.1f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(MODELS))
    parser.add_argument("--mesh", default="8x8", help="H100-80GB mesh shape (default 8x8)")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"sequences of {SEQ} tokens a step (default {BATCH})")
    parser.add_argument("--expert-parallel", nargs="+", default=["auto", "none"], metavar="CHOICE",
                        help="expert_parallel values planned in turn, as the CLI writes them (default: auto none)")
    opts = parser.parse_args()
    names = [opts.only] if opts.only else list(MODELS)
    mesh = tuple(int(n) for n in opts.mesh.split("x"))
    print("| model | expert_parallel | step (predicted) | fits | MFU | plan | planning |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        for choice in opts.expert_parallel:
            print(plan_row(name, _expert_parallel_from_text(choice), mesh, opts.batch), flush=True)


if __name__ == "__main__":
    main()

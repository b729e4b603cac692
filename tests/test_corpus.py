"""The model corpus: each Hugging Face architecture of the zoo, exactly as ``from_config`` builds it
(default attention, tied embeddings where the config ties them, rotary embeddings under
``no_grad``), at a tiny size and at a published size.

* Tiny: compiled on a 2x2 mesh and trained 3 AdamW steps; every rank's losses and final parameters
  equal one device's. Five run as gloo processes (real collectives), the rest under LocalTensorMode.
* Published size: built on ``meta`` and planned for an 8x8 mesh of H100-80GB (``PLAN_BATCH``,
  ``PLAN_SEQ``); the plan fits in memory and the parameter count is the published one.
* Both: the ops no sharding rule covers (run replicated, with a warning) are exactly those listed
  in ``REPLICATED``, so an op that gains or loses a rule shows here (the corpus table in
  docs/models.md).
"""
from __future__ import annotations

import pytest

import autopar
from autopar.core.hardware import get_hardware
from autopar.core.mesh import MeshSpec
from autopar.models.zoo import get_model
from tests.equivalence import check_training, gloo_runner, local_runner, meta_model
from tests.tiers import slow

pytestmark = slow   # every architecture at size and on 2x2: a sweep

SOLVE_S = 10.0
#: (architecture, tiny entry, published-size entry)
CORPUS = [
    ("GPT-2", "gpt2-tiny", "gpt2-125m"), ("OPT", "opt-tiny", "opt-1.3b"), ("BLOOM", "bloom-tiny", "bloom-560m"),
    ("Falcon", "falcon-tiny", "falcon-7b"), ("GPT-J", "gptj-tiny", "gpt-j-6b"),
    ("GPT-NeoX", "gpt-neox-tiny", "pythia-1.4b"), ("Llama", "llama-tiny", "llama-7b"),
    ("Mistral", "mistral-tiny", "mistral-7b"), ("Qwen2", "qwen2-tiny", "qwen2-1.5b"), ("Gemma", "gemma-tiny", "gemma-2b"),
    ("Phi", "phi-tiny", "phi-2"), ("BERT", "bert-tiny", "bert-base"), ("RoBERTa", "roberta-tiny", "roberta-base"),
    ("T5", "t5-tiny", "t5-base"), ("ViT", "vit-tiny", "vit-base"), ("Mixtral", "mixtral-tiny", "mixtral-8x7b"),
]
#: Published sizes are planned for batch 8 x sequence 2048 (or the model's own shorter length),
#: float32 without recomputation (issue 19); Falcon-7B's 71 heads do not split over 8 ranks, so
#: its attention is split by samples only and 8 x 2048 needs 75.9 GiB per device: 4 x 2048.
PLAN_BATCH = {"Falcon": 4}
PLAN_SEQ = 2048
# Seconds of planning for the published size (``deterministic``; 20 s elsewhere): Mixtral 8x7B's
# capture alone took 13 s of a 25 s limit beside CI's other worker, and left no time for a solve.
PLAN_LIMIT = {"Mixtral": 32.0}
GLOO = {"gpt2-tiny", "opt-tiny", "bloom-tiny", "qwen2-tiny", "vit-tiny"}
#: Ops that run replicated for want of a rule, per architecture (none elsewhere): none today.
REPLICATED: dict[str, set[str]] = {}


def _replicated(plan: autopar.Plan) -> set[str]:
    prefix = "no sharding rule for "
    return {w[len(prefix):].split(" (")[0] for w in plan.warnings if w.startswith(prefix)}


@pytest.mark.parametrize("arch, tiny", [(a, t) for a, t, _ in CORPUS], ids=[a for a, _, _ in CORPUS])
def test_trains_on_2x2_equal_to_one_device(arch, tiny):
    entry = get_model(tiny)
    seq = entry.default_seq if entry.name.startswith("vit") else 16   # ViT's seq is its image side
    runner = gloo_runner if tiny in GLOO else local_runner
    plan = check_training(tiny, 4, seq, (2, 2), runner, {"time_limit": SOLVE_S})
    if isinstance(plan, str):
        plan = autopar.Plan.from_json(plan)
    assert _replicated(plan) == REPLICATED.get(arch, set())


@pytest.mark.parametrize("arch, published", [(a, p) for a, _, p in CORPUS], ids=[a for a, _, _ in CORPUS])
def test_plans_at_published_size_on_8x8_h100(arch, published):
    entry = get_model(published)
    model, args, kwargs = meta_model(published, PLAN_BATCH.get(arch, 8), min(entry.default_seq, PLAN_SEQ))
    assert sum(p.numel() for p in model.parameters()) == entry.num_params
    spec = MeshSpec((8, 8), hardware="h100-80gb")
    # the limit bounds the whole call, the capture included (5-20 s for these models on a loaded
    # 2-core host); a deterministic search ends by its charged time where the wall clock does not
    # stop it first (Mixtral 8x7B's did alone here: charged 14 of 23.5 s): this test asks for a
    # fitting plan at published size, not for the best one (benchmarks/realistic_plans.py judges those)
    plan = autopar.plan(model, spec, args, kwargs, time_limit=PLAN_LIMIT.get(arch, 20.0), deterministic=True)
    assert plan.feasible and plan.predicted.peak_memory_bytes <= get_hardware(spec.hardware).memory_bytes
    assert _replicated(plan) == REPLICATED.get(arch, set())

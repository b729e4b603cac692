"""Frozen parameters (``requires_grad=False``) as users freeze them: a frozen embedding, LoRA
adapters from peft on a Hugging Face model (every base weight frozen), Whisper as transformers
builds it (its encoder's sinusoidal positions frozen). A frozen parameter gets no gradient, no
synchronisation and no optimizer state, and is priced so; the planner may still shard it. Each
model trains 3 AdamW steps on 2x2 equal to one device (losses, parameters and buffers), free and
under a budget that forces sharding."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate

import autopar
from autopar.core.mesh import MeshSpec
from autopar.models.zoo import get_model
from tests.equivalence import check_training, gloo_runner, local_runner, make_batches, tight_budget
from tests.tiers import slow

MESH = (2, 2)
SOLVE_S = 10.0
VOCAB = 96
EMBEDDING = "transformer.wte.weight"


def gpt_frozen_embedding() -> torch.nn.Module:
    """The zoo's gpt-tiny with its token embedding frozen, as a user freezes it."""
    model = get_model("gpt-tiny").build()
    model.transformer.wte.weight.requires_grad_(False)
    return model


def llama_lora() -> torch.nn.Module:
    """A tiny HF Llama with peft's LoRA adapters on q and v, as ``get_peft_model`` returns it
    (every base weight frozen, each adapter's B zero: step 0 equals the base model's)."""
    import peft
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def whisper() -> torch.nn.Module:
    """A tiny HF Whisper as transformers builds it: the encoder's positions frozen (its special
    tokens inside the tiny vocabulary)."""
    import transformers

    config = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return transformers.WhisperForConditionalGeneration(config)


def causal_batches() -> list[tuple[tuple, dict]]:
    """3 batches of 4 x 8 tokens, labelled with themselves (the model shifts them)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (4, 8), generator=gen)
        out.append(((), {"input_ids": ids, "labels": ids, "use_cache": False}))
    return out


def whisper_batches() -> list[tuple[tuple, dict]]:
    """3 batches of 4 utterances: 8 mel bins x 32 frames (twice the encoder's positions), 8 labels."""
    gen = torch.Generator().manual_seed(0)
    return [((), {"input_features": torch.randn(4, 8, 32, generator=gen),
                  "labels": torch.randint(3, VOCAB, (4, 8), generator=gen), "use_cache": False}) for _ in range(3)]


CASES = {"frozen-embedding": (gpt_frozen_embedding, lambda: make_batches("gpt-tiny", 6, 16)),
         "lora": (llama_lora, causal_batches),
         "whisper": (whisper, whisper_batches)}


def _options(build, batches, budget: str) -> dict:
    """Planning options: free, or under ``tight_budget`` (replicating everything does not fit)."""
    if budget == "free":
        return {"time_limit": SOLVE_S}
    return {"time_limit": SOLVE_S, "memory_budget": tight_budget(build, 0, 0, MESH, batches=batches)}


def _sharded(plan: autopar.Plan) -> list[str]:
    return [f for f, p in plan.parameters.items() if any(not isinstance(x, Replicate) for x in p.storage)]


@pytest.mark.parametrize("budget", ["free", "tight"])
@pytest.mark.parametrize("case", list(CASES))
@slow
def test_frozen_parameters_train_exactly(case, budget):
    build, batches_of = CASES[case]
    frozen = {f for f, p in build().named_parameters() if not p.requires_grad}
    assert frozen, "the model freezes nothing: the test would not exercise frozen parameters"
    batches = batches_of()
    plan = check_training(build, 0, 0, MESH, local_runner, _options(build, batches, budget), batches=batches)
    if budget == "tight":
        assert _sharded(plan), "a tight budget must shard some parameter"


@slow
def test_a_frozen_parameter_sharded_and_gathered_with_trained_ones_gets_no_gradient():
    """FSDP on 2x2 stores the frozen embedding split and gathers it in one group with trained
    parameters: it is gathered with them, and nothing goes back to it (a zero gradient would let
    AdamW's weight decay move it)."""
    from autopar.core.capture import capture
    from autopar.planning.baselines import candidates
    from codegen.generate import generate

    batches = make_batches("gpt-tiny", 6, 16)
    plan = candidates(gpt_frozen_embedding(), MeshSpec(MESH), *batches[0], time_limit=SOLVE_S, names=["fsdp"])["fsdp"]
    code = generate(capture(gpt_frozen_embedding(), *batches[0]), plan)
    group = next(g for g in code.gathered if EMBEDDING in g.fqns)
    assert group.frozen == {EMBEDDING} and len(group.fqns) > 1
    check_training(gpt_frozen_embedding, 0, 0, MESH, local_runner, {"plan": plan}, batches=batches)


@slow
def test_lora_under_a_tight_budget_on_gloo_processes():
    build, batches_of = CASES["lora"]
    batches = batches_of()
    plan = check_training(build, 0, 0, MESH, gloo_runner, _options(build, batches, "tight"), batches=batches)
    assert _sharded(autopar.Plan.from_json(plan))


def test_frozen_parameters_are_priced_without_gradient_or_optimizer_state():
    """The planner's memory for a frozen parameter is its storage alone (AdamW: a trained one holds
    its gradient and two states besides), with no update, and no gradient sync on the edge into
    the op reading it (the lookup, ``embedding``)."""
    args, kwargs = get_model("gpt-tiny").example(6, 16, device="meta")
    plans = {}
    for frozen in (False, True):
        with torch.device("meta"):
            model = gpt_frozen_embedding() if frozen else get_model("gpt-tiny").build()
        plans[frozen] = autopar.plan(model, MeshSpec((2,)), args, kwargs, time_limit=SOLVE_S, hand_plans=False)
    trained, frozen = plans[False].parameters[EMBEDDING], plans[True].parameters[EMBEDDING]
    nbytes = 256 * 64 * 4
    assert trained.storage == frozen.storage == (Replicate(),)
    assert trained.memory_bytes == 4 * nbytes and trained.compute_s > 0
    assert frozen.memory_bytes == nbytes and frozen.compute_s == 0
    lookup = {k: next(n for n in plan.nodes if n.name == "embedding") for k, plan in plans.items()}
    assert lookup[False].sync_s > 0 and lookup[True].sync_s == 0
    assert plans[True].predicted.peak_memory_bytes < plans[False].predicted.peak_memory_bytes - 2 * nbytes


def test_a_plan_is_for_the_parameters_frozen_when_it_was_made():
    """The plan prices and syncs only trainable parameters' gradients: the model's id (its
    fingerprint) covers which are frozen, so a plan is not applied to the model trained otherwise;
    a model with none frozen keeps the id of its graph alone."""
    from autopar.core.capture import capture, fingerprint

    args, kwargs = make_batches("gpt-tiny", 4, 8, steps=1)[0]
    trained = capture(get_model("gpt-tiny").build(), args, kwargs)
    frozen = capture(gpt_frozen_embedding(), args, kwargs)
    assert EMBEDDING in frozen.frozen and not trained.frozen
    assert trained.fingerprint != frozen.fingerprint
    assert trained.fingerprint == fingerprint(trained.program, trained.model_name)


def test_freezing_changed_after_compile_is_refused_by_name():
    """The plan syncs the gradients of the parameters trainable when it was made: a parameter
    unfrozen (or frozen) after ``compile`` is named, not trained wrong."""
    from autopar.core.errors import AutoparError
    from autopar.profiling.launch import run_on_local_tensor_mesh

    args, kwargs = make_batches("gpt-tiny", 4, 8, steps=1)[0]
    model = gpt_frozen_embedding()

    def body(mesh):
        pmodel = autopar.compile(model, mesh, args, kwargs, pipeline=False, time_limit=SOLVE_S)
        pmodel.train_step(*args, **kwargs)   # as planned: runs
        said = []
        for fqn, flip in ((EMBEDDING, True), ("transformer.ln_f.weight", False)):
            param = pmodel.get_parameter(fqn)
            param.requires_grad_(flip)
            with pytest.raises(AutoparError) as error:
                pmodel(*args, **kwargs)
            param.requires_grad_(not flip)
            said.append(str(error.value))
        with torch.no_grad():   # an evaluation: no gradient, nothing to refuse
            pmodel.get_parameter(EMBEDDING).requires_grad_(True)
            pmodel(*args, **kwargs)
        return said

    said = run_on_local_tensor_mesh(body, (2,))
    assert f"{EMBEDDING} (unfrozen)" in said[0] and "transformer.ln_f.weight (frozen)" in said[1], said

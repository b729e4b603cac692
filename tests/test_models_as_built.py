"""Models as their authors build them, unmodified: regions under ``torch.no_grad()`` (HF rotary
embeddings), HuggingFace ``from_config`` defaults. Each trains 3 AdamW steps on a 2x2 mesh equal to
one device (losses and final parameters)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.core.errors import CaptureError
from autopar.core.mesh import MeshSpec
from autopar.profiling.launch import run_on_gloo_mesh
from tests.equivalence import check_training, gloo_runner, local_runner
from tests.tiers import slow

SOLVE_S = 10.0
VOCAB = 96


class NoGradScale(nn.Module):
    """A projection divided by its weight's norm, the norm computed under ``torch.no_grad()``: the
    weight gets the gradient of the projection only (the norm is a constant to autograd)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        with torch.no_grad():
            norm = self.proj.weight.pow(2).sum().sqrt()
        logits = self.head(torch.relu(self.proj(x)) / norm)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def qwen2() -> nn.Module:
    """HF Qwen2 as ``from_config`` builds it: rotary embedding under ``no_grad``, default attention."""
    import transformers

    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config)


def gpt2() -> nn.Module:
    """HF GPT-2 as ``from_config`` builds it (tied embeddings, default attention), no dropout."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.AutoModelForCausalLM.from_config(config)


def opt() -> nn.Module:
    """HF OPT as ``from_config`` builds it (tied embeddings, positions from the mask's cumsum)."""
    import transformers

    config = transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                    vocab_size=VOCAB, max_position_embeddings=32, word_embed_proj_dim=32,
                                    dropout=0.0, attention_dropout=0.0, layerdrop=0.0)
    return transformers.AutoModelForCausalLM.from_config(config)


def bert() -> nn.Module:
    """HF BERT for masked LM as ``from_config`` builds it (tied embeddings, bidirectional attention)."""
    import transformers

    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.AutoModelForMaskedLM.from_config(config)


def gpt2_dropout() -> nn.Module:
    """HF GPT-2 with its default embedding and residual dropout (0.1); attention dropout 0 (SDPA
    draws that mask inside its kernel, per rank)."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, attn_pdrop=0.0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _causal(ids: torch.Tensor) -> dict:
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _padded(ids: torch.Tensor) -> dict:
    """A left-padded batch: each row's first few positions are padding (mask 0, label -100), which
    the later, real positions would attend to if the mask were dropped."""
    lengths = torch.tensor([16, 11, 7, 13])
    mask = (torch.arange(ids.shape[1])[None, :] >= ids.shape[1] - lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100), "use_cache": False}


def _batches(kwargs_of, steps: int = 3) -> list[tuple[tuple, dict]]:
    gen = torch.Generator().manual_seed(0)
    return [((), kwargs_of(torch.randint(0, VOCAB, (4, 16), generator=gen))) for _ in range(steps)]


def test_no_grad_region_reading_a_parameter_trains_exactly():
    batches = _batches(lambda ids: {"ids": ids, "labels": ids.roll(1, 1)})
    check_training(NoGradScale, 0, 0, (2, 2), local_runner, {"time_limit": SOLVE_S}, batches=batches)


@slow
def test_hf_rotary_under_no_grad_trains_exactly():
    check_training(qwen2, 0, 0, (2, 2), local_runner, {"time_limit": SOLVE_S}, batches=_batches(_causal))


@pytest.mark.parametrize("build, kwargs_of", [(gpt2, _causal), (opt, _causal),
                                               (bert, lambda ids: {"input_ids": ids, "labels": ids})],
                         ids=["gpt2", "opt", "bert"])
@slow
def test_tied_embeddings_train_as_one_parameter(build, kwargs_of):
    """A parameter two ops use (the embedding lookup and the LM head) gets both gradients: after 3
    AdamW steps on 2x2 every parameter, the tied one included, equals one device's."""
    model = build()
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    check_training(build, 0, 0, (2, 2), local_runner, {"time_limit": SOLVE_S}, batches=_batches(kwargs_of))


class MakesTensors(nn.Module):
    """Ops named as the generated code's own helpers (``torch.full`` is a node named ``full``, the
    runtime's gather of an output) and an input named as one of its arguments (``sizes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) * sizes + torch.full((8,), 0.5)).sum()


def test_graph_values_named_as_generated_code_names_do_not_shadow_them():
    from autopar.core.execution import GENERATED_NAMES
    from codegen.module import GENERATED_GLOBALS

    assert GENERATED_GLOBALS.keys() <= GENERATED_NAMES
    gen = torch.Generator().manual_seed(0)
    batches = [((torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)), {}) for _ in range(3)]
    check_training(MakesTensors, 0, 0, (2, 2), local_runner, {"time_limit": SOLVE_S}, batches=batches)


@pytest.mark.parametrize("runner", [local_runner, gloo_runner], ids=["local", "gloo"])
@slow
def test_dropout_draws_as_one_device_under_the_shared_generator(runner):
    """Dropout p=0.1 on split activations: every rank draws the whole tensor's mask from a
    generator compile made alike on every rank, and keeps its part; the 3 steps equal one
    device's from the same seed."""
    plan = check_training(gpt2_dropout, 0, 0, (2, 2), runner, {"time_limit": SOLVE_S}, batches=_batches(_causal))
    plan = autopar.Plan.from_json(plan) if isinstance(plan, str) else plan
    split = [n for n in plan.nodes if n.op == "aten.dropout.default" and any(isinstance(p, Shard) for p in n.out)]
    assert split, "the plan splits no dropout: the test would not exercise the mask path"


class ShiftedLabels(nn.Module):
    """T5's label shift: labels moved right one position into a new tensor, in place."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1]
        return self.emb(shifted).sum()


def test_in_place_writes_are_replicated_and_said_so():
    plan = autopar.plan(ShiftedLabels(), MeshSpec((2,)), (torch.randint(0, VOCAB, (4, 8)),))
    note = next(w for w in plan.warnings if w.startswith("in-place writes (aten.copy_.default)"))
    assert "run replicated" in note
    written = [n for n in plan.nodes if n.op in ("aten.copy_.default", "aten.new_zeros.default")]
    assert written and all(p == Replicate() for n in written for p in n.out)


def _draw_after_compile(mesh) -> torch.Tensor:
    torch.manual_seed(1000 + torch.distributed.get_rank())   # ranks seeded apart, as some scripts do
    model = nn.Linear(4, 4)
    autopar.compile(model, mesh, (torch.ones(2, 4),), time_limit=SOLVE_S)
    return torch.rand(3)


@slow
def test_compile_gives_every_rank_rank_0s_generator():
    draws = run_on_gloo_mesh(_draw_after_compile, (2,), start_method="forkserver")
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.proj(x)
        return y.float().sum()


def test_a_higher_order_op_without_generated_form_is_refused_by_name():
    with pytest.raises(CaptureError, match="wrap_with_autocast"):
        autopar.plan(Autocast(), MeshSpec((2,)), (torch.randn(4, 8),))


@slow
def test_padded_batch_attention_mask_is_honoured():
    """A user's 2-D attention mask with padded positions, split with its batch: the padded
    positions change nothing, on 2x2 as on one device."""
    check_training(gpt2, 0, 0, (2, 2), local_runner, {"time_limit": SOLVE_S}, batches=_batches(_padded))


def test_a_kv_cache_output_is_refused_with_what_to_pass():
    """An HF model asked for its key/value cache (use_cache=True; left out, autopar passes False:
    tests/test_errors.py); training needs none."""
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(CaptureError, match="use_cache=False"):
        autopar.plan(gpt2(), MeshSpec((2,)), (), {"input_ids": ids, "labels": ids, "use_cache": True})

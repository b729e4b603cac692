"""Models as their authors build them, unmodified: regions under ``torch.no_grad()`` (HF rotary
embeddings), HuggingFace ``from_config`` defaults. Each trains 3 AdamW steps on a 2x2 mesh equal to
one device (losses and final parameters)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.core.errors import CaptureError
from autopar.core.mesh import MeshSpec
from tests.equivalence import check_training, local_runner

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


def _batches(kwargs_of, steps: int = 3) -> list[tuple[tuple, dict]]:
    gen = torch.Generator().manual_seed(0)
    return [((), kwargs_of(torch.randint(0, VOCAB, (4, 16), generator=gen))) for _ in range(steps)]


def test_no_grad_region_reading_a_parameter_trains_exactly():
    batches = _batches(lambda ids: {"ids": ids, "labels": ids.roll(1, 1)})
    check_training(NoGradScale, 0, 0, (2, 2), local_runner, {"time_limit": SOLVE_S}, batches=batches)


def test_hf_rotary_under_no_grad_trains_exactly():
    batches = _batches(lambda ids: {"input_ids": ids, "labels": ids, "use_cache": False})
    check_training(qwen2, 0, 0, (2, 2), local_runner, {"time_limit": SOLVE_S}, batches=batches)


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

"""A twelve-layer tiny GPT: enough identical layers for the planner to share decisions between the
inner ones (``autopar.planning.shrink``). Zoo name: ``tests.deep_gpt:build``."""
from __future__ import annotations

import torch

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.zoo import get_model

NAME = "tests.deep_gpt:build"
LAYERS = 12


def build() -> GPT:
    return GPT(GPTConfig(n_layer=LAYERS))


def example_inputs(batch: int, seq: int, device: torch.device) -> tuple:
    return get_model("gpt-tiny").example_inputs(batch, seq, device)

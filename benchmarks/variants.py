"""Zoo models and the variants the planning benchmarks need, built on ``meta``.

``NAME`` is a zoo model; suffixes change one thing of a hand-written GPT's config:
``-48l`` (48 layers) and ``-256k-vocab`` (a 256,000-token vocabulary, as in Gemma or PaLM).
"""
from __future__ import annotations

import dataclasses

import torch

from autopar.models.gpt import GPT
from autopar.models.zoo import get_model

SUFFIXES = {"-48l": {"n_layer": 48}, "-256k-vocab": {"vocab_size": 256_000}}


def build_meta(name: str, batch: int | None = None, seq: int | None = None) -> tuple[torch.nn.Module, tuple, dict]:
    """(model, args, kwargs) on the meta device."""
    changes = {}
    for suffix, change in SUFFIXES.items():
        if name.endswith(suffix):
            name = name.removesuffix(suffix)
            changes.update(change)
    entry = get_model(name)
    with torch.device("meta"):
        model = entry.build()
        if changes:
            model = GPT(dataclasses.replace(model.config, **changes))
    args, kwargs = entry.example(batch, seq, device="meta")
    if "vocab_size" in changes:   # token ids anywhere in the new vocabulary (meta: shapes only)
        args = tuple(torch.empty_like(a) for a in args)
    return model, args, kwargs

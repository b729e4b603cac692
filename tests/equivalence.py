"""Train a zoo model single-device and sharded with the same batches; return what to compare.

The reference runs in plain PyTorch outside any simulated mesh. AdamW uses eps=1e-6: key biases
of attention have a gradient that is exactly zero in exact arithmetic, so its float noise is all
Adam normalises; a larger eps keeps that noise from turning into lr-sized steps in either run.
"""
from __future__ import annotations


import torch

import autopar
from autopar.zoo import get_model

STEPS = 3
LR = 1e-3
EPS = 1e-6


def make_batches(name: str, batch: int, seq: int, steps: int = STEPS) -> list[tuple[tuple, dict]]:
    entry = get_model(name)
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        args, kwargs = entry.example(batch, seq)
        args = tuple(torch.randint_like(a, 0, 200, generator=gen) if a.dtype == torch.long else a for a in args)
        kwargs = {k: torch.randint(0, 200, v.shape, generator=gen) for k, v in kwargs.items()}
        out.append((args, kwargs))
    return out


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return get_model(name).build()


def loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else out.loss


def train(model: torch.nn.Module, batches) -> list[torch.Tensor]:
    """A few AdamW steps; the loss of each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for args, kwargs in batches:
        loss = loss_of(model(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def train_reference(name: str, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(name)
    losses = train(model, batches)
    return [l.item() for l in losses], {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_sharded(mesh, model: torch.nn.Module, batches, plan_options: dict) -> tuple[list, dict, autopar.Plan]:
    """Runs on every rank (or once under LocalTensorMode, with ``model`` built outside it)."""
    args, kwargs = batches[0]
    pmodel = autopar.compile(model, mesh, args, kwargs, **plan_options)
    losses = train(pmodel, batches)
    return losses, autopar.full_state_dict(pmodel), pmodel.plan

"""A decoder whose mixture of experts is written by hand, as Hugging Face's Mixtral was before
transformers 5 and as most hand-written MoEs are: a ``ModuleList`` of SwiGLU experts, each
picking its tokens with ``torch.where`` over a one-hot of the router's top-2 ids and adding its
rows back, weighted, with ``index_add_``. Zoo name: ``tests.hand_moe:build``."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NAME = "tests.hand_moe:build"
VOCAB, HIDDEN, HEADS, LAYERS, EXPERTS, TOP_K, INTERMEDIATE = 64, 32, 4, 2, 4, 2, 48
DEFAULT_BATCH, DEFAULT_SEQ = 2, 4


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.w2 = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = hidden.shape
        hidden = hidden.view(-1, dim)
        weights = F.softmax(self.gate(hidden), dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, TOP_K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(hidden.dtype)
        out = torch.zeros_like(hidden)
        mask = F.one_hot(chosen, num_classes=EXPERTS).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            rows = expert(hidden[None, token].reshape(-1, dim)) * weights[token, slot, None]
            out.index_add_(0, token, rows.to(hidden.dtype))
        return out.view(batch, seq, dim)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.moe = SparseMoe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, HIDDEN))
        return x + self.moe(self.norm2(x))


class HandMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(64, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def build() -> HandMoe:
    return HandMoe()


def example_inputs(batch: int, seq: int, device: torch.device) -> tuple:
    return (torch.randint(0, VOCAB, (batch, seq), device=device),)


def example_kwargs(batch: int, seq: int, device: torch.device) -> dict:
    return {"labels": torch.randint(0, VOCAB, (batch, seq), device=device)}

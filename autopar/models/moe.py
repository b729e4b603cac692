"""A decoder whose mixture of experts is written by hand, as Hugging Face's Mixtral was before
transformers 5 and as most hand-written MoEs are: a ``ModuleList`` of SwiGLU experts, each
picking its tokens with ``torch.where`` over a one-hot of the router's top-k ids and adding its
rows back, weighted, with ``index_add_``. autopar runs such a loop as one op
(``autopar.core.expert_lists``). As a model name: ``autopar.models.moe:build`` (tiny),
``autopar.models.moe:build_gelu`` (tiny, plain GELU experts), ``build_relu_biased`` and
``autopar.models.moe:mixtral_8x7b`` (Mixtral 8x7B's sizes, 47.5B parameters)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

NAME = "autopar.models.moe:build"
DEFAULT_BATCH, DEFAULT_SEQ = 2, 4


@dataclass(frozen=True)
class Sizes:
    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    intermediate: int = 48
    positions: int = 64
    activation: str = "silu"   # "silu", "gelu" or "relu"
    gated: bool = True         # down(act(w1 x) * w3 x) (SwiGLU with silu), else down(act(w1 x))
    bias: bool = False         # the experts' linears with biases


TINY = Sizes()
MIXTRAL_8X7B = Sizes(vocab=32000, hidden=4096, heads=32, layers=32, experts=8, top_k=2, intermediate=14336,
                     positions=4096)
#: Fine-grained: DeepSeek-V2-Lite's routed experts (64 of 1408, 6 a token) in 27 layers, no shared expert.
FINE_GRAINED = Sizes(vocab=102400, hidden=2048, heads=16, layers=27, experts=64, top_k=6, intermediate=1408,
                     positions=4096)


class Expert(nn.Module):
    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.activation = s.activation   # a function of torch.nn.functional
        self.w1 = nn.Linear(s.hidden, s.intermediate, bias=s.bias)
        self.w2 = nn.Linear(s.intermediate, s.hidden, bias=s.bias)
        self.w3 = nn.Linear(s.hidden, s.intermediate, bias=s.bias) if s.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = getattr(F, self.activation)(self.w1(x))
        return self.w2(hidden * self.w3(x) if self.w3 is not None else hidden)


class SparseMoe(nn.Module):
    def __init__(self, s: Sizes = TINY) -> None:
        super().__init__()
        self.top_k, self.num_experts = s.top_k, s.experts
        self.gate = nn.Linear(s.hidden, s.experts, bias=False)
        self.experts = nn.ModuleList(Expert(s) for _ in range(s.experts))

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k router weights (renormalised to sum to 1) and experts."""
        weights = F.softmax(self.gate(hidden), dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(hidden.dtype), chosen

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = hidden.shape
        hidden = hidden.view(-1, dim)
        weights, chosen = self.route(hidden)
        out = torch.zeros_like(hidden)
        mask = F.one_hot(chosen, num_classes=self.num_experts).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            rows = expert(hidden[None, token].reshape(-1, dim)) * weights[token, slot, None]
            out.index_add_(0, token, rows.to(hidden.dtype))
        return out.view(batch, seq, dim)


class Block(nn.Module):
    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.heads, self.hidden = s.heads, s.hidden
        self.norm1, self.norm2 = nn.RMSNorm(s.hidden), nn.RMSNorm(s.hidden)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden, bias=False)
        self.proj = nn.Linear(s.hidden, s.hidden, bias=False)
        self.moe = SparseMoe(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, self.hidden))
        return x + self.moe(self.norm2(x))


class HandMoe(nn.Module):
    def __init__(self, s: Sizes = TINY) -> None:
        super().__init__()
        self.vocab = s.vocab
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.pos = nn.Embedding(s.positions, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), labels[:, 1:].reshape(-1))


def build() -> HandMoe:
    return HandMoe()


def build_gelu() -> HandMoe:
    """The tiny model with plain GELU experts (``down(gelu(up x))``, as GShard's and DeepSpeed-MoE's FFNs)."""
    return HandMoe(Sizes(activation="gelu", gated=False))


def build_relu_biased() -> HandMoe:
    """The tiny model with plain ReLU experts whose linears have biases (``nn.Linear``'s default)."""
    return HandMoe(Sizes(activation="relu", gated=False, bias=True))


def mixtral_8x7b() -> HandMoe:
    return HandMoe(MIXTRAL_8X7B)


def fine_grained() -> HandMoe:
    return HandMoe(FINE_GRAINED)


def example_inputs(batch: int, seq: int, device: torch.device) -> tuple:
    return (torch.randint(0, TINY.vocab, (batch, seq), device=device),)


def example_kwargs(batch: int, seq: int, device: torch.device) -> dict:
    return {"labels": torch.randint(0, TINY.vocab, (batch, seq), device=device)}

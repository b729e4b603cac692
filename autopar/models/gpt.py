"""A small, readable GPT in plain PyTorch (nanoGPT style).

Module names follow nanoGPT (``transformer.wte``, ``transformer.h[i].attn.c_attn``, ...)
so that plans and sharding rules read the same as for the well-known reference code.

Differences from nanoGPT:

* ``lm_head`` is **not** weight-tied to ``transformer.wte``. Tying makes one parameter
  appear in two places of the graph (an embedding lookup and a matmul), which would
  force both uses to agree on one sharding; keeping them separate keeps the sharding
  problem simple. It costs ``vocab_size * n_embd`` extra parameters.
* No ``generate``/``from_pretrained``/optimizer helpers: this model exists to be captured
  with ``torch.export`` and parallelized.

The model is export-friendly: no data-dependent control flow, positions come from
``torch.arange(T, device=idx.device)``, and it can be built on the ``meta`` device
(``with torch.device("meta"): GPT(cfg)``) for planning huge configurations without
allocating any real memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64  # maximum sequence length
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True  # bias in Linear and LayerNorm layers
    dropout: float = 0.0
    mlp_ratio: int = 4  # hidden size of the MLP is mlp_ratio * n_embd

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def num_params(self) -> int:
        """Exact parameter count of ``GPT(self)`` (computed without building it)."""
        d, v, L = self.n_embd, self.vocab_size, self.n_layer
        hidden = self.mlp_ratio * d
        b = 1 if self.bias else 0
        ln = d + b * d
        per_layer = (
            ln  # ln_1
            + 3 * d * d + b * 3 * d  # attn.c_attn
            + d * d + b * d  # attn.c_proj
            + ln  # ln_2
            + d * hidden + b * hidden  # mlp.c_fc
            + hidden * d + b * d  # mlp.c_proj
        )
        return v * d + self.block_size * d + L * per_layer + ln + d * v  # wte, wpe, blocks, ln_f, lm_head


def _dropout(p: float) -> nn.Module:
    # With p == 0 use Identity so that the exported graph has no (no-op) aten.dropout nodes.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # query, key, value projections for all heads, in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = _dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = _dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=_dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        # Deliberately NOT tied to transformer.wte (see module docstring): tying would make
        # one parameter feed both the embedding lookup and the output matmul.
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        # Deterministic init from torch's global RNG, as in nanoGPT.
        self.apply(self._init_weights)
        # GPT-2 paper: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits ``(B, T, vocab)`` if ``targets`` is None, else the mean cross-entropy loss."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

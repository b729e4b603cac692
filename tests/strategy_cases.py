"""Tiny modules, one op family each, for the per-strategy numeric tests (test_strategies_numeric.py).

Each ``Case`` wraps the ops the zoo's test models (gpt-tiny, gpt2-tiny, llama-tiny, bert-tiny)
use, in the form those models use them, with shapes that some mesh axes divide and others do
not (batch 3 or 5 on a 2-rank axis...). Float inputs first go through ``Pre`` (multiply by a
parameter of the input's full shape) so that the backward of the op under test is checked
through a parameter gradient: its gradient is the op's input gradient times the input.

``targets`` names the ATen ops whose every node is forced, strategy by strategy. Nodes inside
``pre`` are not forced (their mul is plumbing, not the op under test).
``expect`` lists, per op, rule names that must be among its candidates on a 2-rank axis, so the
test fails when a rule silently disappears.
"""
from __future__ import annotations

import importlib
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.core.lean_loss import LEAN  # capture makes each cross-entropy over class indices lean

aten = torch.ops.aten
importlib.import_module("transformers.integrations.moe")   # registers torch.ops.transformers.grouped_mm_fallback
GROUPED_MM = torch.ops.transformers.grouped_mm_fallback.default
MOE = torch.ops.autopar.moe_experts.default   # registered with autopar.core.expert_parallel


class Pre(nn.Module):
    """``x * g`` with ``g`` of x's full shape: makes the backward of what follows observable."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.g = nn.Parameter(1.0 + 0.5 * torch.randn(*shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    targets: tuple
    expect: dict = field(default_factory=dict)   # target -> rule names required on a 2-rank axis
    meshes: tuple = ((2,), (3,), (2, 2))
    # On a 2-D mesh: force every candidate (True), or a subset covering every per-axis rule and
    # every kind of axis pair (False; see ``covering_2d`` in test_strategies_numeric.py).
    all_2d: bool = False


# ---------------------------------------------------------------------------------------------
# nn.Linear (aten.linear): GPT / Llama / BERT projections and lm_head
# ---------------------------------------------------------------------------------------------


class LinearBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 6)
        self.lin = nn.Linear(6, 10)

    def forward(self, x):
        return self.lin(self.pre(x))


class LinearNoBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(4, 3, 8)
        self.lin = nn.Linear(8, 5, bias=False)

    def forward(self, x):
        return self.lin(self.pre(x))


# ---------------------------------------------------------------------------------------------
# embeddings: token + position (arange), as GPT; BERT's token types (slice/expand/gather)
# ---------------------------------------------------------------------------------------------


class Embeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 6)
        self.wpe = nn.Embedding(8, 6)

    def forward(self, idx):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class BertEmbeddings(nn.Module):
    """BERT's position ids (buffer sliced) and token type ids (buffer expanded and gathered); its
    word embedding's padding row (id 4, which every input holds) gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.word = nn.Embedding(11, 6, padding_idx=4)
        self.position = nn.Embedding(8, 6)
        self.token_type = nn.Embedding(2, 6)
        self.register_buffer("position_ids", torch.arange(8).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, 8, dtype=torch.long), persistent=False)

    def forward(self, input_ids):
        B, T = input_ids.shape
        position_ids = self.position_ids[:, :T]
        buffered = self.token_type_ids.expand(B, -1)
        token_type_ids = torch.gather(buffered, dim=1, index=position_ids.expand(B, -1))
        return self.word(input_ids) + self.token_type(token_type_ids) + self.position(position_ids)


# ---------------------------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------------------------


class LayerNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 6)
        self.ln = nn.LayerNorm(6)
        with torch.no_grad():
            self.ln.weight.add_(0.3 * torch.randn(6))
            self.ln.bias.add_(0.3 * torch.randn(6))

    def forward(self, x):
        return self.ln(self.pre(x))


class RMSNorm(nn.Module):
    """Llama's RMSNorm: to(float32), pow, mean, add eps, rsqrt, mul, weight * x, to(dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 6)
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(6))
        self.eps = 1e-6

    def forward(self, x):
        h = self.pre(x)
        dtype = h.dtype
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, B: int, H: int, KV: int, T: int, D: int, **sdpa_kwargs) -> None:
        super().__init__()
        self.pq, self.pk, self.pv = Pre(B, H, T, D), Pre(B, KV, T, D), Pre(B, KV, T, D)
        self.kw = sdpa_kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(self.pq(q), self.pk(k), self.pv(v), **self.kw)


class FoldedMaskAttention(nn.Module):
    """SDPA reading a causal mask built from positions, as Hugging Face builds it: folded, found
    causal when planned (attention split by sequence is offered) and when run (SDPA is_causal)."""

    def __init__(self, B: int, H: int, T: int, D: int) -> None:
        super().__init__()
        self.pq, self.pk, self.pv = Pre(B, H, T, D), Pre(B, H, T, D), Pre(B, H, T, D)

    def forward(self, q, k, v):
        B, _, T, _ = q.shape
        pos = torch.arange(T, device=q.device)
        mask = (pos[None, :] <= pos[:, None])[None, None].expand(B, 1, T, T)
        return F.scaled_dot_product_attention(self.pq(q), self.pk(k), self.pv(v), attn_mask=mask)


class GPTAttentionHeads(nn.Module):
    """nanoGPT's head split and merge: split(C) -> getitem -> view -> transpose -> sdpa ->
    transpose -> contiguous -> view."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 24)
        self.n_head, self.n_embd = 4, 8

    def forward(self, x):
        x = self.pre(x)
        B, T, _ = x.shape
        C, H = self.n_embd, self.n_head
        q, k, v = x.split(C, dim=2)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, C)


class HFAttentionHeads(nn.Module):
    """HF's head split and merge: view(B, T, -1, D) -> transpose, then transpose -> reshape(B, T, -1)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(2, 3, 16)

    def forward(self, x):
        x = self.pre(x)
        B, T, _ = x.shape
        h = x.view(B, T, -1, 4).transpose(1, 2)
        return h.transpose(1, 2).contiguous().reshape(B, T, -1).contiguous()


# ---------------------------------------------------------------------------------------------
# views, pointwise, rotary
# ---------------------------------------------------------------------------------------------


class BatchOfOneView(nn.Module):
    """A batch of one flattened with its sequence (as a loss's ``logits.view(-1, vocab)``): the
    split sequence stays split."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(1, 6)

    def forward(self, x):
        return self.pre(x).view(6)


class Views(nn.Module):
    """view splitting the last dim, merging the leading dims (uneven batch), unsqueeze, alias."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 12)

    def forward(self, x):
        x = self.pre(x)
        a = x.view(3, 5, 4, 3)                 # split last dim
        b = x.view(15, 12)                     # merge batch and seq
        c = x.reshape(3, 60)                   # merge seq and hidden
        d = torch.ops.aten.alias(x).unsqueeze(0)
        return a.sum(-1), b, c, d


class Pointwise(nn.Module):
    """gelu (erf and tanh), GPT-2's NewGELU (pow/tanh/mul/add), silu, broadcasting add/mul,
    to(dtype); a dropout(p=0), which capture drops (it returns its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 6)
        self.w = nn.Parameter(torch.randn(6))
        self.b = nn.Parameter(torch.randn(5, 1))

    def forward(self, x):
        x = self.pre(x)
        g = F.gelu(x) * self.w + self.b
        new_gelu = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))
        s = F.silu(x) * x
        d = F.dropout(s, 0.0, True)
        return g + new_gelu.to(torch.float32) - d


class RotaryHalf(nn.Module):
    """Llama's rotary embedding: cos/sin of a cat'ed frequency table, rotate_half (slice, neg, cat)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 2, 5, 8)
        self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    def forward(self, q):
        q = self.pre(q)
        T = q.shape[2]
        t = torch.arange(T, device=q.device).float()
        freqs = t[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().unsqueeze(0).unsqueeze(0), emb.sin().unsqueeze(0).unsqueeze(0)
        x1, x2 = q[..., : q.shape[-1] // 2], q[..., q.shape[-1] // 2 :]
        rot = torch.cat((-x2, x1), dim=-1)
        return q * cos + rot * sin


class SplitGetitem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 12)

    def forward(self, x):
        a, b, c = self.pre(x).split(4, dim=2)
        return a * b + c


class UnbindGetitem(nn.Module):
    """Query, key and value unpacked from one projection (``q, k, v = qkv.unbind(2)``, or a tensor
    unpacked as a tuple, which export records so)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 12)

    def forward(self, x):
        q, k, v = self.pre(x).view(3, 5, 3, 4).unbind(2)
        return q * k + v


# ---------------------------------------------------------------------------------------------
# matmul family: GPT-2's Conv1D (view -> addmm -> view), torch.matmul
# ---------------------------------------------------------------------------------------------


class Conv1D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 6)
        self.weight = nn.Parameter(torch.randn(6, 10) * 0.3)
        self.bias = nn.Parameter(torch.randn(10))

    def forward(self, x):
        x = self.pre(x)
        size_out = x.size()[:-1] + (10,)
        y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return y.view(size_out)


class Matmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pa = Pre(3, 2, 5, 4)
        self.pb = Pre(3, 2, 4, 5)
        self.w = nn.Parameter(torch.randn(5, 7) * 0.3)

    def forward(self, a, b):
        s = torch.matmul(self.pa(a), self.pb(b))       # 4-D @ 4-D (attention scores)
        return torch.matmul(s, self.w)                 # 4-D @ 2-D (a projection)


# ---------------------------------------------------------------------------------------------
# losses and reductions
# ---------------------------------------------------------------------------------------------


class GPTLoss(nn.Module):
    """nanoGPT: cross_entropy(logits.view(-1, V), targets.view(-1)), mean over targets."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 7)

    def forward(self, logits, targets):
        logits = self.pre(logits)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class HFCausalLoss(nn.Module):
    """HF ForCausalLMLoss: labels padded with -100 and shifted by a slice; ignore_index -100."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 7)

    def forward(self, logits, labels):
        logits = self.pre(logits).float()
        labels = labels.to(logits.device)
        labels = F.pad(labels, (0, 1), value=-100)
        shift_labels = labels[..., 1:].contiguous()
        logits = logits.view(-1, logits.size(-1))
        shift_labels = shift_labels.view(-1).to(logits.device)
        return F.cross_entropy(logits, shift_labels, ignore_index=-100, reduction="mean")


class SumLoss(nn.Module):
    """cross_entropy with reduction='sum' and a few ignored targets."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(5, 7)

    def forward(self, logits, targets):
        return F.cross_entropy(self.pre(logits), targets, reduction="sum")


class Reductions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 5, 6)

    def forward(self, x):
        x = self.pre(x)
        return x.sum(dim=1), x.mean(-1, keepdim=True), x.mean(dim=(0, 1)), x.sum()


class FlattenLoss(nn.Module):
    """A GPT's loss as usually written: ``cross_entropy(logits.flatten(0, 1), labels.flatten())``."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(4, 5, 7)

    def forward(self, logits, labels):
        return F.cross_entropy(self.pre(logits).flatten(0, 1), labels.flatten())


class MaskOps(nn.Module):
    """What HF models build masks and positions with: cumsum, diff, tril, gather, ``&`` of
    comparisons, a move to the input's device, and detach (a ``torch.no_grad`` region's end)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(5, 5, 6)

    def forward(self, x, index, ids):
        x = self.pre(x)
        positions = x.cumsum(1)
        causal = torch.tril(positions[..., :5])
        picked = torch.gather(x, 2, index)
        keep = (ids > 2) & (ids < 8)
        steps = torch.diff(x, dim=1)
        return positions.to(x.device, torch.float32), causal, picked, keep, positions.detach() * x, steps


class ConvNorm(nn.Module):
    """A vision stem: a strided conv2d (ViT's patch embedding), group norm, batch norm, a padded
    conv1d and an unflatten."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 3, 8, 8)
        self.patch = nn.Conv2d(3, 6, 2, stride=2)
        self.norm = nn.GroupNorm(2, 6)
        self.bn = nn.BatchNorm2d(6)
        self.conv1d = nn.Conv1d(6, 4, 3, padding=1)

    def forward(self, x):
        y = self.bn(self.norm(self.patch(self.pre(x))))
        return self.conv1d(y.flatten(2)).unflatten(2, (4, 4))


class HFMaskBuild(nn.Module):
    """How HF builds its attention mask under torch.export: the padding mask indexed by batch and
    key positions, comparisons, ``new_ones``, ``where`` with a scalar, a ``masked_fill``
    with a constant tensor (``lift_fresh_copy``), and a float tensor indexed along a middle dim
    by a constant (Falcon's query/key/value split)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(4, 6)
        self.pre4 = Pre(4, 6, 3, 2)

    def forward(self, x, mask, heads):
        b = torch.arange(4)[:, None, None, None]
        q = torch.arange(6)[None, None, :, None]
        kv = torch.arange(6)[None, None, None, :]
        allowed = (kv <= q) & mask.bool()[b, kv] & mask.new_ones(4, 1, 6, 6, dtype=torch.bool)
        allowed = allowed & ((mask != 0) | (mask >= 1))[b, q] | (q == kv)
        scores = self.pre(x)[b, q].expand(4, 1, 6, 6)
        masked = torch.where(allowed, scores, -1e4)
        filled = scores.masked_fill(~allowed, torch.tensor(0.5))
        picked = self.pre4(heads)[:, :, torch.tensor([2, 0])]
        return masked, filled, picked


class AlibiOps(nn.Module):
    """BLOOM's ops: ``baddbmm`` of a broadcast bias and scores, ``repeat``, ``stack``,
    ``repeat_interleave`` and a weight's ``.T`` (numpy_T)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(3, 4, 6)
        self.bias = nn.Parameter(torch.randn(3, 1, 4))
        self.w = nn.Parameter(torch.randn(5, 6))

    def forward(self, x):
        x = self.pre(x)
        scores = torch.baddbmm(self.bias, x, x.transpose(1, 2), beta=1.0, alpha=0.5)
        return (scores, x.repeat(2, 1, 1), torch.stack([x, x * 2], dim=1), x.repeat_interleave(2, dim=1),
                x @ self.w.T)


class Routing(nn.Module):
    """A mixture-of-experts router's ops: ``topk`` of the probabilities, ``sort`` of the chosen
    experts, their ``histc`` counts over a fixed range, and ``floor_divide``; the largest and
    smallest logit of each row with their indices (``max.dim``, gpt-oss's attention sinks' maximum)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(6, 5)

    def forward(self, logits):
        x = self.pre(logits)
        top, idx = x.softmax(-1).topk(2, dim=-1)
        order, _ = idx.sort(dim=-1)
        counts = torch.histc(idx.float(), bins=5, min=0, max=4)
        most, most_at = x.max(dim=-1, keepdim=True)
        least, least_at = x.min(dim=0)
        return top, order, counts, torch.floor_divide(idx, 2), most * 2, most_at, least * 2, least_at


class InPlaceWrites(nn.Module):
    """T5's label shift: a ``new_zeros`` tensor written in place through a slice (``copy_``) and
    by ``masked_fill_``, read before and after the writes."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(4, 5, 6)

    def forward(self, x):
        y = self.pre(x)
        shifted = y.new_zeros(4, 5, 6)
        early = shifted + y
        shifted[:, 1:] = y[:, :-1]
        shifted.masked_fill_(y > 1.0, 0.5)
        return early, shifted * y


class Experts(nn.Module):
    """HF's mixture-of-experts matmul (transformers' grouped_mm_fallback): tokens sorted by
    expert times each expert's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(7, 6)
        self.w = nn.Parameter(torch.randn(3, 6, 5))

    def forward(self, x):
        offs = torch.tensor([2, 2, 7])   # expert 0 takes 2 tokens, expert 1 none, expert 2 five
        return GROUPED_MM(self.pre(x), self.w, offs)


class MoEExperts(nn.Module):
    """A mixture-of-experts layer's experts as capture records them (``autopar::moe_experts``):
    8 tokens routed top-2 to 4 SwiGLU experts, expert 3 chosen by none, so that split by expert
    one rank's experts see few tokens and one none; the router weights observed through ``Pre``.
    An intermediate size of 6 splits within each expert on an axis of 2 (gate and up rows alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.weights = Pre(8, 6), Pre(8, 2)
        self.gate_up = nn.Parameter(0.3 * torch.randn(4, 12, 6))
        self.down = nn.Parameter(0.3 * torch.randn(4, 6, 6))

    def forward(self, x, ids, weights):
        return MOE(self.pre(x), ids, self.weights(weights), self.gate_up, self.down)


class PlainExperts(MoEExperts):
    """The same layer's experts as plain GELU MLPs (``down(gelu(up x))``, ``gate_up`` [E, I, H]),
    as a hand-written loop over experts is captured: within, ``gate_up`` splits by its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(0.3 * torch.randn(4, 6, 6))

    def forward(self, x, ids, weights):
        return MOE(self.pre(x), ids, self.weights(weights), self.gate_up, self.down, "gelu")


class BiasedExperts(PlainExperts):
    """Plain ReLU experts whose linears have biases ([E, I] and [E, H]), split with their weights."""

    def __init__(self) -> None:
        super().__init__()
        self.up_bias, self.down_bias = nn.Parameter(0.3 * torch.randn(4, 6)), nn.Parameter(0.3 * torch.randn(4, 6))

    def forward(self, x, ids, weights):
        return MOE(self.pre(x), ids, self.weights(weights), self.gate_up, self.down, "relu", self.up_bias,
                   self.down_bias)


def _interleaved_swiglu(inner: torch.Tensor) -> torch.Tensor:
    """A gate of the model's own, as gpt-oss's: gate and up columns interleaved, clamped."""
    gate, up = inner[..., ::2].clamp(max=2.0), inner[..., 1::2].clamp(-2.0, 2.0)
    return (up + 1) * gate * torch.sigmoid(1.7 * gate)


#: Registered as capture registers a model's gate (``expert_parallel.GATES``); a name of this module's own.
INTERLEAVED = "tests.strategy_cases.interleaved_swiglu"
importlib.import_module("autopar.core.expert_parallel").GATES[INTERLEAVED] = _interleaved_swiglu


class OwnGateExperts(MoEExperts):
    """SwiGLU experts gated by a function of the model's own (``INTERLEAVED``): split by token or
    by expert, never within (autopar does not know which columns its gate pairs)."""

    def forward(self, x, ids, weights):
        return MOE(self.pre(x), ids, self.weights(weights), self.gate_up, self.down, INTERLEAVED)


def _routing() -> torch.Tensor:
    """[8, 2] expert ids in 0..2: tokens 0-3 choose experts 0 and 1, tokens 4-7 experts 1 and 2."""
    return torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [2, 1], [1, 2], [2, 1], [1, 2]])


class Scatter(nn.Module):
    """Writing along an index, out of place: ``scatter`` of a tensor and of a value, ``scatter_add``
    (as one-hot targets and routing weights are built)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre(5, 3, 6)
        self.src = Pre(5, 3, 2)

    def forward(self, x, index, src):
        x, src = self.pre(x), self.src(src)
        return x.scatter(2, index, src), x.scatter(2, index, 0.5), x.scatter_add(2, index, src)


# ---------------------------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------------------------


class TiedLM(nn.Module):
    """An embedding and the LM head that shares its weight, as Hugging Face ties them, a norm
    between (a parameter one op reads)."""

    def __init__(self, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids))).sum()


def _ids(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape)


def _targets_with_ignored(vocab: int, *shape: int) -> torch.Tensor:
    t = torch.randint(0, vocab, shape)
    flat = t.view(-1)
    flat[1] = -100
    flat[-3] = -100
    return t


CASES: list[Case] = [
    Case("linear-bias", LinearBias, lambda: (torch.randn(3, 5, 6),), (aten.linear.default,),
         {aten.linear.default: {"batch", "seq", "column", "row"}}, all_2d=True),
    Case("linear-nobias", LinearNoBias, lambda: (torch.randn(4, 3, 8),), (aten.linear.default,),
         {aten.linear.default: {"batch", "seq", "column", "row"}}),
    Case("embedding", Embeddings, lambda: (_ids(11, 3, 5),),
         (aten.embedding.default, aten.arange.default, aten.add.Tensor),
         {aten.embedding.default: {"batch", "vocab", "embed-dim"}, aten.add.Tensor: {"elementwise"}}),
    Case("bert-embeddings", BertEmbeddings, lambda: (_ids(11, 3, 5).index_fill_(1, torch.tensor([1, 4]), 4),),
         (aten.embedding.default, aten.slice.Tensor, aten.expand.default, aten.gather.default),
         {aten.embedding.default: {"vocab", "embed-dim"}}),
    Case("layer-norm", LayerNorm, lambda: (torch.randn(3, 5, 6),), (aten.layer_norm.default,),
         {aten.layer_norm.default: {"batch", "seq"}}, all_2d=True),
    Case("rms-norm", RMSNorm, lambda: (torch.randn(3, 5, 6),),
         (aten.to.dtype, aten.pow.Tensor_Scalar, aten.mean.dim, aten.add.Tensor, aten.rsqrt.default,
          aten.mul.Tensor),
         {aten.mean.dim: {"follow"}, aten.rsqrt.default: {"elementwise"}, aten.mul.Tensor: {"elementwise"}}),
    Case("sdpa-causal", lambda: Attention(3, 4, 4, 5, 8, is_causal=True),
         lambda: (torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8)),
         (aten.scaled_dot_product_attention.default,),
         {aten.scaled_dot_product_attention.default: {"heads"}}, all_2d=True),
    Case("sdpa-gqa", lambda: Attention(2, 4, 2, 5, 8, is_causal=True, scale=0.25, enable_gqa=True),
         lambda: (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)),
         (aten.scaled_dot_product_attention.default,),
         {aten.scaled_dot_product_attention.default: {"batch", "heads"}}, all_2d=True),
    Case("sdpa-bidirectional", lambda: Attention(2, 6, 6, 5, 4, scale=0.25),
         lambda: (torch.randn(2, 6, 5, 4), torch.randn(2, 6, 5, 4), torch.randn(2, 6, 5, 4)),
         (aten.scaled_dot_product_attention.default,),
         {aten.scaled_dot_product_attention.default: {"batch", "heads"}}, all_2d=True),
    # sequence 6: split by sequence over 2 and 3 ranks (ring; Ulysses where the heads divide too)
    Case("sdpa-context-causal", lambda: Attention(2, 6, 6, 6, 4, is_causal=True),
         lambda: (torch.randn(2, 6, 6, 4), torch.randn(2, 6, 6, 4), torch.randn(2, 6, 6, 4)),
         (aten.scaled_dot_product_attention.default,),
         {aten.scaled_dot_product_attention.default: {"context-ring", "context-ulysses"}}),
    Case("sdpa-context-gqa", lambda: Attention(2, 4, 2, 6, 8, scale=0.25, enable_gqa=True),
         lambda: (torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)),
         (aten.scaled_dot_product_attention.default,),
         {aten.scaled_dot_product_attention.default: {"context-ring", "context-ulysses"}}),
    Case("sdpa-context-folded-mask", lambda: FoldedMaskAttention(2, 2, 6, 4),
         lambda: (torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)),
         (aten.scaled_dot_product_attention.default,),
         {aten.scaled_dot_product_attention.default: {"context-ring", "context-ulysses"}}),
    Case("gpt-attention-heads", GPTAttentionHeads, lambda: (torch.randn(3, 5, 24),),
         (aten.split.Tensor, aten.view.default, aten.transpose.int),
         {aten.split.Tensor: {"follow"}, aten.view.default: {"follow"}, aten.transpose.int: {"follow"}}),
    Case("hf-attention-heads", HFAttentionHeads, lambda: (torch.randn(2, 3, 16),),
         (aten.view.default, aten.transpose.int, aten.reshape.default),
         {aten.reshape.default: {"follow"}}),
    Case("views", Views, lambda: (torch.randn(3, 5, 12),),
         (aten.view.default, aten.reshape.default, aten.alias.default, aten.unsqueeze.default),
         {aten.view.default: {"follow", "partial"}, aten.unsqueeze.default: {"follow"}}),
    Case("view-batch-of-one", BatchOfOneView, lambda: (torch.randn(1, 6),), (aten.view.default,),
         {aten.view.default: {"follow"}}, meshes=((2,),)),
    Case("split-getitem", SplitGetitem, lambda: (torch.randn(3, 5, 12),),
         (aten.split.Tensor, operator.getitem),
         {aten.split.Tensor: {"follow"}, operator.getitem: {"follow"}}),
    Case("unbind-getitem", UnbindGetitem, lambda: (torch.randn(3, 5, 12),),
         (aten.unbind.int, operator.getitem),
         {aten.unbind.int: {"follow"}, operator.getitem: {"follow"}}),
    Case("pointwise", Pointwise, lambda: (torch.randn(3, 5, 6),),
         (aten.gelu.default, aten.tanh.default, aten.pow.Tensor_Scalar, aten.silu.default, aten.mul.Tensor,
          aten.add.Tensor, aten.sub.Tensor, aten.to.dtype),
         {aten.gelu.default: {"elementwise"}, aten.mul.Tensor: {"elementwise", "partial"},
          aten.add.Tensor: {"elementwise", "partial"}}),
    Case("rotary", RotaryHalf, lambda: (torch.randn(3, 2, 5, 8),),
         (aten.slice.Tensor, aten.neg.default, aten.cat.default, aten.cos.default, aten.sin.default,
          aten.unsqueeze.default, aten.mul.Tensor, aten.add.Tensor),
         {aten.cat.default: {"follow"}, aten.neg.default: {"elementwise", "partial"}}),
    Case("conv1d-addmm", Conv1D, lambda: (torch.randn(3, 5, 6),), (aten.addmm.default, aten.view.default),
         {aten.addmm.default: {"batch", "column", "row"}, aten.view.default: {"follow"}}),
    Case("matmul", Matmul, lambda: (torch.randn(3, 2, 5, 4), torch.randn(3, 2, 4, 5)),
         (aten.matmul.default,),
         {aten.matmul.default: {"batch", "rows", "columns", "reduction"}}),
    Case("gpt-loss", GPTLoss, lambda: (torch.randn(3, 5, 7), _ids(7, 3, 5)),
         (LEAN, aten.view.default),
         {LEAN: {"batch"}}, all_2d=True),
    Case("hf-causal-loss", HFCausalLoss, lambda: (torch.randn(3, 5, 7), _targets_with_ignored(7, 3, 5)),
         (LEAN, aten.pad.default, aten.slice.Tensor, aten.contiguous.default,
          aten.view.default, aten.to.dtype_layout),
         {LEAN: {"batch"}, aten.pad.default: {"follow"}}),
    Case("sum-loss", SumLoss, lambda: (torch.randn(5, 7), _targets_with_ignored(7, 5)),
         (LEAN,),
         {LEAN: {"batch"}}, all_2d=True),
    Case("flatten-loss", FlattenLoss, lambda: (torch.randn(4, 5, 7), _ids(7, 4, 5)),
         (aten.flatten.using_ints, LEAN),
         {aten.flatten.using_ints: {"follow"}, LEAN: {"batch"}}),
    # batch 5, not 3: on 2x2 batch 3 leaves one rank an empty shard, and cumsum's backward asks
    # whether numel <= 1, which LocalTensorMode cannot answer when ranks disagree (gloo ranks can)
    Case("mask-ops", MaskOps, lambda: (torch.randn(5, 5, 6), torch.randint(0, 6, (5, 5, 2)), _ids(10, 5, 5)),
         (aten.cumsum.default, aten.tril.default, aten.gather.default, aten.__and__.Tensor, aten.to.device,
          aten.detach.default, aten.diff.default),
         {aten.cumsum.default: {"follow", "partial"}, aten.tril.default: {"follow", "partial"},
          aten.gather.default: {"follow", "partial"}, aten.__and__.Tensor: {"elementwise"},
          aten.to.device: {"follow", "partial"}, aten.detach.default: {"follow", "partial"},
          aten.diff.default: {"follow", "partial"}}),
    Case("conv-norm", ConvNorm, lambda: (torch.randn(3, 3, 8, 8),),
         (aten.conv2d.default, aten.group_norm.default, aten.batch_norm.default, aten.conv1d.default,
          aten.unflatten.int),
         {aten.conv2d.default: {"batch", "column"}, aten.group_norm.default: {"batch"},
          aten.batch_norm.default: {"batch", "channels"}, aten.conv1d.default: {"batch", "column"},
          aten.unflatten.int: {"follow"}}),
    Case("hf-mask-build", HFMaskBuild,
         lambda: (torch.randn(4, 6), (torch.arange(6)[None, :] >= torch.tensor([[0], [2], [1], [4]])).long(),
                  torch.randn(4, 6, 3, 2)),
         (aten.index.Tensor, aten.new_ones.default, aten.where.ScalarOther, aten.masked_fill.Tensor, aten.le.Tensor,
          aten.ne.Scalar, aten.ge.Scalar, aten.eq.Tensor),
         {aten.index.Tensor: {"follow", "index"}, aten.new_ones.default: {"fresh"},
          aten.where.ScalarOther: {"elementwise"}, aten.masked_fill.Tensor: {"elementwise"}}),
    Case("alibi-ops", AlibiOps, lambda: (torch.randn(3, 4, 6),),
         (aten.baddbmm.default, aten.repeat.default, aten.stack.default, aten.repeat_interleave.self_int,
          aten.numpy_T.default),
         {aten.baddbmm.default: {"batch", "rows", "columns", "reduction"}, aten.repeat.default: {"follow"},
          aten.stack.default: {"follow"}, aten.repeat_interleave.self_int: {"follow"},
          aten.numpy_T.default: {"follow"}}),
    Case("routing", Routing, lambda: (torch.randn(6, 5),),
         (aten.topk.default, aten.sort.default, aten.histc.default, aten.floor_divide.default, aten.max.dim,
          aten.min.dim),
         {aten.topk.default: {"follow"}, aten.sort.default: {"follow"}, aten.histc.default: {"partial-count"},
          aten.floor_divide.default: {"elementwise"}, aten.max.dim: {"follow"}, aten.min.dim: {"follow"}}),
    Case("in-place-writes", InPlaceWrites, lambda: (torch.randn(4, 5, 6),),
         (aten.copy_.default, aten.masked_fill_.Scalar, aten.new_zeros.default),
         {aten.copy_.default: {"replicate"}, aten.masked_fill_.Scalar: {"replicate"}}),
    Case("experts", Experts, lambda: (torch.randn(7, 6),), (GROUPED_MM,),
         {GROUPED_MM: {"column", "row", "partial"}}),
    Case("moe-experts", MoEExperts, lambda: (torch.randn(8, 6), _routing(), torch.rand(8, 2)), (MOE,),
         {MOE: {"batch", "experts", "experts-within"}}, meshes=((2,), (2, 2))),
    Case("moe-plain-experts", PlainExperts, lambda: (torch.randn(8, 6), _routing(), torch.rand(8, 2)), (MOE,),
         {MOE: {"batch", "experts", "experts-within"}}, meshes=((2,), (2, 2))),
    Case("moe-biased-experts", BiasedExperts, lambda: (torch.randn(8, 6), _routing(), torch.rand(8, 2)), (MOE,),
         {MOE: {"batch", "experts"}}, meshes=((2,), (2, 2))),
    Case("moe-own-gate", OwnGateExperts, lambda: (torch.randn(8, 6), _routing(), torch.rand(8, 2)), (MOE,),
         {MOE: {"batch", "experts"}}, meshes=((2,), (2, 2))),
    Case("scatter", Scatter, lambda: (torch.randn(5, 3, 6), torch.randint(0, 6, (5, 3, 2)), torch.randn(5, 3, 2)),
         (aten.scatter.src, aten.scatter.value, aten.scatter_add.default),
         {aten.scatter.src: {"follow", "partial"}, aten.scatter.value: {"follow"},
          aten.scatter_add.default: {"follow", "partial"}}),
    Case("reductions", Reductions, lambda: (torch.randn(3, 5, 6),), (aten.sum.dim_IntList, aten.mean.dim, aten.sum.default),
         {aten.sum.dim_IntList: {"follow", "partial-sum"}, aten.mean.dim: {"follow"}, aten.sum.default: {"partial-sum"}}),
]

"""Context parallelism: attention with the sequence split over the ranks of a process group.

Two runtime kernels, exact against ``scaled_dot_product_attention`` on the whole sequence:

* ``ring_attention``: every rank keeps its queries; key/value blocks travel around the ring, and
  each rank merges the partial results of its queries with each block through their log-sum-exp.
  Memory per rank stays at two key/value blocks whatever the number of ranks.
* ``ulysses_attention``: an all-to-all turns the sequence split into a head split, each rank runs
  attention on whole sequences for its heads, and a second all-to-all turns it back.

Layouts of the sequence over the ranks (``positions`` gives each rank's global position ids):
"contiguous" gives rank r chunk r of n; "balanced" cuts the sequence into 2n chunks and gives
rank r chunks r and 2n-1-r (``balance``/``unbalance`` permute a whole tensor to and from that
order), so that under a causal mask every rank does the same work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from autopar.core.errors import AutoparError
from autopar.core.sizes import maximum

Layout = Literal["contiguous", "balanced"]
Kernel = Literal["flash_cpu", "flash_cuda", "efficient_cuda", "cudnn_cuda", "math"]
_LAYOUTS = ("contiguous", "balanced")


# ----------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------


def _chunk_order(n: int, layout: Layout) -> list[int]:
    """Chunk ids in rank order: rank r holds the r-th run of ``len // n`` of them."""
    if layout == "contiguous":
        return list(range(n))
    if layout == "balanced":
        return [c for r in range(n) for c in (r, 2 * n - 1 - r)]
    raise AutoparError(f"layout must be one of {_LAYOUTS}; got {layout!r}")


def _chunks(length: int, n: int, layout: Layout) -> int:
    """How many chunks ``layout`` cuts a sequence of ``length`` into over ``n`` ranks (checked)."""
    count = len(_chunk_order(n, layout))
    if n < 1 or length % count:
        raise AutoparError(
            f"the {layout} layout over {n} ranks cuts the sequence into {count} equal chunks, "
            f"but its length {length} is not a multiple of {count}: pad the sequence or pick another layout"
        )
    return count


def balance(x: torch.Tensor, dim: int, n: int, period: int | None = None) -> torch.Tensor:
    """``x`` with its ``dim`` (the whole sequence) permuted into the balanced order: split evenly
    into ``n`` parts afterwards, part r holds chunks r and 2n-1-r of the 2n. ``period``: the
    dim holds runs of that many elements (a batch of sequences flattened), each permuted alone."""
    return _permuted(x, dim, n, period, _chunk_order(n, "balanced"))


def unbalance(x: torch.Tensor, dim: int, n: int, period: int | None = None) -> torch.Tensor:
    """The inverse of ``balance``: a balanced-order ``dim`` back in sequence order."""
    slot = {c: i for i, c in enumerate(_chunk_order(n, "balanced"))}
    return _permuted(x, dim, n, period, [slot[c] for c in range(2 * n)])


def _permuted(x: torch.Tensor, dim: int, n: int, period: int | None, order: list[int]) -> torch.Tensor:
    """``x``'s 2n chunks of ``dim`` (of each run of ``period`` along it) put in ``order``."""
    dim = dim % x.dim()
    size = x.size(dim)
    if period is not None and period != size:
        if size % period:
            raise AutoparError(f"a dim of {size} elements does not hold whole runs of {period}")
        runs = x.unflatten(dim, (size // period, period))
        return _permuted(runs, dim + 1, n, None, order).flatten(dim, dim + 1)
    _chunks(size, n, "balanced")
    parts = x.chunk(2 * n, dim)
    return torch.cat([parts[c] for c in order], dim)


def positions(seq_len: int, n: int, rank: int, layout: Layout) -> torch.Tensor:
    """Global position ids (int64) of the part of a ``seq_len`` sequence that ``rank`` holds, in
    its local order: rotary embeddings and masks need each chunk's true offset."""
    count = _chunks(seq_len, n, layout)
    if not 0 <= rank < n:
        raise AutoparError(f"rank {rank} is not in a group of {n} ranks")
    size = seq_len // count
    per_rank = count // n
    mine = _chunk_order(n, layout)[rank * per_rank:(rank + 1) * per_rank]
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in mine])


# ----------------------------------------------------------------------------
# Which part of a key/value block each rank's queries see
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Block:
    """The part of one (queries, key/value block) pair to compute: rows ``q`` of the local queries
    against rows ``kv`` of the block, causal (the square's lower triangle, diagonal included) or
    unmasked. Everything outside it is masked."""

    q: slice
    kv: slice
    causal: bool


_ALL = slice(None)


def _block(is_causal: bool, layout: Layout, rank: int, source: int, length: int) -> _Block | None:
    """What queries of ``rank`` compute against the key/value block of rank ``source`` (both
    ``length`` long), or None where the causal mask hides all of it.

    Chunk a sees chunk b fully if b < a, causally if b == a, not at all if b > a. Contiguous:
    one chunk each, so earlier blocks are seen fully and later ones not at all. Balanced (chunks
    r, 2n-1-r against s, 2n-1-s): for s < r only chunk s is seen, by both query chunks; for s > r
    only query chunk 2n-1-r sees anything, and it sees both key chunks; the own block is causal
    over the local order, as its positions increase along it.
    """
    if not is_causal:
        return _Block(_ALL, _ALL, False)
    if source == rank:
        return _Block(_ALL, _ALL, True)
    if layout == "contiguous":
        return _Block(_ALL, _ALL, False) if source < rank else None
    half = length // 2
    if source < rank:
        return _Block(_ALL, slice(0, half), False)
    return _Block(slice(half, None), _ALL, False)


# ----------------------------------------------------------------------------
# Attention on one block, with its log-sum-exp
# ----------------------------------------------------------------------------


#: The ring's block kernel for each fused kernel SDPA may pick on CUDA.
_CUDA_KERNELS: dict[int, Kernel] = {int(SDPBackend.FLASH_ATTENTION): "flash_cuda",
                                    int(SDPBackend.EFFICIENT_ATTENTION): "efficient_cuda",
                                    int(SDPBackend.CUDNN_ATTENTION): "cudnn_cuda"}


def _kernel_for(query: torch.Tensor) -> Kernel:
    """The fused kernel that returns a log-sum-exp on the query's device: the CPU flash kernel on
    CPU (memory linear in the block, GQA built in); on CUDA the one SDPA itself picks for such a
    block (cuDNN's or FlashAttention in 16-bit dtypes on recent GPUs, the memory-efficient kernel
    in fp32; ``torch.nn.attention.sdpa_kernel`` chooses as for SDPA); elsewhere the matmul kernel
    in fp32, exact on any device but holding a block's whole score matrix."""
    if query.device.type == "cpu":
        return "flash_cpu"
    if query.device.type != "cuda":
        return "math"
    kernel = _CUDA_KERNELS.get(int(torch._fused_sdp_choice(query, query, query, None, 0.0, False)), "math")
    # the memory-efficient kernel's backward, fed a merged log-sum-exp, gave wrong gradients in
    # 16-bit dtypes (an H200, torch 2.11; right in fp32): the matmul kernel runs there instead
    return "math" if kernel == "efficient_cuda" and query.dtype != torch.float32 else kernel


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to the query's ``heads`` (query head i uses kv head i // group)."""
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


def _fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of ``_expand_heads``: each kv head's group of query heads summed."""
    if grad.size(1) == kv_heads:
        return grad
    return grad.unflatten(1, (kv_heads, grad.size(1) // kv_heads)).sum(2)


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Scaled scores in fp32, masked entries -inf (causal: key j > query i)."""
    s = torch.matmul(q.float(), _expand_heads(k, q.size(1)).float().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse), 0 where a row is all masked (lse = -inf) instead of NaN."""
    return torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))


def _block_forward(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in fp32, log-sum-exp [batch, heads, rows] in fp32) of attention on one block."""
    if kernel == "flash_cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse
    if kernel != "math":
        return _cuda_forward(kernel, q, k, v, causal, scale)
    s = _math_scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    return torch.matmul(_probabilities(s, lse), _expand_heads(v, q.size(1)).float()), lse


def _block_backward(kernel: Kernel, grads: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of one block, given ``grads`` = (d_out, out, lse) of the whole attention:
    softmax's backward needs the final output and log-sum-exp, not the block's own."""
    d_out, out, lse = grads
    if kernel == "flash_cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kernel != "math":
        return _cuda_backward(kernel, grads, q, k, v, causal, scale)
    p = _probabilities(_math_scores(q, k, causal, scale), lse)
    d_out = d_out.float()
    d_p = torch.matmul(d_out, _expand_heads(v, q.size(1)).float().transpose(-2, -1))
    d_s = p * (d_p - (d_out * out.float()).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(d_s, _expand_heads(k, q.size(1)).float())
    dk = torch.matmul(d_s.transpose(-2, -1), q.float())
    dv = torch.matmul(p.transpose(-2, -1), d_out)
    return dq, _fold_heads(dk, k.size(1)), _fold_heads(dv, v.size(1))


#: The memory-efficient CUDA kernel pads its log-sum-exp's rows to a multiple of this.
_EFFICIENT_LSE_ROWS = 32


def _cuda_forward(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``_block_forward`` on CUDA's fused kernels: key/value heads repeated to the query's (as
    SDPA does for them under GQA); the log-sum-exp without the efficient kernel's padding."""
    k, v = (_expand_heads(t, q.size(1)) for t in (k, v))
    if kernel == "flash_cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
    elif kernel == "cudnn_cuda":   # its log-sum-exp is [batch, heads, rows, 1]
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal,
                                                                      scale=scale)[:2]
        lse = lse.reshape(q.shape[:-1])
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
    return out.float(), lse[..., :q.size(2)]


def _cuda_backward(kernel: Kernel, grads: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """``_block_backward`` on CUDA's fused kernels, fed the whole attention's output and
    log-sum-exp (contiguous, as they read them). No dropout: the random state they take is unread."""
    d_out, out, lse = (g.contiguous() for g in grads)
    kv_heads = k.size(1)
    k, v = (_expand_heads(t, q.size(1)) for t in (k, v))
    if kernel == "flash_cuda":
        seed, offset = (torch.empty(shape, dtype=torch.uint64, device=q.device) for shape in ((2,), ()))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            d_out, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, seed, offset, scale=scale)
    elif kernel == "cudnn_cuda":
        seed, offset = (torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d_out, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, None, None, q.size(2), k.size(2), 0.0,
            causal, scale=scale)
    else:
        padded = lse.new_zeros(*lse.shape[:-1], -(-lse.size(-1) // _EFFICIENT_LSE_ROWS) * _EFFICIENT_LSE_ROWS)
        padded[..., :lse.size(-1)] = lse
        seed, offset = (torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))
        dq, dk, dv, _bias = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            d_out, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _fold_heads(dk, kv_heads), _fold_heads(dv, kv_heads)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running (out, lse), in place, in fp32. A row whose
    block is all masked (lse -inf) keeps its value; rows masked in both stay 0 with lse -inf."""
    new = torch.logaddexp(lse, block_lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new)


# ----------------------------------------------------------------------------
# The ring
# ----------------------------------------------------------------------------


class _Shift:
    """Tensors sent to the next rank of the ring while the same-shaped ones of the previous rank
    arrive, launched at construction; ``wait`` returns what arrived. Over gloo, whose
    point-to-point messages are host memory, a GPU's tensors travel through host copies (as when
    processes share a GPU)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup, tag: int) -> None:
        n, rank = group.size(), group.rank()
        self.device = tensors[0].device
        self.staged = self.device.type != "cpu" and dist.get_backend(group) == "gloo"
        self.sent = tuple((t.cpu() if self.staged else t).contiguous() for t in tensors)   # alive until sent
        self.received, self.works = self.sent, []            # a ring of one: the block comes back
        if n > 1:
            self.received = tuple(torch.empty_like(t) for t in self.sent)
            ops = [dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=(rank + 1) % n) for t in self.sent]
            ops += [dist.P2POp(dist.irecv, t, group=group, tag=tag, group_peer=(rank - 1) % n)
                    for t in self.received]
            self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        return tuple(t.to(self.device) for t in self.received) if self.staged else self.received


@dataclass(frozen=True)
class _Ring:
    """What the ring's forward and backward share."""

    group: dist.ProcessGroup
    is_causal: bool
    layout: Layout
    scale: float
    kernel: Kernel

    def block(self, step: int, length: int) -> tuple[int, _Block | None]:
        """(source rank, block to compute) of the key/value block this rank holds at ``step``."""
        n, rank = self.group.size(), self.group.rank()
        source = (rank - step) % n
        return source, _block(self.is_causal, self.layout, rank, source, length)


_KV, _DKV = 0, 1   # tags of the two kinds of messages, which may be in flight together


def _ring_forward(ring: _Ring, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in fp32, lse in fp32) of the local queries against every rank's keys/values. The
    next block's transfer is launched before computing on the current one, so they overlap."""
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    kv = (k, v)
    n = ring.group.size()
    for step in range(n):
        incoming = _Shift(kv, ring.group, _KV) if step < n - 1 else None
        _source, blk = ring.block(step, k.size(2))
        if blk is not None:
            o, l = _block_forward(ring.kernel, q[:, :, blk.q], kv[0][:, :, blk.kv], kv[1][:, :, blk.kv],
                                  blk.causal, ring.scale)
            _merge(out[:, :, blk.q], lse[:, :, blk.q], o, l)
        if incoming is not None:
            kv = incoming.wait()
    return out, lse


def _ring_backward(ring: _Ring, d_out: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv). Key/value blocks travel the ring again (recomputed, not stored: memory stays
    at two blocks); each block's dk/dv accumulator (fp32) travels one step behind it, gathering
    every rank's contribution, and a last step brings it home to the block's owner."""
    q, k, v, out, lse = saved
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv, grads = (k, v), (d_out.contiguous(), out, lse)
    partial: _Shift | None = None
    n = ring.group.size()
    for step in range(n):
        incoming = _Shift(kv, ring.group, _KV) if step < n - 1 else None
        _source, blk = ring.block(step, k.size(2))
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        if blk is not None:
            rows = tuple(g[:, :, blk.q] for g in grads)
            g_q, g_k, g_v = _block_backward(ring.kernel, rows, q[:, :, blk.q], kv[0][:, :, blk.kv],
                                            kv[1][:, :, blk.kv], blk.causal, ring.scale)
            dq[:, :, blk.q] += g_q
            dk[:, :, blk.kv] += g_k
            dv[:, :, blk.kv] += g_v
        if partial is not None:
            before_k, before_v = partial.wait()
            dk += before_k
            dv += before_v
        partial = _Shift((dk, dv), ring.group, _DKV)
        if incoming is not None:
            kv = incoming.wait()
    dk, dv = partial.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention with its exact backward (``_ring_backward``)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> torch.Tensor:
        out, lse = _ring_forward(ring, q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dq, dk, dv = _ring_backward(ctx.ring, d_out, ctx.saved_tensors)
        return dq, dk, dv, None


def ring_held_bytes(q_numel: Any, kv_numel: Any, rows: Any, itemsize: int, n: int) -> tuple[Any, Any]:
    """The most ``ring_attention`` allocates at once in its forward (its output and log-sum-exp
    included) and in its backward (the gradients it returns included), (forward, backward) in
    bytes, on a rank that computes every block (a contiguous causal ring's last rank), the block
    kernel's own scratch aside (``ops.attention.flash_cpu_scratch``). ``q_numel``:
    elements of this rank's queries; ``kv_numel``: of its keys and values together; ``rows``: of
    the log-sum-exp; ``itemsize``: of the inputs' dtype; ``n``: ranks in the ring. Sizes may be
    sympy expressions.

    Forward (``_ring_forward``): the fp32 output being merged into, a block's fp32 result and the
    merge's product of it (three fp32 buffers of the queries' size), the log-sum-exp with two
    row-sized temporaries, and the key/value blocks in flight: the one at hand and the one
    arriving (on two ranks one at a time, as the last step receives nothing). Backward
    (``_ring_backward``): dq's fp32 accumulator, the blocks in flight likewise, fp32 dk/dv
    accumulators (this step's, the last step's being sent and the one arriving, and the one that
    arrived before: four sets) and each block's gradients in the inputs' dtype (the previous
    block's still held while the next's are made: two sets). On two ranks a block is computed
    beside three accumulator sets, and the last send holds four beside one set of gradients."""
    q4, kv4, kv_e, grads = 4 * q_numel, 4 * kv_numel, itemsize * kv_numel, itemsize * (q_numel + kv_numel)
    in_flight = kv_e if n <= 2 else 2 * kv_e
    forward = 3 * q4 + 3 * 4 * rows + in_flight
    if n > 2:
        return forward, q4 + in_flight + 4 * kv4 + 2 * grads
    return forward, q4 + in_flight + maximum(3 * kv4 + 2 * grads, 4 * kv4 + grads)


def expanded_heads_bytes(q_numel: Any, grouped: bool, itemsize: int) -> tuple[Any, Any]:
    """What the CUDA block kernels hold beyond ``ring_held_bytes`` (forward, backward) in bytes
    where keys and values have fewer heads than queries: a block's keys and values repeated to
    the query's heads (``_expand_heads``), and in the backward their gradients too before they
    are folded back; nothing otherwise (and on the CPU, whose kernel takes grouped heads)."""
    return (2 * itemsize * q_numel, 4 * itemsize * q_numel) if grouped else (0, 0)


def _check_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool) -> None:
    """Shapes attention on [batch, heads, seq_local, dim] tensors needs (AutoparError otherwise)."""
    if not query.dim() == key.dim() == value.dim() == 4:
        raise AutoparError("context-parallel attention takes [batch, heads, seq_local, dim] query, key and value; "
                           f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[:3] != value.shape[:3] or query.size(1) % key.size(1):
        raise AutoparError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree in batch, heads "
                           f"and length, and query heads ({query.size(1)}) be a multiple of key/value heads")
    if is_causal and query.size(2) != key.size(2):
        raise AutoparError(f"causal attention needs queries and keys of one sequence: {query.size(2)} local "
                           f"queries against {key.size(2)} local keys")


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
                   group: dist.ProcessGroup, layout: Layout, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` of the whole sequence, each rank of ``group`` holding its
    part ([batch, heads, seq_local, dim], placed by ``layout``) of query, key and value and
    getting its queries' rows of the output. Key/value may have fewer heads (as ``enable_gqa``).

    Blocks move by point-to-point ``batch_isend_irecv`` (gloo and NCCL alike) rather than an
    all-gather: a rank holds two key/value blocks at a time instead of the whole sequence, and
    the next block's transfer overlaps attention on the current one. Every rank must hold the
    same local length, even under the balanced layout.
    """
    _check_attention(query, key, value, is_causal)
    _chunk_order(group.size(), layout)   # checks the layout's name
    if layout == "balanced" and key.size(2) % 2:
        raise AutoparError(f"the balanced layout holds two equal chunks per rank; local length {key.size(2)} is odd")
    ring = _Ring(group, is_causal, layout, query.size(-1) ** -0.5 if scale is None else scale, _kernel_for(query))
    return _RingAttention.apply(query, key, value, ring)


# ----------------------------------------------------------------------------
# Ulysses
# ----------------------------------------------------------------------------


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[batch, heads, seq/n, dim] split by sequence -> [batch, heads/n, seq, dim] split by heads."""
    n = group.size()
    b, h, s, d = x.shape
    parts = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()   # [n: head group, ...]
    got = funcol.all_to_all_single(parts, None, None, group)              # [n: sequence chunk, ...]
    return funcol.wait_tensor(got).permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``."""
    n = group.size()
    b, h, s, d = x.shape
    parts = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()   # [n: sequence chunk, ...]
    got = funcol.wait_tensor(funcol.all_to_all_single(parts, None, None, group))   # [n: head group, ...]
    return got.transpose(0, 1).reshape(b, n * h, s // n, d)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
                      group: dist.ProcessGroup, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` of the whole sequence (DeepSpeed-Ulysses), each rank of
    ``group`` holding its contiguous part [batch, heads, seq_local, dim] of query, key and value.

    An all-to-all regroups the tensors by heads (each rank gets ``heads/n`` heads of the whole
    sequence), attention runs locally, and an all-to-all gives every rank its rows back. The
    functional all-to-all is differentiable, so autograd sends the gradients back the same way.
    """
    _check_attention(query, key, value, is_causal)
    n = group.size()
    if query.size(1) % n or key.size(1) % n:
        raise AutoparError(f"Ulysses attention splits heads over the {n} ranks, but there are {query.size(1)} "
                           f"query and {key.size(1)} key/value heads: use ring_attention, or a group whose "
                           "size divides both")
    q, k, v = (_seq_to_heads(t, group) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                         enable_gqa=q.size(1) != k.size(1))
    return _heads_to_seq(out, group)


# ----------------------------------------------------------------------------
# All-gathered keys and values
# ----------------------------------------------------------------------------


def allgather_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, *, is_causal: bool, group: dist.ProcessGroup,
                        rows: torch.Tensor, layout: Layout, scale: float | None = None,
                        enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` of the whole sequence, each rank of ``group`` holding its
    part (placed by ``layout``) of query, key and value: keys and values are all-gathered (a
    functional collective: its backward reduce-scatters their gradients) and this rank's queries,
    at global positions ``rows`` (``positions``), attend to all of them, under the causal mask of
    those positions or under ``attn_mask``'s rows (a mask of the whole sequence, [..., seq, seq]
    or broadcast along queries). Llama 3's context parallelism does the same.

    Memory: the whole sequence's keys and values, kept for the backward; ``ring_attention`` keeps
    two blocks. It needs only collectives, so it also runs where ranks are simulated in one
    process (LocalTensorMode), and takes any mask.
    """
    _check_attention(query, key, value, is_causal)
    n = group.size()
    whole_k, whole_v = (funcol.all_gather_single(t.contiguous(), 2, group) for t in (key, value))
    seq = whole_k.size(2)
    keys = torch.cat([positions(seq, n, r, layout) for r in range(n)]).to(query.device)   # gathered order
    if is_causal:
        attn_mask = keys.unsqueeze(0) <= rows.unsqueeze(1)
    elif attn_mask is not None:
        if attn_mask.size(-2) == seq:
            attn_mask = attn_mask.index_select(-2, rows)
        if attn_mask.size(-1) == seq and layout != "contiguous":
            attn_mask = attn_mask.index_select(-1, keys)
    return F.scaled_dot_product_attention(query, whole_k, whole_v, attn_mask, scale=scale, enable_gqa=enable_gqa)

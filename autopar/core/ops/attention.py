"""Scaled dot-product attention (``aten.scaled_dot_product_attention``): split by batch or heads,
or by sequence (context parallelism: ``autopar.core.context_parallel``'s ring or Ulysses
attention); a folded mask that is causal (or lets everything through) on this rank is passed as
``is_causal`` (or no mask), as eager Hugging Face calls it; its backward keeps what the fused
kernels keep.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import sympy
import torch
import torch.fx as fx
from torch.distributed._local_tensor import (
    LocalTensor,
    local_tensor_mode,
    maybe_disable_local_tensor_mode,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_flop_count

from autopar.core.capture import tensor_val
from autopar.core.context_parallel import (
    Layout,
    allgather_attention,
    expanded_heads_bytes,
    positions,
    ring_attention,
    ring_held_bytes,
    ulysses_attention,
)
from autopar.core.from_shapes import sampled_from_shapes, value_from_shapes
from autopar.core.ops.base import (
    Collective,
    Emitter,
    Kept,
    LocalCall,
    Placed,
    Site,
    collectives,
    emitter,
    flop_share,
    kernel,
    rule,
    rule_key,
    saved,
    timed,
    working,
)
from autopar.core.placements import Placements, largest_shard_shape
from autopar.core.rules import AxisRule, OpView, fits, replicate
from autopar.core.sizes import maximum, minimum
from autopar.core.together import rank_map

aten = torch.ops.aten
SDPA = torch.ops.aten.scaled_dot_product_attention.default


@rule(SDPA)
def split_attention(v: OpView, n: int) -> list[AxisRule]:
    """SDPA on [batch, heads, seq, dim]: batch or heads (GQA: kv heads split with q heads), or
    the sequence (``context_rules``).

    Batch and heads run per shard locally, so both need an even split; a mask follows q where it
    has that dim.
    """
    q, k = v.in_shapes[0], v.in_shapes[1]
    rules = [replicate(v)]
    for d, name in ((0, "batch"), (1, "heads")):
        if not (fits(q[d], n, even=True) and fits(k[d], n, even=True)):
            continue
        ins = [Shard(d), Shard(d), Shard(d)]
        for extra in v.in_shapes[3:]:
            de = d - (len(q) - len(extra))
            if de >= 0 and extra[de] == q[d]:
                ins.append(Shard(de))
            elif de < 0 or extra[de] == 1:
                ins.append(Replicate())
            else:
                break
        else:
            rules.append(AxisRule(Shard(d), tuple(ins), name))
    return rules + context_rules(v, n)


@emitter(SDPA)
def emit(em: Emitter, site: Site) -> bool:
    """Split by sequence, ``context_attention`` over the axis that splits it. Where its mask is
    folded (``codegen.generate._Emitter.tell_attention``), the runtime's ``attention``, which
    reads what ``attention_mask`` made of the mask on this rank."""
    context = context_of(site.plan)
    if context is not None:
        text = em.call_text(site.node, site.reads)
        axis, kind = context
        balanced = context_layout(site.plan) == "balanced"
        em.emit(f"{site.node.name} = kernels.context_attention({text[text.index('(') + 1:-1]}, mesh=mesh, "
                f"axis={axis}, kind={kind!r}{', layout=' + repr('balanced') if balanced else ''})",
                site.comment + f"; the sequence split over {em.axes[axis]}: {_HOW[kind]}"
                + ("; balanced layout: this rank holds chunks r and 2n-1-r, equal causal work" if balanced else ""))
        return True
    if site.node.name not in em.masked_attention:
        return False
    text = em.call_text(site.node, site.reads)
    em.emit(f"{site.node.name} = kernels.attention{text[text.index('('):]}",
            site.comment + "; its mask, made once, may be causal or let everything through: then SDPA runs "
            "is_causal or unmasked, as eager Hugging Face calls it")
    return True


@saved(SDPA)
def fused_kernel(node: fx.Node, flags: tuple[bool, ...]) -> Kept | None:
    """On ``meta`` (planning for a cluster that is not here) SDPA takes its math path, which keeps
    the batch x heads x seq x seq attention matrix; the fused kernels training really runs (flash /
    memory-efficient on CUDA, flash on CPU) keep q, k, v, the output and one fp32 log-sum-exp per
    query row instead. So does a call whose mask is found causal or open when planned: it runs
    as ``is_causal`` or unmasked (``attention``, ``context_attention``), where fake tensors would
    take the masked math path. Elsewhere what the op keeps on fake tensors (None)."""
    out = tensor_val(node)
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if out.device.type != "meta" and not (isinstance(mask, fx.Node) and causal_or_open(mask)):
        return None
    rows = 1
    for size in out.shape[:-1]:
        rows *= size
    return Kept(frozenset(i for i, f in enumerate(flags[:3]) if f), True, rows * 4)


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """CPU fused attention does the same work as the CUDA kernels PyTorch counts."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# FlopCounterMode counts the CUDA attention kernels but not the CPU one a CPU model's SDPA runs.
if torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in flop_registry:
    register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)(_cpu_flash_attention_flops)


#: ``attention_mask``'s answer for a mask that is exactly causal: SDPA's ``is_causal=True``.
CAUSAL = "causal"


@kernel
def attention_mask(mask: torch.Tensor | str | None) -> torch.Tensor | str | None:
    """A folded attention mask as SDPA needs it on this rank: None where it lets every query see
    every key, ``CAUSAL`` where it is exactly the causal mask of square attention, else the mask.
    Eager Hugging Face makes the same call on the batch (no padding: SDPA's is_causal); an
    exported graph builds the mask instead. A mask never built (``fold.unbuilt_masks``) comes as
    its answer already."""
    if not isinstance(mask, torch.Tensor):
        return mask
    values = list(mask._local_tensors.values()) if isinstance(mask, LocalTensor) else [mask]
    with maybe_disable_local_tensor_mode():
        kinds = {_mask_kind(v) for v in values}
    return {"none": None, "causal": CAUSAL}.get(kinds.pop(), mask) if len(kinds) == 1 else mask


def _mask_kind(mask: torch.Tensor) -> str:
    if mask.dtype == torch.bool:
        if bool(mask.all()):
            return "none"
        if mask.dim() >= 2 and mask.shape[-1] == mask.shape[-2]:
            causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
            if torch.equal(mask, causal.expand_as(mask)):
                return "causal"
    elif mask.is_floating_point() and not bool(mask.any()):
        return "none"   # an additive mask of zeros
    return "mask"


@kernel
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` with a mask ``attention_mask`` has looked at."""
    if isinstance(attn_mask, str):   # CAUSAL
        return aten.scaled_dot_product_attention.default(query, key, value, None, dropout_p, True, **kwargs)
    return aten.scaled_dot_product_attention.default(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)


# ----------------------------------------------------------------------------
# Split by sequence (context parallelism)
# ----------------------------------------------------------------------------

#: How a rule split by sequence runs: ``ring_attention`` or ``ulysses_attention``.
ContextKind = Literal["ring", "ulysses"]
CONTEXT_KINDS: tuple[ContextKind, ...] = get_args(ContextKind)
_HOW = {"ring": "ring attention (keys and values passed around the ring, exact softmax merge)",
        "ulysses": "Ulysses attention (all-to-alls regroup it by heads around attention on the whole sequence)"}
SEQ = 2   # the sequence dim of [batch, heads, seq, dim]
#: The rule name of a causal ring in the balanced layout (rank r holds chunks r and 2n-1-r of
#: 2n: ``context_parallel.balance``), where every rank does the same causal work.
BALANCED_RING = "context-ring-balanced"


@functools.lru_cache(maxsize=256)
def planned_mask_kind(mask: fx.Node) -> str | None:
    """What ``attention_mask`` will find this mask to be ("causal", "none" or "mask"), where it is
    computed from sizes alone: computed here as the forward computes it (``from_shapes``); a
    mask too large for that (``from_shapes.LIMIT``: a long sequence's) is computed at a grid of
    query and key positions only (``mask_grid``), and taken to be what it is there. None where
    it reads an input, or neither way computes it. (Only the cost depends on it: the run finds
    out again, exactly.)"""
    value = value_from_shapes(mask)
    if isinstance(value, torch.Tensor):
        return _mask_kind(value)
    shape = tensor_val(mask).shape
    if len(shape) < 2 or shape[-1] != shape[-2] or not all(isinstance(s, int) for s in shape):
        return None
    positions = mask_grid(shape[-1], math.prod(shape[:-2]))
    grid = sampled_from_shapes(mask, positions, positions)
    if grid is None or grid.dtype != torch.bool:
        return None
    if bool(grid.all()):
        return "none"
    causal = positions[None, :] <= positions[:, None]
    return "causal" if torch.equal(grid, causal.expand_as(grid)) else "mask"


#: Booleans a mask's grid (``mask_grid``) may hold, its leading dims (batch, heads) included: a
#: large batch of long sequences on the densest grid held billions (benchmarks/RESULTS.md).
GRID_ELEMENTS = 1 << 26
#: Grids from densest to thinnest: (positions at each end, positions spread over the sequence,
#: neighbours either side of each, largest number of equal blocks whose edges are taken).
_GRIDS = ((64, 96, 8, 128), (16, 48, 1, 16))


def mask_grid(seq: int, leading: int = 1) -> torch.Tensor:
    """Query and key positions at which a long sequence's mask is computed when planned: the
    first and last positions, neighbours either side of positions spread over the sequence, and
    of every block edge of 2 up to 128 equal blocks (where a split sequence's ranks meet): a
    window, a shifted diagonal or a block structure shows there. The densest grid whose
    ``leading`` x grid x grid booleans fit ``GRID_ELEMENTS``, else the thinnest (16 blocks)."""
    for edge, points, around, blocks in _GRIDS:
        spread = torch.linspace(0, seq - 1, points).long()
        divisors = [d for d in (2, 4, 8, 16, 32, 64, 128) if d <= blocks]
        edges = torch.tensor([seq * i // d for d in divisors for i in range(1, d)], dtype=torch.long)
        near = torch.cat([spread, edges])[:, None] + torch.arange(-around, around + 1)[None, :]
        every = torch.cat([torch.arange(min(edge, seq)), torch.arange(max(seq - edge, 0), seq), near.flatten()])
        grid = every.clamp(0, seq - 1).unique()
        if leading * len(grid) ** 2 <= GRID_ELEMENTS:
            break
    return grid


@rule_key(SDPA)
def mask_of(node: fx.Node) -> str | None:
    """What its mask is known to be when planned (``planned_mask_kind``; None: no mask, or not
    known): the rules differ by it, and calls of equal shapes may not have the same mask."""
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return planned_mask_kind(mask) if isinstance(mask, fx.Node) else None


def causal_or_open(mask: fx.Node) -> bool:
    """Is this attention mask known, at planning time, to be exactly causal or to let every query
    see every key?"""
    return planned_mask_kind(mask) in ("causal", "none")


def context_rules(v: OpView, n: int) -> list[AxisRule]:
    """q, k, v split on the sequence (dim 2), the output too: ring attention, or Ulysses where
    query and key/value heads divide by ``n`` (``context_refusal`` says what each needs), and the
    sequence not yet split by an earlier axis (one axis runs it). A causal ring whose sequence
    cuts into 2n equal chunks may also run in the balanced layout (``BALANCED_RING``). A mask is
    read whole (R) where it is split this way."""
    q, k = v.in_shapes[0], v.in_shapes[1]
    query, mask, dropout = v.node.args[0], v.arg(3, "attn_mask"), v.arg(4, "dropout_p", 0.0)
    if (context_refusal(q, k, mask, dropout, n, "ring") is not None or not isinstance(query, fx.Node)
            or tensor_val(query).shape[SEQ] != q[SEQ]):
        return []
    ins = (Shard(SEQ),) * 3 + (Replicate(),) * (len(v.in_shapes) - 3)
    rules = [AxisRule(Shard(SEQ), ins, "context-ring")]
    if causal_attention(v.node) and q[SEQ] % (2 * n) == 0:
        rules.append(AxisRule(Shard(SEQ), ins, BALANCED_RING))
    if context_refusal(q, k, mask, dropout, n, "ulysses") is None:
        rules.append(AxisRule(Shard(SEQ), ins, "context-ulysses"))
    return rules


def context_refusal(q: Sequence[Any], k: Sequence[Any], mask: Any, dropout: Any, n: int,
                    kind: ContextKind) -> str | None:
    """Why SDPA of query shape ``q``, key shape ``k``, ``mask`` (a node, or None) and ``dropout``
    cannot be split by sequence over ``n`` ranks as ``kind``, else None. Exact only for
    self-attention (keys as long as queries) in equal parts, without dropout, with no mask or
    one from sizes alone that is causal or open (``causal_or_open``); Ulysses also needs query
    and key/value heads that divide by ``n``."""
    if len(q) != 4 or not all(isinstance(s, int) for s in (*q, *k)):
        return "its query is not [batch, heads, sequence, dim] of fixed sizes"
    if q[SEQ] != k[SEQ]:
        return f"its keys ({k[SEQ]}) are not as long as its queries ({q[SEQ]}): not self-attention"
    if not fits(q[SEQ], n, even=True):
        padded = -(-q[SEQ] // n) * n
        return (f"its sequence of {q[SEQ]} does not split into {n} equal parts: pad it to {padded} tokens (a multiple "
                f"of {n}) at the end, with labels -100 there, which leaves a causal model's loss unchanged")
    if dropout != 0.0:
        return "it has dropout"
    if mask is not None and not (isinstance(mask, fx.Node) and causal_or_open(mask)):
        return ("its mask is not known to be causal or open when planned (a mask read from an input, or one "
                "that masks more: padding, a sliding window)")
    if kind == "ulysses" and (q[1] % n or k[1] % n):
        return f"its {q[1]} query heads and {k[1]} key/value heads do not both divide by {n} (Ulysses splits heads)"
    return None


def _heads_divide(q_heads: int, k_heads: int, n: int) -> bool:
    """Can Ulysses over ``n`` ranks split these local query and key/value heads? Where another
    axis left fewer, ``context_attention`` runs the ring instead, and is priced so."""
    return q_heads % n == 0 and k_heads % n == 0


def _local_heads(t: torch.Tensor, p: Placements, mesh_shape: Sequence[int]) -> int:
    """The heads (dim 1) of ``t`` on one rank, split as placements ``p`` split them."""
    heads = t.shape[1]
    for a, q in enumerate(p):
        if q == Shard(1):
            heads //= mesh_shape[a]
    return heads


def context_of(placed: Placed) -> tuple[int, ContextKind] | None:
    """(mesh axis, kind) where ``placed`` splits the query by sequence, else None. The kind is
    the rule's name on that axis (a ``Strategy``'s ``names``, a ``NodePlan``'s label)."""
    axes = [a for a, p in enumerate(placed.ins[0]) if p == Shard(SEQ)]
    if not axes:
        return None
    names = getattr(placed, "names", None)
    label = names[axes[0]] if names is not None else getattr(placed, "strategy", "")
    return axes[0], next(k for k in CONTEXT_KINDS if f"context-{k}" in label)


def context_layout(placed: Placed) -> Layout:
    """How ``placed``'s sequence is laid out over the ranks of the axis splitting it: "balanced"
    for the ``BALANCED_RING`` rule, else each rank one contiguous block."""
    context = context_of(placed)
    if context is None:
        return "contiguous"
    names = getattr(placed, "names", None)
    label = names[context[0]] if names is not None else getattr(placed, "strategy", "")
    return "balanced" if BALANCED_RING in label else "contiguous"


def _with(p: Placements, axis: int, placement: Placement) -> Placements:
    return tuple(placement if a == axis else q for a, q in enumerate(p))


def causal_attention(node: fx.Node) -> bool:
    """Does the whole attention run causal (``is_causal``, or a mask ``causal_or_open`` let in
    that is causal)?"""
    is_causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return mask_of(node) == "causal" or bool(is_causal)


def ring_blocks(node: fx.Node, placed: Placed, n: int) -> float:
    """Blocks of its own length (a rank's queries against a rank's keys, unmasked) the busiest
    rank of a ring over ``n`` ranks computes: every one (n) without a mask; under a causal one,
    in the contiguous layout the last rank's n-1 earlier blocks and its own half-masked (n - 1/2);
    balanced, every rank half of each other block and its own half-masked (n/2)."""
    if not causal_attention(node):
        return float(n)
    return n / 2 if context_layout(placed) == "balanced" else n - 0.5


@timed(SDPA)
def context_call(call: LocalCall, node: fx.Node, placed: Placed, mesh_shape: Sequence[int],
                 grad: Mapping[fx.Node, bool]) -> LocalCall:
    """Split by sequence, the attention the slowest rank computes. Ring: its queries against as
    many keys as its blocks' work (``ring_blocks``), unmasked. Ulysses: the whole sequence for
    1/n of the heads, masked as the op is; the ring's where other axes left it heads Ulysses
    cannot split (``context_attention`` runs the ring there)."""
    context = context_of(placed)
    if context is None:
        return call
    axis, kind = context
    n = mesh_shape[axis]
    q, k, v = call.args[:3]
    kwargs = {key: val for key, val in call.kwargs.items() if key in ("scale", "enable_gqa")}

    def grown(t: torch.Tensor, heads: bool, length: int) -> torch.Tensor:
        shape = (t.shape[0], t.shape[1] // n if heads else t.shape[1], length, t.shape[3])
        return torch.empty(shape, dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)

    if kind == "ring" or not _heads_divide(q.shape[1], k.shape[1], n):
        keys = math.ceil(k.shape[2] * ring_blocks(node, placed, n))
        return LocalCall(SDPA, (q, grown(k, False, keys), grown(v, False, keys)), kwargs)
    return LocalCall(SDPA, (grown(q, True, q.shape[2] * n), grown(k, True, k.shape[2] * n),
                            grown(v, True, v.shape[2] * n), None, 0.0, causal_attention(node)), kwargs)


@flop_share(SDPA)
def ring_share(node: fx.Node, placed: Placed, mesh_shape: Sequence[int]) -> float:
    """Split by sequence as a ring, its busiest rank's blocks (``ring_blocks``) over the n an even
    split of FLOP counts (which count causal attention unmasked) gives it; else 1."""
    context = context_of(placed)
    if context is None or (context[1] == "ulysses" and _heads_divide(*_query_and_key_heads(node, placed, mesh_shape),
                                                                     mesh_shape[context[0]])):
        return 1.0
    return ring_blocks(node, placed, mesh_shape[context[0]]) / mesh_shape[context[0]]


def _query_and_key_heads(node: fx.Node, placed: Placed, mesh_shape: Sequence[int]) -> tuple[int, int]:
    """The local query and key/value heads of SDPA ``node`` placed ``placed``."""
    q, k = (_local_heads(tensor_val(a), p, mesh_shape) for a, p in zip(node.args[:2], placed.ins[:2], strict=True))
    return q, k


@collectives(SDPA)
def context_moves(node: fx.Node, placed: Placed, mesh_shape: Sequence[int], grad: bool,
                  loss_with_gradients: str | None) -> list[Collective]:
    """Split by sequence, what moves over its axis. Ring (``ring_attention``): keys and values go
    round the ring, (n-1)/n of each reaching every rank, as an all-gather; the backward sends them
    round again (recomputed, not kept) and brings their gradients back in fp32 accumulators, as
    a reduce-scatter. Each step's transfer is launched before the block at hand is computed, so
    it runs under the n-1 blocks computed meanwhile (``hidden_by``). Ulysses: q, k, v and the
    output each change from a sequence to a heads split (the ``all_to_all_single`` its kernel
    calls), and their gradients back; where other axes left it heads it cannot split, the ring's."""
    context = context_of(placed)
    if context is None:
        return []
    axis, kind = context
    vals = [tensor_val(a) for a in node.args[:3]]
    moves = []
    q_heads, k_heads = (_local_heads(t, p, mesh_shape) for t, p in zip(vals[:2], placed.ins[:2], strict=True))
    if kind == "ring" or not _heads_divide(q_heads, k_heads, mesh_shape[axis]):
        under = (mesh_shape[axis] - 1) / mesh_shape[axis]
        for t, p in zip(vals[1:], placed.ins[1:3], strict=True):
            gather = Collective(tuple(t.shape), t.dtype, p, _with(p, axis, Replicate()), under)
            moves.append(gather)
            if grad:
                moves += [gather, Collective(tuple(t.shape), torch.float32, _with(p, axis, Partial()), p, under)]
        return moves
    tensors = [*vals, tensor_val(node)]
    for i, (t, p) in enumerate(zip(tensors, (*placed.ins[:3], placed.out), strict=True)):
        by_seq, by_heads = p, _with(p, axis, Shard(1))
        forward = (by_seq, by_heads) if i < 3 else (by_heads, by_seq)   # q, k, v in; the output back
        moves.append(Collective(tuple(t.shape), t.dtype, *forward, kind="all_to_all_single"))
        if grad:
            moves.append(Collective(tuple(t.shape), t.dtype, forward[1], forward[0], kind="all_to_all_single"))
    return moves


def flash_cpu_scratch(q_rows: Any, kv_rows: Any, dim: Any, q_numel: Any, itemsize: int) -> tuple[Any, Any]:
    """Bytes the CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which CPU SDPA
    and the ring's blocks run) allocates for one call, (forward, backward), on one thread (as
    autopar's CPU ranks run): its tiles are 256, 64 or 32 query rows (from 768 or 192 rows on) by
    up to 512 keys. Forward: the scores tile, its row maximum and sum, an output tile, in fp32
    (its accumulating dtype), and the scores again in a 16-bit dtype; backward: the
    probabilities and their gradient, a row, in fp32 (and in a 16-bit dtype), and one fp32
    buffer of the queries' size. Sizes may be sympy expressions."""
    if isinstance(q_rows, sympy.Basic):
        rows: Any = sympy.Piecewise((sympy.Min(q_rows, 32), q_rows < 192), (64, q_rows < 768), (256, True))
    else:
        rows = min(q_rows, 256 if q_rows >= 768 else 64 if q_rows >= 192 else 32)
    keys = minimum(kv_rows, 512)
    tile = rows * keys
    half = itemsize * tile if itemsize < 4 else 0
    return 4 * (tile + 2 * rows + rows * dim) + half, 4 * (2 * tile + rows + q_numel) + 2 * half


@working(SDPA)
def attention_working(node: fx.Node, placed: Placed, mesh_shape: Sequence[int]) -> Any:
    """Bytes SDPA holds while it runs beyond its output, what it keeps and its inputs' gradients.
    Split by sequence as the ring: its accumulators and key/value blocks in flight
    (``ring_held_bytes``), less what the schedule holds there already (its output and
    log-sum-exp in the forward, its inputs' gradients in the backward). On the CPU, beside that,
    the flash kernel's scratch of one call (``flash_cpu_scratch``): of one block for the ring,
    of the whole sequence on 1/n of the heads for Ulysses; on a GPU, the ring's grouped-query
    keys and values repeated to the query's heads (``expanded_heads_bytes``)."""
    vals = [tensor_val(a) for a in node.args[:3]]
    q, k, v = (largest_shard_shape(t.shape, p, mesh_shape) for t, p in zip(vals, placed.ins[:3], strict=True))
    itemsize, cpu = vals[0].dtype.itemsize, tensor_val(node).device.type == "cpu"
    q_numel, kv_numel, rows = math.prod(q), math.prod(k) + math.prod(v), q[0] * q[1] * q[2]
    context = context_of(placed)
    if context is None or (context[1] == "ulysses" and _heads_divide(q[1], k[1], mesh_shape[context[0]])):
        seq = k[2] * (mesh_shape[context[0]] if context is not None else 1)   # Ulysses: the whole sequence
        return maximum(*flash_cpu_scratch(seq if context else q[2], seq, q[3], q_numel, itemsize)) if cpu else 0
    forward, backward = ring_held_bytes(q_numel, kv_numel, rows, itemsize, mesh_shape[context[0]])
    forward, backward = forward - itemsize * q_numel - 4 * rows, backward - itemsize * (q_numel + kv_numel)
    scratch = flash_cpu_scratch(q[2], k[2], q[3], q_numel, itemsize) if cpu else \
        expanded_heads_bytes(q_numel, k[1] != q[1], itemsize)
    return maximum(forward + scratch[0], backward + scratch[1])


def _axis_coordinate(mesh: DeviceMesh, axis: int, rank: int) -> int:
    """Where global ``rank`` sits along mesh ``axis``."""
    return int((mesh.mesh == rank).nonzero()[0][axis])


@kernel
def context_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                      dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                      enable_gqa: bool = False, mesh: DeviceMesh, axis: int, kind: ContextKind,
                      layout: Layout = "contiguous") -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` of q, k, v split by sequence over mesh ``axis``, laid
    out as ``layout`` (this rank's rows of the output): ``ring_attention`` or ``ulysses_attention`` over
    the axis's process group. A mask ``attention_mask`` found causal runs as ``is_causal``. Where
    point-to-point sends do not run (ranks simulated in one process) the ring, and any other
    mask, run as ``allgather_attention``: the same numbers; Ulysses on heads that a later axis
    split to fewer than its ranks runs as the ring."""
    if isinstance(attn_mask, str):   # CAUSAL
        attn_mask, is_causal = None, True
    group = mesh.get_group(axis)
    n = group.size()
    if attn_mask is None and kind == "ulysses" and _heads_divide(query.size(1), key.size(1), n):
        return ulysses_attention(query, key, value, is_causal=is_causal, group=group, scale=scale)
    if attn_mask is None and local_tensor_mode() is None:
        return ring_attention(query, key, value, is_causal=is_causal, group=group, layout=layout, scale=scale)
    seq = query.size(SEQ) * n
    if local_tensor_mode() is None:   # one rank of real processes: its own coordinate
        rows = positions(seq, n, mesh.get_coordinate()[axis], layout).to(query.device)
    else:
        rows = rank_map(lambda r: positions(seq, n, _axis_coordinate(mesh, axis, r), layout).to(query.device))
    return allgather_attention(query, key, value, attn_mask, is_causal=is_causal, group=group, rows=rows,
                               layout=layout, scale=scale, enable_gqa=enable_gqa)

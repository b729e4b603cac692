"""Context parallelism: attention with the sequence split over the ranks of a process group.

Layouts of the sequence over the ranks (``positions`` gives each rank's global position ids):
"contiguous" gives rank r chunk r of n; "balanced" cuts the sequence into 2n chunks and gives
rank r chunks r and 2n-1-r (``balance``/``unbalance`` permute a whole tensor to and from that
order), so that under a causal mask every rank does the same work. ``_block`` says which part of
another rank's key/value block a rank's queries see.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from autopar.core.errors import AutoparError

Layout = Literal["contiguous", "balanced"]
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


def balance(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` with its ``dim`` (the whole sequence) permuted into the balanced order: split evenly
    into ``n`` parts afterwards, part r holds chunks r and 2n-1-r of the 2n."""
    _chunks(x.size(dim), n, "balanced")
    parts = x.chunk(2 * n, dim)
    return torch.cat([parts[c] for c in _chunk_order(n, "balanced")], dim)


def unbalance(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The inverse of ``balance``: a balanced-order ``dim`` back in sequence order."""
    _chunks(x.size(dim), n, "balanced")
    parts = x.chunk(2 * n, dim)
    slot = {c: i for i, c in enumerate(_chunk_order(n, "balanced"))}
    return torch.cat([parts[slot[c]] for c in range(2 * n)], dim)


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

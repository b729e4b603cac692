"""Context parallelism (autopar/core/context_parallel.py): the sequence layouts over the ranks
and which part of each key/value block a rank's queries see."""
from __future__ import annotations

import itertools

import pytest
import torch

import autopar.core.context_parallel as cp
from autopar.core.errors import AutoparError

# ----------------------------------------------------------------------------
# Layouts and block masks
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_balance_gives_rank_r_chunks_r_and_mirror_and_unbalance_inverts(n):
    seq = 4 * n
    x = torch.arange(seq * 3).reshape(3, seq).T   # [seq, 3]: row i holds position i
    parts = cp.balance(x, 0, n).chunk(n, 0)
    for r, part in enumerate(parts):
        want = torch.cat([x.chunk(2 * n)[r], x.chunk(2 * n)[2 * n - 1 - r]])
        assert torch.equal(part, want)
        assert torch.equal(cp.positions(seq, n, r, "balanced"), want[:, 0])
        assert torch.equal(cp.positions(seq, n, r, "contiguous"), x.chunk(n)[r][:, 0])
    assert torch.equal(cp.unbalance(cp.balance(x, 0, n), 0, n), x)
    assert torch.equal(cp.unbalance(cp.balance(x.T, 1, n), 1, n), x.T)


def test_lengths_the_layout_cannot_cut_are_refused():
    with pytest.raises(AutoparError, match="multiple of 4"):
        cp.balance(torch.zeros(6), 0, 2)
    with pytest.raises(AutoparError, match="multiple of 3"):
        cp.positions(10, 3, 0, "contiguous")
    with pytest.raises(AutoparError, match="layout must be one of"):
        cp.positions(8, 2, 0, "striped")


def _mask_of(blk: cp._Block | None, length: int) -> torch.Tensor:
    """The [queries, keys] visibility a block plan computes."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    if blk is not None:
        rows, cols = range(length)[blk.q], range(length)[blk.kv]
        part = torch.ones(len(rows), len(cols), dtype=torch.bool)
        mask[rows.start:rows.stop, cols.start:cols.stop] = part.tril() if blk.causal else part
    return mask


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_block_plans_see_exactly_the_earlier_positions(layout, is_causal):
    for n in range(1, 6):
        seq = 4 * n
        length = seq // n
        for rank, source in itertools.product(range(n), repeat=2):
            pos_q = cp.positions(seq, n, rank, layout)
            pos_k = cp.positions(seq, n, source, layout)
            want = pos_k[None, :] <= pos_q[:, None] if is_causal else torch.ones(length, length, dtype=torch.bool)
            got = _mask_of(cp._block(is_causal, layout, rank, source, length), length)
            assert torch.equal(got, want), (n, rank, source)

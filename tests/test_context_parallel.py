"""Context-parallel attention (autopar/core/context_parallel.py) against
``scaled_dot_product_attention`` on the whole sequence: outputs and the gradients of query, key
and value, on gloo groups of 2, 3 and 4 processes; layouts, masks, merging and the two block
kernels on one process."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar.core.context_parallel as cp
from autopar.core.errors import AutoparError
from autopar.core.ops.attention import flash_cpu_scratch
from autopar.profiling.launch import run_on_gloo_mesh
from autopar.profiling.measure import cpu_peak_growth
from tests.tiers import slow, slow_except

BATCH, HEADS, DIM = 2, 4, 8
FP32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 2e-2, "rtol": 2e-2}


# ----------------------------------------------------------------------------
# One process: layouts, block masks, merging, kernels
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


def test_merging_an_all_masked_block_changes_nothing_and_makes_no_nan():
    out, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    before = out.clone(), lse.clone()
    cp._merge(out, lse, torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf")))
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])
    empty_out, empty_lse = torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf"))
    cp._merge(empty_out, empty_lse, torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf")))
    assert not empty_out.isnan().any() and torch.equal(empty_out, torch.zeros(2, 3, 4))


def test_merging_two_halves_equals_attention_on_both():
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8)
    out, lse = cp._block_forward("math", q, k[:, :, :4], v[:, :, :4], False, 8 ** -0.5)
    cp._merge(out, lse, *cp._block_forward("flash_cpu", q, k[:, :, 4:], v[:, :, 4:], False, 8 ** -0.5))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), **FP32)
    torch.testing.assert_close(lse, (q @ k.transpose(-2, -1) * 8 ** -0.5).logsumexp(-1), **FP32)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_the_math_kernel_matches_the_cpu_flash_kernel(causal, kv_heads):
    q, d_out = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    k, v = torch.randn(2, kv_heads, 8, 8), torch.randn(2, kv_heads, 8, 8)
    flash = cp._block_forward("flash_cpu", q, k, v, causal, 0.3)
    math = cp._block_forward("math", q, k, v, causal, 0.3)
    for a, b in zip(flash, math, strict=True):
        torch.testing.assert_close(a, b, **FP32)
    grads = (d_out, flash[0], flash[1])
    for a, b in zip(cp._block_backward("flash_cpu", grads, q, k, v, causal, 0.3),
                    cp._block_backward("math", grads, q, k, v, causal, 0.3), strict=True):
        torch.testing.assert_close(a, b, **FP32)


class _Solo:
    """A group of one rank, or of ``size`` where attention must refuse before communicating."""

    def __init__(self, size: int = 1) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_ring_of_one_rank_is_attention_with_its_gradients(dtype):
    q, k, v, d_out = (t.to(dtype).requires_grad_() for t in torch.randn(4, 2, 4, 8, 8))
    out = cp.ring_attention(q, k, v, is_causal=True, group=_Solo(), layout="balanced")
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for got, ref in zip((out, *grads), (want, *torch.autograd.grad(want, (q, k, v), d_out)), strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got, ref, **(BF16 if dtype == torch.bfloat16 else FP32))


def _ring_peaks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """The most ring attention's forward, then its backward, allocate at once (the profiler's
    allocations), in the default process group."""
    box = {}

    def forward() -> None:
        box["out"] = cp.ring_attention(q, k, v, is_causal=True, group=dist.group.WORLD, layout="contiguous")

    peak = cpu_peak_growth(forward)
    d_out = torch.ones_like(box["out"])
    return peak, cpu_peak_growth(lambda: box["out"].backward(d_out))


@pytest.mark.parametrize("n", [2, 4])
def test_what_the_ring_is_priced_to_hold_is_what_its_kernel_allocates(n):
    """The last rank of a causal ring of ``n`` (it computes every block), in a fake process group
    (sends complete at once; received blocks are allocated as on gloo), on one thread as autopar's
    CPU ranks: the most its forward and its backward allocate at once is ``ring_held_bytes`` and
    the flash kernel's scratch (``flash_cpu_scratch``) of one block, to the byte in fp32, within
    10% in bf16 (whose peak falls elsewhere); with grouped-query heads."""
    threads = torch.get_num_threads()
    dist.init_process_group("fake", store=FakeStore(), rank=n - 1, world_size=n)
    try:
        torch.set_num_threads(1)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(1, h, 256, 16, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
            measured = _ring_peaks(q, k, v)
            held = cp.ring_held_bytes(q.numel(), 2 * k.numel(), 4 * 256, dtype.itemsize, n)
            scratch = flash_cpu_scratch(256, 256, 16, q.numel(), dtype.itemsize)
            priced = (held[0] + scratch[0], held[1] + scratch[1])
            if dtype == torch.float32:
                assert measured == priced
            else:
                assert measured == (pytest.approx(priced[0], rel=0.1), pytest.approx(priced[1], rel=0.1))
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


def test_shapes_attention_cannot_split_are_refused():
    x, odd = torch.zeros(2, 4, 8, 8), torch.zeros(2, 4, 7, 8)
    with pytest.raises(AutoparError, match="local length 7 is odd"):
        cp.ring_attention(odd, odd, odd, is_causal=True, group=_Solo(2), layout="balanced")
    with pytest.raises(AutoparError, match="multiple of key/value heads"):
        cp.ring_attention(x, x[:, :3], x[:, :3], is_causal=False, group=_Solo(2), layout="contiguous")
    with pytest.raises(AutoparError, match="one sequence"):
        cp.ring_attention(x, odd, odd, is_causal=True, group=_Solo(2), layout="contiguous")
    with pytest.raises(AutoparError, match="4 query and 2 key/value heads"):
        cp.ulysses_attention(x, x[:, :2], x[:, :2], is_causal=True, group=_Solo(4))


# ----------------------------------------------------------------------------
# gloo groups against attention on the whole sequence
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    kernel: str            # "ring" or "ulysses"
    is_causal: bool
    layout: str = "contiguous"
    kv_heads: int = HEADS
    dtype: torch.dtype = torch.float32
    block: str = "auto"    # "math": the ring forced onto the matmul block kernel
    scale: float | None = None


CASES = {
    "full": Case("ring", False),
    "causal": Case("ring", True),
    "balanced": Case("ring", True, "balanced"),
    "balanced-full": Case("ring", False, "balanced"),
    "gqa": Case("ring", True, "contiguous", kv_heads=2),
    "gqa-balanced": Case("ring", True, "balanced", kv_heads=1),
    "math-block": Case("ring", True, "balanced", kv_heads=2, block="math"),
    "bf16": Case("ring", True, "balanced", dtype=torch.bfloat16),
    "scaled": Case("ring", True, "balanced", kv_heads=2, scale=0.3),
    "ulysses": Case("ulysses", False),
    "ulysses-causal": Case("ulysses", True),
    "ulysses-gqa": Case("ulysses", True, kv_heads=2, scale=0.3),
}


def _local(x: torch.Tensor, case: Case, n: int, rank: int) -> torch.Tensor:
    whole = cp.balance(x, 2, n) if case.layout == "balanced" else x
    return whole.chunk(n, 2)[rank].clone()


def _run_case(group, case: Case, tensors: tuple[torch.Tensor, ...],
              device: str = "cpu") -> tuple[torch.Tensor, ...] | str:
    """This rank's output and its part of the gradients of query, key, value (or the error),
    computed on ``device`` and returned on the CPU."""
    n, rank = group.size(), group.rank()
    q, k, v, d_out = (_local(t.to(case.dtype), case, n, rank).to(device) for t in tensors)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    try:
        if case.kernel == "ring":
            out = cp.ring_attention(q, k, v, is_causal=case.is_causal, group=group, layout=case.layout,
                                   scale=case.scale)
        else:
            out = cp.ulysses_attention(q, k, v, is_causal=case.is_causal, group=group, scale=case.scale)
    except AutoparError as e:
        return str(e)
    out.backward(d_out)
    return tuple(t.cpu() for t in (out.detach(), q.grad, k.grad, v.grad))


def _all_cases(mesh, cases: dict[str, Case], inputs: dict[str, tuple[torch.Tensor, ...]],
               device: str = "cpu") -> dict:
    group = mesh.get_group()
    results = {}
    for name, case in cases.items():
        if case.block == "math":   # this process only: the ring on the kernel other devices use
            cp._kernel_for = lambda query: "math"
        results[name] = _run_case(group, case, inputs[name], device)
        cp._kernel_for = _KERNEL_FOR
    return results


_KERNEL_FOR = cp._kernel_for


def _inputs(case: Case, seq: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, d_out = (torch.randn(BATCH, HEADS, seq, DIM, generator=gen) for _ in range(2))
    k, v = (torch.randn(BATCH, case.kv_heads, seq, DIM, generator=gen) for _ in range(2))
    return q, k, v, d_out


def _reference(case: Case, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Output and gradients of query, key, value of attention on the whole sequence, in fp32."""
    q, k, v, d_out = (t.to(case.dtype).float().clone() for t in tensors)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=case.is_causal, scale=case.scale,
                                         enable_gqa=case.kv_heads != HEADS)
    out.backward(d_out)
    return out.detach(), q.grad, k.grad, v.grad


def _whole(parts: list[torch.Tensor], case: Case, n: int) -> torch.Tensor:
    whole = torch.cat(parts, 2).float()
    return cp.unbalance(whole, 2, n) if case.layout == "balanced" else whole


def _check(name: str, case: Case, results: list, tensors: tuple[torch.Tensor, ...], n: int) -> None:
    """Every rank's results of one case, put together, against the whole sequence's attention."""
    if case.kernel == "ulysses" and (HEADS % n or case.kv_heads % n):
        assert all("splits heads over the" in r for r in results), (name, results[0])
        return
    # SDPA itself, run in bf16 on these inputs, is up to 2e-2 off the fp32 values too
    tolerance = BF16 if case.dtype == torch.bfloat16 else FP32
    for what, got, want in zip(("out", "dq", "dk", "dv"), zip(*results, strict=True),
                               _reference(case, tensors), strict=True):
        assert got[0].dtype == case.dtype, (name, what)
        torch.testing.assert_close(_whole(list(got), case, n), want, **tolerance,
                                   msg=lambda m, label=f"{name}, {what}": f"{label}: {m}")


@pytest.mark.parametrize("n", slow_except([2, 3, 4], 2))
def test_context_parallel_attention_matches_attention_on_the_whole_sequence(n):
    seq = 8 * n   # two chunks per rank for the balanced layout, four rows each
    inputs = {name: _inputs(case, seq, seed) for seed, (name, case) in enumerate(CASES.items())}
    per_rank = run_on_gloo_mesh(_all_cases, (n,), CASES, inputs, timeout_s=120, start_method="forkserver")
    for name, case in CASES.items():
        _check(name, case, [r[name] for r in per_rank], inputs[name], n)


def _on_axis(mesh, cases: dict[str, Case], inputs: dict[str, tuple[torch.Tensor, ...]]) -> dict:
    group = mesh.get_group("cp")
    return {name: _run_case(group, case, inputs[name]) for name, case in cases.items()}


@slow
def test_on_a_mesh_axis_the_ring_stays_within_its_group():
    # mesh [[0, 1], [2, 3]]: ranks 2 and 3 are ranks 0 and 1 of their "cp" group
    cases = {name: CASES[name] for name in ("balanced", "ulysses-causal")}
    inputs = {name: _inputs(case, 16, seed) for seed, (name, case) in enumerate(cases.items())}
    per_rank = run_on_gloo_mesh(_on_axis, (2, 2), cases, inputs, axis_names=("dp", "cp"), timeout_s=120,
                                start_method="forkserver")
    for row in (per_rank[:2], per_rank[2:]):
        for name, case in cases.items():
            _check(name, case, [r[name] for r in row], inputs[name], 2)

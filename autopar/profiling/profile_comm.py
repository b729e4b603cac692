"""Measure this machine's collectives and runtime overheads: the ``collectives`` and ``overheads``
of a :class:`cost_models.profile.Profile`.

Everything is timed through the same code the generated module runs (``codegen.runtime``), on
the processes that will run it (ranks share the host's cores), so the runtime's Python overhead
is part of every number: a collective's Python cost lands in its fitted latency.

* :func:`fit_link`: pure least-squares fit of (nbytes, seconds) samples to ``collective_time``.
* :func:`time_collectives`, :func:`time_overheads`: run on every rank of a live mesh, in lockstep.
* :func:`profile_mesh`: both, on a local gloo mesh of the given shape.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.core.placements import largest_shard_shape
from autopar.profiling.launch import run_on_gloo_mesh
from codegen.runtime import move, param_shard, redistribute, sync_grad_to
from cost_models.comm import Link, collective_time
from cost_models.profile import FRESH_BUFFER_BYTES, MEASURED_KINDS, OVERHEADS, collective_key, group_sizes

__all__ = ["DEFAULT_SIZES", "fit_link", "measure_mesh", "print_progress", "profile_mesh", "time_collectives",
           "time_overheads", "time_overlap"]

#: 4 KiB .. 16 MiB, 6 log-spaced sizes: latency-bound at the small end, bandwidth-bound at the
#: large end. About 7 s for a (4,) mesh on 2 idle cores (all-to-all, gathered on gloo, is most).
DEFAULT_SIZES: tuple[int, ...] = tuple(round(4096 * 4096 ** (i / 5)) for i in range(6))
DEFAULT_REPEATS = 5

#: How the runtime performs each collective: (placement before, placement after) on the timed axis.
REDISTRIBUTIONS: dict[str, tuple[Placement, Placement]] = {
    "all_reduce": (Partial(), Replicate()),
    "all_gather": (Shard(0), Replicate()),
    "reduce_scatter": (Partial(), Shard(0)),
    "all_to_all": (Shard(0), Shard(1)),  # gloo has no all-to-all: DTensor all-gathers and chunks
}

Progress = Callable[[str], None]
_ELEMENT = torch.float32
_ELEMENT_BYTES = torch.finfo(_ELEMENT).bits // 8


# --------------------------------------------------------------------------- fitting


def fit_link(kind: str, n: int, samples: Sequence[tuple[float, float]]) -> Link:
    """The ``Link`` whose ``collective_time(kind, nbytes, n, link)`` best matches ``samples`` of
    (nbytes, seconds).

    Robust to noise: repeated samples of one size are reduced to their median, and the fit
    minimises *relative* squared error, so the small (latency-bound) sizes set the latency and the
    large ones the bandwidth instead of the largest times drowning out the rest. Constrained to
    what a link can be: a negative fitted latency is refitted as 0; a non-positive slope (no
    growth with size above the noise) takes the slowest bandwidth the samples allow (transfer can
    take no longer than the whole measured time), and the latency is refitted under it.

    Raises ValueError for ``n < 2`` (nothing is communicated), fewer than two distinct sizes
    (latency and bandwidth cannot be told apart), or a sample that is not two positive finite
    numbers.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"fit_link needs a group of n >= 2 devices (n == 1 communicates nothing), got {n!r}")
    c_lat, c_bw = _coefficients(kind, n)
    sizes, times = _medians_by_size(samples)
    if len(sizes) < 2:
        raise ValueError(f"fit_link needs samples of at least two distinct sizes, got sizes {sizes}")
    lat_col = [c_lat / t for t in times]            # d(relative time)/d(latency)
    bw_col = [c_bw * s / t for s, t in zip(sizes, times, strict=True)]  # d(relative time)/d(1/bandwidth)
    latency, inv_bw = _lstsq2(lat_col, bw_col, [1.0] * len(times))
    if inv_bw <= 0:
        inv_bw = min(t / (c_bw * s) for s, t in zip(sizes, times, strict=True))
        latency = _lstsq1(lat_col, [1 - b * inv_bw for b in bw_col])
    elif latency < 0:
        latency, inv_bw = 0.0, _lstsq1(bw_col, [1.0] * len(bw_col))
    return Link(bandwidth=1 / inv_bw, latency=max(latency, 0.0))


def _coefficients(kind: str, n: int) -> tuple[float, float]:
    """``collective_time`` is ``c_lat * latency + c_bw * nbytes / bandwidth``: read both
    coefficients off the model itself, so the fit follows it if it changes."""
    c_bw = collective_time(kind, 1.0, n, Link(bandwidth=1.0, latency=0.0))
    c_lat = collective_time(kind, 1.0, n, Link(bandwidth=1.0, latency=1.0)) - c_bw
    return c_lat, c_bw


def _medians_by_size(samples: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    by_size: dict[float, list[float]] = defaultdict(list)
    for sample in samples:
        nbytes, seconds = (float(v) for v in sample)
        if not (math.isfinite(nbytes) and math.isfinite(seconds) and nbytes > 0 and seconds > 0):
            raise ValueError(f"samples must be (nbytes, seconds) pairs of positive finite numbers, got {sample!r}")
        by_size[nbytes].append(seconds)
    sizes = sorted(by_size)
    return sizes, [statistics.median(by_size[s]) for s in sizes]


def _lstsq1(col: list[float], target: list[float]) -> float:
    """argmin_x sum((x * col - target)^2)."""
    return sum(c * y for c, y in zip(col, target, strict=True)) / sum(c * c for c in col)


def _lstsq2(col_a: Sequence[float], col_b: Sequence[float], target: Sequence[float]) -> tuple[float, float]:
    """argmin_(a, b) sum((a * col_a + b * col_b - target)^2), by the 2x2 normal equations."""
    saa = sum(a * a for a in col_a)
    sbb = sum(b * b for b in col_b)
    sab = sum(a * b for a, b in zip(col_a, col_b, strict=True))
    sat = sum(a * t for a, t in zip(col_a, target, strict=True))
    sbt = sum(b * t for b, t in zip(col_b, target, strict=True))
    det = saa * sbb - sab * sab
    return (sbb * sat - sab * sbt) / det, (saa * sbt - sab * sat) / det


# --------------------------------------------------------------------------- collectives


def time_collectives(device_mesh: DeviceMesh, *, sizes: Sequence[int] = DEFAULT_SIZES,
                     repeats: int = DEFAULT_REPEATS, progress: Progress | None = None,
                     kinds: Sequence[str] = MEASURED_KINDS) -> dict[str, Link]:
    """Fit a ``Link`` per collective kind (of ``kinds``) and group size of ``device_mesh``; every
    rank calls this in lockstep and gets the same result.

    The four redistributions of ``REDISTRIBUTIONS`` go through ``codegen.runtime.redistribute`` on
    an fp32 DTensor sized so that ``nbytes`` means what ``collective_time`` says for the kind;
    ``all_to_all_single`` is the functional call kernels make (``_all_to_all_single``);
    ``send_recv`` is a ``torch.distributed`` ping-pong between the first two ranks of the axis
    group (half a round trip: no clocks to compare). Every timing follows a barrier; the step
    waits for the slowest rank, so each size keeps the largest per-rank median over ``repeats``.
    All groups of an axis communicate at once, as they do in training. Axes of one size are
    measured once (``collective_key`` knows only the size); axes of size 1 communicate nothing.
    On a mesh of several axes, ``JOB_KINDS`` also on a group of every rank (``group_sizes``).
    Returns ``{collective_key(kind, n): Link}``.
    """
    links: dict[str, Link] = {}
    axes = _axes_by_size(device_mesh)
    groups = [(device_mesh, axis, n, kinds) for axis, n in axes]
    job = device_mesh.size()
    whole = [k for k in kinds if job in group_sizes(k, device_mesh.shape) - {n for _, n in axes}]
    if whole and job == dist.get_world_size():   # the gradient buckets' sum over every rank
        groups.append((DeviceMesh.from_group(dist.group.WORLD, device_mesh.device_type), 0, job, whole))
    for mesh, axis, n, group_kinds in groups:
        for kind in group_kinds:
            start = time.perf_counter()
            samples = _sweep(mesh, axis, kind, sizes, repeats)
            link = links[collective_key(kind, n)] = fit_link(kind, n, samples)
            if progress is not None:
                progress(f"{collective_key(kind, n)}: latency {link.latency * 1e6:.1f} us, "
                         f"bandwidth {link.bandwidth / 1e9:.3f} GB/s ({time.perf_counter() - start:.1f} s)")
    return links


def _axes_by_size(mesh: DeviceMesh) -> list[tuple[int, int]]:
    """(axis, size) of the first axis of each size > 1."""
    first: dict[int, int] = {}
    for axis, n in enumerate(mesh.shape):
        if n > 1:
            first.setdefault(n, axis)
    return [(axis, n) for n, axis in first.items()]


def _sweep(mesh: DeviceMesh, axis: int, kind: str, sizes: Sequence[int],
           repeats: int) -> list[tuple[float, float]]:
    """(nbytes, seconds of the slowest rank) per size."""
    nbytes, medians = [], []
    for size in sizes:
        if kind == "send_recv":
            actual, run, calls = _ping_pong(mesh, axis, size)
        elif kind == "all_to_all_single":
            actual, run, calls = _all_to_all_single(mesh, axis, size)
        else:
            actual, run, calls = _redistribution(mesh, axis, kind, size)
        nbytes.append(actual)
        medians.append(_mean_seconds([run], repeats, before=dist.barrier)[0] / calls)
    return list(zip(nbytes, _slowest(medians), strict=True))


def _redistribution(mesh: DeviceMesh, axis: int, kind: str,
                    nbytes: int) -> tuple[int, Callable[[], Any], int]:
    """(exact nbytes, one runtime redistribute of ``kind`` along ``axis``, collectives per run).

    The global tensor is (n, cols), cols a multiple of n, so every split is even. ``nbytes`` is
    its size, except for all-to-all where it is one rank's buffer (its shard: 1/n of it)."""
    n = mesh.shape[axis]
    per_buffer = n if kind == "all_to_all" else 1
    cols = n * max(1, round(nbytes * per_buffer / (_ELEMENT_BYTES * n * n)))
    shape = torch.Size((n, cols))
    before, after = (_on_axis(mesh.ndim, axis, p) for p in REDISTRIBUTIONS[kind])
    local = torch.randn(largest_shard_shape(shape, before, mesh.shape), dtype=_ELEMENT)
    x = DTensor.from_local(local, mesh, before, run_check=False, shape=shape, stride=(cols, 1))
    x.requires_grad_()  # as activations do: the autograd bookkeeping is part of the cost
    return n * cols * _ELEMENT_BYTES // per_buffer, lambda: redistribute(x, after), 1


def _all_to_all_single(mesh: DeviceMesh, axis: int, nbytes: int) -> tuple[int, Callable[[], Any], int]:
    """(exact nbytes: one rank's buffer, an all-to-all of it over the axis group as the expert and
    Ulysses kernels run it, 1): ``funcol.all_to_all_single`` with split sizes, waited on, of a
    tensor that requires grad (gloo runs it as its own all-to-all, not DTensor's gather)."""
    group, n = mesh.get_group(axis), mesh.shape[axis]
    rows = n * max(1, round(nbytes / (_ELEMENT_BYTES * n)))
    x = torch.randn(rows, 1, dtype=_ELEMENT, requires_grad=True)
    splits = [rows // n] * n
    return rows * _ELEMENT_BYTES, lambda: funcol.wait_tensor(funcol.all_to_all_single(x, splits, splits, group)), 1


def _ping_pong(mesh: DeviceMesh, axis: int, nbytes: int) -> tuple[int, Callable[[], Any], int]:
    """(exact nbytes, a message there and back between the axis group's first two ranks, 2)."""
    group, me = mesh.get_group(axis), mesh.get_local_rank(axis)
    buf = torch.empty(max(1, round(nbytes / _ELEMENT_BYTES)), dtype=_ELEMENT)

    def run() -> None:
        if me == 0:
            dist.send(buf, group=group, group_dst=1)
            dist.recv(buf, group=group, group_src=1)
        elif me == 1:
            dist.recv(buf, group=group, group_src=0)
            dist.send(buf, group=group, group_dst=0)

    return buf.numel() * _ELEMENT_BYTES, run, 2


def _on_axis(ndim: int, axis: int, placement: Placement) -> list[Placement]:
    return [placement if a == axis else Replicate() for a in range(ndim)]


def _mean_seconds(runs: Sequence[Callable[[], Any]], repeats: int,
                  before: Callable[[], Any] = lambda: None) -> list[float]:
    """Wall time of each of ``runs``, after one untimed warm-up call each: the median over
    ``BLOCKS`` blocks of the mean of ``repeats / BLOCKS`` timed calls. The runs take turns, so a
    burst of load from elsewhere on the host hits all of them alike. Means within a block, because
    when ranks outnumber cores a run is sometimes descheduled and training pays that too; the
    median across blocks, so a burst from elsewhere does not."""
    times: list[list[float]] = [[] for _ in runs]
    for run in runs:
        run()
    for _ in range(repeats):
        for run, seconds in zip(runs, times, strict=True):
            before()
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
    per_block = max(1, repeats // BLOCKS)
    return [statistics.median(statistics.mean(seconds[b:b + per_block]) for b in range(0, len(seconds), per_block))
            for seconds in times]


def _slowest(values: Sequence[float]) -> list[float]:
    """Element-wise maximum over all ranks (a collective: every rank calls it)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# --------------------------------------------------------------------------- runtime overheads

#: Calls per timed run: a run lasts a few hundred microseconds, well under a scheduler time slice,
#: so its median is the code's own cost, not whether the other ranks sharing the cores preempted
#: it (longer runs made ``local_op`` jump 4x between runs on a loaded host). Even, so that a
#: chain of transposing views ends in its start shape.
OVERHEAD_CALLS = 2
BLOCKS = 5
OVERHEAD_REPEATS = 51
PARAM_COUNTS = (1, 2)
_TINY = torch.Size((2, 4))


def time_overheads(device_mesh: DeviceMesh, *, repeats: int = OVERHEAD_REPEATS) -> dict[str, float]:
    """Seconds the runtime adds per occurrence (forward + backward) for each key of
    ``cost_models.profile.OVERHEADS``; every rank calls this in lockstep and gets the slowest
    rank's numbers. All tensors are tiny (2 x 4 fp32) and replicated, so no collective runs and
    only fixed costs are left. Each time is a median over ``repeats``; the runs compared take turns.

    * ``move``: a chain of ``OVERHEAD_CALLS`` ``aten.neg`` calls each followed by a
      ``codegen.runtime.move`` that keeps the placement, then backward, minus the same chain
      without moves, per move. The cost model adds it to every placement change (its collectives
      are priced apart: they were timed through the same ``redistribute``).
    * ``param_read``: the same chain adding a parameter read through ``codegen.runtime.param_shard``
      at each step, minus adding its plain local tensor: added per op input that is a parameter.
    * ``grad_hook``: backward into ``OVERHEAD_CALLS`` DTensor parameters (through ``to_local``)
      with ``codegen.runtime.sync_grad_to`` hooks whose gradient already has the parameter's
      placement, minus the same without hooks, per parameter: added once per parameter, on top
      of the collective a hook may run.
    * ``optimizer_per_param``, ``optimizer_per_plain_param``: slope of ``torch.optim.AdamW.step()``
      time over ``PARAM_COUNTS`` DTensor (plain) parameters: added once per parameter tensor
      stored split (replicated), on top of the time its bytes take.
    * ``step``: intercept at 0 parameters of a whole step (``zero_grad(set_to_none=True)``, a
      forward summing each parameter's ``to_local()`` into a replicated scalar DTensor loss,
      ``loss.backward()``, ``AdamW.step()``) over ``PARAM_COUNTS`` parameters: added once per
      training step.
    * ``pipeline_microbatch``, ``pipeline_step``: slope and intercept of a ``Schedule1F1B`` step
      of tiny stages (one multiply each) over the first mesh axis of more than one rank, against
      its critical path of ``m + ranks - 1`` forward-backward pairs, for microbatch counts ``m``
      of ``PIPELINE_MICROBATCHES`` a stage, less the same microbatches' forwards and backwards without the pipeline: each
      stage's forward and backward of a microbatch pays the slope; a pipelined step the
      intercept (0 where no axis has two ranks). The intercept may be below zero: where ranks
      outnumber cores, a rank idle in the bubble leaves its core to the others, and the step
      takes less than its critical path (``pipeline_step``, alone, is kept as fitted).

    * ``relayout_per_mib``, ``fresh_per_mib``: ``_local_copy_rates``.

    Noise can push a difference below zero; it is reported as 0.
    """
    step, per_param, per_plain_param = _optimizer_overheads(device_mesh, repeats)
    per_microbatch, pipelined = _pipeline_overheads(device_mesh, repeats)
    per_move, per_param_read = _move_and_read_overheads(device_mesh, repeats)
    mine = {
        "move": per_move,
        "param_read": per_param_read,
        "grad_hook": _grad_hook_overhead(device_mesh, repeats),
        "optimizer_per_param": per_param,
        "optimizer_per_plain_param": per_plain_param,
        "step": step,
        "pipeline_microbatch": per_microbatch,
        "pipeline_step": pipelined,
        **_local_copy_rates(),
    }
    return dict(zip(OVERHEADS, _slowest([mine[key] if key == "pipeline_step" else max(0.0, mine[key])
                                         for key in OVERHEADS]), strict=True))


def _move_and_read_overheads(device_mesh: DeviceMesh, repeats: int) -> tuple[float, float]:
    """Seconds per ``move`` that keeps a placement, and per parameter read through ``param_shard``
    over adding its plain local tensor (``time_overheads``' ``move`` and ``param_read``)."""
    rep = _replicated(device_mesh)
    x = torch.ones(_TINY, requires_grad=True)
    param = _tiny(device_mesh)
    plain_param = param.to_local().detach().clone().requires_grad_()
    neg = torch.ops.aten.neg.default
    moved, bare, read, plain_read = _mean_seconds([
        _chain(lambda y: move(neg(y), device_mesh, rep, rep, rep, _TINY), x),
        _chain(neg, x),
        _chain(lambda y: neg(y) + param_shard(param, rep, rep), x),
        _chain(lambda y: neg(y) + plain_param, x),
    ], repeats)
    return (moved - bare) / OVERHEAD_CALLS, (read - plain_read) / OVERHEAD_CALLS


#: Sizes of the copies ``_local_copy_rates`` times: one the allocator reuses, one it maps afresh.
_REUSED_BYTES = 8 * 2**20
_FRESH_BYTES = 8 * FRESH_BUFFER_BYTES
_COPY_REPEATS = 5


def _local_copy_rates() -> dict[str, float]:
    """Seconds per MiB of a placement change's relayout: concatenating two halves along the last
    dim into a new tensor, as DTensor does after gathering along a dim other than the first,
    every rank at once. ``relayout_per_mib`` from a buffer the allocator reuses
    (``_REUSED_BYTES``); ``fresh_per_mib`` the extra per MiB above ``FRESH_BUFFER_BYTES`` of a
    buffer it maps afresh (``_FRESH_BYTES``), its page faults. A freed buffer of twice the reused
    size first raises glibc's threshold above it, as a training step's buffers do (a fresh
    process maps every buffer over 128 KiB afresh: 4-6x the rate on 4 processes)."""
    torch.empty(2 * _REUSED_BYTES, dtype=torch.uint8)   # freed at once
    reused, fresh = (_mean_seconds([_concatenation(n)], _COPY_REPEATS, before=dist.barrier)[0]
                     for n in (_REUSED_BYTES, _FRESH_BYTES))
    mib = 2**20
    relayout = reused / (_REUSED_BYTES / mib)
    return {"relayout_per_mib": relayout,
            "fresh_per_mib": (fresh - relayout * _FRESH_BYTES / mib) / ((_FRESH_BYTES - FRESH_BUFFER_BYTES) / mib)}


def _concatenation(nbytes: int) -> Callable[[], None]:
    """A concatenation of two halves along the last dim into a new tensor of ``nbytes``."""
    rows = 1024
    halves = [torch.ones(rows, nbytes // (2 * rows * _ELEMENT_BYTES), dtype=_ELEMENT) for _ in range(2)]
    return lambda: torch.cat(halves, dim=1)


def _replicated(mesh: DeviceMesh) -> list[Placement]:
    return [Replicate()] * mesh.ndim


def _tiny(mesh: DeviceMesh, grad: bool = True) -> DTensor:
    """A tiny replicated DTensor leaf, by default one that requires grad (a parameter)."""
    return DTensor.from_local(torch.ones(_TINY), mesh, _replicated(mesh), run_check=False).requires_grad_(grad)


def _chain(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    """``OVERHEAD_CALLS`` calls of ``step`` from ``x``, then backward through all of them; the
    gradients are reset each run, as a training step does."""
    grad = torch.ones_like(x)

    def run() -> None:
        x.grad = None
        y = x
        for _ in range(OVERHEAD_CALLS):
            y = step(y)
        y.backward(grad)

    return run


def _grad_hook_overhead(mesh: DeviceMesh, repeats: int) -> float:
    hooked, bare = [_tiny(mesh) for _ in range(OVERHEAD_CALLS)], [_tiny(mesh) for _ in range(OVERHEAD_CALLS)]
    for p in hooked:
        sync_grad_to(p)
    with_hooks, without = _mean_seconds([_backward_into(hooked), _backward_into(bare)], repeats)
    return (with_hooks - without) / OVERHEAD_CALLS


def _backward_into(params: list[DTensor]) -> Callable[[], None]:
    grads = [torch.ones(_TINY)] * len(params)

    def run() -> None:
        for p in params:
            p.grad = None
        torch.autograd.backward([p.to_local() for p in params], grads)

    return run


def _optimizer_overheads(mesh: DeviceMesh, repeats: int) -> tuple[float, float, float]:
    """(fixed seconds of a training step, seconds of ``AdamW.step`` per DTensor parameter, per
    plain parameter)."""
    steps, updates, plain_updates = [], [], []
    for k in PARAM_COUNTS:
        params = [_tiny(mesh) for _ in range(k)]
        opt = torch.optim.AdamW(params)
        steps.append(_train_step(mesh, params, opt))
        updates.append(opt.step)  # on the gradients the steps leave
        plain = [p.to_local().detach().clone().requires_grad_() for p in params]
        for p in plain:
            p.grad = torch.ones_like(p)
        plain_updates.append(torch.optim.AdamW(plain).step)
    medians = _mean_seconds(steps + updates + plain_updates, repeats)
    n = len(PARAM_COUNTS)
    ones = [1.0] * n
    step, _ = _lstsq2(ones, PARAM_COUNTS, medians[:n])      # (intercept, slope)
    _, per_param = _lstsq2(ones, PARAM_COUNTS, medians[n:2 * n])
    _, per_plain_param = _lstsq2(ones, PARAM_COUNTS, medians[2 * n:])
    return step, per_param, per_plain_param


def _train_step(mesh: DeviceMesh, params: list[DTensor], opt: torch.optim.Optimizer) -> Callable[[], None]:
    def run() -> None:
        opt.zero_grad(set_to_none=True)
        local_loss = sum(p.to_local().sum() for p in params)
        DTensor.from_local(local_loss, mesh, _replicated(mesh), run_check=False).backward()
        opt.step()

    return run


#: Microbatches per stage of the pipelined steps ``_pipeline_overheads`` fits its line over (1F1B
#: needs at least one a stage).
PIPELINE_MICROBATCHES = (1, 2, 4)


def _pipeline_overheads(mesh: DeviceMesh, repeats: int) -> tuple[float, float]:
    """(seconds per microbatch on a stage, fixed seconds per step) of ``Schedule1F1B`` over the
    first axis of ``mesh`` with more than one rank (see ``time_overheads``)."""
    axis = next((a for a, n in enumerate(mesh.shape) if n > 1), None)
    if axis is None:
        return 0.0, 0.0
    ranks = mesh.shape[axis]
    counts = [k * ranks for k in PIPELINE_MICROBATCHES]
    steps, bare = zip(*(_pipelined_step(mesh.get_group(axis), mesh.get_local_rank(axis), ranks, m) for m in counts), strict=True)
    times = _mean_seconds(steps + bare, repeats)
    n = len(counts)
    beyond = [piped - alone for piped, alone in zip(times[:n], times[n:], strict=True)]
    fixed, per_microbatch = _lstsq2([1.0] * n, [m + ranks - 1 for m in counts], beyond)
    return per_microbatch, fixed


class _Multiply(nn.Module):
    """A tiny pipeline stage: its input times a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(_TINY))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _pipelined_step(group: Any, stage: int, ranks: int, microbatches: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(a ``Schedule1F1B`` step of ``microbatches`` through ``_Multiply`` stages, one per rank of
    ``group``, this rank's ``stage``; the same microbatches through this rank's stage alone)."""
    module = _Multiply()
    meta = torch.empty(_TINY)
    piped = PipelineStage(module, stage, ranks, torch.device("cpu"), input_args=(meta.requires_grad_(stage > 0),),
                          output_args=(torch.empty(_TINY, requires_grad=True),), group=group)
    schedule = Schedule1F1B(piped, microbatches, loss_fn=lambda out, target: out.sum(), scale_grads=False)
    batch = torch.ones(microbatches * _TINY[0], _TINY[1])
    inputs = [torch.ones(_TINY, requires_grad=stage > 0) for _ in range(microbatches)]
    last = stage == ranks - 1

    def run() -> None:
        module.weight.grad = None
        schedule.step(*((batch,) if stage == 0 else ()), target=batch if last else None,
                      losses=[] if last else None, return_outputs=False)

    def alone() -> None:
        module.weight.grad = None
        for x in inputs:
            module(x).sum().backward()

    return run, alone


# --------------------------------------------------------------------------- a whole mesh


def print_progress(line: str) -> None:
    """A ``progress`` callback for :func:`profile_mesh`: one line to stderr."""
    print(f"autopar profile: {line}", file=sys.stderr, flush=True)


def profile_mesh(shape: tuple[int, ...], *, axis_names: tuple[str, ...] | None = None,
                 progress: Progress | None = None, sizes: Sequence[int] = DEFAULT_SIZES,
                 repeats: int = DEFAULT_REPEATS) -> tuple[dict[str, Link], dict[str, float]]:
    """(collectives, overheads) of a local gloo mesh of ``shape``: one process per device, each
    with one thread, as ``run_on_gloo_mesh`` runs the generated code.

    ``progress`` is called on rank 0 with a line per measurement; it runs in that rank's process,
    so it must be picklable (a module-level function such as :func:`print_progress`)."""
    results = run_on_gloo_mesh(measure_mesh, tuple(shape), tuple(sizes), repeats, progress,
                               axis_names=axis_names, start_method="forkserver")
    return results[0]


def time_overlap(mesh: DeviceMesh, *, compute_s: float = 0.03, rounds: int = 5) -> float:
    """How much of an asynchronous all-reduce really runs under compute, as a share of the shorter
    of the two: ``(compute + comm - both) / min(compute, comm)``, clamped to [0, 1], the lowest
    over ranks, on the first mesh axis with more than one rank. Gradient sync is launched asynchronously and hidden by the backward; on CPU ranks
    without spare cores the collective needs the same cores, and little is hidden."""
    a = torch.randn(256, 256)
    reps = max(1, int(compute_s / max(_seconds(lambda: a @ a), 1e-6)))
    buffer = torch.randn(2**20)   # 4 MiB: a layer's gradients
    group = mesh.get_group(next(a for a, n in enumerate(mesh.shape) if n > 1))

    def compute() -> None:
        for _ in range(reps):
            a @ a

    def comm() -> Any:
        return dist.all_reduce(buffer, group=group, async_op=True)

    def both() -> None:
        work = comm()
        compute()
        work.wait()

    alone_c, alone_m, overlapped = (
        statistics.median(_timed_after_barrier(fn) for _ in range(rounds))
        for fn in (compute, lambda: comm().wait(), both))
    share = (alone_c + alone_m - overlapped) / max(min(alone_c, alone_m), 1e-9)
    mine = min(1.0, max(0.0, share))
    everyone: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return min(everyone)


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _timed_after_barrier(fn: Callable[[], Any]) -> float:
    dist.barrier()
    return _seconds(fn)


def measure_mesh(mesh: DeviceMesh, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS,
                 progress: Progress | None = None, overheads: bool = True,
                 kinds: Sequence[str] = MEASURED_KINDS) -> tuple[dict[str, Link], dict[str, float]]:
    """(collectives of ``kinds``, overheads), run by every rank of a live mesh in lockstep;
    ``progress`` is called on rank 0 only. ``overheads=False`` times the collectives alone
    (overheads ``{}``)."""
    say = progress if dist.get_rank() == 0 else None
    links = time_collectives(mesh, sizes=sizes, repeats=repeats, progress=say, kinds=kinds)
    if not overheads:
        return links, {}
    start = time.perf_counter()
    measured = time_overheads(mesh)
    if say is not None:
        shown = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in measured.items())
        say(f"overheads: {shown} ({time.perf_counter() - start:.1f} s)")
    return links, measured

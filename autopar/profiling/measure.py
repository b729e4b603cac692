"""What one training step really costs on this rank, in the cost model's terms.

The planner predicts, per device, the time of one step (forward, backward, optimizer) and the peak
of tensor bytes live during it (parameters, gradients, optimizer states, activations).
:func:`measure_training` measures exactly those two figures, so predictions can be checked
(``benchmarks/cost_accuracy.py``).

Time: the median over timed steps run without any profiler, each after a barrier (so a rank does
not time its peers' lateness from the previous step) and, on CUDA, a synchronize.

Peak memory: one more, separate step. CUDA's caching allocator keeps a peak counter
(``max_memory_allocated``). PyTorch's CPU allocator has none, but with ``profile_memory=True`` the
profiler records every allocation and free made through it (``[memory]`` events: signed byte
counts in time order). Their running sum is the net growth since the step began; its maximum plus
the bytes live at the start (every storage held by the parameters, gradients, optimizer states,
buffers and the batch; a DTensor's local shard) is the step's peak. Frees of blocks allocated
before profiling started are not reported, so the CPU figure can only err high, never low.
"""
from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autopar.core.errors import AutoparError

__all__ = ["StepMeasurement", "measure_training", "time_training", "time_in_turns", "ratio_in_rounds",
           "slowest_rank_steps", "training_step", "loss_of", "live_bytes", "cpu_peak_growth", "peak_step_bytes"]

Batch = tuple[tuple, dict]
K = TypeVar("K")


@dataclass
class StepMeasurement:
    """One rank's measured step: seconds (median and each timed step) and tensor bytes."""

    step_s: float            # median seconds per step over the timed steps
    step_s_all: list[float]  # seconds of each timed step
    peak_bytes: int          # peak tensor bytes live on this rank during a full step: the median of ``peak_bytes_all``
    baseline_bytes: int      # tensor bytes live at the start of that step
    peak_bytes_all: list[int] = field(default_factory=list)   # the peak of each step measured


def loss_of(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output: a tensor, a ModelOutput's ``.loss``, or a tuple's first item."""
    loss = output
    if not hasattr(loss, "backward"):
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, (tuple, list)):
            loss = output[0]
    if loss is None:
        raise AutoparError(f"cannot find the loss in the model's output ({type(output).__name__})")
    return loss


def training_step(module: nn.Module, batch: Batch, optimizer: torch.optim.Optimizer,
                  loss_fn: Callable[[Any], torch.Tensor] = loss_of) -> None:
    """Forward, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``.

    Gradients are freed at the end, not the start, so that between steps only parameters,
    optimizer states and buffers are live (the baseline), as the cost model assumes.
    The model's output is not kept: only the loss outlives the forward.
    """
    forward_backward(module, batch, loss_fn)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def forward_backward(module: nn.Module, batch: Batch, loss_fn: Callable[[Any], torch.Tensor] = loss_of) -> torch.Tensor:
    """A step's forward and backward: a compiled module's ``train_step`` (its microbatches as
    planned), else the forward and ``loss.backward()``. Returns the loss."""
    args, kwargs = batch
    if hasattr(module, "train_step"):
        return module.train_step(*args, **kwargs)
    loss = loss_fn(module(*args, **kwargs))
    loss.backward()
    return loss


def live_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard).

    Storages, not tensors: views and tied parameters share memory and are counted once.
    """
    storages: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        s = t.untyped_storage()
        key = (t.device, s.data_ptr())
        storages[key] = max(storages.get(key, 0), s.nbytes())
    return sum(storages.values())


def _state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> list[Any]:
    params = list(module.parameters())
    return (params + [p.grad for p in params if p.grad is not None] + list(module.buffers())
            + pytree.tree_leaves(list(optimizer.state.values())) + pytree.tree_leaves(batch))


def cpu_peak_growth(fn: Callable[[], Any]) -> int:
    """Run ``fn`` and return the highest net bytes it had allocated through PyTorch's CPU
    allocator at any moment (0 if it never held more than at its start).

    Read from the profiler's allocation events (address and signed size) summed in time order,
    starting from 0: the allocator's own running total is process-wide and may carry blocks
    from earlier profiling sessions. Frees of blocks allocated before ``fn`` started are left
    out: the allocator reports some of them, with the size of whatever block last held the
    address while profiling, so counting them would make the figure depend on address reuse.
    The figure errs high (such frees are not credited), never low.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(((e.start_time_ns, e.extra_fields) for e in _event_tree(prof.profiler.kineto_results)
                     if type(e.extra_fields).__name__ == "_ExtraFields_Allocation"
                     and e.extra_fields.device.type == "cpu"), key=lambda e: e[0])
    peak = total = 0
    live: set[int] = set()
    for _, alloc in events:
        if alloc.alloc_size > 0:
            live.add(alloc.ptr)
        elif alloc.ptr in live:
            live.discard(alloc.ptr)
        else:
            continue
        total += alloc.alloc_size
        peak = max(peak, total)
    return peak


def _event_tree(results: Any) -> Iterator[Any]:
    """Every event of a profile, children included."""
    stack = list(results.experimental_event_tree())
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def _device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_training(module: nn.Module, batches: Sequence[Batch], optimizer: torch.optim.Optimizer, *,
                  warmup: int = 2, steps: int = 5, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  on_step: Callable[[], None] | None = None) -> list[float]:
    """Train ``warmup`` steps (optimizer states then exist), then time ``steps`` steps: seconds of
    each. ``batches`` (``(args, kwargs)`` pairs) are used in turn; ``on_step`` is called after
    every step (progress), outside the timed span.

    Every rank of a distributed module must call this together (steps start after a barrier).
    """
    if not batches:
        raise AutoparError("timing training needs at least one batch")
    if steps < 1 or warmup < 0:
        raise AutoparError(f"timing training needs steps >= 1 and warmup >= 0 (got {steps}, {warmup})")
    device = _device(module)
    loss_fn = loss_fn or loss_of
    tick = on_step or (lambda: None)
    for i in range(warmup):
        training_step(module, batches[i % len(batches)], optimizer, loss_fn)
        tick()
    times = []
    gc.collect()   # as timeit does: a collection the timed steps did not cause falls outside them
    gc.disable()
    try:
        for i in range(warmup, warmup + steps):
            _barrier()
            _sync(device)
            t0 = time.perf_counter()
            training_step(module, batches[i % len(batches)], optimizer, loss_fn)
            _sync(device)
            times.append(time.perf_counter() - t0)
            tick()
    finally:
        gc.enable()
    return times


def time_in_turns(runs: Mapping[K, tuple[nn.Module, torch.optim.Optimizer, Batch]], *, rounds: int, warmup: int,
                  steps: int, on_step: Callable[[K], None] | None = None) -> dict[K, list[list[float]]]:
    """``time_training`` of every run (module, optimizer, batch) in turn, ``rounds`` times: each
    run's timed steps, round by round. Turns spread each run's steps over the whole timing, so
    that the host's slow and fast spells (they last seconds) fall on all runs alike; the rounds'
    orders (``turn_order``) let every run follow every other equally often, since the first
    steps after another run's find the caches and the allocator as that one left them (in one
    fixed order, a run that always follows the heaviest pays for it in every round).

    Every rank of distributed modules must call this together, with the runs in the same order.
    ``on_step(key)`` is called after each of a run's steps (progress).
    """
    times: dict[K, list[list[float]]] = {key: [] for key in runs}
    keys = list(runs)
    for r in range(rounds):
        for k in turn_order(len(keys), r):
            key = keys[k]
            module, optimizer, batch = runs[key]
            tick = None if on_step is None else (lambda key=key: on_step(key))
            times[key].append(time_training(module, [batch], optimizer, warmup=warmup, steps=steps, on_step=tick))
    return times


def ratio_in_rounds(variant: Sequence[float], peer: Sequence[float]) -> float:
    """Median over rounds of ``variant``'s round over ``peer``'s (the same rounds of
    ``time_in_turns``, in order): the two ran moments apart, so a spell of load on a shared host
    slows both alike and cancels, where it does not in the ratio of their medians."""
    return statistics.median(v / p for v, p in zip(variant, peer, strict=True))


def ratio_interval(variant: Sequence[float], peer: Sequence[float], level: float = 0.9, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """How far ``ratio_in_rounds`` could move with other rounds: the ``level`` percentile
    bootstrap interval of the median of in-round ratios (rounds resampled with replacement,
    ``draws`` times, a fixed ``seed``: the same rounds give the same interval). A ratio whose
    interval straddles its target is not measured to meet it or to miss it."""
    ratios = [v / p for v, p in zip(variant, peer, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    tail = (1.0 - level) / 2
    return medians[int(tail * (draws - 1))], medians[int((1.0 - tail) * (draws - 1))]


def turn_order(n: int, r: int) -> list[int]:
    """The order of ``n`` runs in round ``r``: the rows of a balanced Latin square (Williams'
    design), in which each run comes right after each other run once every ``n`` rounds (``n``
    even) or twice every ``2 n`` (odd: the rows, then the rows reversed); each round starts with
    another run."""
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]   # 0, 1, n-1, 2, n-2, ...
    row = [(x + r) % n for x in first]
    return row[::-1] if n % 2 and (r // n) % 2 else row


def slowest_rank_steps(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each timed step's seconds on its slowest rank, from every rank's ``time_training`` list:
    the ranks time the same steps, each starting after a barrier, so a step lasts as long as its
    slowest rank takes."""
    if len({len(steps) for steps in per_rank}) != 1:
        raise AutoparError(f"ranks timed different numbers of steps: {[len(steps) for steps in per_rank]}")
    return [max(step) for step in zip(*per_rank, strict=True)]


def measure_training(module: nn.Module, batches: Sequence[Batch], optimizer: torch.optim.Optimizer, *,
                     warmup: int = 2, steps: int = 5, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                     peak_steps: int = 3) -> StepMeasurement:
    """``time_training``, then the peak memory of ``peak_steps`` more steps: their median.

    One step's peak is not every step's: where collectives run asynchronously (a kernel's
    all-to-all in the backward, the gradient buckets), how long their buffers live depends on
    when the peers answer, and some steps peak well above the others (``benchmarks/RESULTS.md``).
    The median is the typical step's.

    Every rank of a distributed module must call this together (steps start after a barrier).
    """
    if peak_steps < 1:
        raise AutoparError(f"measuring the peak needs peak_steps >= 1 (got {peak_steps})")
    times = time_training(module, batches, optimizer, warmup=warmup, steps=steps, loss_fn=loss_fn)
    first = warmup + steps
    peaks = [peak_step_bytes(module, batches[(first + i) % len(batches)], optimizer, loss_fn)
             for i in range(peak_steps)]
    peak, baseline = sorted(peaks)[(peak_steps - 1) // 2]
    return StepMeasurement(step_s=statistics.median(times), step_s_all=times, peak_bytes=peak,
                           baseline_bytes=baseline, peak_bytes_all=[p for p, _ in peaks])


def peak_step_bytes(module: nn.Module, batch: Batch, optimizer: torch.optim.Optimizer,
                    loss_fn: Callable[[Any], torch.Tensor] | None = None) -> tuple[int, int]:
    """(peak, baseline): the tensor bytes live at the peak of one more training step on ``batch``
    and at its start, on this rank (CUDA's peak counter; on the CPU the profiler's allocations).

    Every rank of a distributed module must call this together (the step starts after a barrier).
    """
    device = _device(module)

    def step() -> None:
        training_step(module, batch, optimizer, loss_fn or loss_of)

    gc.collect()
    _barrier()
    if device.type == "cuda":
        _sync(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device), baseline
    baseline = live_bytes(_state_tensors(module, optimizer, batch))
    growth = cpu_peak_growth(step)
    if growth == 0:  # a training step always allocates: the profiler recorded nothing
        raise AutoparError("the profiler reported no CPU allocation during a training step; "
                           "cannot measure peak memory (is another profiler active?)")
    return baseline + growth, baseline

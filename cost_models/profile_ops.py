"""Op calls to profile: what one rank runs for a node under a strategy, and how long it takes.

The cost model looks measured seconds up by ``op_key`` of the local call (target, local shapes and
dtypes, other arguments), so ``op_call`` is the one place that says what a node runs under a
strategy: profiling (``op_calls`` then ``time_op_calls``) and the cost model both go through it.
Keys hold shapes, never data or node names, so identical layers share one set of measurements.
"""
from __future__ import annotations

import functools
import logging
import math
import operator
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.core.capture import tensor_val
from autopar.core.ops import entry_for
from autopar.core.ops.base import LocalCall
from autopar.core.placements import largest_shard_shape
from autopar.core.strategies import NodeChoices, Strategy, StrategySpace
from cost_models.activations import gradients
from cost_models.profile import OpTime, op_key

log = logging.getLogger(__name__)

def no_compute(node: fx.Node) -> bool:
    """Nodes with nothing of their own to time: picking an output of a multi-output op. Every other
    op runs on this rank's part as the ATen op itself, views included (``codegen.generate``)."""
    return node.target is operator.getitem


class _RuntimeDevice:
    """A device argument (``arange(..., device=meta)``): generated code passes the device it runs
    on, not the capture's, so keys must not depend on where the model was captured."""

    def __repr__(self) -> str:
        return "device"

    def __reduce__(self) -> str:
        return "RUNTIME_DEVICE"   # unpickles as the module's one instance (profiling ranks compare by identity)


RUNTIME_DEVICE = _RuntimeDevice()


@dataclass(frozen=True)
class OpCall:
    """One op invocation as one rank runs it; tensors are meta tensors of the local shape and dtype.

    Calls compare and hash by ``key`` alone: two nodes with the same key share a measurement."""

    target: Any = field(compare=False)
    args: tuple = field(compare=False)
    kwargs: dict[str, Any] = field(compare=False)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", op_key(self.target, self.args, self.kwargs))


def op_call(nc: NodeChoices, s: Strategy, mesh_shape: Sequence[int], grad: Mapping[fx.Node, bool]
            ) -> OpCall | None:
    """The call node ``nc`` makes on the largest shard (the slowest rank) under strategy ``s``, or
    None when it has no compute to time (not an op, ``no_compute``, no tensor output). Inputs that
    get a gradient in training (``grad``, from ``activations.gradients``) require one: the op's
    backward computes theirs alone, and an op with none has no backward to time."""
    node = nc.node
    if nc.kind != "op" or no_compute(node) or tensor_val(node) is None:
        return None
    placements = iter(s.ins)

    def local(a: Any) -> Any:
        if isinstance(a, torch.device):
            return RUNTIME_DEVICE
        if not isinstance(a, fx.Node):
            return a
        val = tensor_val(a)
        if val is None:  # a non-tensor graph value (a symbolic size): its recorded value
            return a.meta.get("val")
        return torch.empty(largest_shard_shape(val.shape, next(placements), mesh_shape), dtype=val.dtype, device="meta",
                           requires_grad=grad.get(a, False))

    call = LocalCall(node.target, *pytree.tree_map(local, (tuple(node.args), dict(node.kwargs))))
    entry = entry_for(node)
    if entry is not None and entry.timed is not None:   # the op runs otherwise (``autopar.core.ops``)
        call = entry.timed(call, node, s, mesh_shape, grad)
    return OpCall(*call)


def op_calls(space: StrategySpace, mesh_shape: Sequence[int]) -> list[OpCall]:
    """The distinct calls (by key) of every op node under every candidate strategy, in graph order
    (not the folded ones: they run once, ``autopar.core.fold``)."""
    calls: dict[str, OpCall] = {}
    grad = gradients(space)
    for nc in space.nodes:
        if nc.kind != "op" or nc.node.name in space.folded:
            continue
        for s in nc.strategies:
            call = op_call(nc, s, mesh_shape, grad)
            if call is not None:
                calls.setdefault(call.key, call)
    return list(calls.values())


def time_op_calls(calls: Iterable[OpCall], *, device: str = "cpu", min_time_s: float = 0.02, repeats: int = 5,
                  progress: Callable[[int, int, str], None] | None = None) -> dict[str, OpTime]:
    """Measure forward and backward seconds of each call on real inputs on ``device``.

    Each of forward and backward is the median over ``repeats`` batches of calls, each batch
    lasting at least ``min_time_s / repeats``. ``progress(i, n, key)`` is called before call ``i``
    (0-based) of ``n``. A call that raises gets no entry and a warning: the cost model then falls
    back to the roofline for it."""
    calls = list(calls)
    dev = torch.device(device)
    times: dict[str, OpTime] = {}
    for i, call in enumerate(calls):
        if progress is not None:
            progress(i, len(calls), call.key)
        try:
            times[call.key] = _time_call(call, dev, min_time_s / repeats, repeats)
        except Exception as e:  # any op error: the op does not run standalone with these inputs
            first_line = (str(e).strip().splitlines() or [""])[0]
            log.warning("autopar: cannot profile %s (%s: %s); its cost stays the roofline estimate",
                        call.key, type(e).__name__, first_line)
    return times


def _time_call(call: OpCall, device: torch.device, per_repeat: float, repeats: int) -> OpTime:
    """Forward seconds, then backward seconds alone (one forward, its graph kept and reused).

    The forward is timed as generated code issues it, call after call (on a GPU: the host's issuing
    or the kernels, whichever is slower). On a GPU the backward is its kernels' time
    (``_kernel_seconds``): a step's backward is one call of the autograd engine, but each isolated
    ``autograd.grad`` pays the engine's hand-off to its device thread (~0.3 ms on an H100 host,
    several times the kernels of most ops: gpt2-125m's step was predicted 3x the measured one)."""
    args, kwargs = pytree.tree_map(lambda a: _real(a, device), (call.args, call.kwargs))
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    def run() -> Any:   # as generated code runs it
        return call.target(*args, **kwargs)

    fwd = _median_seconds(run, device, per_repeat, repeats)
    outs = [t for t in pytree.tree_leaves(run()) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        return OpTime(fwd, 0.0)
    grads = [torch.randn_like(t) for t in outs]
    timer = _kernel_seconds if device.type == "cuda" else _median_seconds
    bwd = timer(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True),
                device, per_repeat, repeats)
    return OpTime(fwd, bwd)


def _real(a: Any, device: torch.device) -> Any:
    """A real input for a meta one: floats random (differentiable where the meta one is), integers
    zeros (valid indices and class targets), booleans ones (keep-masks); the runtime device for
    device args."""
    if a is RUNTIME_DEVICE:
        return device
    if not isinstance(a, torch.Tensor):
        return a
    if a.dtype.is_floating_point:
        return torch.randn(a.shape, dtype=a.dtype, device=device, requires_grad=a.requires_grad)
    if a.dtype == torch.bool:
        return torch.ones(a.shape, dtype=a.dtype, device=device)
    return torch.zeros(a.shape, dtype=a.dtype, device=device)


def _median_seconds(fn: Callable[[], Any], device: torch.device, per_repeat: float, repeats: int) -> float:
    """Median seconds per call over ``repeats`` batches, each at least ``per_repeat`` long."""
    n, _ = _autorange(fn, device, per_repeat)
    return statistics.median(_batch_seconds(fn, n, device) / n for _ in range(repeats))


def _kernel_seconds(fn: Callable[[], Any], device: torch.device, per_repeat: float, repeats: int) -> float:
    """Median GPU seconds per call over ``repeats`` batches: each batch is issued while a sleeping
    kernel holds the stream (twice as long as the host takes to issue it), then runs back to back,
    timed by events on the stream; the host's cost per call stays out."""
    n, elapsed = _autorange(fn, device, per_repeat)
    cycles = math.ceil((2 * elapsed + 1e-3) * _sleep_cycles_per_second(device))

    def batch() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n

    return statistics.median(batch() for _ in range(repeats))


def _autorange(fn: Callable[[], Any], device: torch.device, per_repeat: float) -> tuple[int, float]:
    """After a warmup call (allocator, kernel choice, dispatcher caches): how many calls make a
    batch at least ``per_repeat`` long (timeit's autorange), and that batch's seconds."""
    fn()
    _sync(device)
    n = 1
    while (elapsed := _batch_seconds(fn, n, device)) < per_repeat:
        n = max(2 * n, math.ceil(1.2 * n * per_repeat / max(elapsed, 1e-9)))
    return n, elapsed


@functools.cache
def _sleep_cycles_per_second(device: torch.device) -> float:
    """The rate of ``torch.cuda._sleep``'s cycles on ``device``, timed once."""
    cycles = 10_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)   # the first launch loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def _batch_seconds(fn: Callable[[], Any], n: int, device: torch.device) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

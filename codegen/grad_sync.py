"""Gradient synchronisation as DDP does it: buckets of gradients all-reduced while the backward
still runs.

The generated forward reads most parameters as their local shard (``runtime.shard_of``): the
gradient accumulates there, as a plain tensor, placed as ``codegen.generate.direct_grad`` says. A
replicated parameter used by ops that run split (a batch split over dp, a sequence split over tp)
gets a partial gradient on those mesh axes: each rank holds a summand. Parameters whose
gradients reduce over the same axes, in the same dtype, share buckets (``bucket_bytes``, 25 MiB by
default, as DDP's), filled in the order the backward produces their gradients (the reverse of
their first use in the forward). When a bucket's last gradient is accumulated, the gradients are
flattened into one buffer and its all-reduce is launched (c10d's, asynchronous, in place, as
DDP's reducer does); when the backward ends every bucket is waited for, and each summed gradient
is added to its parameter's ``grad``, a DTensor placed as the parameter is stored (a plain
parameter's is plain, ``runtime.replicated``; a second backward before the optimizer step adds to
it). A parameter's ``grad`` handed over so is a view of its bucket's buffer, and the next backward
flattens into that buffer again where all of the bucket's ``grad`` are None by then
(``zero_grad(set_to_none=True)``, torch's default), as DDP's ``gradient_as_bucket_view`` does: a
fresh buffer a step cost a 125M model's step 100-300 ms of page faults on CPU. A gradient kept
past ``zero_grad`` is then overwritten: clone it to keep it. A plain parameter whose gradient no axis sums (one
device, or a dp axis the batch does not split) is left alone: its gradient accumulates in its own
``grad``, as on one device.

ZeRO-3 parameters gathered in groups (``codegen.zero3``) hand their group's launched
reduce-scatter here (``later``); it is waited for and handed over at the same moment. Parameters
read otherwise (a ZeRO-3 parameter gathered alone, reads that disagree) keep a per-parameter hook
(``runtime.sync_grad_to``).

``train_step``'s loss rides along (``carry``), and so does the plain loop's (a forward's deferred
sum, ``autopar.core.launched.carry_deferred``, taken as the backward begins): each rank's summand
of it joins the first bucket reduced over the same axes, so that summing the loss over ranks
costs no collective of its own (the loss alone would be one more all-reduce a step, as long to
launch as the gradients' own).

Gradient accumulation (``ShardedModule.train_step`` over microbatches) turns ``sync`` off for
all backwards but the last: the partial gradients then stay summed in the local shards' ``grad``
and the last backward all-reduces the microbatches' sum once, as DDP's ``no_sync`` does. ZeRO-3
groups reduce-scatter every backward (their whole gradients would not fit), as FSDP2 does.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from autopar.core.execution import BUCKET_BYTES
from autopar.core.launched import carry_deferred
from autopar.core.placements import Placements
from autopar.core.precision import reduce_dtype
from codegen.runtime import Launched, gradient_leaf, shard_of, sum_in_place

DEFAULT_BUCKET_BYTES = BUCKET_BYTES


@dataclass
class Carried:
    """A rank's summand of a value summed over mesh ``axes`` with the gradients (``GradSync.carry``)."""

    summand: torch.Tensor
    axes: tuple[int, ...]
    reduced: Launched | None = None   # the sum, flattened

    def value(self) -> torch.Tensor:
        """The sum over ranks, shaped as the summand (waits for it)."""
        return self.reduced.wait().reshape(self.summand.shape)


@dataclass
class _Bucket:
    axes: tuple[int, ...]                 # mesh axes the gradients are summed over (none: only handed over)
    dtype: torch.dtype                    # the gradients'
    wire: torch.dtype                     # the one they are summed in (``reduce_precision``)
    params: list[nn.Parameter] = field(default_factory=list)
    leaves: list[torch.Tensor] = field(default_factory=list)   # where each one's gradient accumulates
    numel: int = 0                        # of the gradients, all together
    ready: int = 0                        # gradients accumulated in this backward
    reduced: Launched | None = None       # the launched all-reduce of the flattened gradients
    buffer: torch.Tensor | None = None    # where the last backward flattened them: reused (see ``_launch``)
    views: list[torch.Tensor] | None = None   # ``buffer`` cut and shaped as each leaf: each one's gradient
    carried: list[Carried] = field(default_factory=list)   # summands reduced at the end of ``reduced``


class GradSync:
    """Hands every directly read parameter its gradient after the backward, summing the partial
    ones in buckets whose all-reduce overlaps the rest of the backward.

    ``params``: each parameter with the placement its local gradient accumulates in, in the order
    their gradients become ready in the backward. ``reduce_precision``: "bf16" sums floating
    gradients in bf16 (each bucket cast before its all-reduce and back after, a ZeRO-3 group's
    before its reduce-scatter: ``wire``), as FSDP2's ``reduce_dtype``."""

    def __init__(self, mesh: DeviceMesh, params: Sequence[tuple[nn.Parameter, Placements]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_precision: str = "fp32") -> None:
        self.mesh = mesh
        self.reduce_precision = reduce_precision
        self.buckets: list[_Bucket] = []
        open_: dict[tuple[tuple[int, ...], torch.dtype], _Bucket] = {}
        for p, grad in params:
            axes = tuple(a for a, g in enumerate(grad) if isinstance(g, Partial))
            if not axes and not isinstance(p, DTensor):   # nothing to do: it accumulates in p.grad
                continue
            key = (axes, p.dtype)
            bucket = open_.get(key)
            if bucket is None or bucket.numel * p.dtype.itemsize >= bucket_bytes:
                bucket = open_[key] = _Bucket(axes, p.dtype, reduce_dtype(reduce_precision, p.dtype))
                self.buckets.append(bucket)
            local = gradient_leaf(p)
            local.requires_grad_(True)   # the forward reads the shard: its gradient accumulates there
            bucket.params.append(p)
            bucket.leaves.append(local)
            bucket.numel += local.numel()
            local.register_post_accumulate_grad_hook(partial(self._ready, bucket))
        self._queued = False
        self._later: list[tuple[list[nn.Parameter], torch.Tensor, bool]] = []   # (params, reduced, offloaded)
        self._carried: list[Carried] = []   # waiting for a bucket to launch
        self.sync = True   # False: partial gradients accumulate locally, not reduced (``train_step``)

    def _ready(self, bucket: _Bucket, _local: torch.Tensor) -> None:
        """A shard's gradient is accumulated: launch its bucket's all-reduce once it is full."""
        self._queue()
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and bucket.axes and self.sync:
            self._launch(bucket)

    def carry(self, summand: torch.Tensor, axes: Sequence[int]) -> Carried:
        """Sum this rank's ``summand`` (the loss) over mesh ``axes`` in the all-reduce of the next
        bucket of gradients summed over them (at the latest in the backward that synchronises);
        alone, launched now, when no bucket is. Call before the backward."""
        carried = Carried(summand.detach(), tuple(axes))
        if self._bucket_sums(carried.axes, summand.dtype):
            self._carried.append(carried)
        else:
            carried.reduced = self._sum_alone(carried)
        return carried

    def _take(self, deferred: Any) -> Carried | None:
        """Carry a forward's deferred sum (``autopar.core.launched``, the plain loop's loss) where a
        bucket of this mesh sums over its axes in its dtype; None where none does."""
        if deferred.mesh is not self.mesh or not self._bucket_sums(deferred.axes, deferred.summand.dtype):
            return None
        return self.carry(deferred.summand, deferred.axes)

    def _bucket_sums(self, axes: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Does a bucket sum gradients over mesh ``axes`` in ``dtype`` (so it may carry a summand)?"""
        return any(b.axes == axes and b.wire == dtype for b in self.buckets)

    def _sum_alone(self, c: Carried) -> Launched:
        """Launch the sum of a summand no bucket takes (a copy: the summand shares the loss's storage)."""
        return sum_in_place(c.summand.reshape(-1).clone(), self.mesh, c.axes)

    def later(self, params: list[nn.Parameter], reduced: torch.Tensor, to_host: bool = False) -> None:
        """``reduced``: the launched collective that yields ``params``' local gradients, flattened
        and concatenated (a ZeRO-3 group's reduce-scatter); handed over when the backward ends.
        ``to_host``: the parameters are offloaded: the earlier offloaded groups' gradients are
        waited for and handed over now, so that one at most waits in device memory."""
        self._queue()
        if to_host:
            for earlier, waiting in [(p, r) for p, r, h in self._later if h]:
                _hand_over(_with_shards(earlier), funcol.wait_tensor(waiting))
            self._later = [entry for entry in self._later if not entry[2]]
        self._later.append((params, reduced, to_host))

    def _queue(self) -> None:
        if not self._queued:   # once per backward: finish every bucket when the backward ends
            carry_deferred(self._take)   # a loss's sum not launched yet: carried, or launched first
            Variable._execution_engine.queue_callback(self._finish)
            self._queued = True

    def _launch(self, bucket: _Bucket) -> None:
        """Flatten the bucket's gradients (and the summands it carries) and launch their sum. The
        buffer of the last backward is reused where it holds the same gradients, copied in by one
        ``_foreach_copy_`` into its views (``bucket.views``), and none handed over is still held:
        a ``grad`` handed over is one of those views."""
        bucket.carried = [c for c in self._carried if c.axes == bucket.axes and c.summand.dtype == bucket.wire]
        self._carried = [c for c in self._carried if all(c is not b for b in bucket.carried)]
        grads = [leaf.grad for leaf in bucket.leaves]
        tail = [c.summand.reshape(-1) for c in bucket.carried]
        every = all(g is not None for g in grads)
        flat = bucket.buffer
        if (every and flat is not None and flat.numel() == bucket.numel + sum(t.numel() for t in tail)
                and all(p.grad is None for p in bucket.params)):
            torch._foreach_copy_(bucket.views, grads)
            if tail:
                torch.cat(tail, out=flat[bucket.numel:])
        else:   # first backward, a parameter unused, a gradient kept, or summed in another dtype
            flat = torch.cat([g.reshape(-1) for g in grads if g is not None] + tail).to(bucket.wire)
            keep = every and bucket.wire == bucket.dtype
            bucket.buffer = flat if keep else None
            bucket.views = _views(flat, bucket.leaves) if keep else None
        bucket.reduced = sum_in_place(flat, self.mesh, bucket.axes)

    def wire(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` gradients in the dtype they are summed in (a ZeRO-3 group's, ``codegen.zero3``)."""
        return flat.to(reduce_dtype(self.reduce_precision, flat.dtype))

    def _finish(self) -> None:
        """End of the backward: launch what is left (parameters this step did not use leave a
        bucket short), wait, and add every summed gradient to its parameter's ``grad``."""
        self._queued = False
        for bucket in self.buckets:
            if bucket.axes and not self.sync:   # accumulating: the local sums wait for the last backward
                bucket.ready = 0
                continue
            used = [(p, leaf) for p, leaf in zip(bucket.params, bucket.leaves, strict=True) if leaf.grad is not None]
            if bucket.axes and bucket.reduced is None and used:
                self._launch(bucket)
            if bucket.reduced is not None:
                flat = bucket.reduced.wait()
                if flat is bucket.buffer and len(used) == len(bucket.params):   # summed in place: its views
                    for p, view in zip(bucket.params, bucket.views, strict=True):
                        _add_grad(p, view)
                else:
                    _hand_over(used, flat)
                tail = flat[flat.numel() - sum(c.summand.numel() for c in bucket.carried):]
                for c, part in zip(bucket.carried, tail.split([c.summand.numel() for c in bucket.carried]), strict=True):
                    c.reduced = Launched(part.clone())   # not a view: the gradients' storage goes to the optimizer
            else:
                for p, leaf in used:
                    _add_grad(p, leaf.grad)
            for _, leaf in used:
                leaf.grad = None
            bucket.ready, bucket.reduced, bucket.carried = 0, None, []
        if self.sync:   # summands no bucket took (its parameters unused in this step): alone
            for c in self._carried:
                c.reduced = self._sum_alone(c)
            self._carried = []
        later, self._later = self._later, []
        for params, reduced, _ in later:
            _hand_over(_with_shards(params), funcol.wait_tensor(reduced))


def _with_shards(params: list[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    return [(p, shard_of(p)) for p in params]


def _hand_over(params: list[tuple[nn.Parameter, torch.Tensor]], flat: torch.Tensor) -> None:
    """Split ``flat`` into the local gradients of ``params`` (each with its local shard), in
    order, and add each to its parameter's ``grad`` (in the parameter's dtype, where they were
    summed in another, and memory: an offloaded one's goes to the host); what follows them in
    ``flat`` (carried summands) is left."""
    for (p, local), part in zip(params, _views(flat, [local for _, local in params]), strict=True):
        _add_grad(p, part.to(local.device, local.dtype))


def _views(flat: torch.Tensor, locals_: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut, in order, into views shaped as each of ``locals_`` (what follows them is left)."""
    sizes = [t.numel() for t in locals_]
    parts = flat.split([*sizes, flat.numel() - sum(sizes)])
    return [part.view_as(t) for t, part in zip(locals_, parts, strict=False)]


def _add_grad(p: nn.Parameter, local_grad: torch.Tensor) -> None:
    # a DTensor's gradient is placed and shaped as the parameter
    grad = DTensor(local_grad, p._spec, requires_grad=False) if isinstance(p, DTensor) else local_grad
    p.grad = grad if p.grad is None else p.grad + grad

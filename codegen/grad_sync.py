"""Gradient synchronisation as DDP does it: buckets of gradients all-reduced while the backward
still runs.

A replicated parameter used by ops that run split (a batch split over dp, a sequence split over
tp) gets a partial gradient on those mesh axes: each rank holds a summand. Parameters whose
gradients reduce over the same axes, in the same dtype, share buckets (``bucket_bytes``, 25 MiB by
default, as DDP's), filled in the order the backward produces their gradients (the reverse of
their first use in the forward). When a bucket's last gradient is accumulated, its all-reduce is
launched (functional collectives: asynchronous until waited for); at the end of the backward every
bucket is waited for and each gradient becomes its parameter's replicated DTensor gradient, ready
for the optimizer.

Parameters outside these buckets keep a per-parameter hook (``runtime.sync_grad_to``): sharded
ones (ZeRO-3 and tensor parallel storage, whose gradients the backward reduce-scatters itself) and
those whose uses disagree on where the gradient is partial.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from autopar.core.placements import Placements

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass
class _Bucket:
    axes: tuple[int, ...]                 # mesh axes the gradients are summed over
    params: list[nn.Parameter] = field(default_factory=list)
    nbytes: int = 0
    ready: int = 0                        # gradients accumulated in this backward
    reduced: torch.Tensor | None = None   # the launched all-reduce of the flattened gradients


class GradSync:
    """Bucketed, overlapped all-reduce of the partial gradients of replicated parameters.

    ``params``: each parameter (a DTensor stored ``storage``) with the mesh axes its gradient is
    partial on, in the order their gradients become ready in the backward."""

    def __init__(self, mesh: DeviceMesh, params: Sequence[tuple[nn.Parameter, tuple[int, ...]]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.mesh = mesh
        self.buckets: list[_Bucket] = []
        open_: dict[tuple[tuple[int, ...], torch.dtype], _Bucket] = {}
        self._bucket_of: dict[int, _Bucket] = {}
        for p, axes in params:
            key = (axes, p.dtype)
            bucket = open_.get(key)
            if bucket is None or bucket.nbytes >= bucket_bytes:
                bucket = open_[key] = _Bucket(axes)
                self.buckets.append(bucket)
            bucket.params.append(p)
            bucket.nbytes += p.to_local().numel() * p.element_size()
            self._bucket_of[id(p)] = bucket
            p.register_post_accumulate_grad_hook(self._ready)
        self._queued = False

    def _ready(self, p: nn.Parameter) -> None:
        """A parameter's gradient is accumulated: launch its bucket's all-reduce once it is full."""
        if not self._queued:   # once per backward: wait for every bucket when the backward ends
            Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params if p.grad is not None]
        flat = torch.cat([_partial_local(g, bucket.axes).reshape(-1) for g in grads])
        if len(bucket.axes) == self.mesh.ndim and self.mesh.size() == dist.get_world_size():
            flat = funcol.all_reduce(flat, "sum", dist.group.WORLD)   # one collective, ranks summed in order
        else:
            for axis in bucket.axes:
                flat = funcol.all_reduce(flat, "sum", (self.mesh, axis))
        bucket.reduced = flat

    def _finish(self) -> None:
        """End of the backward: launch what is left (parameters this step did not use leave a
        bucket short), wait, and give every parameter its summed gradient."""
        self._queued = False
        for bucket in self.buckets:
            if bucket.reduced is None and bucket.ready:
                self._launch(bucket)
            if bucket.reduced is None:
                continue
            flat = funcol.wait_tensor(bucket.reduced)
            offset = 0
            for p in bucket.params:
                if p.grad is None:
                    continue
                local = p.to_local()
                n = local.numel()
                p.grad = DTensor.from_local(flat[offset:offset + n].view_as(local), self.mesh, list(p.placements),
                                            run_check=False, shape=p.shape, stride=p.stride())
                offset += n
            bucket.ready, bucket.reduced = 0, None


def _partial_local(grad: DTensor, axes: tuple[int, ...]) -> torch.Tensor:
    """This rank's summand of ``grad`` over ``axes``. A gradient already summed there (left by an
    earlier backward the optimizer has not consumed: gradient accumulation) counts 1/n per rank."""
    local = grad.to_local()
    for a in axes:
        if isinstance(grad.placements[a], Replicate):
            local = local / grad.device_mesh.size(a)
    return local


def partial_axes(storage: Placements, reads: Sequence[tuple[Placements, Placements]]) -> tuple[int, ...] | None:
    """The mesh axes a replicated parameter's gradient is summed over, if every read takes it as
    stored and gives its gradient back partial on the same axes (``reads``: (placement, gradient's
    placement) each); None when it cannot go in a bucket (a read that moves it first hands the
    gradient through that move's backward, which places it otherwise)."""
    if not reads or any(want != tuple(storage) or grad != reads[0][1] for want, grad in reads):
        return None
    if any(not isinstance(p, Replicate) for p in storage):
        return None
    axes = tuple(a for a, p in enumerate(reads[0][1]) if isinstance(p, Partial))
    return axes or None

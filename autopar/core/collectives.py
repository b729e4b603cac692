"""The collectives generated code and the ops' kernels (``autopar.core.ops``) run: sums over mesh
axes, the process group of some axes, an output made whole from its parts. Between processes a
sum or a gather handed out as an output is launched now and waited for where it is first read
(``autopar.core.launched``); with ranks simulated in one process (LocalTensorMode), under
``torch.compile`` or over axes that need one collective each, they are functional collectives.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from autopar.core import launched
from autopar.core.context_parallel import balance, unbalance
from autopar.core.placements import for_dtensor
from autopar.core.together import one_process


class _PlannedRedistributions(logging.Filter):
    """While autopar redistributes, drop DTensor's hints, logged by every rank: that a change over
    several mesh axes runs one collective per axis (once per mesh), and that gloo runs an
    all-to-all as an all-gather and a chunk (once per process). The planner chose those
    collectives and priced them as measured through this runtime (``autopar profile``). Also
    while a backward runs: DTensor moves the gradients of autopar's moves itself
    (``Redistribute.backward``, outside any call of ours; gpt2-125m on 2x2 logged the hint of a
    slice's gradient gathered back over both axes once per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self._ours = threading.local()

    def __enter__(self) -> None:
        self._ours.active = True

    def __exit__(self, *exc: Any) -> None:
        self._ours.active = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self._ours, "active", False) and torch._C._current_graph_task_id() == -1


_PLANNED = _PlannedRedistributions()


for _hints in ("torch.distributed.tensor._redistribute", "torch.distributed.tensor._collective_utils"):
    logging.getLogger(_hints).addFilter(_PLANNED)


def planned() -> contextlib.AbstractContextManager:
    """``_PLANNED``, except while ``torch.compile`` traces: it cannot enter it, and broke the graph
    at every redistribution (gpt2-tiny's solver plan on 2 ranks: 34 graphs, 9 since). A hint
    DTensor logs while a graph is traced is not dropped."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _PLANNED


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> torch.Tensor:
    """Launch the sum of ``x`` over the ranks of mesh ``axes`` (a functional collective: the
    result is waited for when first used): one collective when the axes span the whole job."""
    if len(axes) == 1 or spans_job(mesh, axes):
        return funcol.all_reduce(x, "sum", axes_group(mesh, axes))
    for axis in axes:
        x = funcol.all_reduce(x, "sum", (mesh, axis))
    return x


def spans_job(mesh: DeviceMesh, axes: Sequence[int]) -> bool:
    """Are ``axes`` every axis of a mesh made of every rank of the job (one process group)?"""
    return len(axes) == mesh.ndim and mesh.size() == dist.get_world_size()


def axes_group(mesh: DeviceMesh, axes: Sequence[int]) -> dist.ProcessGroup:
    """The process group of one mesh axis, or of the whole job (``spans_job``), for a functional
    or a c10d collective; ranks in mesh order."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    if not spans_job(mesh, axes):
        raise ValueError(f"mesh axes {tuple(axes)} are neither one axis nor the whole job")
    return dist.group.WORLD


def sum_over_ranks(x: torch.Tensor, mesh: DeviceMesh, axes: Sequence[int]) -> torch.Tensor:
    """The sum over mesh ``axes`` of every rank's summand, replicated: launched, waited for when
    the value is first read (between processes, ``autopar.core.launched.summed``: reading nothing waits
    for nothing). Backward: each summand's gradient is the sum's (Megatron's reduce from the
    model-parallel region)."""
    if not torch.compiler.is_compiling() and not one_process() and (len(axes) == 1 or spans_job(mesh, axes)):
        return launched.summed(x, axes_group(mesh, axes), mesh, axes)
    return _SumOverRanks.apply(x, mesh, tuple(axes))


class _SumOverRanks(torch.autograd.Function):
    """``sum_over_ranks`` as functional collectives (one process, ``torch.compile``, axes that
    need one collective each)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, axes: tuple[int, ...]) -> torch.Tensor:
        return all_reduce(x, mesh, axes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def full(x: Any, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int]) -> Any:
    """The full tensor every rank returns: this rank's part gathered (or summed) over the mesh.
    Between processes, an even split's gather is launched here and waited for where the output
    is first read (``autopar.core.launched``): a loop that reads only the loss never waits for the
    logits. Other splits, and ranks simulated in one process, gather at once."""
    if not isinstance(x, torch.Tensor) or all(isinstance(p, Replicate) for p in have):
        return x
    if not torch.compiler.is_compiling() and not one_process() and launched.gatherable(x, mesh, have, shape):
        return launched.gathered(x, mesh, have, shape, lambda grad: _part_of(grad, mesh, have, shape))
    with planned():
        return as_dtensor(x, mesh, have, shape).full_tensor()


def full_balanced(x: Any, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int], *, dim: int,
                  ranks: int, period: int) -> Any:
    """``full`` of an output whose ``dim`` is split in the balanced order (``context_parallel.balance``
    over ``ranks`` ranks, each run of ``period`` elements alone): gathered as ``full`` gathers
    (when first read, between processes), then put back in sequence order; its gradient permuted
    back before it is split."""
    if not torch.compiler.is_compiling() and not one_process() and launched.gatherable(x, mesh, have, shape):
        return launched.gathered(x, mesh, have, shape,
                                 lambda grad: _part_of(balance(grad, dim, ranks, period), mesh, have, shape),
                                 lambda whole: unbalance(whole, dim, ranks, period))
    with planned():
        return unbalance(as_dtensor(x, mesh, have, shape).full_tensor(), dim, ranks, period)


def _part_of(whole_value: torch.Tensor, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int]) -> torch.Tensor:
    """This rank's part, placed ``have`` (never partial), of a tensor every rank holds whole."""
    with planned():
        return as_dtensor(whole_value, mesh, [Replicate()] * mesh.ndim, shape).redistribute(mesh, for_dtensor(have)).to_local()


@torch.compiler.disable
def kept_sharded(x: Any, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int]) -> Any:
    """An output kept sharded (``gather_outputs=False``): ``as_dtensor``, made outside any
    ``torch.compile`` graph. AOT autograd takes a DTensor output's gradient to be a DTensor, and
    where the loss's backward does not read that output (the logits returned beside the loss) the
    gradient comes as plain zeros, which it rejects; so the graph returns this rank's part, wrapped
    here. A sum still on its way (the loss, ``launched.summed``) stays so inside its replicated
    DTensor, carried in the gradients' all-reduce as under the default outputs (``as_dtensor``
    would take a view of it, an op that waits: a blocking all-reduce in every forward)."""
    if isinstance(x, launched.Pending) and all(isinstance(p, Replicate) for p in have):
        return _Replicated.apply(x, mesh, tuple(shape))
    return as_dtensor(x, mesh, have, shape)


class _Replicated(torch.autograd.Function):
    """A ``Pending`` as the replicated DTensor holding it unread; its gradient goes back local."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, shape: tuple[int, ...]) -> DTensor:
        meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), x.dtype)
        return DTensor(x, DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta),  # type: ignore[call-arg]
                       requires_grad=x.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (grad.to_local() if isinstance(grad, DTensor) else grad), None, None


def as_dtensor(x: Any, mesh: DeviceMesh, have: Sequence[Placement], shape: Sequence[int]) -> Any:
    """This rank's part as a DTensor of the global ``shape`` (an output kept sharded; a move's start)."""
    if not isinstance(x, torch.Tensor):
        return x
    return DTensor.from_local(x.contiguous(), mesh, for_dtensor(have), run_check=False, shape=torch.Size(shape),
                              stride=contiguous_stride(shape))

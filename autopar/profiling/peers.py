"""What users run instead of autopar, built the way PyTorch's documentation builds it, to measure
autopar against on the same mesh and batch: DDP, FSDP2 (``fully_shard`` per block, then the root)
and tensor parallelism (``parallelize_module``, with FSDP2 on the data-parallel axis).

Torch's wrappers take each rank's part of the global batch (``rank_batch``); autopar takes the
global batch, as its API asks.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

Batch = tuple[tuple, dict]


def blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a transformer: the longest ModuleList of one module type."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of repeated blocks to shard one by one")
    return max(lists, key=len)


def rank_batch(batch: Batch, parts: int, index: int) -> Batch:
    """Part ``index`` of ``parts`` of a global batch (every tensor's first dimension split)."""
    def cut(t: Any) -> Any:
        return t.chunk(parts)[index] if isinstance(t, torch.Tensor) and t.dim() > 0 else t
    args, kwargs = batch
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def ddp(model: nn.Module, batch: Batch) -> tuple[nn.Module, Batch]:
    """``DistributedDataParallel`` over the default process group, with this rank's part of ``batch``."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model), rank_batch(batch, dist.get_world_size(), dist.get_rank())


def fsdp2(model: nn.Module, batch: Batch) -> tuple[nn.Module, Batch]:
    """FSDP2 over every rank: ``fully_shard`` on each block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):
        fully_shard(block)
    return fully_shard(model), rank_batch(batch, dist.get_world_size(), dist.get_rank())


def tensor_parallel_plan(model: nn.Module) -> dict[str, Any] | None:
    """Megatron-style tensor parallelism of each block with torch's API (q/k/v and gate/up
    projections column-wise, o and down projections row-wise), as ``parallelize_module`` takes it;
    None for a model torch's API cannot split unchanged (a fused qkv projection, HF's Conv1D
    layers): that needs its code rewritten, as Megatron does."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel(),
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            **{f"mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")}}
    return plan if set(plan) <= {name for name, _ in blocks(model)[0].named_modules()} else None


def tensor_parallel(model: nn.Module, batch: Batch, mesh: DeviceMesh) -> tuple[nn.Module, Batch]:
    """``tensor_parallel_plan`` on the mesh's last axis, FSDP2 on the first; each dp group gets its
    part of ``batch``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tensor_parallel_plan(model)
    if plan is None or mesh.ndim != 2:
        raise ValueError(f"torch's tensor parallel API cannot split {type(model).__name__} unchanged "
                         f"on a {mesh.ndim}-D mesh (needs separate q/k/v and gate/up nn.Linear layers, 2-D mesh)")
    dp, tp = mesh[mesh.mesh_dim_names[0]], mesh[mesh.mesh_dim_names[1]]
    for layer in blocks(model):
        parallelize_module(layer, tp, plan)
        fully_shard(layer, mesh=dp)
    return fully_shard(model, mesh=dp), rank_batch(batch, mesh.size(0), mesh.get_local_rank(0))


#: torch's wrappers by the name results give them.
NAMES = ("torch DDP", "torch FSDP2", "torch TP x FSDP2", "torch eager")


def wrap(name: str, model: nn.Module, batch: Batch, mesh: DeviceMesh) -> tuple[nn.Module, Batch]:
    """``model`` wrapped as torch's wrapper ``name`` (one of ``NAMES``; "torch eager": as it is),
    with this rank's part of ``batch``."""
    if name == "torch DDP":
        return ddp(model, batch)
    if name == "torch FSDP2":
        return fsdp2(model, batch)
    if name == "torch TP x FSDP2":
        return tensor_parallel(model, batch, mesh)
    if name == "torch eager":
        return model, batch
    raise ValueError(f"unknown torch wrapper {name!r}; expected one of {', '.join(NAMES)}")

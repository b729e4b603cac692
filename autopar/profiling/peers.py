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


def tensor_parallel(model: nn.Module, batch: Batch, mesh: DeviceMesh) -> tuple[nn.Module, Batch] | None:
    """Megatron-style tensor parallelism with torch's API on the mesh's last axis (q/k/v and
    gate/up projections column-wise, o and down projections row-wise), FSDP2 on the first; each dp
    group gets its part of ``batch``. None for a model torch's API cannot split unchanged (a fused
    qkv projection, HF's Conv1D layers): that needs its code rewritten, as Megatron does."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layers = blocks(model)
    plan = {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel(),
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            **{f"mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")}}
    if not set(plan) <= {name for name, _ in layers[0].named_modules()} or mesh.ndim != 2:
        return None
    dp, tp = mesh[mesh.mesh_dim_names[0]], mesh[mesh.mesh_dim_names[1]]
    for layer in layers:
        parallelize_module(layer, tp, plan)
        fully_shard(layer, mesh=dp)
    return fully_shard(model, mesh=dp), rank_batch(batch, mesh.size(0), mesh.get_local_rank(0))

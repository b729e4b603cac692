"""What users run instead of autopar, built the way PyTorch's documentation builds it, to measure
autopar against on the same mesh and batch: DDP, FSDP2 (``fully_shard`` per block, then the root)
tensor parallelism (``parallelize_module``, with FSDP2 on the data-parallel axis), and for
mixture-of-experts models torchtitan-style expert parallelism written by hand (``expert_parallel``:
experts split by expert, tokens sent to them and back by all-to-all, the rest under DDP).

Torch's wrappers take each rank's part of the global batch (``rank_batch``); autopar takes the
global batch, as its API asks.
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
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


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers 5's experts modules of ``model`` (fused ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I] parameters), by name."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3
            and isinstance(getattr(m, "down_proj", None), nn.Parameter) and m.down_proj.dim() == 3]


def _dispatched_experts(experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """transformers' fused experts' forward over an expert-parallel ``group`` (this rank holds
    local experts ``[r*L, (r+1)*L)`` of ``n*L``): ``routed`` to its local experts' SwiGLUs."""
    def expert(e: int, part: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(part, experts.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])

    return routed(hidden.to(experts.gate_up_proj.dtype), top_k_index, top_k_weights, expert,
                  experts.gate_up_proj.size(0), group).to(hidden.dtype)


def routed(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
           expert: Callable[[int, torch.Tensor], torch.Tensor], local: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Each (token, choice) pair of ``hidden`` sent to its expert's rank of ``group`` by an
    all-to-all (counts first, so that every rank knows the uneven splits), each of this rank's
    ``local`` experts run on its rows (``expert(local index, rows)``), the results sent back by
    the reverse all-to-all and summed weighted by the router. Differentiable: the functional
    all-to-all's backward sends gradients back."""
    import torch.distributed._functional_collectives as funcol

    def all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_to_all_single(rows.contiguous(), out_splits, in_splits, group))

    n, k = group.size(), top_k_index.size(1)
    pair_expert = top_k_index.reshape(-1)
    by_expert = torch.argsort(pair_expert, stable=True)          # by expert, hence by destination rank
    to_expert = torch.bincount(pair_expert, minlength=n * local)
    from_rank = torch.empty_like(to_expert)                       # [source rank x local expert]
    dist.all_to_all_single(from_rank, to_expert, group=group)
    splits = torch.cat([to_expert.view(n, local).sum(1), from_rank.view(n, local).sum(1),
                        from_rank.view(n, local).sum(0)]).tolist()
    send, recv, rows = splits[:n], splits[n:2 * n], splits[2 * n:]
    x = all_to_all(hidden[by_expert // k], recv, send)
    # a source's rows arrive grouped by local expert: group all sources' rows by local expert
    local_of_row = torch.arange(local, device=x.device).repeat(n).repeat_interleave(from_rank)
    regroup = torch.argsort(local_of_row, stable=True)
    y = torch.cat([expert(e, part) for e, part in enumerate(x[regroup].split(rows))])
    y = y.new_zeros(y.shape).index_copy(0, regroup, y)            # back to arrival order
    y = all_to_all(y, send, recv)
    pairs = y.new_zeros(y.shape).index_copy(0, by_expert, y).view(*top_k_index.shape, -1)
    return (pairs * top_k_weights.unsqueeze(-1)).sum(1)


def _keep_local_experts(experts: nn.Module, ep_rank: int, ep_size: int) -> None:
    """Replace the experts' parameters by this rank's slices (experts ``[r*L, (r+1)*L)``)."""
    if experts.gate_up_proj.size(0) % ep_size or getattr(experts, "has_bias", False) or \
            getattr(experts, "is_transposed", False):
        raise ValueError(f"torch EP needs experts without biases in transformers' [E, 2I, H] layout, E divisible by "
                         f"{ep_size}; got {type(experts).__name__} with {experts.gate_up_proj.size(0)} experts")
    local = experts.gate_up_proj.size(0) // ep_size
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        setattr(experts, name, nn.Parameter(full.detach()[ep_rank * local:(ep_rank + 1) * local].clone()))


def hand_moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The hand-written mixture-of-experts layers of ``model`` (``autopar.models.moe.SparseMoe``:
    a router ``gate`` and a ``ModuleList`` of experts), by name."""
    from autopar.models.moe import SparseMoe

    return [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoe)]


def has_experts(model: nn.Module) -> bool:
    """Does ``model`` have mixture-of-experts layers torch EP splits (``expert_parallel``)?"""
    return bool(experts_modules(model) or hand_moe_layers(model))


def _routed_hand_moe(moe: nn.Module, hidden: torch.Tensor, *, group: dist.ProcessGroup) -> torch.Tensor:
    """``SparseMoe.forward`` over an expert-parallel ``group``: its router as it is, its tokens
    ``routed`` to this rank's experts (``moe.experts`` holds only those)."""
    batch, seq, dim = hidden.shape
    x = hidden.view(-1, dim)
    weights, chosen = moe.route(x)
    out = routed(x, chosen, weights, lambda e, rows: moe.experts[e](rows), len(moe.experts), group)
    return out.to(hidden.dtype).view(batch, seq, dim)


def _split_by_expert(model: nn.Module, group: dist.ProcessGroup, rank: int, size: int) -> list[str]:
    """Each MoE layer of ``model`` keeps this rank's experts and runs over ``group`` (its forward
    swapped on the instance, as torchtitan's hooks do: the model's class is untouched); the names
    of the experts' parameters (DDP leaves them to ``_average_expert_grad``)."""
    fused, hand = experts_modules(model), hand_moe_layers(model)
    for _, experts in fused:
        _keep_local_experts(experts, rank, size)
        experts.forward = types.MethodType(functools.partial(_dispatched_experts, group=group), experts)
    for _, moe in hand:
        if len(moe.experts) % size:
            raise ValueError(f"torch EP needs the experts to divide by {size}; got {len(moe.experts)}")
        local = len(moe.experts) // size
        moe.experts = nn.ModuleList(list(moe.experts)[rank * local:(rank + 1) * local])
        moe.forward = types.MethodType(functools.partial(_routed_hand_moe, group=group), moe)
    return ([f"{name}.{p}" for name, _ in fused for p in ("gate_up_proj", "down_proj")]
            + [f"{name}.experts.{p}" for name, moe in hand for p, _ in moe.experts.named_parameters()])


def expert_parallel(model: nn.Module, batch: Batch, mesh: DeviceMesh) -> tuple[nn.Module, Batch]:
    """torchtitan-style expert parallelism with data parallelism ("torch EP x DP"): each
    mixture-of-experts layer's experts (transformers' fused ones, or a hand-written list:
    ``hand_moe_layers``) split by expert over the mesh's last axis (each rank its experts,
    tokens dispatched by all-to-all: ``routed``), every rank its part of ``batch``; the other
    parameters' gradients averaged over all ranks by DDP, the experts' summed over the first axis
    (the ranks holding the same experts; none on a 1-D mesh) and divided by the number of ranks,
    as DDP's average would."""
    from torch.nn.parallel import DistributedDataParallel

    if not has_experts(model) or mesh.ndim > 2:
        raise ValueError(f"torch EP needs a mixture-of-experts model (transformers' fused experts, or "
                         f"autopar.models.moe's) and a 1-D or 2-D mesh; got {type(model).__name__} on a "
                         f"{mesh.ndim}-D mesh")
    ep, world = mesh.get_group(mesh.ndim - 1), dist.get_world_size()
    dp = mesh.get_group(0) if mesh.ndim == 2 else None
    ignored = _split_by_expert(model, ep, mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    params = dict(model.named_parameters())
    for name in ignored:
        params[name].register_post_accumulate_grad_hook(functools.partial(_average_expert_grad, dp=dp, world=world))
    return DistributedDataParallel(model), rank_batch(batch, world, dist.get_rank())


#: The experts' gradient all-reduces on their way in this backward (``_average_expert_grad``).
_EXPERT_SYNCS: list[dist.Work] = []


def _average_expert_grad(p: torch.Tensor, dp: dist.ProcessGroup | None, world: int) -> None:
    """An expert's gradient divided by the ranks (as DDP's average), then summed over ``dp``
    asynchronously, as its gradient is ready: it overlaps the rest of the backward, as DDP's
    buckets and torchtitan's FSDP over the data axis do, and is waited for at the backward's end."""
    p.grad.div_(world)
    if dp is None:
        return
    if not _EXPERT_SYNCS:
        torch.autograd.Variable._execution_engine.queue_callback(_wait_expert_syncs)
    _EXPERT_SYNCS.append(dist.all_reduce(p.grad, group=dp, async_op=True))


def _wait_expert_syncs() -> None:
    while _EXPERT_SYNCS:
        _EXPERT_SYNCS.pop().wait()


#: torch's wrappers by the name results give them.
NAMES = ("torch DDP", "torch FSDP2", "torch TP x FSDP2", "torch EP x DP", "torch eager")


def wrap(name: str, model: nn.Module, batch: Batch, mesh: DeviceMesh) -> tuple[nn.Module, Batch]:
    """``model`` wrapped as torch's wrapper ``name`` (one of ``NAMES``; "torch eager": as it is),
    with this rank's part of ``batch``."""
    if name == "torch DDP":
        return ddp(model, batch)
    if name == "torch FSDP2":
        return fsdp2(model, batch)
    if name == "torch TP x FSDP2":
        return tensor_parallel(model, batch, mesh)
    if name == "torch EP x DP":
        return expert_parallel(model, batch, mesh)
    if name == "torch eager":
        return model, batch
    raise ValueError(f"unknown torch wrapper {name!r}; expected one of {', '.join(NAMES)}")

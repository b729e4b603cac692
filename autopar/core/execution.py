"""How each op executes in generated code, and which collective each placement change is.

One statement read by the code generator (what it emits), the cost model (what it prices) and
profiling (what it times), so that they cannot drift apart: if codegen changes how an op runs,
the cost model's price changes with it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.core.placements import Placements, grad_target

aten = torch.ops.aten

#: Ops whose output aliases their input: they move no data and save nothing for the backward.
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.transpose.int, aten.t.default, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.expand.default, aten.slice.Tensor, aten.select.int,
    aten.split.Tensor, aten.split_with_sizes.default, aten.alias.default,
    aten.detach.default, operator.getitem,
}

#: Ops that convert a tensor's dtype (or device) and keep its shape: a weight cast to bf16 by the
#: precision policy (``autopar.core.precision``) is still that weight to whoever asks what it is.
CAST_OPS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device}

#: Ops that change no value. Export records them or not depending on the device's layouts (a
#: transpose of CPU flash attention's output is already contiguous, of a meta tensor it is not),
#: so they are left out of the fingerprint and plans are matched without them.
IDENTITY_OPS = {aten.contiguous.default, aten.alias.default, aten.clone.default, aten.detach.default}

#: Names generated code uses for itself: the forward's arguments and the runtime helpers and
#: modules ``codegen.module.compile_source`` binds. Capture renames graph values that would
#: shadow one (a model's ``torch.full`` is a node named ``full``).
GENERATED_NAMES = frozenset({
    "self", "mesh", "device", "sizes", "torch", "aten", "operator", "float", "R", "S", "P", "Partial",
    "redistribute", "move", "param_shard", "shard_of", "on_device", "expect", "uneven_reshape", "sharded_cross_entropy",
    "sharded_embedding", "full", "kept_sharded", "gather_params", "dropout_mask", "recompute", "loss_count",
    "once", "attention_mask", "attention", "constants", "sync_batch_norm", "write_back",
})

#: Ops whose second argument is a shape, their output's: generated code passes this rank's local
#: shape instead (every op runs on this rank's part, as the ATen op itself).
SHAPE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                 aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default}

def draws_whole_mask(node: fx.Node, out: Placements) -> bool:
    """Does generated code run this node as a dropout drawing the whole tensor's mask on every
    rank (``runtime.dropout_mask``)? A training dropout with p > 0 whose output is split: each
    rank keeps its part of the mask one device would draw. The cost model prices the whole draw."""
    return (node.target is aten.dropout.default and bool(node.args[2]) and node.args[1] > 0
            and any(isinstance(p, Shard) for p in out))


def batch_statistics(node: fx.Node) -> bool:
    """Does ``node`` normalise by its input's batch statistics (a batch_norm in training mode)?"""
    if node.target is not aten.batch_norm.default:
        return False
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs["training"])


def statistics_axes(node: fx.Node, ins: tuple[Placements, ...]) -> tuple[int, ...]:
    """The mesh axes over which a training batch_norm whose inputs are placed ``ins`` gathers the
    statistics of the other ranks' parts (``codegen.batch_norm``): those splitting its input on a
    dim other than the channels (dim 1). Empty for any other op, and in eval mode."""
    if not batch_statistics(node):
        return ()
    return tuple(a for a, p in enumerate(ins[0]) if isinstance(p, Shard) and p.dim != 1)


def running_statistics(node: fx.Node) -> list[fx.Node]:
    """The buffers a training batch_norm updates in place (its running mean and variance); its
    schema does not say it writes them, so ``writes_in_place`` does not see these writes."""
    if not batch_statistics(node):
        return []
    return [a for a in node.args[3:5] if isinstance(a, fx.Node)]


def writes_in_place(node: fx.Node) -> bool:
    """Does ``node`` write its first argument in place (``copy_``, ``masked_fill_``, ``index_put_``...)?"""
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def written_aliases(graph: fx.Graph) -> set[fx.Node]:
    """Every value an in-place op writes, with all the values that alias it (its base, the
    base's views, the in-place ops' own outputs). A write reaches the other aliases only where
    they are one local tensor, so the planner keeps them replicated; generated code also forgets
    the moved copies of them it made before a write."""
    written = {storage_base(n.args[0]) for n in graph.nodes if n.op == "call_function" and writes_in_place(n)}
    return {n for n in graph.nodes if storage_base(n) in written}


def storage_base(node: fx.Node) -> fx.Node:
    """The value whose storage ``node`` is (through views and in-place ops' outputs)."""
    while node.op == "call_function" and (node.target in VIEW_OPS or writes_in_place(node)) and node.args:
        node = node.args[0]
    return node


def written_buffers(graph: fx.Graph, buffer_of: dict[str, str]) -> dict[str, str]:
    """The buffers the forward writes in place (FQN -> the op that writes it first): by an op
    whose schema says so (a counter's ``add_``), or a training batch norm's running statistics."""
    out: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        targets = running_statistics(node) or ([storage_base(node.args[0])] if writes_in_place(node) else [])
        for target in targets:
            if target.name in buffer_of:
                out.setdefault(buffer_of[target.name], str(node.target))
    return out


#: Bytes of gradients the runtime reduces in one collective (DDP's default bucket), and of ZeRO-3
#: parameters it gathers in one: per-collective latency is paid once per this many bytes.
BUCKET_BYTES = 25 * 2**20

def moves(out: Placements, inp: Placements, grad: Placements, grad_flows: bool = True,
          target: Placements | None = None) -> bool:
    """Does generated code move (``runtime.move``) a value placed ``out`` into a consumer that reads
    it placed ``inp`` and gives its gradient back placed ``grad``? Where the placement differs, or
    the gradient must be brought to where the producer keeps it (``target``, by default
    ``grad_target``: a replicated input of a split op gets a partial gradient, which is all-reduced)."""
    return out != inp or (grad_flows and grad != (target if target is not None else grad_target(out)))


def axis_collective(src: Placement, dst: Placement) -> str | None:
    """The collective that moves a tensor from ``src`` to ``dst`` on one mesh axis, or None when
    the change is local (same placement, slicing a replica, or a replica becoming a partial sum).
    A shard that must become partial is gathered first (the runtime reaches Replicate, then splits)."""
    if src == dst or (isinstance(src, Partial) and isinstance(dst, Partial)):
        return None
    if isinstance(dst, Replicate):
        return "all_reduce" if isinstance(src, Partial) else "all_gather"
    if isinstance(dst, Shard):
        return "reduce_scatter" if isinstance(src, Partial) else "all_to_all" if isinstance(src, Shard) else None
    return "all_gather" if isinstance(src, Shard) else None

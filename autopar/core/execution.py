"""How ops execute in generated code, and which collective each placement change is.

One statement read by the code generator (what it emits), the cost model (what it prices) and
profiling (what it times), so that they cannot drift apart: if codegen changes how an op runs,
the cost model's price changes with it. What sets one op apart (cross-entropy split by batch, a
batch norm's statistics, a dropout's whole mask...) is declared with that op in ``autopar.core.ops``.
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
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.alias.default,
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
#: shadow one (a model's ``torch.full`` is a node named ``full``). The ops' kernels are read as
#: ``kernels.<name>``.
GENERATED_NAMES = frozenset({
    "self", "mesh", "device", "sizes", "torch", "aten", "operator", "float", "R", "S", "SB", "P", "Partial",
    "redistribute", "move", "move_balanced", "balance", "full_balanced", "param_shard", "shard_of", "held", "on_device",
    "expect", "uneven_reshape",
    "full", "kept_sharded", "gather_params", "recompute", "loss_count", "once", "constants", "kernels",
})

def writes_in_place(node: fx.Node) -> bool:
    """Does ``node`` write its first argument in place (``copy_``, ``masked_fill_``, ``index_put_``...)?"""
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def private_write(node: fx.Node, position: dict[fx.Node, int]) -> torch._ops.OpOverload | None:
    """The out-of-place form (``aten.div.Tensor``) of an in-place write that no other value sees
    (HF's router renormalising its top-k weights: ``top /= top.sum(-1, keepdim=True)``), else
    None. ``node`` writes an op's fresh output (not an input, parameter, buffer or view), which
    is read before the write only (``position``: graph order), by ops that neither view nor
    write it: run out of place, nothing changes; run in place, it and its aliases would have to
    stay replicated (``written_aliases``), gathering what every rank could keep split."""
    if not writes_in_place(node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    schema = node.target._schema
    name, overload = schema.name.split("::")[-1], node.target._overloadname
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    functional = getattr(packet, overload, None) if packet is not None else None
    if functional is None or functional._schema.is_mutable or len(functional._schema.arguments) != len(schema.arguments):
        return None
    written = node.args[0]
    readers_before = all(u is node or (position[u] < position[node] and u.target not in VIEW_OPS
                                       and not writes_in_place(u)) for u in written.users)
    return functional if readers_before and _fresh(written) else None


def _fresh(node: fx.Node) -> bool:
    """Is ``node`` storage of its own: an op's output that aliases none of its inputs?"""
    op, index = (node.args[0], node.args[1]) if node.target is operator.getitem else (node, 0)
    if op.op != "call_function" or not isinstance(op.target, torch._ops.OpOverload) or op.target in VIEW_OPS:
        return False
    returns = op.target._schema.returns
    return isinstance(index, int) and index < len(returns) and returns[index].alias_info is None


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

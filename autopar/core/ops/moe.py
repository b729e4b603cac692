"""A mixture-of-experts layer's experts (``autopar::moe_experts``, the one op capture records for
transformers' experts: ``autopar.core.expert_parallel.experts_as_one_op``): replicated, split by
token (each rank its tokens, every expert), split by expert over one mesh axis (expert
parallelism: each rank holds E/n experts and routes its tokens to their ranks by all-to-all,
``autopar.core.expert_parallel``), or split within each expert over one axis (Megatron's expert
tensor parallelism: each rank holds 1/n of every expert's intermediate dimension, matching gate
and up rows and the down projection's columns, and returns a partial sum); by expert on one axis
and within on another, each rank runs its slice of its experts.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils.flop_counter import register_flop_formula

from autopar.core.capture import tensor_val
from autopar.core.errors import AutoparError
from autopar.core.expert_parallel import ACTIVATIONS, GATES, gate_kept, gated, routed_experts
from autopar.core.ops.base import (
    Collective,
    Emitter,
    Kept,
    LocalCall,
    Placed,
    Site,
    TimedKernel,
    collectives,
    emitter,
    imbalance,
    kernel,
    rule,
    saved,
    timed,
    working,
)
from autopar.core.placements import Placements, ShardBlocks, largest_shard_shape, shard_fraction, split_axes
from autopar.core.rules import AxisRule, OpView, fits, replicate
from autopar.core.sizes import maximum

if TYPE_CHECKING:   # strategies imports this package
    from autopar.core.mesh import MeshSpec
    from autopar.core.plan import ExpertParallelPlan
    from autopar.core.strategies import NodeChoices, Strategy, StrategySpace

MOE = torch.ops.autopar.moe_experts.default
#: The rule name of the experts split by expert over an axis (expert parallelism).
EXPERTS = "experts"
#: The rule name of each expert split within, by its intermediate dimension (expert tensor parallelism).
WITHIN = "experts-within"
#: ``gate_up`` [E, 2I, H] split within: the gate's rows and the up's, each block split over the axis.
GATE_UP_WITHIN = ShardBlocks(1, 2)
HIDDEN, IDS, WEIGHTS, GATE_UP, DOWN = range(5)   # the op's tensor inputs; then its biases, where it has them


@rule(MOE)
def split_experts(v: OpView, n: int) -> list[AxisRule]:
    """Tokens [T, H] (with their top-k ids and weights [T, k]) split evenly on dim 0, the
    experts whole ("batch") or split by expert (``EXPERTS``: dim 0 of ``gate_up`` and ``down``),
    where the number of experts divides by ``n`` and no earlier axis split them (one axis runs
    the all-to-alls); or the tokens whole and each expert split within (``within``)."""
    tokens, gate_up = v.in_shapes[HIDDEN], v.in_shapes[GATE_UP]
    weights = len(v.in_shapes) - 3   # gate_up, down and their biases, where given
    rules = [replicate(v)] + within(v, n)
    if not fits(tokens[0], n, even=True):
        return rules
    split = (Shard(0),) * 3
    rules.append(AxisRule(Shard(0), split + (Replicate(),) * weights, "batch"))
    if gate_up[0] == num_experts(v.node) and gate_up[0] % n == 0:
        rules.append(AxisRule(Shard(0), split + (Shard(0),) * weights, EXPERTS))
    return rules


def within(v: OpView, n: int) -> list[AxisRule]:
    """Megatron's split of an MLP, per expert: ``gate_up`` by its intermediate rows (the gate's and
    the up's alike: ``GATE_UP_WITHIN``), ``down`` by its intermediate columns, so that each rank
    computes its share of every routed row's intermediate activations and a partial sum of the
    output; tokens, ids and router weights whole on the axis. Where the intermediate size
    divides by ``n`` and no earlier axis split it (one axis splits it, in two blocks). Not with
    biases (the down projection's would be added on every rank of the partial sum)."""
    inner = v.in_shapes[DOWN][2]
    if (inner % n or inner != tensor_val(v.node.args[DOWN]).shape[2] or len(v.in_shapes) > DOWN + 1
            or _activation(v.node) not in ACTIVATIONS):
        return []
    gate_up = GATE_UP_WITHIN if gated(v.in_shapes[GATE_UP], v.in_shapes[DOWN]) else Shard(1)   # (a plain MLP: its rows)
    return [AxisRule(Partial(), (Replicate(),) * 3 + (gate_up, Shard(2)), WITHIN)]


def _activation(node: fx.Node) -> str:
    """The layer's activation: a name of ``ACTIVATIONS``, or of a gate captured from the model
    (``GATES``), which may read its rows in any layout (gpt-oss's interleave gate and up columns)."""
    return str(node.args[DOWN + 1]) if len(node.args) > DOWN + 1 else str(node.kwargs.get("activation", "silu"))


def within_axis(placed: Placed) -> int | None:
    """The mesh axis that splits each expert within under ``placed`` (``down`` by its columns), or None."""
    return next((a for a, p in enumerate(placed.ins[DOWN]) if p == Shard(2)), None)


def num_experts(node: fx.Node) -> int:
    """E: how many experts the layer has (dim 0 of its ``gate_up``)."""
    return int(tensor_val(node.args[GATE_UP]).shape[0])


def expert_axis(placed: Placed) -> int | None:
    """The mesh axis that splits the experts by expert under ``placed``, or None."""
    return next((a for a, p in enumerate(placed.ins[GATE_UP]) if p == Shard(0)), None)


@emitter(MOE)
def emit(em: Emitter, site: Site) -> bool:
    """Always the kernel ``moe_experts``: over its axis's group where the experts are split by
    expert; else on this rank's tokens with every expert (the same code, differentiated by
    autograd rather than the op's recomputing backward). Split within, it runs unchanged on this
    rank's slice of each expert (its gate and up rows, its down columns): a partial sum."""
    axis, inner = expert_axis(site.plan), within_axis(site.plan)
    text = em.call_text(site.node, site.reads)
    how = (f"; experts split by expert over {em.axes[axis]}: tokens sent to their experts' ranks and back by "
           "all-to-all" if axis is not None else "")
    if inner is not None:
        how += f"; each expert split within over {em.axes[inner]}: a partial sum of the output"
    em.emit(f"{site.node.name} = kernels.moe_experts({text[text.index('(') + 1:-1]}, mesh=mesh, axis={axis})",
            site.comment + how)
    return True


@kernel
def moe_experts(hidden: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, *, mesh: DeviceMesh, axis: int | None) -> torch.Tensor:
    """The experts on this rank's tokens: ``routed_experts`` over mesh ``axis``'s group (this
    rank's experts being its slice of them), or with every expert here (``axis`` None). A slice of
    a larger value (experts stacked in the graph: ``autopar.core.expert_lists``) is copied first,
    so that what the backward keeps is the slice, not the whole stack."""
    gate_up, down, gate_up_bias, down_bias = (_own(w) for w in (gate_up, down, gate_up_bias, down_bias))
    return routed_experts(hidden, top_idx, top_w, gate_up, down, None if axis is None else mesh.get_group(axis),
                          activation, gate_up_bias, down_bias)


def _own(weight: torch.Tensor | None) -> torch.Tensor | None:
    """``weight``, copied where it is a computed view of a larger tensor (a parameter is used as it is)."""
    if weight is None:
        return None
    base = weight._base
    return weight.clone() if not weight.is_leaf and base is not None and base.numel() > weight.numel() else weight


def _evenly_routed(hidden: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on this rank's tokens, their rows routed evenly over the local experts
    (profiling's integer inputs are zeros: every row to one expert). A gate captured from a model
    in another process (``GATES``) is timed as SwiGLU's, its cost alike to within its few elementwise ops."""
    activation = activation if activation in ACTIVATIONS or activation in GATES else "silu"
    even = torch.arange(top_idx.numel(), device=top_idx.device).remainder(gate_up.size(0)).view(top_idx.shape)
    return routed_experts(hidden, even, top_w, gate_up, down, None, activation, gate_up_bias, down_bias)


AS_RUN = TimedKernel("autopar.moe_experts.kernel", _evenly_routed)


@timed(MOE)
def as_run(call: LocalCall, node: fx.Node, placed: Placed, mesh_shape: Sequence[int],
           grad: Mapping[fx.Node, bool]) -> LocalCall:
    """Timed as generated code runs it: the kernel under autograd (``AS_RUN``), not the op, whose
    backward runs the kernel's forward again (1.6-2.8x the kernel's time on this host); its
    all-to-alls are priced apart (``all_to_alls``)."""
    return LocalCall(AS_RUN, call.args, call.kwargs)


def _with(p: Placements, axis: int, placement: Shard | Replicate) -> Placements:
    return tuple(placement if a == axis else q for a, q in enumerate(p))


@collectives(MOE)
def all_to_alls(node: fx.Node, placed: Placed, mesh_shape: Sequence[int], grad: bool,
                loss_with_gradients: str | None) -> list[Collective]:
    """Split by expert: the counts exchanged (one small all-to-all), then each (token, choice)
    row [T*k, H] sent to its expert's rank and the result sent back (two all-to-alls), each again
    in the backward; priced as an all-to-all of the rows on the axis (uniform routing: each rank
    sends and receives T*k/n rows). Each is the ``all_to_all_single`` the kernel calls, priced
    on that collective's link (not DTensor's all-to-all, which gloo runs as an all-gather), at
    the experts' in-step factor (``Collective.in_step``)."""
    axis = expert_axis(placed)
    if axis is None:
        return []
    hidden, ids = tensor_val(node.args[HIDDEN]), tensor_val(node.args[IDS])
    rows = (hidden.shape[0] * ids.shape[1], hidden.shape[1])
    tokens = placed.ins[HIDDEN]
    move = Collective(rows, hidden.dtype, tokens, _with(tokens, axis, Shard(1)), kind="all_to_all_single",
                      in_step="experts")
    counts = Collective((mesh_shape[axis], num_experts(node)), torch.int64, _with(tokens, axis, Shard(0)),
                        _with(tokens, axis, Shard(1)), kind="all_to_all_single", in_step="experts")
    return [counts, move, move] + ([move, move] if grad else [])


@imbalance(MOE)
def busiest_rank(placed: Placed, skew_on: Callable[[int], float]) -> float:
    """Split by expert, the router decides how many rows each rank receives: the busiest gets
    ``skew_on(axis)`` times the mean (``PlanOptions.expert_skew`` for the expert axis's size), and
    its experts, its all-to-alls and its dispatched rows take that much longer and more memory.
    Split by token, each rank runs its own rows: no imbalance."""
    axis = expert_axis(placed)
    return skew_on(axis) if axis is not None else 1.0

@saved(MOE)
def dispatched(node: fx.Node, flags: tuple[bool, ...]) -> Kept | None:
    """What autograd keeps of the kernel: tokens, router weights and experts (inputs), and per
    (token, choice) row the dispatched token and the returned result (2H) and the expert's gate,
    activation, up projection and product (4I; a plain MLP: its projection and activation, 2I; a
    gate of the model's own: what it keeps, ``gate_kept``), in the experts' dtype. The kernel is autograd's
    ops (``routed_experts``), each freeing what it kept as its backward runs: ``by_parts``. A
    rank keeps its share of the rows, and of the 4I where each expert is split within
    (``kept_share``)."""
    hidden, ids, gate_up, down = (tensor_val(node.args[i]) for i in (HIDDEN, IDS, GATE_UP, DOWN))
    rows = hidden.shape[0] * ids.shape[1]
    inner = 2 * gate_up.shape[1] if gated(gate_up.shape, down.shape) else 2 * down.shape[2]
    if _activation(node) in GATES:   # a gate of the model's own keeps what it keeps (counted once, run)
        inner = gate_kept(_activation(node), gate_up.shape[1])
    extra = rows * (2 * hidden.shape[1] + inner) * gate_up.element_size()
    weights = (HIDDEN, WEIGHTS, *range(GATE_UP, len(flags)))   # (the ids are not differentiated)
    return Kept(frozenset(i for i in weights if flags[i]), False, extra, by_parts=True,
                share=functools.partial(kept_share, 2 * hidden.shape[1], inner))


def kept_share(token_part: int, inner_part: int, ins: Sequence[Placements], mesh_shape: Sequence[int]) -> float:
    """The share of the kept rows one rank holds: its tokens' share of the rows, each row's
    ``token_part`` values whole and its ``inner_part`` values split as each expert is (within)."""
    rows = shard_fraction(ins[HIDDEN], mesh_shape)
    within = math.prod(mesh_shape[a] for a in split_axes(ins[DOWN], 2))
    return rows * (token_part + inner_part / within) / (token_part + inner_part)


@working(MOE)
def row_buffers(node: fx.Node, placed: Placed, mesh_shape: Sequence[int]) -> float:
    """The kernel's temporaries beside what it keeps, on this rank's T*k rows (uniform routing), in
    the experts' dtype, the larger of its two passes. Forward: three buffers of rows [T*k, H] at
    once (sent, received and grouped by expert, the experts' outputs on their way back; the
    all-to-all's buffers are these). Backward: one local expert's gate and up gradients ([r, I]
    each, r = T*k / local experts), while its kept product is freed; the rows' own gradients
    (about two [T*k, H]) take the place of the kept rows freed before them. Split within, I is
    this rank's share."""
    tokens, hidden = largest_shard_shape(tensor_val(node.args[HIDDEN]).shape, placed.ins[HIDDEN], mesh_shape)
    gate_up = tensor_val(node.args[GATE_UP])
    experts, fused, _ = largest_shard_shape(gate_up.shape, placed.ins[GATE_UP], mesh_shape)
    rows = tokens * tensor_val(node.args[IDS]).shape[1]
    forward, backward = 3 * rows * hidden, rows * fused / experts   # (a plain MLP: one gradient of [r, I])
    return maximum(forward, backward) * gate_up.element_size()


@register_flop_formula(torch.ops.autopar.moe_experts)
def _flops(hidden_shape, ids_shape, weights_shape, gate_up_shape, down_shape, *args, out_shape=None, **kwargs) -> int:
    """The grouped GEMMs over the rows routed (T*k): [rows, H] x [H, 2I] and [rows, I] x [I, H]."""
    rows = hidden_shape[0] * ids_shape[1]
    return 2 * rows * gate_up_shape[1] * gate_up_shape[2] + 2 * rows * down_shape[1] * down_shape[2]



def grouped_gemms(hidden: Sequence[int], ids: Sequence[int], weights: Sequence[int], gate_up: Sequence[int],
                  down: Sequence[int], *biases: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """The products (m, n, k, batch) the experts run on one rank, from its inputs' local shapes:
    each of its E_l experts multiplies its share of the rows routed to this rank (T*k rows,
    uniform routing: T*k / E_l each) by [H, 2I], then by [I, H]; priced per shape
    (``cost_models.efficiency``), so few tokens an expert reach less of the GEMM rate."""
    experts = gate_up[0]
    rows = -(-hidden[0] * ids[1] // experts)
    return [(rows, gate_up[1], gate_up[2], experts), (rows, down[1], down[2], experts)]


# ----------------------------------------------------------------------------
# What the planner is told to do, and what it did
# ----------------------------------------------------------------------------


def _forced_axis(space: StrategySpace, layers: list[NodeChoices], axis: str) -> int:
    """The index of mesh axis ``axis``, which ``expert_parallel`` names to split the experts
    over (by expert or within); else a clear ``AutoparError``."""
    names = space.mesh.axis_names
    if axis not in names:   # the mesh was checked (``check_axis``): a pipeline stage's, without the pipeline axis
        raise AutoparError(f"expert_parallel names mesh axis {axis!r}, which carries the pipeline's stages (its "
                           "ranks hold other layers): name another axis to split the experts over, or another "
                           "pipeline axis")
    if not layers:
        raise AutoparError("expert_parallel names an axis, but the model has no mixture-of-experts layer autopar "
                           "recognises (transformers' experts classes with fused gate_up_proj / down_proj weights "
                           "and SiLU, or a hand-written list of MLP experts); pass expert_parallel='auto' "
                           "or False")
    return names.index(axis)


def _refuse_by_expert(space: StrategySpace, layers: list[NodeChoices], a: int) -> None:
    """Refuse splitting by expert over mesh axis ``a`` where some layer of ``layers`` cannot."""
    name, ranks = space.mesh.axis_names[a], space.mesh.shape[a]
    for nc in layers:
        e, tokens = num_experts(nc.node), tensor_val(nc.node.args[HIDDEN]).shape[0]
        if e % ranks:
            raise AutoparError(f"{nc.node.name} has {e} experts, which cannot split evenly over mesh axis {name!r} "
                               f"of {ranks} ranks: name an axis whose size divides {e}")
        if not any(expert_axis(s) == a for s in nc.strategies):
            raise AutoparError(f"{nc.node.name}'s {tokens} tokens cannot split evenly over mesh axis {name!r} of "
                               f"{ranks} ranks (each rank routes its own tokens): change the batch or the axis")


def _refuse_within(space: StrategySpace, layers: list[NodeChoices], a: int) -> None:
    """Refuse splitting each expert within over mesh axis ``a`` where some layer cannot."""
    name, ranks = space.mesh.axis_names[a], space.mesh.shape[a]
    for nc in layers:
        inner = tensor_val(nc.node.args[DOWN]).shape[2]
        if any(isinstance(a, fx.Node) for a in nc.node.args[DOWN + 2:]):
            raise AutoparError(f"{nc.node.name}'s experts have biases, so they cannot split within (each rank of "
                               "the partial sum would add the down projection's bias): split them by expert only")
        if _activation(nc.node) not in ACTIVATIONS:
            raise AutoparError(f"{nc.node.name}'s experts gate with a function of their model's own "
                               f"({_activation(nc.node)}), whose layout of the gate and up columns autopar does not "
                               "know, so they cannot split within: split them by expert only")
        if inner % ranks:
            raise AutoparError(f"{nc.node.name}'s experts have an intermediate size of {inner}, which cannot split "
                               f"evenly over mesh axis {name!r} of {ranks} ranks: name an axis whose size divides "
                               f"{inner}")


def _forced(space: StrategySpace, choice: dict[str, str]) -> tuple[int | None, int | None]:
    """(axis splitting by expert, axis splitting within) that a forcing ``choice`` names, checked."""
    layers = [nc for nc in space.nodes if nc.node.target is MOE]
    by, inner = (_forced_axis(space, layers, choice[k]) if k in choice else None for k in ("axis", "within"))
    if by is not None:
        _refuse_by_expert(space, layers, by)
    if inner is not None:
        _refuse_within(space, layers, inner)
    return by, inner


def check_axis(choice: str | bool | dict[str, str], mesh: MeshSpec) -> None:
    """Refuse an ``expert_parallel`` axis the mesh lacks (a typo), before any planning."""
    for axis in choice.values() if isinstance(choice, dict) else ():
        if axis not in mesh.axis_names:
            raise AutoparError(f"expert_parallel names mesh axis {axis!r}, which the mesh "
                               f"{tuple(mesh.axis_names)} lacks: name one of its axes")


def narrowed(space: StrategySpace, choice: str | bool | dict[str, str]) -> StrategySpace:
    """``space`` with the MoE layers' strategies ``PlanOptions.expert_parallel`` allows: all
    ("auto"), none split by expert (False), or exactly the layout a dict names (split by expert
    over ``axis``, within each expert over ``within``, neither where its key is absent). A new
    space: the one given (which problems share) is kept."""
    if choice == "auto":
        return space
    forced = None if choice is False else _forced(space, choice)  # type: ignore[arg-type]

    def allowed(s: Strategy) -> bool:
        if forced is None:
            return expert_axis(s) is None
        return (expert_axis(s), within_axis(s)) == forced

    nodes = [replace(nc, strategies=[s for s in nc.strategies if allowed(s)]) if nc.node.target is MOE else nc
             for nc in space.nodes]
    return replace(space, nodes=nodes)


def expert_parallel_of(space: StrategySpace, chosen: Sequence[Strategy],
                       skew_on: Callable[[int], float] = lambda axis: 1.0) -> ExpertParallelPlan | None:
    """``Plan.expert_parallel``: the layout most MoE layers split their experts in (the mesh axis
    splitting them by expert and the experts each rank holds; the axis splitting each within),
    how many layers of how many do, and the router's skew priced where not uniform and some
    layer splits by expert; None where none splits its experts."""
    layouts = [(expert_axis(s), within_axis(s), num_experts(nc.node))
               for nc, s in zip(space.nodes, chosen, strict=True) if nc.node.target is MOE]
    split = [(a, w, e) for a, w, e in layouts if (a, w) != (None, None)]
    if not split:
        return None
    a, w, e = max(set(split), key=lambda layout: (split.count(layout), str(layout)))
    names = space.mesh.axis_names
    found: ExpertParallelPlan = {"layers": split.count((a, w, e)), "of": len(layouts)}
    if a is not None:
        found = {"axis": names[a], "experts_per_rank": e // space.mesh.shape[a], **found}
    if w is not None:
        found = {**found, "within": names[w]}
    if a is not None and skew_on(a) != 1.0:
        found["skew"] = skew_on(a)
    return found

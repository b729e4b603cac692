"""Symbolic costs: a plan's step time and memory as sympy expressions of batch ``B`` and sequence
length ``S``, so a report can show how they grow, and a plan can be re-costed at another size
without tracing the model again.

``symbolic_plan_costs(model, plan, args, kwargs)`` captures the model once with ``torch.export``
and the batch (dim 0) and sequence (dim 1) of its 2-D integer inputs (token ids, labels) marked
dynamic, so shapes in the graph are symbols. Export's symbols become ``B`` and ``S``. Each graph
node is matched to the plan's node (the same ops in the same order; see ``align_plan``) and its
chosen placements are priced by the planner's own ``CostModel`` (``cost_models.estimate``):
the same node, edge and redistribution code, fed sympy sizes instead of ints, so every formula
exists once. Compute is the roofline (no profile): measured op times exist only at the shapes
that were profiled, so a plan made with a profile is re-costed here from the roofline.

What is exact and what is simplified:

* per-node costs (compute, communication, the memory of each lifetime) are the cost model's own,
  exactly; so are their sums (``compute_s``, ``comm_s``, ``overlapped_comm_s``, ``comm_bytes``,
  ``state_bytes``, ``activation_bytes``, ``gradient_bytes``);
* ``SymbolicCosts.simulate(b, s)`` runs the planner's schedule (``cost_models.schedule``) on the
  per-node costs evaluated at ``b, s``: it gives exactly the step time and peak memory the
  planner would predict for these placements at that size;
* the closed forms ``peak_memory_bytes``, ``exposed_comm_s`` and ``step_time_s`` (for reports)
  simplify the schedule, see ``closed_forms``.
"""
from __future__ import annotations

import difflib
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard
from torch.export import Dim
from torch.utils import _pytree as pytree

from autopar.core.capture import CapturedGraph, capture, check_inputs, tensor_val
from autopar.core.errors import AutoparError
from autopar.core.execution import IDENTITY_OPS, VIEW_OPS
from autopar.core.mesh import MeshSpec
from autopar.core.placements import Placements
from autopar.core.plan import NodePlan, Plan
from autopar.core.strategies import NodeChoices, Strategy, StrategySpace, _no_tiny_shards, build_space
from cost_models.estimate import Cost, CostModel, _dim, get_optimizer
from cost_models.schedule import StepPrediction, Timeline, step_costs

__all__ = ["B", "S", "GraphMismatchError", "SymbolicCosts", "symbolic_plan_costs", "closed_forms", "exposed_terms",
           "align_plan"]

B, S = sympy.symbols("B S", positive=True, integer=True)

KIND_OP = {"param": "parameter", "input": "input", "buffer": "buffer", "output": "output"}
# Ops that move no data: a run of them may differ between two captures of one model (export
# records a full-range slice as ``alias`` at fixed sizes, as ``slice`` with symbolic ones).
_PASS_THROUGH = {str(t) for t in VIEW_OPS | IDENTITY_OPS}
_VIEWS = {str(t) for t in VIEW_OPS}


class GraphMismatchError(AutoparError):
    """The model's graph is not the one the plan was made for."""


# ---------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------


@dataclass
class SymbolicCosts:
    """One training step of a plan, per device, as sympy expressions of ``B`` and ``S``.

    Times in seconds, memory in bytes. ``at(b, s)`` evaluates them; ``simulate(b, s)`` runs the
    planner's exact schedule at that size; ``describe()`` is a few lines for a report."""

    model_name: str
    mesh: MeshSpec
    planned: tuple[int, int]             # (batch, sequence) the plan was made at
    compute_s: sympy.Expr                # forward + backward compute (roofline)
    backward_s: sympy.Expr               # of which backward
    comm_s: sympy.Expr                   # blocking communication
    overlapped_comm_s: sympy.Expr        # gradient synchronisation queued during the backward
    exposed_comm_s: sympy.Expr           # closed form: the part no backward compute hides (exact at the planned size)
    step_time_s: sympy.Expr              # closed form: compute + blocking comm + exposed
    comm_bytes: dict[str, sympy.Expr]    # bytes sent per device, per mesh axis name
    state_bytes: sympy.Expr              # parameters, optimizer states, inputs: live all step
    activation_bytes: sympy.Expr         # kept from the forward for the backward
    gradient_bytes: sympy.Expr           # parameter gradients
    working_bytes: sympy.Expr            # largest working memory of one op
    optimizer_bytes: sympy.Expr          # largest temporary of one parameter's update
    peak_memory_bytes: sympy.Expr        # closed form, see ``closed_forms``
    flops: sympy.Expr                    # forward FLOPs of the whole model (all devices together)
    limits: dict[str, tuple[int, int | None]]   # valid range of "B" and "S" (the model's own limits)
    # sharded dims that grow with B and S: (size, sharded on each mesh axis?); each rank needs a part
    sharded: set[tuple[sympy.Expr, tuple[bool, ...]]] = field(default_factory=set, repr=False)
    exposed_picks: tuple[int, ...] = ()  # the synchronisations in ``exposed_comm_s``'s max (``closed_forms``)
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    # per-node costs and the schedule, for ``simulate``
    _nodes: list[Cost] = field(default_factory=list, repr=False)
    _queued: list[tuple[int, sympy.Expr]] = field(default_factory=list, repr=False)
    _timeline: Timeline | None = field(default=None, repr=False)

    EXPRESSIONS = ("compute_s", "backward_s", "comm_s", "overlapped_comm_s", "exposed_comm_s", "step_time_s",
                   "state_bytes", "activation_bytes", "gradient_bytes", "working_bytes", "optimizer_bytes",
                   "peak_memory_bytes", "flops")

    def _sizes(self, batch: int, seq: int) -> dict[sympy.Symbol, int]:
        for label, sym, value in (("batch", "B", batch), ("seq", "S", seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AutoparError(f"{label} must be a positive int, got {value!r}")
            low, high = self.limits[sym]
            if value < low or (high is not None and value > high):
                bounds = f"{low} <= {sym} <= {high}" if high is not None else f"{sym} >= {low}"
                raise AutoparError(f"{self.model_name} accepts {bounds} (its own limits, found by torch.export); "
                                   f"got {label}={value}")
        sizes = {B: batch, S: seq}
        for size, axes in sorted(self.sharded, key=str):
            n = int(_number(size, sizes))
            if not _no_tiny_shards((n,), tuple(Shard(0) if a else Replicate() for a in axes), self.mesh):
                split = " x ".join(str(k) for k, a in zip(self.mesh.shape, axes, strict=True) if a)
                raise AutoparError(f"the plan splits a dim of size {size} over {split} devices: at B={batch}, S={seq} "
                                   f"({size} = {n}) some device gets none of it; the plan needs a larger size")
        return sizes

    def at(self, batch: int, seq: int) -> dict[str, float]:
        """Every expression at ``B=batch, S=seq`` (no tracing); ``comm_bytes`` as ``comm_bytes_<axis>``.

        Raises ``AutoparError`` outside the model's limits, or where the plan splits a dim that
        grows with B or S over more devices than it has elements. Rules that want an even split
        (some views, attention) are not re-checked: at a size that divides unevenly the planner
        might not offer these placements; they are costed as the cost model costs uneven shards."""
        sizes = self._sizes(batch, seq)
        out = {name: _number(getattr(self, name), sizes) for name in self.EXPRESSIONS}
        out.update({f"comm_bytes_{axis}": _number(e, sizes) for axis, e in self.comm_bytes.items()})
        return out

    def simulate(self, batch: int, seq: int) -> StepPrediction:
        """The planner's schedule (``Timeline.simulate``) on the per-node costs at ``B=batch, S=seq``:
        exactly the step time, exposed communication and peak memory the planner predicts for
        these placements at that size (roofline costs)."""
        nodes, queued = _evaluate(self._nodes, self._queued, self._sizes(batch, seq))
        return self._timeline.simulate(nodes, queued)

    def describe(self, digits: int = 3) -> str:
        """A few lines for a report: how step time and memory grow with ``B`` and ``S``."""
        b, s = self.planned
        now = self.at(b, s)
        lim = self.limits["S"][1]
        head = (f"{self.model_name} on {self.mesh.describe()}, per device, as functions of batch B and sequence "
                f"length S (roofline; planned at B={b}, S={s}{f'; S <= {lim}' if lim else ''}):")
        exact = self.simulate(b, s)
        rows = [
            ("step time", self.step_time_s, "ms", 1e3, now["step_time_s"], exact.step_s),
            ("  compute", self.compute_s, "ms", 1e3, now["compute_s"], None),
            ("  blocking comm", self.comm_s, "ms", 1e3, now["comm_s"], None),
            ("  gradient sync", self.overlapped_comm_s, "ms", 1e3, now["overlapped_comm_s"], None),
            ("  exposed sync", self.exposed_comm_s, "ms", 1e3, now["exposed_comm_s"], exact.exposed_s),
            ("peak memory", self.peak_memory_bytes, "MiB", 2.0 ** -20, now["peak_memory_bytes"], exact.peak_bytes),
            ("  state", self.state_bytes, "MiB", 2.0 ** -20, now["state_bytes"], None),
            ("  activations", self.activation_bytes, "MiB", 2.0 ** -20, now["activation_bytes"], None),
            ("  gradients", self.gradient_bytes, "MiB", 2.0 ** -20, now["gradient_bytes"], None),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [head]
        sizes = {B: b, S: s}
        for label, expr, unit, scale, value, scheduled in rows:
            note = f"{_sig(value * scale, digits)} {unit} at the planned size"
            if scheduled is not None:
                note += f"; the exact schedule: {_sig(scheduled * scale, digits)} {unit}"
            if label == "step time":
                shown = pretty(resolve_max(self.compute_s + self.comm_s, sizes) * scale, digits)
                exposed = _clamp(self.exposed_comm_s, sizes, scale)
                shown += f" + {pretty(exposed, digits)}" if exposed != 0 else ""
            elif label == "  exposed sync":
                shown = pretty(_clamp(expr, sizes, scale), digits)
            else:
                shown = pretty(resolve_max(expr, sizes) * scale, digits)
            lines.append(f"  {label.ljust(width)} = {shown} {unit}   ({note})")
        lines.append("  (step time = compute + blocking comm + exposed sync; each op's roofline max(compute, memory) "
                     "taken as it falls at the planned size; exposed sync and peak simplify the schedule, "
                     ".simulate(B, S) runs it)")
        return "\n".join(lines)


_SCALAR_FIELDS = tuple(f.name for f in fields(Cost) if f.name not in ("comm_bytes", "measured"))


def _evaluate(nodes: Sequence[Cost], queued: Sequence[tuple[int, object]], sizes: dict
              ) -> tuple[list[Cost], list[tuple[int, float]]]:
    """Per-node costs and queued synchronisations at ``sizes`` (each distinct expression once)."""
    memo: dict[sympy.Basic, float] = {}

    def num(x):
        if not isinstance(x, sympy.Basic):
            return x
        if x not in memo:
            memo[x] = _number(x, sizes)
        return memo[x]

    return ([_map_cost(c, num) for c in nodes], [(i, num(x)) for i, x in queued])


def _map_cost(c: Cost, f) -> Cost:
    return Cost(**{k: f(getattr(c, k)) for k in _SCALAR_FIELDS}, comm_bytes=tuple(f(x) for x in c.comm_bytes),
                measured=c.measured)


def _number(expr, sizes: dict) -> float:
    if isinstance(expr, sympy.Basic):
        return float(expr.xreplace(sizes))
    return float(expr)


def _sig(x: float, digits: int) -> str:
    return f"{x:.{digits}g}"


def resolve_max(expr, sizes: dict):
    """``expr`` with each ``Max`` replaced by its argument that is largest at ``sizes``: the formula
    that holds around that size (e.g. which ops are compute- and which memory-bound there)."""
    if not isinstance(expr, sympy.Basic) or not expr.args:
        return expr
    if isinstance(expr, sympy.Max):
        return resolve_max(max(expr.args, key=lambda a: _number(a, sizes)), sizes)
    return expr.func(*(resolve_max(a, sizes) for a in expr.args))


def _clamp(expr, sizes: dict, scale: float):
    """The exposed communication for display: its outer max kept (it reaches a bound as B and S
    grow), the maxes inside resolved, ``scale`` taken inside."""
    if isinstance(expr, sympy.Max):
        return sympy.Max(*(sympy.expand(scale * resolve_max(a, sizes)) for a in expr.args), evaluate=False)
    return sympy.expand(scale * resolve_max(expr, sizes))


def pretty(expr, digits: int = 3) -> str:
    """``expr`` expanded into terms, each coefficient rounded to ``digits`` significant digits."""
    expr = sympy.sympify(expr)
    expr = sympy.expand(expr) if not isinstance(expr, sympy.Max) else expr
    numbers = {a: sympy.Float(float(_sig(float(a), digits)), digits) for a in expr.atoms(sympy.Number)
               if not (a.is_Integer and abs(int(a)) < 10 ** digits)}
    return sympy.sstr(expr.xreplace(numbers), full_prec=False, order="grlex")


# ---------------------------------------------------------------------------------------------
# Closed forms of the schedule
# ---------------------------------------------------------------------------------------------


def closed_forms(nodes: Sequence[Cost], queued: Sequence[tuple[int, object]], timeline: Timeline,
                 axes: Sequence[str], picks: Sequence[int] | None = None) -> dict[str, Any]:
    """Totals and closed forms over per-node costs (``nodes[i]``: node i's cost with its incoming
    edges, ``queued``: (node index, seconds) of gradient synchronisations; as ``Timeline.simulate``
    takes them). Works on numbers and on sympy expressions alike.

    Simplifications of ``Timeline.simulate``, which checks every position of the step:

    * ``peak_memory_bytes`` = the larger of the end of the forward (state + every kept activation
      + the largest working memory of one op) and the optimizer step (state + every gradient +
      the largest update temporary). It bounds every moment of the forward from above (it adds
      the largest working memory of any op to all activations) and is exact at the optimizer
      step; a peak inside the backward, where gradients pile up faster than activations are
      freed, can exceed it.
    * ``exposed_comm_s`` = max(0, e_k for k in ``picks``), ``e_k`` from ``exposed_terms``. Over
      every k (``picks=None``) this is exactly the schedule's exposed time; ``symbolic_plan_costs``
      picks the first and last synchronisation and the one that binds at the planned size: exact
      there, a lower bound elsewhere (exact while the same synchronisation binds).
    """
    kinds = [nc.kind for nc in timeline.space.nodes]
    add = _total
    totals = {
        "compute_s": add(c.compute_s for c in nodes),
        "backward_s": add(c.backward_s for c in nodes),
        "comm_s": add(c.comm_s for c in nodes),
        "overlapped_comm_s": add(x for _, x in queued),
        "state_bytes": add(c.state_bytes for c in nodes),
        "activation_bytes": add(c.saved_bytes for c in nodes),
        "gradient_bytes": add(c.grad_bytes for c in nodes),
        "working_bytes": _max([c.transient_bytes for c, k in zip(nodes, kinds, strict=True) if k == "op"]),
        "optimizer_bytes": _max([c.transient_bytes for c, k in zip(nodes, kinds, strict=True) if k == "param"]),
    }
    totals["comm_bytes"] = {a: add(c.comm_bytes[i] if i < len(c.comm_bytes) else 0 for c in nodes)
                            for i, a in enumerate(axes)}
    state = totals["state_bytes"]
    totals["peak_memory_bytes"] = _max([state + totals["activation_bytes"] + totals["working_bytes"],
                                        state + totals["gradient_bytes"] + totals["optimizer_bytes"]])
    totals["exposed_comm_s"] = _max([0, *exposed_terms(nodes, queued, timeline, picks).values()])
    totals["step_time_s"] = totals["compute_s"] + totals["comm_s"] + totals["exposed_comm_s"]
    return totals


def exposed_terms(nodes: Sequence[Cost], queued: Sequence[tuple[int, object]], timeline: Timeline,
                  picks: Sequence[int] | None = None) -> dict[int, Any]:
    """The schedule's gradient synchronisations run one after another on one channel, each from
    when the backward has produced it; so the exposed time is max(0, max over k of ``e_k``), with
    ``e_k`` = (seconds of the synchronisations queued from the k-th on) - (backward compute left
    after the k-th is queued), k in queue order (the backward runs nodes in reverse schedule
    order; node i's synchronisations are queued after its backward). ``e_k`` for k in ``picks``
    (default: all)."""
    order = sorted(range(len(nodes)), key=lambda i: (timeline.position[i], i))
    rank = {i: r for r, i in enumerate(order)}
    syncs = sorted(((rank[i], q, x) for q, (i, x) in enumerate(queued)), key=lambda t: (-t[0], t[1]))
    out = {}
    for k in range(len(syncs)) if picks is None else picks:
        out[k] = _total(x for _, _, x in syncs[k:]) - _total(nodes[i].backward_s for i in order[:syncs[k][0]])
    return out


def _total(values) -> Any:
    values = list(values)
    if any(isinstance(v, sympy.Basic) for v in values):
        return sympy.Add(*values)
    return float(sum(values))


def _max(values: list) -> Any:
    if any(isinstance(v, sympy.Basic) for v in values):
        return sympy.Max(*set(values))
    return float(max(values, default=0.0))


# ---------------------------------------------------------------------------------------------
# Capture with dynamic batch and sequence
# ---------------------------------------------------------------------------------------------


@dataclass
class _DynamicCapture:
    captured: CapturedGraph
    symbols: dict[sympy.Symbol, sympy.Symbol]  # export's symbol -> B or S
    limits: dict[str, tuple[int, int | None]]
    planned: tuple[int, int]
    warnings: list[str]

    @property
    def graph(self) -> fx.Graph:
        return self.captured.graph


def _is_tokens(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 2 and not x.dtype.is_floating_point and not x.dtype.is_complex


def _capture_dynamic(model: torch.nn.Module, args: tuple, kwargs: dict) -> _DynamicCapture:
    """Export ``model`` with dims 0 and 1 of every 2-D integer input dynamic."""
    check_inputs(model, args, kwargs)
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    tokens = [x for x in pytree.tree_leaves(list(bound.arguments.values())) if _is_tokens(x)]
    if not tokens:
        raise AutoparError(
            f"{type(model).__name__}: symbolic costs need a 2-D integer input (token ids: batch x sequence) "
            "whose dims 0 and 1 become B and S; the example inputs have none")
    planned = (int(tokens[0].shape[0]), int(tokens[0].shape[1]))   # token ids are 2-D (``_is_tokens``)
    # export fixes a dim of size 1 (0/1 specialisation): capture such a dim at size 2 instead
    grow = any(d == 1 for t in tokens for d in t.shape)

    def spec(x):
        return {0: Dim.AUTO, 1: Dim.AUTO} if _is_tokens(x) else None

    def resized(x):
        return torch.zeros([max(d, 2) for d in x.shape], dtype=x.dtype, device=x.device) if _is_tokens(x) else x

    arguments = dict(bound.arguments)
    if grow:
        arguments = {k: pytree.tree_map(resized, v) for k, v in arguments.items()}
    dynamic = {k: pytree.tree_map(spec, v) for k, v in arguments.items()}
    call = inspect.signature(model.forward).bind_partial()
    call.arguments.update(arguments)
    captured = capture(model, tuple(call.args), dict(call.kwargs), dynamic_shapes=dynamic)
    program = captured.program
    symbols: dict[sympy.Symbol, sympy.Symbol] = {}
    fixed = set()
    for node in program.graph.nodes:
        val = tensor_val(node) if node.op == "placeholder" and node.name in captured.user_inputs else None
        if val is None or val.dim() != 2 or val.dtype.is_floating_point:
            continue
        for d, target in ((0, B), (1, S)):
            e = _dim(val.shape[d])
            if isinstance(e, sympy.Symbol):
                symbols[e] = target
            elif isinstance(e, (int, sympy.Integer)):
                fixed.add(str(target))
    limits = {}
    for target in ("B", "S"):
        uppers = [program.range_constraints[e].upper for e, t in symbols.items()
                  if str(t) == target and e in program.range_constraints]
        finite = [int(u) for u in uppers if isinstance(u, (int, sympy.Integer))]
        limits[target] = (1, min(finite) if finite else None)
    warnings = []
    for target in sorted(fixed - {str(t) for t in symbols.values()}):
        warnings.append(f"torch.export fixed {target} at its example size: the model's code does not allow it to vary, "
                        f"so the costs do not depend on it")
        limits[target] = (planned[0 if target == "B" else 1],) * 2
    return _DynamicCapture(captured, symbols, limits, planned, warnings)


# ---------------------------------------------------------------------------------------------
# Matching the plan
# ---------------------------------------------------------------------------------------------


def _plan_key(n: NodePlan) -> str:
    return f"parameter {n.fqn}" if n.op == "parameter" else n.op


def _node_key(nc: NodeChoices) -> str:
    return f"parameter {nc.fqn}" if nc.kind == "param" else KIND_OP.get(nc.kind, str(nc.node.target))


def _strategy(n: NodePlan) -> Strategy:
    return Strategy(n.out, n.ins, ("plan",) * len(n.out), n.storage)


def align_plan(plan: Plan, space: StrategySpace) -> tuple[list[Strategy], list[str], list[str]]:
    """The plan's strategy for each node of ``space``, matched by position in the op sequence (node
    names differ between captures: symbolic sizes get nodes of their own). Where the sequences
    differ only by views and identity copies (``alias``, ``slice``, ``contiguous``: export records
    them or not depending on sizes and device), the unmatched ones pass their input's placement
    through; any other difference is a ``GraphMismatchError``. Returns the strategies, the plan's
    name of each node (ours where unmatched) and warnings."""
    ours = [_node_key(nc) for nc in space.nodes]
    theirs = [_plan_key(n) for n in plan.nodes]
    chosen: list[Strategy | None] = [None] * len(ours)
    names = [nc.node.name for nc in space.nodes]
    warnings: list[str] = []
    matcher = difflib.SequenceMatcher(None, theirs, ours, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                chosen[j1 + k] = _strategy(plan.nodes[i1 + k])
                names[j1 + k] = plan.nodes[i1 + k].name
            continue
        plan_side, ours_side = plan.nodes[i1:i2], space.nodes[j1:j2]
        odd = [n.op for n in plan_side if n.op not in _PASS_THROUGH] + \
              [_node_key(nc) for nc in ours_side if _node_key(nc) not in _PASS_THROUGH or len(nc.inputs) != 1]
        if odd or any(len(n.ins) != 1 for n in plan_side):
            where = plan_side[0].name if plan_side else (plan.nodes[i1 - 1].name if i1 else "the start")
            raise GraphMismatchError(
                f"this model's graph differs from the one plan {plan.model_name!r} was made for, near plan node "
                f"{where!r}: the plan has {[n.op for n in plan_side]}, the model {[_node_key(nc) for nc in ours_side]}. "
                "Symbolic costs need the model and plan of the same architecture; re-plan this model.")
        changed = [n.name for n in plan_side if n.ins[0] != n.out]
        if not ours_side and changed:
            warnings.append(f"plan nodes {changed} change placement in a view this capture lacks: their "
                            "resharding is costed at the next op instead")
        copies = [n.name for n in plan_side if n.op not in _VIEWS] + \
                 [nc.node.name for nc in ours_side if nc.node.target not in VIEW_OPS]
        if copies:
            warnings.append(f"copies {copies} (contiguous/clone) are in only one of the plan and this capture: "
                            "costs differ from the plan's by them")
        block = {nc.node for nc in ours_side}
        for j, nc in zip(range(j1, j2), ours_side, strict=True):
            src = nc.inputs[0]
            if src in block:
                inp = plan_side[-1].out if plan_side else chosen[space.index[src]].out
            elif plan_side:
                inp = plan_side[0].ins[0]
            else:
                inp = _out_of(chosen, space, src)
            out = plan_side[-1].out if plan_side else inp
            chosen[j] = Strategy(out, (inp,), ("follow",) * len(out))
    return chosen, names, warnings


def _out_of(chosen: list, space: StrategySpace, node: fx.Node) -> Placements:
    i = space.index.get(node)
    if i is None or chosen[i] is None:
        return (Replicate(),) * space.mesh.ndim
    return chosen[i].out


# ---------------------------------------------------------------------------------------------
# Costing
# ---------------------------------------------------------------------------------------------


def symbolic_plan_costs(model: torch.nn.Module, plan: Plan, args: tuple, kwargs: dict | None = None, *,
                        optimizer: str = "adamw") -> SymbolicCosts:
    """Re-cost ``plan``'s placements as expressions of batch ``B`` and sequence length ``S``.

    ``model``, ``args``, ``kwargs``: the model the plan was made for and example inputs (any size;
    the batch and sequence dims of their 2-D integer inputs become ``B`` and ``S``; the model may
    be on ``meta``). Captures once; the result evaluates at any size without tracing.
    Costs are the roofline of ``plan.mesh.hardware`` (no profile: measured op times exist only at
    the shapes that were profiled), with ``optimizer``'s states and update.
    Raises ``GraphMismatchError`` when the model is not the plan's."""
    kwargs = kwargs or {}
    if not isinstance(args, tuple):
        args = (args,)
    _check_plan_of(model, plan)
    t0 = time.perf_counter()
    cap = _capture_dynamic(model, args, kwargs)
    timings = {"capture": time.perf_counter() - t0}
    t0 = time.perf_counter()
    space, chosen, cost_model, timeline, warnings = _planned_space(plan, cap, optimizer)
    swap = dict(cap.symbols)

    def sub(x):
        return x.xreplace(swap) if isinstance(x, sympy.Basic) else x

    costs, queued = step_costs(space, cost_model, chosen)
    costs = [_map_cost(c, sub) for c in costs]
    queued = [(i, sub(x)) for i, x in queued]
    flops = _total([sub(cost_model.flops(nc.node)) for nc in space.nodes
                    if nc.kind == "op" and nc.node.target not in VIEW_OPS])
    # the exposed synchronisation's closed form: the first, the last and the one that binds at the planned size
    at_plan = exposed_terms(*_evaluate(costs, queued, {B: cap.planned[0], S: cap.planned[1]}), timeline)
    picks = sorted({0, len(queued) - 1, max(at_plan, key=at_plan.get)}) if queued else []
    forms = closed_forms(costs, queued, timeline, plan.mesh.axis_names, picks)
    timings["costs"] = time.perf_counter() - t0
    _check_batch_and_sequence_only(plan, [*forms.values(), *forms["comm_bytes"].values(), flops])
    if plan.predicted.profiled:
        warnings.append("the plan was costed with a measured profile; symbolic costs are the roofline, so they "
                        "differ from the plan's figures at the planned size")
    comm_bytes = forms.pop("comm_bytes")
    return SymbolicCosts(
        model_name=plan.model_name, mesh=plan.mesh, planned=cap.planned,
        **{k: sympy.sympify(v) for k, v in forms.items()},
        comm_bytes={a: sympy.sympify(v) for a, v in comm_bytes.items()},
        flops=sympy.sympify(flops), limits=cap.limits, sharded=_sharded_sizes(space, chosen, sub),
        exposed_picks=tuple(picks), warnings=cap.warnings + warnings, timings=timings,
        _nodes=costs, _queued=queued, _timeline=timeline)


def _check_plan_of(model: torch.nn.Module, plan: Plan) -> None:
    """``plan`` was made for ``model``'s class and runs its batch in one microbatch."""
    if type(model).__name__ != plan.model_name:
        raise GraphMismatchError(f"plan {plan.model_name!r} was made for another model than {type(model).__name__}; "
                                 "re-plan this model")
    if plan.microbatches > 1:
        raise AutoparError(f"plan {plan.model_name!r} runs its batch in {plan.microbatches} microbatches; symbolic "
                           "costs cover plans of one microbatch (plan with microbatches=1 to see them)")


def _planned_space(plan: Plan, cap: _DynamicCapture, optimizer: str) -> tuple[StrategySpace, list, CostModel, Timeline, list[str]]:
    """The dynamic capture's strategy space with each node's one strategy the plan's (``align_plan``),
    the cost model of the plan's knobs, the step's timeline, and the alignment's warnings."""
    space = build_space(cap.captured, plan.mesh, with_strategies=False)
    chosen, names, warnings = align_plan(plan, space)
    for nc, s in zip(space.nodes, chosen, strict=True):
        nc.strategies = [s]
    cost_model = CostModel(plan.mesh, space, optimizer=get_optimizer(optimizer), gather_outputs=plan.gather_outputs,
                           recompute=plan.recompute, reduce_precision=plan.reduce_precision,
                           offload=bool(plan.offloaded), expert_skew=plan.expert_parallel.get("skew", 1.0) if plan.expert_parallel else 1.0)
    timeline = Timeline(space, block_of=cost_model.block_of)
    timeline.names = names
    return space, chosen, cost_model, timeline, warnings


def _sharded_sizes(space: StrategySpace, chosen: list, sub: Callable[[Any], Any]) -> set:
    """(symbolic size, which mesh axes split it) of every tensor dim of B or S the plan splits."""
    sharded = set()
    for nc, chose in zip(space.nodes, chosen, strict=True):
        for val, placements in [(tensor_val(nc.node), chose.out), *((tensor_val(i), p) for i, p in zip(nc.inputs, chose.ins, strict=True))]:
            for d in range(val.dim() if val is not None else 0):
                axes = tuple(isinstance(p, Shard) and p.dim == d for p in placements)
                size = sub(_dim(val.shape[d]))
                if any(axes) and isinstance(size, sympy.Basic) and size.free_symbols:
                    sharded.add((size, axes))
    return sharded


def _check_batch_and_sequence_only(plan: Plan, values: list) -> None:
    """The closed forms depend on no size but ``B`` and ``S``."""
    stray = set()
    for value in values:
        if isinstance(value, sympy.Basic):
            stray |= value.free_symbols - {B, S}
    if stray:
        raise AutoparError(f"{plan.model_name}'s costs depend on sizes other than batch and sequence "
                           f"({', '.join(sorted(map(str, stray)))}): symbolic costs cover B and S only")


"""``format_report``: the human-readable explanation of a ``Plan`` (what ``Plan.report()`` returns).

Sections: header (model, mesh, hardware, memory budget); the predicted step (time split into
compute and communication, peak memory per device with its breakdown, bytes sent per mesh axis);
the solver's result; time per planning stage; the parameters (grouped by layer pattern, so a
96-layer model reads as one row per kind of parameter); the most expensive nodes; warnings.

Everything here reads only the ``Plan`` (a plan loaded with ``Plan.from_json`` reports the same).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.core.hardware import get_hardware
from autopar.core.placements import placements_str
from autopar.core.units import fmt

if TYPE_CHECKING:   # plan.py imports this module for Plan.report(); types only here
    from autopar.core.blocks import RecomputeMode
    from autopar.core.plan import ExpertParallelPlan, NodePlan, Plan, Prediction, TimeLimitLog

__all__ = ["BASES", "format_report", "fmt", "headline", "param_pattern", "step_with_band", "summary"]  # fmt re-exported from autopar.core.units

#: What a prediction rests on (``Prediction.basis``), as the report says it.
BASES = {
    "profile": "times measured on this host (autopar profile, calibrated on whole training steps)",
    "first-profile": "times measured on this host by a first compile (not calibrated on whole steps: "
                     "`autopar profile` does it)",
    "tables": "the preset's efficiency tables (measured and published kernel and NCCL rates, cost_models/tables)",
    "roofline": "an uncalibrated roofline (datasheet peaks): a lower bound, not a prediction; run `autopar "
                "profile` on this machine, or plan for a preset with efficiency tables",
}


def _op_name(op: str) -> str:
    """``aten.linear.default`` -> ``linear``; ``<built-in function getitem>`` -> ``getitem``."""
    m = re.fullmatch(r"<built-in function (\w+)>", op)
    if m:
        return m.group(1)
    if op.startswith("aten."):
        op = op[len("aten."):]
        if op.endswith(".default"):
            op = op[: -len(".default")]
    return op


def param_pattern(fqn: str) -> str:
    """The layer pattern of a parameter name: numeric path components become ``*``.

    ``transformer.h.11.attn.c_attn.weight`` -> ``transformer.h.*.attn.c_attn.weight`` (``ln_1``
    keeps its digit: only whole components that are numbers are layer indices).
    """
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def _index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``."""
    out, start, prev = [], None, None
    for i in sorted(set(indices)):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


@dataclass
class _ParamRow:
    name: str
    count: int
    strategy: str
    storage: str
    memory_bytes: float | None        # per device (None: none of its parameters on the device reported)
    stages: str = ""                  # the pipeline stages holding them


class _Holding:
    """Where a pipeline plan's parameters live, for a per-device parameter table: the stages
    holding each, and the parameters of the one device the table reports (a device of the pipeline
    rank of the peak). Without a pipeline every device holds every parameter."""

    def __init__(self, plan: Plan) -> None:
        p = plan.pipeline
        self.rank = p.peak_rank() if p is not None else None
        self.held = p.held_by(self.rank) if p is not None else None
        self.stages: dict[str, list[int]] = {}
        for k, stage in enumerate(p.stages if p is not None else ()):
            for f in stage.parameters:
                self.stages.setdefault(f, []).append(k)

    def row(self, name: str, strategy: str, storage: str, ms: list[NodePlan]) -> _ParamRow:
        """A row of ``ms``: their memory on the reported device, the stages holding them."""
        fqns = [m.fqn or m.name for m in ms]
        mine = [m for m, f in zip(ms, fqns, strict=True) if self.held is None or f in self.held]
        stages = _index_ranges([k for f in fqns for k in self.stages.get(f, [])]) if self.held is not None else ""
        return _ParamRow(name, len(ms), strategy, storage, sum(m.memory_bytes for m in mine) if mine else None,
                         stages)


def _storage_text(n: NodePlan) -> str:
    placed = placements_str(n.storage) if n.storage is not None else placements_str(n.out)
    return placed + " in host memory" if n.offloaded else placed


def _strategy_text(n: NodePlan) -> str:
    # The label spells out ZeRO-3 storage ("stored (S(0), R), gathered on use"); the storage
    # column already shows it, so keep the strategy column short.
    return re.sub(r" \(stored .*, gathered on use\)$", "", n.strategy)


def _param_rows(params: list[NodePlan], holding: _Holding) -> list[_ParamRow]:
    """One row per layer pattern whose members all share a strategy, else one row per
    (pattern, strategy) with the layer indices spelled out (counted where the pattern has two
    indices; one parameter alone by its name)."""
    groups: dict[str, list[NodePlan]] = {}
    for n in params:
        groups.setdefault(param_pattern(n.fqn or n.name), []).append(n)
    rows = []
    for pattern, members in groups.items():
        by_choice: dict[tuple[str, str], list[NodePlan]] = {}
        for n in members:
            by_choice.setdefault((_strategy_text(n), _storage_text(n)), []).append(n)
        if len(by_choice) == 1 or "*" not in pattern:
            for (strategy, storage), ms in by_choice.items():
                rows.append(holding.row(pattern if len(ms) > 1 else (ms[0].fqn or ms[0].name), strategy, storage, ms))
            continue
        for (strategy, storage), ms in by_choice.items():
            if pattern.count("*") == 1 and len(ms) > 1:
                rows.append(holding.row(_named_layers(pattern, [m.fqn or m.name for m in ms]), strategy, storage, ms))
            elif len(ms) > 1:   # (a list in a list, e.g. each layer's experts: counted, not spelled out)
                rows.append(holding.row(pattern, strategy, storage, ms))
            else:
                rows.extend(holding.row(m.fqn or m.name, strategy, storage, [m]) for m in ms)
    return rows


def _table(headers: list[str], rows: list[list[str]], right: Collection[int] = frozenset(), indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return indent + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(headers), indent + "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _hardware_line(name: str) -> str:
    try:
        hw = get_hardware(name)
    except Exception:  # noqa: BLE001 - a report never fails on a hardware file that moved
        return name
    flops = hw.peak_flops.get("float32")
    return (f"{hw.name} ({fmt(hw.memory_bytes, 'B')} memory, {flops / 1e12:.3g} TFLOP/s fp32, "
            f"{hw.devices_per_node} devices per node)")


def _recompute_line(recompute: dict[str, RecomputeMode]) -> str:
    """Each recomputation mode with the blocks it applies to (first and last of a run)."""
    if not recompute:
        return "none (every activation the backward needs is kept)"
    by_mode: dict[str, list[str]] = {}
    for path, mode in recompute.items():
        by_mode.setdefault(mode, []).append(path)
    what = {"full": "each keeps its input and runs its forward again in the backward",
            "selective": "each keeps its attention core's inputs and computes the attention probabilities again "
                         "in the backward"}
    return "; ".join(f"{mode} for {len(paths)} block(s) ({paths[0]}" + (f" ... {paths[-1]})" if len(paths) > 1 else ")")
                     + f": {what[mode]}" for mode, paths in by_mode.items())


def _experts_line(ep: ExpertParallelPlan) -> str:
    """Expert parallelism: the axes splitting the mixture-of-experts layers by expert and within."""
    parts = []
    if "axis" in ep:
        per_rank = f"{ep['experts_per_rank']} expert{'s' * (ep['experts_per_rank'] != 1)} per rank"
        parts.append(f"split by expert over {ep['axis']}: {per_rank}, tokens sent to their experts' ranks and back "
                     "by all-to-all")
    if "within" in ep:
        parts.append(f"each expert split within over {ep['within']} (its intermediate dimension: a partial sum "
                     "of the output)")
    skew = (f"; priced with the busiest rank receiving {ep['skew']:g}x the mean of the rows routed (expert_skew)"
            if "skew" in ep else "")
    return f"{'; '.join(parts)} ({ep['layers']} of {ep['of']} MoE layers){skew}"


def _pipeline_lines(plan: Plan) -> list[str]:
    """The pipeline section: schedule, microbatches, bubble, and one row per stage."""
    p = plan.pipeline
    ranks = plan.mesh.shape[plan.mesh.axis_names.index(p.axis)]
    lines = [f"Pipeline over {p.axis}: {p.num_stages} stages on {ranks} ranks ({p.virtual_stages} per rank), "
             f"{p.schedule}, {p.num_microbatches} microbatches of {plan.microbatch_size} rows; predicted bubble "
             f"{100 * p.bubble_fraction:.1f}% of the busiest rank's step",
             "  each stage runs the placements below on the other axes; times per microbatch; memory per device: "
             "its parameters (with their gradients and optimizer states), its rank's peak (all its stages, the "
             "microbatches in flight)"]
    state = {n.fqn or n.name: n.memory_bytes for n in plan.nodes if n.op == "parameter"}
    rows = []
    for k, stage in enumerate(p.stages):
        modules = stage.modules[0] if len(stage.modules) == 1 else f"{stage.modules[0]} ... {stage.modules[-1]}"
        rows.append([str(k), str(p.rank_of(k)), f"{stage.blocks[0]}-{stage.blocks[1] - 1}", modules,
                     fmt(stage.forward_s, "s"), fmt(stage.backward_s, "s"),
                     fmt(sum(state.get(f, 0.0) for f in stage.parameters), "B"), fmt(stage.peak_memory_bytes, "B")])
    lines += _table(["stage", "rank", "blocks", "modules", "forward", "backward", "parameters", "rank's peak"], rows,
                    right={4, 5, 6, 7})
    return lines + [""]


def _parameter_lines(plan: Plan, params: list[NodePlan], axes: str) -> list[str]:
    """The parameters section: one row per layer pattern and choice, memory per device (under a
    pipeline, a device of the peak's rank, with the stages holding each row)."""
    holding = _Holding(plan)
    rows = _param_rows(params, holding)
    grouped = "" if len(rows) == len(params) else f", {len(rows)} rows: layers with the same choice share one"
    where = "per device" if holding.rank is None else (
        f"on one device of pipeline rank {holding.rank}, the rank of the peak ('-': held by other ranks only; "
        f"each stage's share is in the pipeline table)")
    lines = [f"Parameters ({len(params)}{grouped})",
             f"  placements per mesh axis ({axes}): R replicated, S(d) split on tensor dim d "
             f"(S(d:b): in b blocks, each split); memory = parameter + gradient + optimizer state {where}",
             f"  strategy counts: {_counts(params)}"]
    headers = ["parameter", "n", "strategy", "storage", "memory"] + (["stages"] if holding.rank is not None else [])
    table = [[r.name, f"x{r.count}" if r.count > 1 else "", r.strategy, r.storage,
              fmt(r.memory_bytes, "B") if r.memory_bytes is not None else "-"]
             + ([r.stages] if holding.rank is not None else []) for r in rows]
    return lines + _table(headers, table, right={1, 4}) + [""]


def step_with_band(p: Prediction) -> str:
    """The step time with the band validation runs found on its basis: "1.9 s (likely 1.6 s-2.3 s)"
    (a band need not hold the prediction: runs on a basis may all take longer than predicted)."""
    band = p.band_s
    return fmt(p.step_time_s, "s") + (f" (likely {fmt(band[0], 's')}-{fmt(band[1], 's')})" if band else "")


#: A part of the step below this share of it is said to be negligible, not given in nanoseconds.
NEGLIGIBLE = 1e-3


def _share(part: float, whole: float, digits: int = 0) -> str:
    """``part`` as a percentage of ``whole``, a nonzero part too small to show as "under 0.1%"."""
    if whole <= 0:
        return "-"
    share = 100 * part / whole
    least = 10.0 ** -digits
    return f"under {least:g}%" if 0 < share < least else f"{share:.{digits}f}%"


def _step_parts(p: Prediction) -> str:
    """What the step time is made of: compute, blocking communication, and the gradient
    synchronisation queued during the backward with the part of it no compute hides."""
    total = p.step_time_s
    parts = [f"compute {fmt(p.compute_s, 's')} ({_share(p.compute_s, total)})",
             f"blocking communication {fmt(p.comm_s, 's')} ({_share(p.comm_s, total)})" if p.comm_s > 0
             else "no blocking communication"]
    queued, exposed = p.overlapped_comm_s, p.exposed_comm_s
    if queued <= 0:
        parts.append("no gradient sync")
    elif queued < NEGLIGIBLE * total:
        parts.append(f"gradient sync negligible (under {NEGLIGIBLE:.1%} of the step)")
    elif exposed < NEGLIGIBLE * total:
        parts.append(f"gradient sync {fmt(queued, 's')} hidden under the backward")
    else:
        parts.append(f"exposed gradient sync {fmt(exposed, 's')} of {fmt(queued, 's')} queued during the backward")
    return ", ".join(parts)


def utilisation(p: Prediction) -> str:
    """MFU and HFU as the reports give them ("" where the peak FLOP/s are unknown)."""
    return f"MFU {_share(p.mfu, 1)}, HFU {_share(p.hfu, 1)}" if p.mfu > 0 else ""


def headline(plan: Plan) -> dict[str, str]:
    """The figures both reports lead with (text ``format_report``, HTML ``report_html``)."""
    p = plan.predicted
    used = f", {_share(p.peak_memory_bytes, plan.memory_budget, 1)} of the budget" if plan.memory_budget > 0 else ""
    return {"model": plan.model_name, "mesh": plan.mesh.describe(), "step time": step_with_band(p),
            "utilisation": utilisation(p) or "unknown",
            "peak memory": f"{fmt(p.peak_memory_bytes, 'B')} per device{used}, at {p.peak_at or '?'}",
            "planning time": fmt(plan.planning_s, "s"),
            **({"context parallel": context_text(plan)} if plan.context_parallel is not None else {})}


def context_text(plan: Plan) -> str:
    """Where and how the plan splits attention by sequence (``Plan.context_parallel``)."""
    cp = plan.context_parallel
    if cp is None:
        return "none (every attention runs on whole sequences)"
    how = {"ring": "ring attention (keys and values passed around the axis)",
           "ulysses": "Ulysses (all-to-alls regroup the sequence by heads around attention)"}.get(cp.kind, cp.kind)
    ranks = "x".join(str(plan.mesh.shape[plan.mesh.axis_names.index(a)]) for a in cp.axis.split("+"))
    layout = {"balanced": "balanced layout (rank r holds chunks r and 2n-1-r: equal causal work)"}.get(
        cp.load_balance, f"{cp.load_balance} layout")
    return f"{how} over {cp.axis} ({ranks} ranks), {layout}, {len(cp.nodes)} attention call(s) split by sequence"


def format_report(plan: Plan, top: int | None = 12) -> str:
    """A readable planning report: what was chosen, what it is predicted to cost, and why it is
    slow. ``top``: nodes listed with their costs (``None``: every node)."""
    out = [*_header_lines(plan), *_prediction_lines(plan)]
    if plan.pipeline is not None:
        out.extend(_pipeline_lines(plan))
    out.extend(_solver_lines(plan))
    params = [n for n in plan.nodes if n.op == "parameter"]
    if params:
        out.extend(_parameter_lines(plan, params, ", ".join(plan.mesh.axis_names)))
    out.extend(_node_lines(plan, top))
    out.extend(_warning_lines(plan))
    return "\n".join(out)


def _header_lines(plan: Plan) -> list[str]:
    """What the plan is for and the knobs it turns: hardware, budget, precision, batch,
    recomputation, offload, outputs."""
    mesh = plan.mesh
    offloaded = plan.offloaded
    out = [
        f"autopar plan: {plan.model_name} on {mesh.describe()}",
        f"  hardware        {_hardware_line(mesh.hardware)}",
        f"  memory budget   {fmt(plan.memory_budget, 'B')} per device",
        f"  fingerprint     {plan.fingerprint} (model structure + input shapes)",
        "  precision       " + (plan.precision if plan.precision == "fp32" else f"{plan.precision} compute")
        + f"; fp32 parameters, gradients (summed over ranks in {plan.reduce_precision}) and optimizer states",
        "  batch           " + (f"{plan.batch_size} rows per step" if plan.microbatches == 1 else
                                f"{plan.batch_size} rows per step in {plan.microbatches} microbatches of "
                                f"{plan.microbatch_size} (gradient accumulation: train_step; node costs per step, "
                                f"memory per microbatch)"),
        "  recompute       " + _recompute_line(plan.recompute),
        "  offload         " + (f"optimizer: {len(offloaded)} ZeRO-sharded parameter(s) keep their shards, gradients "
                                "and optimizer states in host memory; the optimizer steps them there" if offloaded
                                else "none (parameters, gradients and optimizer states on the device)"),
        "  context         " + context_text(plan),
        "  outputs         " + ("gathered whole on every rank" if plan.gather_outputs
                                else "returned as DTensors, placed as planned (gather_outputs=False)"),
    ]
    if plan.expert_parallel is not None:
        out.insert(-2, "  experts         " + _experts_line(plan.expert_parallel))
    if not plan.feasible:
        out.append("  FEASIBLE        no: no plan fits the memory budget; the one below is the least bad")
    return [*out, ""]


def _prediction_lines(plan: Plan) -> list[str]:
    """The predicted step: its time and what it is made of, peak memory and its parts,
    communication per axis, utilisation, and what the figures rest on."""
    p = plan.predicted
    head = headline(plan)
    lower_bound = " (a lower bound: see 'rests on')" if p.basis == "roofline" else ""
    out = ["Predicted training step (forward + backward + optimizer, slowest device)",
           f"  step time       {head['step time']}{lower_bound}  ({_step_parts(p)})",
           f"  peak memory     {head['peak memory']}"]
    if p.memory_breakdown:
        width = max(len(k) for k in p.memory_breakdown)
        out.extend(f"    {k.ljust(width)}  {fmt(v, 'B').rjust(10)}" for k, v in p.memory_breakdown.items())
    comm = ", ".join(f"{a}: {fmt(b, 'B')}" for a, b in p.comm_bytes.items()) or "none"
    out.append(f"  communication   {comm} (bytes sent per device per step, by mesh axis)")
    if p.mfu > 0:
        out.append(f"  utilisation     {utilisation(p)} (model FLOPs, and with "
                   f"recomputed forwards, over the devices' peak in the compute dtype)")
    return [*out, f"  rests on        {BASES.get(p.basis, p.basis)}", f"  costs from      {p.cost_source or '?'}", ""]


def _solver_lines(plan: Plan) -> list[str]:
    """How the plan was found: the solver's status and size, planning time per stage, and what
    the time limit cut short."""
    s = plan.solver
    out = []
    if s:
        gap = s.get("gap")
        gap_text = f"{100 * gap:.2f}%" if isinstance(gap, (int, float)) and math.isfinite(gap) else str(gap)
        out.append(f"Solver          {s.get('status', '?')}, gap {gap_text}, {s.get('variables', '?')} variables, "
                   f"{s.get('constraints', '?')} constraints")
    if plan.timings:
        stages = ", ".join(f"{k} {fmt(v, 's')}" for k, v in plan.timings.items())
        out.append(f"Planning time   {fmt(plan.planning_s, 's')} ({stages})")
    limited = s.get("time_limit") if s else None
    if isinstance(limited, dict):
        out.append(_time_limit_line(limited))
    return [*out, ""] if s or plan.timings else out


def _time_limit_line(limited: TimeLimitLog) -> str:
    """What the time limit cut short, and whether another run makes the same plan: it does unless
    the wall clock stopped the search before its charged time did (``autopar.planning.work``)."""
    cut = limited.get("cut_short") or []
    again = ("the same call gives the same plan" if limited.get("reproducible", not cut) else
             "another run may give another plan")
    return (f"Time limit      {fmt(limited.get('limit_s', 0.0), 's')}"
            + (f", which cut short: {'; '.join(cut)} ({again}; raise time_limit for more)" if cut else
               f": nothing cut short ({again})"))


def _node_lines(plan: Plan, top: int | None) -> list[str]:
    """The ops by strategy, and the ``top`` nodes (``None``: all) by predicted time with their costs."""
    out = []
    ops = [n for n in plan.nodes if n.op not in ("parameter", "input", "buffer", "output")]
    if ops:
        out += [f"Ops ({len(ops)}): {_counts(ops)}", ""]
    if not (top is None or top > 0):
        return out
    ranked = sorted(plan.nodes, key=lambda n: n.compute_s + n.comm_s, reverse=True)
    ranked = [n for n in ranked if n.compute_s + n.comm_s + n.memory_bytes > 0]
    ranked = ranked if top is None else ranked[:top]
    title = "All nodes" if top is None else f"Top {len(ranked)} nodes"
    out.append(f"{title} by predicted time (compute: forward + backward, and the optimizer for parameters; comm: "
               "resharding into the node, gathers and gradient sync; memory: held per device, of which kept for the "
               "backward; source: measured by `autopar profile` or roofline)")
    table = [[n.name, _op_name(n.op), n.layer or n.fqn or "-",
              _strategy_text(n) if n.op == "parameter" else n.strategy,
              fmt(n.compute_s, "s"), fmt(n.comm_s, "s") if n.comm_s else "-",
              fmt(n.memory_bytes, "B"), fmt(n.saved_bytes, "B") if n.saved_bytes else "-", n.source]
             for n in ranked]
    out.extend(_table(["node", "op", "layer / parameter", "strategy", "compute", "comm", "memory", "kept", "source"],
                      table, right={4, 5, 6, 7}))
    return [*out, ""]


def _warning_lines(plan: Plan) -> list[str]:
    """The plan's warnings, and one where the predicted peak exceeds the budget."""
    p = plan.predicted
    warnings = list(plan.warnings)
    if plan.memory_budget > 0 and p.peak_memory_bytes > plan.memory_budget:
        warnings.append(f"predicted peak memory {fmt(p.peak_memory_bytes, 'B')} exceeds the budget "
                        f"{fmt(plan.memory_budget, 'B')}")
    if not warnings:
        return ["Warnings: none (every op has a sharding rule)"]
    return [f"Warnings ({len(warnings)})", *(f"  - {w}" for w in grouped_warnings(warnings))]


def grouped_warnings(warnings: list[str]) -> list[str]:
    """Warnings that say the same of each layer (``blocks.3.moe.experts: ...``) as one line naming
    the layers (``blocks.[0-31].moe.experts (32): ...``), in the order each first appears."""
    groups: dict[tuple[str, str], list[str]] = {}
    for w in warnings:
        name, sep, rest = w.partition(": ")
        key = (param_pattern(name), rest) if sep and " " not in name and "*" in param_pattern(name) else (w, "")
        groups.setdefault(key, []).append(name)
    out = []
    for (pattern, rest), names in groups.items():
        if not rest:
            out.append(pattern)
        elif len(names) == 1:
            out.append(f"{names[0]}: {rest}")
        else:
            out.append(f"{_named_layers(pattern, names)} ({len(names)}): {rest}")
    return out


def _named_layers(pattern: str, names: list[str]) -> str:
    """``blocks.*.moe`` over ``blocks.0.moe`` ... ``blocks.31.moe`` -> ``blocks.[0-31].moe``
    (the pattern as it is where it has several indices)."""
    if pattern.count("*") != 1:
        return pattern
    pos = pattern.split(".").index("*")
    return pattern.replace("*", f"[{_index_ranges([int(n.split('.')[pos]) for n in names])}]")


#: What a prediction rests on, in a few words (``summary``).
SHORT_BASES = {"profile": "from times measured on this host", "first-profile": "from times measured on this host",
               "tables": "from the preset's efficiency tables", "roofline": "(an uncalibrated roofline: a lower bound)"}


def summary(plan: Plan) -> list[str]:
    """A few lines on ``plan`` for the log (``compile`` says them): what was chosen, the predicted
    step and peak memory, and where the whole report is."""
    p = plan.predicted
    params = [n for n in plan.nodes if n.op == "parameter"]
    counts = Counter(_strategy_text(n) for n in params).most_common()
    placed = ", ".join(f"{label} {c}" for label, c in counts[:3]) + (", ..." if len(counts) > 3 else "")
    over = "" if plan.feasible else f", {fmt(plan.shortfall_bytes, 'B')} OVER the budget"
    return [f"{plan.model_name} on {plan.mesh.describe()} runs {_chosen(plan)}: parameters {placed} (of "
            f"{len(params)}){_knobs(plan)}",
            f"predicted step {step_with_band(p)} {SHORT_BASES.get(p.basis, p.basis)}; peak memory "
            f"{fmt(p.peak_memory_bytes, 'B')} per device ({_share(p.peak_memory_bytes, plan.memory_budget, 1)} of the "
            f"{fmt(plan.memory_budget, 'B')} budget{over})",
            f"planned in {fmt(plan.planning_s, 's')}; the module's plan.report() explains every choice"]


def _chosen(plan: Plan) -> str:
    """Which plan: the solver's, or a hand plan (kept by the planner, or given)."""
    kept = plan.solver.get("kept_hand_plan")
    if plan.name != "auto":
        return f"the hand plan {plan.name!r}"
    return f"the hand plan {kept!r} (the solver's plan did not beat it)" if kept else "the solver's plan"


def _knobs(plan: Plan) -> str:
    """The memory knobs the plan turns: pipeline, microbatches, recomputation, offload."""
    said = []
    if plan.pipeline is not None:
        pp = plan.pipeline
        said.append(f"a pipeline of {pp.num_stages} stages over {pp.axis} ({pp.schedule})")
    if plan.microbatches > 1:
        said.append(f"{plan.microbatches} microbatches of {plan.microbatch_size} rows")
    if plan.recompute:
        said.append(f"{plan.recompute_mode} recomputation of {len(plan.recompute)} blocks")
    if plan.context_parallel is not None:
        cp = plan.context_parallel
        said.append(f"attention split by sequence over {cp.axis} ({cp.kind}"
                    + (", balanced)" if cp.load_balance == "balanced" else ")"))
    if plan.offloaded:
        said.append(f"the optimizer states of {len(plan.offloaded)} parameters in host memory")
    return "".join(f"; {s}" for s in said)


def _counts(nodes: list[NodePlan]) -> str:
    counts = Counter(_strategy_text(n) if n.op == "parameter" else n.strategy for n in nodes)
    return ", ".join(f"{label} {c}" for label, c in counts.most_common())

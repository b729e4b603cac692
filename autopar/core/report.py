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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.core.hardware import get_hardware
from autopar.core.placements import placements_str
from autopar.core.units import fmt

if TYPE_CHECKING:   # plan.py imports this module for Plan.report(); types only here
    from autopar.core.plan import NodePlan, Plan, Prediction

__all__ = ["BASES", "format_report", "fmt", "param_pattern", "step_with_band"]  # fmt re-exported from autopar.core.units

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
    memory_bytes: float


def _storage_text(n: NodePlan) -> str:
    placed = placements_str(n.storage) if n.storage is not None else placements_str(n.out)
    return placed + " in host memory" if n.offloaded else placed


def _strategy_text(n: NodePlan) -> str:
    # The label spells out ZeRO-3 storage ("stored (S(0), R), gathered on use"); the storage
    # column already shows it, so keep the strategy column short.
    return re.sub(r" \(stored .*, gathered on use\)$", "", n.strategy)


def _param_rows(params: list[NodePlan]) -> list[_ParamRow]:
    """One row per layer pattern whose members all share a strategy, else one row per
    (pattern, strategy) with the layer indices spelled out (or per parameter)."""
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
                name = pattern if len(ms) > 1 else (ms[0].fqn or ms[0].name)
                rows.append(_ParamRow(name, len(ms), strategy, storage, sum(m.memory_bytes for m in ms)))
            continue
        for (strategy, storage), ms in by_choice.items():
            if pattern.count("*") == 1 and len(ms) > 1:
                pos = pattern.split(".").index("*")
                idx = [int((m.fqn or m.name).split(".")[pos]) for m in ms]
                name = pattern.replace("*", f"[{_index_ranges(idx)}]")
                rows.append(_ParamRow(name, len(ms), strategy, storage, sum(m.memory_bytes for m in ms)))
            else:
                rows.extend(_ParamRow(m.fqn or m.name, 1, strategy, storage, m.memory_bytes) for m in ms)
    return rows


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return indent + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), indent + "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _hardware_line(name: str) -> str:
    try:
        hw = get_hardware(name)
    except Exception:  # noqa: BLE001 - a report never fails on a hardware file that moved
        return name
    flops = hw.peak_flops.get("float32")
    return (f"{hw.name} ({fmt(hw.memory_bytes, 'B')} memory, {flops / 1e12:.3g} TFLOP/s fp32, "
            f"{hw.devices_per_node} devices per node)")


def _recompute_line(recompute: dict[str, str]) -> str:
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


def _pipeline_lines(plan: Plan) -> list[str]:
    """The pipeline section: schedule, microbatches, bubble, and one row per stage."""
    p = plan.pipeline
    ranks = plan.mesh.shape[plan.mesh.axis_names.index(p.axis)]
    lines = [f"Pipeline over {p.axis}: {p.num_stages} stages on {ranks} ranks ({p.virtual_stages} per rank), "
             f"{p.schedule}, {p.num_microbatches} microbatches of {plan.microbatch_size} rows; predicted bubble "
             f"{100 * p.bubble_fraction:.1f}% of the busiest rank's step",
             "  each stage runs the placements below on the other axes; times per microbatch; memory: its "
             "rank's peak (all its stages, the microbatches in flight)"]
    rows = []
    for k, stage in enumerate(p.stages):
        modules = stage.modules[0] if len(stage.modules) == 1 else f"{stage.modules[0]} ... {stage.modules[-1]}"
        rows.append([str(k), f"{stage.blocks[0]}-{stage.blocks[1] - 1}", modules, fmt(stage.forward_s, "s"),
                     fmt(stage.backward_s, "s"), fmt(stage.peak_memory_bytes, "B")])
    lines += _table(["stage", "blocks", "modules", "forward", "backward", "peak memory"], rows, right={3, 4, 5})
    return lines + [""]


def step_with_band(p: Prediction) -> str:
    """The step time with the band validation runs found on its basis: "1.9 s (1.6-2.3 s)"."""
    band = p.band_s
    return fmt(p.step_time_s, "s") + (f" ({fmt(band[0], 's')}-{fmt(band[1], 's')})" if band else "")


def format_report(plan: Plan, top: int | None = 12) -> str:
    """A readable planning report: what was chosen, what it is predicted to cost, and why it is
    slow. ``top``: nodes listed with their costs (``None``: every node)."""
    p = plan.predicted
    mesh = plan.mesh
    axes = ", ".join(mesh.axis_names)
    out: list[str] = []
    add = out.append

    # ------------------------------------------------------------------ header
    add(f"autopar plan: {plan.model_name} on {mesh.describe()}")
    add(f"  hardware        {_hardware_line(mesh.hardware)}")
    add(f"  memory budget   {fmt(plan.memory_budget, 'B')} per device")
    add(f"  fingerprint     {plan.fingerprint} (model structure + input shapes)")
    add("  precision       " + (plan.precision if plan.precision == "fp32" else f"{plan.precision} compute")
        + f"; fp32 parameters, gradients (summed over ranks in {plan.reduce_precision}) and optimizer states")
    add("  batch           " + (f"{plan.batch_size} rows per step" if plan.microbatches == 1 else
                              f"{plan.batch_size} rows per step in {plan.microbatches} microbatches of "
                              f"{plan.microbatch_size} (gradient accumulation: train_step; node costs per step, "
                              f"memory per microbatch)"))
    add("  recompute       " + _recompute_line(plan.recompute))
    offloaded = plan.offloaded
    add("  offload         " + (f"optimizer: {len(offloaded)} ZeRO-sharded parameter(s) keep their shards, gradients "
                                 "and optimizer states in host memory; the optimizer steps them there" if offloaded
                                 else "none (parameters, gradients and optimizer states on the device)"))
    add("  outputs         " + ("gathered whole on every rank" if plan.gather_outputs
                                 else "returned as DTensors, placed as planned (gather_outputs=False)"))
    if not plan.feasible:
        add("  FEASIBLE        no: no plan fits the memory budget; the one below is the least bad")
    add("")

    # ------------------------------------------------------------------ prediction
    add("Predicted training step (forward + backward + optimizer, slowest device)")
    total = p.step_time_s
    share = (lambda x: f"{100 * x / total:.0f}%") if total > 0 else (lambda x: "-")
    lower_bound = " (a lower bound: see 'rests on')" if p.basis == "roofline" else ""
    add(f"  step time       {step_with_band(p)}{lower_bound}  (compute {fmt(p.compute_s, 's')} {share(p.compute_s)}, "
        f"blocking communication {fmt(p.comm_s, 's')} {share(p.comm_s)}, exposed gradient sync "
        f"{fmt(p.exposed_comm_s, 's')} of {fmt(p.overlapped_comm_s, 's')} queued during the backward)")
    used = f", {100 * p.peak_memory_bytes / plan.memory_budget:.1f}% of the budget" if plan.memory_budget > 0 else ""
    add(f"  peak memory     {fmt(p.peak_memory_bytes, 'B')} per device{used}, at {p.peak_at or '?'}")
    if p.memory_breakdown:
        width = max(len(k) for k in p.memory_breakdown)
        for k, v in p.memory_breakdown.items():
            add(f"    {k.ljust(width)}  {fmt(v, 'B').rjust(10)}")
    comm = ", ".join(f"{a}: {fmt(b, 'B')}" for a, b in p.comm_bytes.items()) or "none"
    add(f"  communication   {comm} (bytes sent per device per step, by mesh axis)")
    if p.mfu > 0:
        add(f"  utilisation     MFU {100 * p.mfu:.0f}%, HFU {100 * p.hfu:.0f}% (model FLOPs, and with recomputed "
            f"forwards, over the devices' peak in the compute dtype)")
    add(f"  rests on        {BASES.get(p.basis, p.basis)}")
    add(f"  costs from      {p.cost_source or '?'}")
    add("")

    if plan.pipeline is not None:
        out.extend(_pipeline_lines(plan))

    # ------------------------------------------------------------------ solver and timings
    s = plan.solver
    if s:
        gap = s.get("gap")
        gap_text = f"{100 * gap:.2f}%" if isinstance(gap, (int, float)) and math.isfinite(gap) else str(gap)
        add(f"Solver          {s.get('status', '?')}, gap {gap_text}, {s.get('variables', '?')} variables, "
            f"{s.get('constraints', '?')} constraints")
    if plan.timings:
        stages = ", ".join(f"{k} {fmt(v, 's')}" for k, v in plan.timings.items())
        add(f"Planning time   {fmt(sum(plan.timings.values()), 's')} ({stages})")
    limited = s.get("time_limit") if s else None
    if isinstance(limited, dict):
        cut = limited.get("cut_short") or []
        add(f"Time limit      {fmt(limited.get('limit_s', 0.0), 's')}: "
            + (f"it cut short {'; '.join(cut)} (another run may give another plan; raise time_limit)" if cut
               else "nothing cut short (the same call gives the same plan)"))
    if s or plan.timings:
        add("")

    # ------------------------------------------------------------------ parameters
    params = [n for n in plan.nodes if n.op == "parameter"]
    if params:
        rows = _param_rows(params)
        grouped = "" if len(rows) == len(params) else f", {len(rows)} rows: layers with the same choice share one"
        add(f"Parameters ({len(params)}{grouped})")
        add(f"  placements per mesh axis ({axes}): R replicated, S(d) split on tensor dim d; "
            "memory = parameter + gradient + optimizer state per device")
        add(f"  strategy counts: {_counts(params)}")
        table = [[r.name, f"x{r.count}" if r.count > 1 else "", r.strategy, r.storage, fmt(r.memory_bytes, "B")]
                 for r in rows]
        out.extend(_table(["parameter", "n", "strategy", "storage", "memory"], table, right={1, 4}))
        add("")

    # ------------------------------------------------------------------ ops
    ops = [n for n in plan.nodes if n.op not in ("parameter", "input", "buffer", "output")]
    if ops:
        add(f"Ops ({len(ops)}): {_counts(ops)}")
        add("")
    ranked = sorted(plan.nodes, key=lambda n: n.compute_s + n.comm_s, reverse=True)
    ranked = [n for n in ranked if n.compute_s + n.comm_s + n.memory_bytes > 0]
    if top is None or top > 0:
        ranked = ranked if top is None else ranked[:top]
        title = "All nodes" if top is None else f"Top {len(ranked)} nodes"
        add(f"{title} by predicted time (compute: forward + backward, and the optimizer for parameters; comm: "
            "resharding into the node, gathers and gradient sync; memory: held per device, of which kept for the "
            "backward; source: measured by `autopar profile` or roofline)")
        table = [[n.name, _op_name(n.op), n.layer or n.fqn or "-",
                  _strategy_text(n) if n.op == "parameter" else n.strategy,
                  fmt(n.compute_s, "s"), fmt(n.comm_s, "s") if n.comm_s else "-",
                  fmt(n.memory_bytes, "B"), fmt(n.saved_bytes, "B") if n.saved_bytes else "-", n.source]
                 for n in ranked]
        out.extend(_table(["node", "op", "layer / parameter", "strategy", "compute", "comm", "memory", "kept", "source"],
                          table, right={4, 5, 6, 7}))
        add("")

    # ------------------------------------------------------------------ warnings
    warnings = list(plan.warnings)
    if plan.memory_budget > 0 and p.peak_memory_bytes > plan.memory_budget:
        warnings.append(f"predicted peak memory {fmt(p.peak_memory_bytes, 'B')} exceeds the budget "
                        f"{fmt(plan.memory_budget, 'B')}")
    if warnings:
        add(f"Warnings ({len(warnings)})")
        out.extend(f"  - {w}" for w in warnings)
    else:
        add("Warnings: none (every op has a sharding rule)")
    return "\n".join(out)


def _counts(nodes: list[NodePlan]) -> str:
    counts = Counter(_strategy_text(n) if n.op == "parameter" else n.strategy for n in nodes)
    return ", ".join(f"{label} {c}" for label, c in counts.most_common())

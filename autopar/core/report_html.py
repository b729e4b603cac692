"""``plan_html``: a plan as one self-contained HTML page (what ``Plan.to_html`` writes).

Inline SVG charts drawn by the small helpers below (no script, no network): the summary the text
report leads with (``report.headline``), memory per device over the step, the placement map
(layers x mesh axes), time per layer, communication per mesh axis, the pipeline schedule as a Gantt
chart (given its simulated ``schedule``: ``autopar.planning.pipeline.schedule_timeline``), and
the strategies the search weighed. Repeated layers share a row (``report.param_pattern``), so a
96-layer model's page stays small.
"""
from __future__ import annotations

import html
import re
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autopar.core.placements import placements_str
from autopar.core.report import headline, param_pattern
from autopar.core.units import fmt

if TYPE_CHECKING:
    from autopar.core.plan import NodePlan, Plan

#: One simulated computation: (rank, kind "F"/"B"/"I"/"W", stage, microbatch, start s, end s).
Interval = tuple[int, str, int, int, float, float]

COLOURS = {"state": "#4e79a7", "parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#76b7b2",
           "activations": "#59a14f", "recomputed": "#edc948", "working": "#b07aa1", "compute": "#4e79a7",
           "blocking comm": "#e15759", "gradient sync": "#f28e2b", "F": "#4e79a7", "B": "#59a14f",
           "I": "#59a14f", "W": "#76b7b2", "busy": "#4e79a7", "predicted": "#4e79a7", "measured": "#59a14f"}
WIDTH = 760
#: Above this many computations the Gantt chart draws each rank's busy runs, not every microbatch.
GANTT_DETAIL = 3000
STYLE = ("body{font-family:sans-serif;max-width:980px;margin:1em auto;color:#222}table{border-collapse:collapse;"
         "font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}.note{color:#666;"
         "font-size:13px}svg{display:block;margin:.5em 0}text{font-size:11px;font-family:sans-serif}")


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "") -> str:
    tip = f"<title>{_e(title)}</title>" if title else ""
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{h:.1f}" fill="{fill}">{tip}</rect>'


def _text(x: float, y: float, text: str, anchor: str = "start") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{_e(text)}</text>'


def _svg(height: float, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" role="img" '
            f'aria-label="{_e(label)}">{"".join(body)}</svg>')


def _legend(keys: Sequence[str], y: float) -> list[str]:
    out = []
    for i, k in enumerate(keys):
        out += [_rect(10 + 150 * i, y - 9, 10, 10, COLOURS.get(k, "#999")), _text(24 + 150 * i, y, k)]
    return out


def bar_chart(rows: list[tuple[str, dict[str, float]]], unit: str, label: str) -> str:
    """Horizontal stacked bars: per row its parts (key -> value), ``unit`` "s" or "B"."""
    keys = list(dict.fromkeys(k for _, parts in rows for k in parts))
    top = max((sum(parts.values()) for _, parts in rows), default=0.0) or 1.0
    left, bar = 250, WIDTH - 340
    body = _legend(keys, 14)
    for i, (name, parts) in enumerate(rows):
        y, x = 24 + 16 * i, float(left)
        body.append(_text(left - 4, y + 11, name[-40:], "end"))
        for k, v in parts.items():
            w = bar * v / top
            body.append(_rect(x, y, w, 13, COLOURS.get(k, "#999"), f"{name}: {k} {fmt(v, unit)}"))
            x += w
        body.append(_text(x + 4, y + 11, fmt(sum(parts.values()), unit)))
    return _svg(30 + 16 * len(rows), body, label)


def _layer_of(n: NodePlan) -> str:
    """A node's module path; a parameter's is its name's module."""
    return n.layer or (n.fqn or n.name).rpartition(".")[0] or "(model)"


def layer_groups(plan: Plan) -> dict[str, list[NodePlan]]:
    """Nodes by layer pattern (``transformer.h.*.attn``), in the order the graph first runs them."""
    out: dict[str, list[NodePlan]] = {}
    for n in plan.nodes:
        if n.op not in ("input", "output"):
            out.setdefault(param_pattern(_layer_of(n)), []).append(n)
    return out


def _count(pattern: str, nodes: list[NodePlan]) -> str:
    layers = {_layer_of(n) for n in nodes}
    return f"{pattern} (x{len(layers)})" if len(layers) > 1 else pattern


def time_chart(plan: Plan) -> str:
    """Per layer pattern, summed over its layers: compute, blocking communication (resharding,
    gathers) and gradient synchronisation (queued in the backward, mostly hidden)."""
    rows = [(_count(k, ns), {"compute": sum(n.compute_s for n in ns),
                             "blocking comm": sum(n.comm_s - n.sync_s for n in ns),
                             "gradient sync": sum(n.sync_s for n in ns)}) for k, ns in layer_groups(plan).items()]
    return bar_chart([r for r in rows if sum(r[1].values()) > 0], "s", "time per layer")


def comm_chart(plan: Plan) -> str:
    """Bytes each device sends a step, per mesh axis."""
    rows = [(a, {"sent": b}) for a, b in plan.predicted.comm_bytes.items()]
    return bar_chart(rows or [("(none)", {"sent": 0.0})], "B", "communication per mesh axis")


def memory_series(plan: Plan) -> tuple[list[str], dict[str, list[float]]]:
    """Memory per device over the step, rebuilt from what the plan keeps: the peak's breakdown
    (``Prediction.memory_breakdown``) and each node's kept activations (no per-op timeline).
    Moments: after each op's forward, then its backward in reverse. Activations grow as the
    forward keeps them and shrink as the backward frees them, gradients grow over the backward,
    the rest stays; each part reaches its value at the peak."""
    ops = [n for n in plan.nodes if n.op not in ("parameter", "input", "buffer", "output")]
    if not ops:
        return ["step"], {k: [v] for k, v in plan.predicted.memory_breakdown.items()}
    kept = [n.saved_bytes for n in ops] if any(n.saved_bytes for n in ops) else [1.0] * len(ops)
    activations = _cumulative(kept) + [1.0 - f for f in _cumulative(kept[::-1])]
    gradients = [0.0] * len(ops) + _cumulative([1.0] * len(ops))
    moments = [f"forward {n.name}" for n in ops] + [f"backward {n.name}" for n in ops[::-1]]
    series = {}
    for key, value in plan.predicted.memory_breakdown.items():
        shape = activations if key in ("activations", "recomputed") else gradients if key == "gradients" else None
        series[key] = [value * f for f in shape] if shape else [value] * len(moments)
    return moments, series


def _cumulative(values: list[float]) -> list[float]:
    """Running sums of ``values`` as fractions of their total."""
    out, acc, whole = [], 0.0, sum(values) or 1.0
    for v in values:
        acc += v
        out.append(acc / whole)
    return out


def memory_chart(plan: Plan) -> str:
    """The stacked area of ``memory_series`` with the peak marked."""
    moments, series = memory_series(plan)
    keep = range(0, len(moments), max(1, len(moments) // 400))   # a few hundred moments draw the shape
    moments, series = [moments[i] for i in keep], {k: [s[i] for i in keep] for k, s in series.items()}
    n = len(moments)
    totals = [sum(s[i] for s in series.values()) for i in range(n)]
    top = max(totals, default=0.0) or 1.0
    h, x0, w = 200.0, 60.0, WIDTH - 80.0

    def xy(i: int, v: float) -> str:
        return f"{x0 + w * i / max(n - 1, 1):.1f},{30 + h - h * v / top:.1f}"

    body, base = _legend(list(series), 14), [0.0] * n
    for key, values in series.items():
        upper = [b + v for b, v in zip(base, values, strict=True)]
        points = [xy(i, upper[i]) for i in range(n)] + [xy(i, base[i]) for i in reversed(range(n))]
        body.append(f'<polygon points="{" ".join(points)}" fill="{COLOURS.get(key, "#999")}">'
                    f"<title>{_e(key)}: {fmt(max(values), 'B')} at the peak</title></polygon>")
        base = upper
    peak = max(range(n), key=totals.__getitem__)
    px = x0 + w * peak / max(n - 1, 1)
    body += [f'<line x1="{px:.1f}" y1="30" x2="{px:.1f}" y2="{30 + h:.0f}" stroke="#000" stroke-dasharray="4"/>',
             _text(px, 28 + h + 16, f"peak {fmt(plan.predicted.peak_memory_bytes, 'B')} at "
                   f"{plan.predicted.peak_at or '?'}", "start" if peak / n <= 0.2 else "middle" if peak / n < 0.8 else "end"),
             _text(x0 - 4, 40, fmt(top, "B"), "end"), _text(x0, 30 + h + 30, "forward ->  <- backward")]
    return _svg(h + 70, body, "memory per device over the step")


def _placed(n: NodePlan) -> tuple[str, ...]:
    """A node's placement per mesh axis: a parameter's storage, else its output's."""
    ps = n.storage if n.op == "parameter" and n.storage is not None else n.out
    return tuple(placements_str(ps)[1:-1].replace(" ", "").split(",")) if ps else ()


def _recomputed(plan: Plan, nodes: list[NodePlan]) -> str:
    """" [recompute full 40/96]" where some layers of a row lie in recomputed blocks, else ""."""
    layers = {_layer_of(n) for n in nodes}
    modes = Counter(mode for layer in layers for path, mode in plan.recompute.items()
                    if layer == path or layer.startswith(path + "."))
    return "".join(f" [recompute {mode} {c}/{len(layers)}]" for mode, c in modes.items())


def placement_map(plan: Plan) -> str:
    """Layers x mesh axes: per cell the placements of the layer's nodes on that axis (most common
    first), coloured by the most common: replicated grey, split blue, partial orange; recomputed
    layers marked in their name."""
    axes = plan.mesh.axis_names
    groups = layer_groups(plan)
    left, cell = 400, (WIDTH - 410) / max(len(axes), 1)
    body = [_text(left + cell * (a + 0.5), 14, f"{name} ({plan.mesh.shape[a]})", "middle") for a, name in enumerate(axes)]
    for i, (layer, nodes) in enumerate(groups.items()):
        y = 20 + 16 * i
        body.append(_text(left - 4, y + 11, _count(layer, nodes)[-46:] + _recomputed(plan, nodes), "end"))
        for a in range(len(axes)):
            counts = Counter(p[a] for n in nodes if len(p := _placed(n)) > a).most_common()
            if not counts:
                continue
            first = counts[0][0]
            fill = "#ccc" if first == "R" else "#f28e2b" if first.startswith("P") else "#4e79a7"
            body += [_rect(left + cell * a + 1, y, cell - 2, 14, fill,
                           f"{layer} on {axes[a]}: " + ", ".join(f"{p} x{c}" for p, c in counts)),
                     _text(left + cell * (a + 0.5), y + 11, ", ".join(p for p, _ in counts[:3]), "middle")]
    return _svg(26 + 16 * len(groups), body, "placement map")


def gantt_chart(schedule: Sequence[Interval]) -> str:
    """The pipeline schedule per rank: forwards and backwards of each microbatch; the white
    between them is the bubble. Past ``GANTT_DETAIL`` computations, each rank's busy runs."""
    ranks = 1 + max(e[0] for e in schedule)
    end = max(e[5] for e in schedule) or 1.0
    left, w = 60.0, WIDTH - 70.0
    bars = _busy_runs(schedule) if len(schedule) > GANTT_DETAIL else list(schedule)
    body = _legend(sorted({e[1] for e in bars}), 14)
    for r in range(ranks):
        body.append(_text(left - 4, 36 + 18 * r, f"rank {r}", "end"))
    for r, kind, stage, mb, t0, t1 in bars:
        title = f"rank {r} busy {fmt(t1 - t0, 's')}" if kind == "busy" else f"{kind} stage {stage} microbatch {mb}"
        body.append(_rect(left + w * t0 / end, 24 + 18 * r, w * (t1 - t0) / end, 15, COLOURS.get(kind, "#999"), title))
    body.append(_text(left, 40 + 18 * ranks, f"0 to {fmt(end, 's')}"))
    return _svg(48 + 18 * ranks, body, "pipeline schedule")


def _busy_runs(schedule: Sequence[Interval]) -> list[Interval]:
    """Each rank's computations merged where one starts as the previous ends."""
    out: list[Interval] = []
    for e in sorted(schedule, key=lambda e: (e[0], e[4])):
        last = out[-1] if out else None
        if last is not None and last[0] == e[0] and e[4] - last[5] <= 1e-9 * max(e[5], 1e-30):
            out[-1] = (last[0], "busy", -1, -1, last[4], e[5])
        else:
            out.append((e[0], "busy", -1, -1, e[4], e[5]))
    return out


def strategy_rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    """The strategies weighed, fastest first: (name, predicted step, peak memory, verdict). The
    plan itself, every hand plan costed and every pipeline layout tried (``plan.solver``)."""
    s, p = plan.solver, plan.predicted
    kept = plan.name if plan.name != "auto" else s.get("kept_hand_plan", "")
    chosen = f"auto ({'hand plan ' + kept if kept else 'solver'})" if plan.name == "auto" else plan.name
    ranked: list[tuple[float, tuple[str, str, str, str]]] = [
        (p.step_time_s, (chosen, fmt(p.step_time_s, "s"), fmt(p.peak_memory_bytes, "B"), "chosen"))]
    for name, h in s.get("hand_plans", {}).items():
        if name == kept:
            continue
        if not h.get("feasible", True) or "step_time_s" not in h:
            need = h.get("least_memory_bytes")
            why = f"does not fit: needs at least {fmt(need, 'B')}" if need else "does not fit the budget"
            ranked.append((float("inf"), (name, "-", "-", why)))
            continue
        step = h["step_time_s"]
        why = f"{step / p.step_time_s:.2f}x the chosen step" if step >= p.step_time_s else \
            "faster, but over the budget or not chosen (see the search log)"
        ranked.append((step, (name, fmt(step, "s"), fmt(h.get("peak_memory_bytes"), "B"), why)))
    for name, text in s.get("pipelines", {}).items():
        shown, _, peak = text.partition(", peak ")
        seconds = _seconds(shown)
        why = "the chosen layout" if shown == fmt(p.step_time_s, "s") and peak == fmt(p.peak_memory_bytes, "B") else \
            s.get("pipeline", "weighed (see the search log)")
        row = (f"pipeline {name}", shown, peak, why) if seconds else \
            (f"pipeline {name}", "-", "-", text)
        ranked.append((seconds or float("inf"), row))
    ranked.sort(key=lambda r: float(f"{r[0]:.3g}"))   # as shown: the chosen plan first among equals
    return [row for _, row in ranked]


def _seconds(text: str) -> float | None:
    """The seconds ``fmt`` wrote as ``text`` ("59.5 ms"), or None."""
    m = re.fullmatch(r"([\d.]+) (ns|us|ms|s)", text.strip())
    return float(m.group(1)) * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)] if m else None


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An HTML table of ``rows`` of text (escaped) under ``headers``."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def section(title: str, note: str, content: str) -> str:
    """A titled part of a page: its heading, a note saying what it shows, then ``content``."""
    return f'<h2>{_e(title)}</h2><p class="note">{_e(note)}</p>{content}'


def plan_html(plan: Plan, schedule: Sequence[Interval] | None = None) -> str:
    """The whole page. ``schedule``: the pipeline's simulated computations for its Gantt chart
    (``autopar.planning.pipeline.schedule_timeline(plan)``; without it the chart is left out)."""
    head = headline(plan)
    where = "" if plan.pipeline is None else f" (a device of pipeline rank {plan.pipeline.peak_rank()}, the peak's)"
    parts = [f"<h1>autopar plan: {_e(plan.model_name)} on {_e(plan.mesh.describe())}</h1>",
             table(["", ""], [(k, v) for k, v in head.items()]),
             section("Memory per device over the step" + where,
                      "Rebuilt from the peak's breakdown and each node's kept activations: the plan keeps no per-op "
                      "memory timeline, so the shape between the moments is approximate; the peak's parts are the "
                      "plan's ('state': parameters with their optimizer states, which the plan keeps as one).", memory_chart(plan)),
             section("Placement map", "Per layer (repeated layers share a row) and mesh axis: the placements of "
                      "its nodes, most common first (parameters as stored). R replicated, S(d) split on dim d, "
                      "P partial.", placement_map(plan)),
             section("Time per layer", "Summed over the layers of a row, per step: compute (forward, backward, "
                      "optimizer), blocking communication, gradient synchronisation queued in the backward "
                      f"(exposed in all: {fmt(plan.predicted.exposed_comm_s, 's')}).", time_chart(plan)),
             section("Communication per mesh axis", "Bytes each device sends a step.", comm_chart(plan))]
    if plan.pipeline is not None:
        parts.append(_pipeline_section(plan, schedule))
    parts.append(section("Strategies weighed", "Fastest first; the chosen plan, every hand plan costed, every "
                          "pipeline layout tried.", table(["strategy", "step", "peak memory", "verdict"],
                                                           strategy_rows(plan))))
    return page(f"autopar plan: {plan.model_name}", parts)


def page(title: str, parts: Sequence[str]) -> str:
    """A whole self-contained page: ``title``, the project's style, then ``parts`` (HTML)."""
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{_e(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n")


def _pipeline_section(plan: Plan, schedule: Sequence[Interval] | None) -> str:
    p = plan.pipeline
    assert p is not None
    note = (f"{p.schedule} over {p.axis}: {p.num_stages} stages on {p.ranks} ranks, {p.num_microbatches} "
            f"microbatches; predicted bubble {100 * p.bubble_fraction:.1f}% of the busiest rank's step. Replayed on "
            "the stages' recorded seconds per microbatch (activation sends not drawn).")
    if not schedule:
        return section("Pipeline schedule", note + " No schedule was given to draw.", "")
    return section("Pipeline schedule", note, gantt_chart(schedule))

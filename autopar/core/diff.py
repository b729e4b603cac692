"""``plan_diff``: what changed between two plans, as lines of text (``autopar diff a.json b.json``).

Compared: what each is for (model, mesh, precision, batch), the predicted step and peak memory,
microbatches, recomputation, the pipeline (schedule, stages, microbatches) and each node's
placement (strategy, output, storage), grouped by layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.core.placements import placements_str
from autopar.core.units import fmt

if TYPE_CHECKING:
    from autopar.core.plan import NodePlan, Plan

#: Nodes listed per layer whose placement changed (the rest counted).
SHOWN_PER_LAYER = 4


def _changed(what: str, a: object, b: object) -> list[str]:
    return [] if a == b else [f"{what}: {a} -> {b}"]


def _placement(n: NodePlan) -> str:
    stored = f", stored {placements_str(n.storage)}" if n.storage is not None and n.storage != n.out else ""
    return f"{n.strategy} {placements_str(n.out)}{stored}" + (" offloaded" if n.offloaded else "")


def _experts(plan: Plan) -> str:
    ep = plan.expert_parallel
    if ep is None:
        return "none"
    parts = ([f"over {ep['axis']}, {ep['experts_per_rank']} expert{'s' * (ep['experts_per_rank'] != 1)} per rank"]
             if "axis" in ep else []) + ([f"within over {ep['within']}"] if "within" in ep else [])
    return "; ".join(parts)


def _headline_lines(a: Plan, b: Plan) -> list[str]:
    pa, pb = a.predicted, b.predicted
    out = [*_changed("model", a.model_name, b.model_name), *_changed("mesh", a.mesh.describe(), b.mesh.describe()),
           *_changed("plan", a.name, b.name), *_changed("precision", a.precision, b.precision),
           *_changed("batch", a.batch_size, b.batch_size), *_changed("microbatches", a.microbatches, b.microbatches),
           *_changed("expert parallelism", _experts(a), _experts(b))]
    if pa.step_time_s != pb.step_time_s:
        out.append(f"predicted step: {fmt(pa.step_time_s, 's')} -> {fmt(pb.step_time_s, 's')} "
                   f"({100 * (pb.step_time_s / pa.step_time_s - 1) if pa.step_time_s else 0:+.1f}%)")
    if pa.peak_memory_bytes != pb.peak_memory_bytes:
        out.append(f"peak memory: {fmt(pa.peak_memory_bytes, 'B')} -> {fmt(pb.peak_memory_bytes, 'B')}")
    return out


def _recompute_lines(a: Plan, b: Plan) -> list[str]:
    out = []
    for path in sorted(set(a.recompute) | set(b.recompute)):
        if a.recompute.get(path) != b.recompute.get(path):
            out.append(f"recompute {path}: {a.recompute.get(path, 'none')} -> {b.recompute.get(path, 'none')}")
    return out


def _pipeline_lines(a: Plan, b: Plan) -> list[str]:
    pa, pb = a.pipeline, b.pipeline
    if pa is None or pb is None:
        return _changed("pipeline", "none" if pa is None else f"{pa.schedule} over {pa.axis}",
                        "none" if pb is None else f"{pb.schedule} over {pb.axis}")
    out = [*_changed("pipeline axis", pa.axis, pb.axis), *_changed("pipeline schedule", pa.schedule, pb.schedule),
           *_changed("pipeline microbatches", pa.num_microbatches, pb.num_microbatches),
           *_changed("pipeline stages per rank", pa.virtual_stages, pb.virtual_stages)]
    blocks_a, blocks_b = [s.blocks for s in pa.stages], [s.blocks for s in pb.stages]
    return out + _changed("pipeline stages (blocks)", blocks_a, blocks_b)


def _node_lines(a: Plan, b: Plan) -> list[str]:
    """Per layer, the nodes whose placement changed (``SHOWN_PER_LAYER`` named), and nodes only
    one plan has."""
    theirs = {n.name: n for n in b.nodes}
    by_layer: dict[str, list[str]] = {}
    for n in a.nodes:
        m = theirs.get(n.name)
        if m is not None and _placement(n) != _placement(m):
            layer = n.layer or (n.fqn or n.name).rpartition(".")[0] or "(model)"
            by_layer.setdefault(layer, []).append(f"{n.name}: {_placement(n)} -> {_placement(m)}")
    out = []
    for layer, changes in by_layer.items():
        more = f" (and {len(changes) - SHOWN_PER_LAYER} more)" if len(changes) > SHOWN_PER_LAYER else ""
        out.append(f"placements in {layer}: {len(changes)} node(s) changed{more}")
        out.extend(f"  {c}" for c in changes[:SHOWN_PER_LAYER])
    ours = {n.name for n in a.nodes}
    only_a, only_b = sorted(ours - set(theirs)), sorted(set(theirs) - ours)
    out += [f"nodes only in the first plan: {len(only_a)} ({', '.join(only_a[:5])})"] if only_a else []
    return out + ([f"nodes only in the second plan: {len(only_b)} ({', '.join(only_b[:5])})"] if only_b else [])


def plan_diff(a: Plan, b: Plan) -> list[str]:
    """What changed from plan ``a`` to plan ``b``, a line per change (empty: nothing did)."""
    return [*_headline_lines(a, b), *_pipeline_lines(a, b), *_recompute_lines(a, b), *_node_lines(a, b)]

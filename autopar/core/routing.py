"""The router's imbalance on the example batch: ``PlanOptions.expert_skew="measured"``.

Split by expert, a layer takes as long as its busiest rank: the one whose experts receive the
most rows (``autopar.core.ops.moe.busiest_rank``). Routing is priced uniform unless told
otherwise. "measured" runs the captured graph once on the model's own weights and the example
inputs, counts the rows each mixture-of-experts layer routes to each expert, and prices the
experts split over an axis of n ranks (E/n consecutive experts a rank, as the kernel holds them)
at the mean over layers of the most rows a rank receives over the mean. The figure holds for the
weights the model has when it is planned: a trained router's imbalance (fine-tuning a released
checkpoint), or a freshly initialised one's.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.utils import _pytree as pytree

from autopar.core.capture import CapturedGraph
from autopar.core.errors import AutoparError
from autopar.core.ops.moe import IDS, MOE, num_experts
from autopar.core.stacked_params import stacked_value


class _Counting(fx.Interpreter):
    """The graph run on real values, counting each MoE layer's rows per expert as it runs."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.rows: dict[str, torch.Tensor] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.target is MOE:
            ids = self.env[n.args[IDS]]
            self.rows[n.name] = torch.bincount(ids.reshape(-1).to(torch.int64).cpu(), minlength=num_experts(n))
        return super().run_node(n)


def routed_rows(captured: CapturedGraph, model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Rows each expert receives in each MoE layer (its node's name -> [E] counts) on the example
    inputs: ``captured``'s graph run once, without gradients, on ``model``'s parameters and
    buffers. Refused for a model on ``meta`` (no weights to route with)."""
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    state.update({fqn: stacked_value(model, parts) for fqn, parts in captured.stacked.items()
                  if all(state[p].device.type != "meta" for p in parts)})
    if any(t.device.type == "meta" for t in state.values()):
        raise AutoparError("expert_skew='measured' runs the model's router on the example inputs, and this model is on "
                           "the meta device (no weights). Give the skew as a number (the busiest rank's rows over the "
                           "mean, from a training run), or plan the model with its weights")
    inputs = iter(pytree.tree_leaves((args, kwargs or {})))
    values = []
    for node in captured.graph.nodes:
        if node.op != "placeholder":
            continue
        name = node.name
        values.append(state[captured.param_of[name]] if name in captured.param_of
                      else state[captured.buffer_of[name]] if name in captured.buffer_of
                      else captured.program.constants[captured.constant_of[name]] if name in captured.constant_of
                      else next(inputs))
    counting = _Counting(captured.program.graph_module)
    with torch.no_grad(), maybe_disable_local_tensor_mode():   # the real model, whatever mode compiles it
        counting.run(*values)
    return counting.rows


def busiest_over_mean(rows: torch.Tensor, ranks: int) -> float:
    """The most rows any of ``ranks`` ranks (E/ranks consecutive experts each) receives, over the
    mean: 1.0 for uniform routing, ``ranks`` where one rank receives every row."""
    per_rank = rows.reshape(ranks, -1).sum(1).double()
    mean = float(per_rank.mean())
    return float(per_rank.max()) / mean if mean > 0 else 1.0


def measured_skew(rows: dict[str, torch.Tensor], sizes: Iterable[int]) -> dict[int, float]:
    """Per expert-axis size n (of ``sizes`` that divide every layer's experts): the mean over
    layers of ``busiest_over_mean``, rounded to 3 places (it prices the busiest rank's work)."""
    skews = {}
    for n in sorted(set(sizes)):
        if n > 1 and rows and all(r.numel() % n == 0 for r in rows.values()):
            skews[n] = round(statistics.fmean(busiest_over_mean(r, n) for r in rows.values()), 3)
    return skews


def measured_if_asked(options: Any, captured: CapturedGraph, model: torch.nn.Module, args: tuple, kwargs: dict | None,
                      mesh_shape: Iterable[int]) -> Any:
    """``options`` (a ``PlanOptions``) with ``expert_skew="measured"`` replaced by the factors
    measured on ``model`` and the example inputs for the sizes of the mesh's axes; as it is otherwise."""
    if options.expert_skew != "measured":
        return options
    return replace(options, expert_skew=measured_skew(routed_rows(captured, model, args, kwargs or {}), mesh_shape))

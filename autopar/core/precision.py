"""Precision policies: in what dtype a model computes, while its parameters, their gradients and
optimizer states stay fp32 (the master copy).

``"bf16"`` is the policy of FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`` and torchtitan: every floating parameter and floating input is cast
to bf16 where it is used, the model's ops run on what they are given (a model that upcasts, as HF's
RMSNorm and losses do, still does), and the backward of each cast returns an fp32 gradient to the
fp32 parameter, so gradients are reduced in fp32.

Capture records the policy in the graph itself (``capture(..., precision=)``): it exports
:class:`ComputeIn` around the model, so each cast is an ordinary op (``aten.to.dtype``) that the
planner places and prices and the code generator writes out, and every activation's dtype in the
graph is the one the run will have (costs in bf16 bytes and FLOPs follow). The same module is the
single-device reference a sharded run under the policy equals.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.core.errors import AutoparError

__all__ = ["PRECISIONS", "Precision", "ComputeIn", "check_precision", "compute_dtype", "reduce_dtype"]

#: A precision policy's name (``PlanOptions.precision``, ``reduce_precision``).
Precision = Literal["fp32", "bf16"]
#: Policy name -> the dtype ops compute in.
PRECISIONS: dict[Precision, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_precision(precision: str) -> Precision:
    if precision not in PRECISIONS:
        raise AutoparError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def compute_dtype(precision: Precision) -> torch.dtype:
    return PRECISIONS[check_precision(precision)]


def reduce_dtype(reduce_precision: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient of ``dtype`` is summed over ranks in: "fp32" leaves every gradient in
    its own (a bf16 parameter's is not widened), "bf16" narrows floating ones to bf16."""
    precision = check_precision(reduce_precision)
    if precision == "fp32" or not dtype.is_floating_point:
        return dtype
    return PRECISIONS[precision]


class ComputeIn(nn.Module):
    """``model`` run under a precision policy: its floating parameters and floating inputs are cast
    to the policy's dtype on each call, its parameters stay as they are (fp32 masters, updated by
    the optimizer). Use it as the single-device reference of a plan made with ``precision=``."""

    def __init__(self, model: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.model = model
        self.precision = precision
        self.dtype = compute_dtype(precision)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cast = {name: self._cast(p) for name, p in self.model.named_parameters()}
        args, kwargs = pytree.tree_map_only(torch.Tensor, self._cast, (args, kwargs))
        return torch.func.functional_call(self.model, cast, args, kwargs)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() else t

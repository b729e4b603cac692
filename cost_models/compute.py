"""Roofline compute cost of one operator, in seconds."""

from __future__ import annotations

import math

import sympy
import torch

from autopar.core.hardware import Hardware
from autopar.core.sizes import maximum

__all__ = ["as_amount", "compute_time", "is_amount"]


def as_amount(x):
    """A count from PyTorch as a float, or as a sympy expression when it is symbolic (a
    ``SymInt``/``SymFloat`` of a capture with dynamic shapes: ``autopar.planning.symbolic``)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        from torch.utils._sympy.functions import ToFloat

        return x.node.expr.replace(ToFloat, lambda a: a)
    return x if isinstance(x, sympy.Basic) else float(x)


def is_amount(value) -> bool:
    """A non-negative finite number, or a sympy expression of sizes not known to be negative
    (symbolic costs, ``autopar.planning.symbolic``: FLOPs and bytes as expressions of batch and sequence)."""
    if isinstance(value, sympy.Expr):
        return value.is_negative is not True and value.is_finite is not False
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def compute_time(
    flops: float,
    bytes_moved: float,
    hw: Hardware,
    dtype: torch.dtype,
    *,
    allow_tf32: bool = False,
) -> float:
    """Seconds for one op doing ``flops`` FLOPs and moving ``bytes_moved`` bytes
    (bytes read + bytes written to device memory) in ``dtype``.

    ``max(flops / hw.flops_for(dtype), bytes_moved / hw.memory_bandwidth) + hw.op_overhead_s``;
    exactly 0 when both ``flops`` and ``bytes_moved`` are 0 (views, no-ops).
    ``allow_tf32`` selects the TF32 tensor-core peak for float32 where the hardware has one.
    Either amount may be a sympy expression (symbolic costs); the result then is one too.
    """
    for label, value in (("flops", flops), ("bytes_moved", bytes_moved)):
        if not is_amount(value):
            raise ValueError(f"{label} must be a non-negative finite number, got {value!r}")
    if flops == 0 and bytes_moved == 0:
        return 0.0
    t_compute = flops / hw.flops_for(dtype, allow_tf32=allow_tf32)
    t_memory = bytes_moved / hw.memory_bandwidth
    return maximum(t_compute, t_memory) + hw.op_overhead_s

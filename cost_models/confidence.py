"""How sure a predicted step is: what it rests on, its band, and the FLOPs it does.

A step time is a claim: it says what it rests on (``Prediction.basis``: times measured on this
host, a GPU preset's efficiency tables, or an uncalibrated roofline) and how far off predictions
on that basis were found (the band: the spread of measured or published over predicted step
times in the validation benchmarks, ``tables/bands.json``, each with its benchmark and commit).
Model and hardware FLOPs give the prediction's MFU and HFU, to set beside published runs'.
"""
from __future__ import annotations

import functools
import json

import torch

from autopar.core.hardware import Hardware
from cost_models.efficiency import TABLES, efficiency_of

__all__ = ["MEASURED_SHARE", "basis_of", "band_of", "step_flops"]

#: A prediction rests on the profile where it measured at least this share of the compute time.
MEASURED_SHARE = 0.5


def basis_of(measured_share: float, hw: Hardware, profile=None) -> str:
    """``Prediction.basis``: "profile" where a calibrated profile (``autopar profile``: in-step
    factors fitted on whole training steps) measured most of the compute time, "first-profile"
    where an uncalibrated one did (what ``compile`` measures on a new machine), else "tables"
    where the hardware has efficiency tables, else "roofline"."""
    if measured_share >= MEASURED_SHARE:
        return "profile" if profile is not None and "ops" in profile.calibration else "first-profile"
    return "tables" if efficiency_of(hw) is not None else "roofline"


@functools.cache
def _bands() -> dict:
    return json.loads((TABLES / "bands.json").read_text())


def band_of(basis: str) -> tuple[float, float]:
    """(low, high): the step was found between these multiples of the prediction on this basis
    ((0, 0): no band, the roofline's case)."""
    entry = _bands().get(basis)
    return (entry["low"], entry["high"]) if entry else (0.0, 0.0)


def step_flops(model, precision: str) -> dict[str, float]:
    """A step's model FLOPs (3x the forward's: backward twice the forward), hardware FLOPs (with
    the forwards of recomputed blocks again) and the devices' summed peak FLOP/s in the compute
    dtype, over the whole mesh (``model``: a ``CostModel``). Symbolic sizes give 0 (unknown)."""
    ops = [nc.node for nc in model.space.nodes if nc.kind == "op"]
    try:
        forward = float(sum(model.flops(n) for n in ops)) * model.microbatches
        recomputed = float(sum(model.flops(n) for n in ops if n in model.block_of)) * model.microbatches
    except TypeError:   # a sympy expression of the batch and sequence sizes
        return {}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    devices = model.mesh.size
    return {"model_flops": 3 * forward, "hardware_flops": 3 * forward + recomputed,
            "peak_flops": devices * model.hw.flops_for(dtype)}

"""autopar: an auto-parallelizing compiler for PyTorch training.

``autopar.plan(model, mesh, inputs)`` chooses a sharding for every op (data, tensor, sequence
parallelism, ZeRO-3) with an ILP over a cost model; ``autopar.compile`` returns a module that
trains sharded on ``torch.distributed``.

The passes, in order, and where each lives (every package imports only the ones above it)::

    solver/              the ILP over choices and costs: no torch, no autopar
    autopar/core/        capture (torch.export) -> strategies (rules per mesh axis) -> Plan data;
                         errors, units, mesh, hardware presets, ``execution``: how ops run and
                         which collective each placement change is, ``ops``: each op's special
                         handling in one module (docs/ops.md), and ``progress``: what runs, told
                         on a status line and the ``autopar`` logger
    cost_models/         seconds and bytes of every choice (profile or roofline), the step schedule
    codegen/             Plan -> readable sharded forward, and the runtime it calls
    autopar/models/      the zoo of models to plan (as their authors build them)
    autopar/planning/    shrink, hand plans, problem building and the planner: -> Plan
    autopar/profiling/   measuring this host: local gloo meshes, op/collective timings, calibration
    autopar/api.py, cli  plan(), compile(), full_state_dict(), the ``autopar`` command
    autopar/compare.py   strategies planned (and measured) side by side: ``autopar compare``
    autopar/checkpoint.py save(), load(): checkpoints of a compiled module and its optimizer

Importing this package loads none of them: each public name loads its module on first use.
"""
from __future__ import annotations

from typing import Any as _Any

__version__ = "0.1.0"
__all__ = ["compile", "plan", "full_state_dict", "save", "load", "PlanOptions", "MeshSpec", "Plan", "ComputeIn",
           "AutoparError", "BufferWriteError", "CaptureError", "CheckpointError", "HardwareError", "InfeasibleError", "InputMismatchError",
           "LossWeightError", "MeshError", "PlanFileError"]


#: Where each public name lives: a module is imported when one of its names is first used
#: (checkpoint's, torch.distributed.checkpoint with them, only by a script that saves or loads).
_HOME = {"compile": "autopar.api", "plan": "autopar.api", "full_state_dict": "autopar.api",
         "save": "autopar.checkpoint", "load": "autopar.checkpoint", "PlanOptions": "autopar.planning.options",
         "MeshSpec": "autopar.core.mesh", "Plan": "autopar.core.plan", "ComputeIn": "autopar.core.precision",
         **{name: "autopar.core.errors" for name in __all__ if name.endswith("Error")}}


def __getattr__(name: str) -> _Any:
    """The public names load on first use: ``import autopar.core.errors`` runs this file first,
    and must not pull in the planner, ortools and the code generator with it."""
    if name not in __all__:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public API (the lazy names included), not this file's imports."""
    return sorted([*__all__, "__version__"])

"""autopar: an auto-parallelizing compiler for PyTorch training.

``autopar.plan(model, mesh, inputs)`` chooses a sharding for every op (data, tensor, sequence
parallelism, ZeRO-3) with an ILP over a cost model; ``autopar.compile`` returns a module that
trains sharded on ``torch.distributed``.
"""
from autopar.api import compile, full_state_dict, plan
from autopar.errors import (AutoparError, CaptureError, HardwareError, InfeasibleError, InputMismatchError,
                            MeshError, PlanFileError)
from autopar.mesh import MeshSpec
from autopar.plan import Plan

__version__ = "0.1.0"
__all__ = ["compile", "plan", "full_state_dict", "MeshSpec", "Plan", "AutoparError", "CaptureError",
           "HardwareError", "InfeasibleError", "InputMismatchError", "MeshError", "PlanFileError"]

"""Public entry points: ``plan``, ``compile``, ``full_state_dict``."""
from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import CapturedGraph, capture
from autopar.errors import MeshError
from autopar.mesh import MeshSpec, as_mesh_spec
from autopar.plan import Plan
from autopar.planner import DEFAULT_TIME_LIMIT_S, MIN_GAIN, plan_captured
from codegen.module import ShardedModule, full_state_dict
from cost_models.profile import Profile
from cost_models.profiling import resolve_profile

__all__ = ["plan", "compile", "full_state_dict"]


def _as_tuple(example_inputs: Any) -> tuple:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def plan(model: nn.Module, mesh: DeviceMesh | MeshSpec, example_inputs: Any, example_kwargs: dict | None = None, *,
         memory_budget: float | None = None, time_limit: float | None = DEFAULT_TIME_LIMIT_S,
         profile: Profile | str | None = "auto", optimizer: str = "adamw", share_layers: bool = True,
         hand_plans: bool = True, min_gain: float = MIN_GAIN) -> Plan:
    """Choose a placement for every op of ``model`` on ``mesh``; runs no collective.

    ``memory_budget``: bytes per device (default: the hardware's memory). ``time_limit``: seconds
    for the solver, after which the best plan found is returned with its optimality gap
    (``None``: solve to optimality). ``profile``: measured costs of this host (``autopar
    profile``); ``"auto"`` uses the cached one when it matches the mesh, ``None`` the roofline
    presets only; the plan's ``predicted.cost_source`` says which were used. ``optimizer``:
    "adamw", "adam", "sgd" or "sgd-momentum" (its states count in memory). ``share_layers``: let
    identical inner layers share decisions (``autopar.shrink``). ``hand_plans``: cost the standard
    strategies first (``autopar.baselines``) and start from the best that fits; the plan's
    ``solver["hand_plans"]`` lists them. ``min_gain``: the solver's plan is returned only if
    predicted at least this fraction faster than the best fitting hand plan (else that hand plan,
    saying so). The model and inputs may live on the ``meta`` device.
    """
    spec = as_mesh_spec(mesh)
    t0 = time.perf_counter()
    captured = capture(model, _as_tuple(example_inputs), example_kwargs)
    timings = {"capture": time.perf_counter() - t0}
    return plan_captured(captured, spec, memory_budget=memory_budget, time_limit=time_limit, timings=timings,
                         profile=resolve_profile(profile, spec), optimizer=optimizer, share_layers=share_layers,
                         hand_plans=hand_plans, min_gain=min_gain)


def compile(model: nn.Module, mesh: DeviceMesh, example_inputs: Any, example_kwargs: dict | None = None, *,
            plan: Plan | None = None, keep_outputs_sharded: bool = False, **plan_options: Any) -> ShardedModule:
    """Shard ``model`` over a live ``mesh`` and return a module every rank calls with global inputs.

    The returned module reuses ``model``'s submodules: its parameters become DTensors holding only
    this rank's shard, under the original names.
    """
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(
            f"compile needs a live torch.distributed DeviceMesh (got {type(mesh).__name__}); "
            "use autopar.plan() with a MeshSpec to plan for a mesh that does not exist here"
        )
    args = _as_tuple(example_inputs)
    captured = capture(model, args, example_kwargs)
    spec = as_mesh_spec(mesh)
    if plan is None:
        plan = _plan_shared_by_all_ranks(captured, spec, mesh, plan_options)
    else:
        plan.check_matches(captured.fingerprint, spec)
    return ShardedModule(model, mesh, plan, captured, keep_outputs_sharded)


def _plan_shared_by_all_ranks(captured: CapturedGraph, spec: MeshSpec, mesh: DeviceMesh, options: dict) -> Plan:
    """Every rank must run the same plan, and a time-limited solve can end differently in two
    processes: the first rank plans, the others receive its plan (JSON) and check it."""
    options = {**options, "profile": resolve_profile(options.get("profile", "auto"), spec)}
    if local_tensor_mode() is not None or not dist.is_initialized() or dist.get_world_size() == 1 \
            or dist.get_backend() == "fake":
        return plan_captured(captured, spec, **options)
    if mesh.size() != dist.get_world_size():
        raise MeshError(
            f"compile shares its plan over the default process group, but the mesh has {mesh.size()} of the "
            f"{dist.get_world_size()} ranks: plan once with autopar.plan() and pass plan= to compile on every rank"
        )
    message = [plan_captured(captured, spec, **options).to_json() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(message, src=0)
    shared = Plan.from_json(message[0])
    shared.check_matches(captured.fingerprint, spec)
    return shared

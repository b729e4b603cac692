"""Public entry points: ``plan``, ``compile``, ``full_state_dict``."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.buffers import refuse_split_steps, whole_batch_state
from autopar.core.capture import CapturedGraph, as_args, capture
from autopar.core.errors import MeshError, PlanFileError
from autopar.core.mesh import MeshSpec, as_mesh_spec, split_first_axis
from autopar.core.microbatch import batch_size, microbatch_capture
from autopar.core.plan import Plan
from autopar.core.progress import log_summary
from autopar.core.routing import measured_if_asked
from autopar.core.together import one_process, together
from autopar.planning.clock import Clock, charge_capture
from autopar.planning.options import PlanOptions
from autopar.planning.planner import memoized, plan_captured, priced_workloads, timed
from autopar.profiling.missing_ops import measure_host, measure_missing_ops
from codegen.grad_sync import DEFAULT_BUCKET_BYTES
from codegen.module import ShardedModule, full_state_dict
from codegen.pipelined import PipelinedModule
from codegen.runtime import share_generator
from cost_models.profile import Profile, resolve_profile

__all__ = ["plan", "compile", "full_state_dict"]


def plan(model: nn.Module, mesh: DeviceMesh | MeshSpec, example_inputs: Any, example_kwargs: dict | None = None, *,
         options: PlanOptions | None = None, **option_values: Any) -> Plan:
    """Choose a placement for every op of ``model`` on ``mesh``; runs no collective. The model and
    inputs may live on the ``meta`` device. ``options`` and ``option_values`` (``memory_budget=``,
    ``time_limit=``, ``profile=``, ...) steer the planner: see ``autopar.PlanOptions``."""
    start = time.perf_counter()   # the limit bounds the whole call, the capture included
    options = PlanOptions.of(options, **option_values)
    spec = as_mesh_spec(mesh)
    args = as_args(example_inputs)
    with Clock(options.time_limit, start=start, deterministic=options.deterministic).shown("planning", options.progress) as clock:
        with clock.stage("capture") as took, clock.stops_capture("capturing the model"):
            captured = capture(model, args, example_kwargs, precision=options.precision)
        charge_capture(clock, captured, took.seconds)
        if options.expert_skew == "measured":
            with clock.stage("router", "running the router on the example batch (expert_skew='measured')"):
                options = measured_if_asked(options, captured, model, args, example_kwargs, spec.shape)
        planned = plan_captured(captured, spec, options, clock=clock,
                                recapture=microbatch_capture(model, args, example_kwargs, options.precision))
        del captured
    return timed(planned, clock)


def compile(model: nn.Module, mesh: DeviceMesh, example_inputs: Any, example_kwargs: dict | None = None, *,
            plan: Plan | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            options: PlanOptions | None = None, **option_values: Any) -> ShardedModule:
    """Shard ``model`` over a live ``mesh`` and return a module every rank calls with global inputs.
    Without ``plan``, plans first with ``options``/``option_values`` (``autopar.PlanOptions``).
    ``bucket_bytes``: size of the buckets gradients are all-reduced in during the backward.
    The module returns outputs as the plan says (``gather_outputs``, a planning option): whole on
    every rank by default, the loss's sum launched in the forward and waited for where first read,
    split outputs (the logits) gathered when first read, on every rank alike
    (``autopar.core.launched``): a loop that reads only the loss pays nothing for the logits.

    The returned module reuses ``model``'s submodules: its parameters become DTensors holding only
    this rank's shard, under the original names (plain tensors, as under DDP, when the plan
    replicates every one). Every rank's random generator becomes rank 0's,
    so that dropout draws alike everywhere: a split dropout draws the whole tensor's mask and keeps
    its part, equal to one device's from the same seed (CPU; on GPU the mask is drawn by
    ``bernoulli_``, not the fused kernel one GPU uses).
    """
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(
            f"compile needs a live torch.distributed DeviceMesh (got {type(mesh).__name__}); "
            "use autopar.plan() with a MeshSpec to plan for a mesh that does not exist here"
        )
    with torch.set_grad_enabled(torch.is_grad_enabled()):   # grad mode as the caller left it, even on failure
        options = PlanOptions.of(options, **option_values)
        spec = as_mesh_spec(mesh)
        precision = plan.precision if plan is not None else options.precision
        args = as_args(example_inputs)
        recapture = memoized(microbatch_capture(model, args, example_kwargs, precision))

        def whole() -> CapturedGraph:
            return together("capturing the model", lambda: capture(model, args, example_kwargs, precision=precision))

        captured = None
        if plan is None:
            captured = whole()
            if options.expert_skew == "measured":
                options = together("running the router on the example batch", lambda: measured_if_asked(
                    options, captured, model, args, example_kwargs, spec.shape))
            plan = _plan_shared_by_all_ranks(captured, spec, mesh, options, recapture)
        mesh = _formed_as_planned(mesh, spec, plan)
        spec = as_mesh_spec(mesh, spec.hardware)
        # first whether the plan is this model's and this mesh's, then anything else about it
        rows = batch_size(args, example_kwargs or {})
        captured = together("capturing the model as the plan runs it",
                            lambda: _captured_as_planned(plan, captured, whole, recapture, rows))
        together("checking the plan", lambda: plan.check_matches(captured.fingerprint, spec, captured.precision))
        if plan.pipeline is not None and one_process():
            raise MeshError("a pipeline plan runs one process per rank (torchrun, gloo or NCCL); this mesh "
                            "simulates its ranks in one process")
        refuse_split_steps(captured.model_name, whole_batch_state(captured), _in_parts(plan),
                           "Plan it again with microbatches=1 and pipeline=False.")
        log_summary(plan)
        if not one_process():   # dropout draws alike on every rank (``autopar.core.ops.dropout.dropout_mask``)
            share_generator()
        if plan.pipeline is not None:
            return together("generating the stages and sharding the weights",
                            lambda: PipelinedModule(model, mesh, plan, captured, bucket_bytes))
        return together("generating code and sharding the weights",
                        lambda: ShardedModule(model, mesh, plan, captured, bucket_bytes))


def _plan_shared_by_all_ranks(captured: CapturedGraph, spec: MeshSpec, mesh: DeviceMesh, options: PlanOptions,
                              recapture: Callable[[int], CapturedGraph]) -> Plan:
    """Every rank must run the same plan, and a time-limited solve can end differently in two
    processes: the first rank plans, the others receive its plan (JSON) and check it. The profile
    is resolved on every rank first, so that a bad one raises everywhere, not on rank 0 alone;
    then every rank measures, with ``profile="auto"``, what the cache lacks of this host (a first
    profile: collectives and overheads, ``measure_host``) and the model's ops the profile lacks
    (``measure_missing_ops``), unless ``measure_missing_ops`` is off. ``recapture`` is
    memoized: a microbatch captured for the plan serves the compiled module too."""
    resolved = together("reading the profile", lambda: replace(options, profile=resolve_profile(options.profile, spec)))
    if not one_process() and mesh.size() != dist.get_world_size():
        raise MeshError(
            f"compile shares its plan over the default process group, but the mesh has {mesh.size()} of the "
            f"{dist.get_world_size()} ranks: plan once with autopar.plan() and pass plan= to compile on every rank"
        )
    if options.measure_missing_ops:
        profile = cast("Profile | None", resolved.profile)   # as resolve_profile returned it
        if isinstance(options.profile, str) and options.profile == "auto":   # the cache: fill in what it lacks
            profile = measure_host(mesh, spec, profile)
            resolved = replace(resolved, profile=profile)
        # without a profile nothing is measured: no microbatch captured for it
        workloads = priced_workloads(captured, spec, resolved, recapture) if profile is not None \
            else [(captured, spec)]
        measure_missing_ops(workloads, profile, source=options.profile)
    if one_process():
        return plan_captured(captured, spec, resolved, recapture=recapture)
    message = [together("planning", lambda: plan_captured(captured, spec, resolved, recapture=recapture).to_json()
                        if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(message, src=0)
    return together("reading the shared plan", lambda: Plan.from_json(message[0]))   # compile checks it


def _captured_as_planned(plan: Plan, captured: CapturedGraph | None, whole: Callable[[], CapturedGraph],
                         recapture: Callable[[int], CapturedGraph], rows: int) -> CapturedGraph:
    """The model captured as ``plan`` runs it, for ``Plan.check_matches``: the whole batch
    (``captured``, where compile planned it), or one microbatch of a pipeline plan (its stages run
    that graph: the batch's is not needed). A pipeline plan made for batches of other ``rows`` is
    refused as a plan made for other input shapes: no microbatch of this batch is the planned one."""
    if plan.pipeline is None:
        return captured or whole()
    if rows != plan.batch_size:
        raise PlanFileError(f"this plan was made for another model or input shapes ({plan.model_name}): it runs "
                            f"batches of {plan.batch_size} rows, the example has {rows}; re-plan with autopar.plan()")
    return recapture(plan.microbatches)


def _in_parts(plan: Plan) -> str | None:
    """How ``plan`` runs a step's forward on parts of the batch, if it does."""
    if plan.pipeline is not None:
        return f"this plan pipelines it in {plan.pipeline.num_microbatches} microbatches"
    return f"this plan runs it in {plan.microbatches} microbatches" if plan.microbatches > 1 else None


def _formed_as_planned(mesh: DeviceMesh, spec: MeshSpec, plan: Plan) -> DeviceMesh:
    """``mesh``, or the same ranks formed as the plan's mesh where the plan pipelines over a
    factor of the first axis (``autopar.core.mesh.split_first_axis``): a new mesh, whose process
    groups every rank creates here."""
    shape = tuple(plan.mesh.shape)
    if shape == tuple(spec.shape) or plan.pipeline is None:
        return mesh
    if math.prod(shape) != spec.size or spec.shape[0] % shape[0] or \
            split_first_axis(spec, shape[0], plan.mesh.axis_names[0]).shape != shape:
        return mesh   # another mesh altogether: check_matches says so, after the model's fingerprint
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=tuple(plan.mesh.axis_names))

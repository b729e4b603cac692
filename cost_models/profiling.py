"""Profile the machine at hand for one model and mesh (``autopar profile``), and find the cached
profile that matches a planning request.

One local gloo run measures everything, with every rank busy at once as in training (CPU ranks
share cores): each rank times the model's distinct local op calls (``profile_ops``; the slowest
rank's time is kept), then the collectives per mesh axis and the runtime's overheads
(``profile_comm``). Ops already in the cached profile are not measured again.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import capture
from autopar.launch import run_on_gloo_mesh
from autopar.mesh import MeshSpec, as_mesh_spec, hardware_for_device
from autopar.strategies import build_space
from cost_models.comm import COLLECTIVE_KINDS
from cost_models.profile import OpTime, Profile, ProfileError, collective_key, default_profile_path, hardware_fingerprint
from cost_models.profile_comm import measure_mesh, print_progress
from cost_models.profile_ops import OpCall, op_calls, time_op_calls

Progress = Callable[[str], None]
THREADS_PER_RANK = 1   # autopar.launch gives each local rank one thread


def local_fingerprint(mesh: MeshSpec) -> dict[str, Any]:
    """The fingerprint a profile of ``mesh`` run on this host (one process per device) carries."""
    device = "cuda" if mesh.hardware != "cpu" and torch.cuda.is_available() else "cpu"
    return hardware_fingerprint(device, processes_per_host=mesh.size, threads=THREADS_PER_RANK)


def find_profile(mesh: MeshSpec) -> Profile | None:
    """The cached profile of this host for ``mesh``, if ``autopar profile`` made one and the mesh's
    hardware is this host's kind of device (planning for other hardware uses its preset)."""
    local_kind = hardware_for_device("cuda" if torch.cuda.is_available() else "cpu")
    if mesh.hardware != local_kind:
        return None
    path = default_profile_path(local_fingerprint(mesh))
    return Profile.from_json(path) if path.exists() else None


def resolve_profile(profile: Profile | str | Path | None, mesh: MeshSpec) -> Profile | None:
    """``"auto"``: the cached profile of this host if one matches; a path or Profile: that one,
    refused if it was measured on other hardware; ``None``: roofline presets only."""
    if profile is None:
        return None
    if isinstance(profile, str) and profile == "auto":
        return find_profile(mesh)
    loaded = profile if isinstance(profile, Profile) else Profile.from_json(str(profile))
    want = local_fingerprint(mesh)
    if mesh.hardware == hardware_for_device(want["device"]) and loaded.fingerprint != want:
        diff = {k: (loaded.fingerprint.get(k), v) for k, v in want.items() if loaded.fingerprint.get(k) != v}
        raise ProfileError(f"the profile was measured on other hardware than this {mesh.describe()} "
                           f"(profile vs here: {diff}); run `autopar profile` for this mesh")
    return loaded


def profile_model(model: nn.Module, mesh: MeshSpec | tuple[int, ...], example_inputs: Any,
                  example_kwargs: dict | None = None, *, path: str | Path | None = None,
                  progress: Progress | None = print_progress) -> tuple[Profile, Path]:
    """Measure the ops ``model`` runs on ``mesh`` (every candidate strategy's local shapes), the
    collectives of each mesh axis and the runtime overheads on a local gloo mesh; merge them into
    the cached profile for this host and mesh size and save it. Returns (profile, file)."""
    spec = as_mesh_spec(mesh) if not isinstance(mesh, tuple) else MeshSpec(mesh, hardware="cpu")
    say = progress or (lambda line: None)
    t0 = time.perf_counter()
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    space = build_space(capture(model, args, example_kwargs), spec)
    fingerprint = local_fingerprint(spec)
    path = Path(path) if path is not None else default_profile_path(fingerprint)
    profile = Profile.from_json(path) if path.exists() else Profile(fingerprint)
    if profile.fingerprint != fingerprint:
        raise ProfileError(f"{path} holds a profile of other hardware; pass another path")
    calls = [c for c in op_calls(space, spec.shape) if c.key not in profile.ops]
    sizes = {n for n in spec.shape if n > 1}
    need_comm = not profile.overheads or any(collective_key(kind, n) not in profile.collectives
                                             for kind in COLLECTIVE_KINDS if kind != "broadcast" for n in sizes)
    say(f"{len(calls)} op calls to time ({len(profile.ops)} cached), "
        f"{'collectives and overheads' if need_comm else 'collectives cached'}; captured in {time.perf_counter() - t0:.1f} s")
    t1 = time.perf_counter()
    portable = [(_op_name(c.target), c.args, c.kwargs) for c in calls]   # op overloads do not pickle
    if fingerprint["device"] == "cuda":   # gloo on CPU tensors says nothing of NCCL: keep the presets' links
        need_comm = False
    ops, links, overheads = run_on_gloo_mesh(_worker, spec.shape, portable, need_comm, fingerprint["device"], progress,
                                             axis_names=spec.axis_names, start_method="forkserver")[0]
    profile.merge(Profile(fingerprint, ops, links, overheads))
    profile.to_json(path)
    say(f"measured in {time.perf_counter() - t1:.1f} s; saved {path}")
    return profile, path


def _op_name(target: Any) -> str:
    name = str(target)
    if _op(name) is not target:
        raise ProfileError(f"cannot profile {target!r}: not an ATen operator")
    return name


def _op(name: str) -> Any:
    op: Any = torch.ops
    for part in name.split("."):
        op = getattr(op, part)
    return op


def _worker(mesh: DeviceMesh, portable: list[tuple[str, tuple, dict]], need_comm: bool, device: str,
            progress: Progress | None) -> tuple[dict[str, OpTime], dict, dict]:
    say = progress if dist.get_rank() == 0 else None
    calls = [OpCall(_op(name), args, kwargs) for name, args, kwargs in portable]
    if device == "cuda":   # each rank times on its own GPU
        device = f"cuda:{dist.get_rank() % torch.cuda.device_count()}"
    step = max(1, len(calls) // 10)
    shown = (lambda i, n, key: say(f"op {i + 1}/{n}: {key[:90]}") if say and i % step == 0 else None)
    mine = time_op_calls(calls, device=device, progress=shown)
    everyone: list[dict[str, OpTime]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    slowest = {k: OpTime(max(r[k].fwd_s for r in everyone if k in r), max(r[k].bwd_s for r in everyone if k in r))
               for k in mine}
    if not need_comm:
        return slowest, {}, {}
    return (slowest, *measure_mesh(mesh, progress=progress))

"""``MeshSpec``: a mesh of devices that need not exist.

Planning works on a ``MeshSpec`` (shape, axis names, hardware preset), so a 1024-GPU cluster
can be planned on a laptop. A live ``DeviceMesh`` is converted to a ``MeshSpec`` with the
hardware inferred from its device type.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.errors import MeshError


@dataclass(frozen=True)
class MeshSpec:
    """A logical device mesh: ``shape`` (row-major, last axis fastest), names and hardware.
    ``job_size``: the processes of the job this mesh is a part of, where it is not the whole job (a
    pipeline stage's sub-mesh): what is measured on a host depends on how many processes share it
    (``cost_models.profile.local_fingerprint``). Planning detail, not saved with a plan."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None = None
    hardware: str = "cpu"
    job_size: int | None = None

    def __init__(
        self,
        shape: tuple[int, ...] | list[int] | int,
        axis_names: tuple[str, ...] | list[str] | None = None,
        hardware: str = "cpu",
        job_size: int | None = None,
    ) -> None:
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape_t or any(not isinstance(s, int) or s < 1 for s in shape_t):
            raise MeshError(f"mesh shape must be a non-empty tuple of positive ints, got {shape!r}")
        names = tuple(axis_names) if axis_names is not None else default_axis_names(len(shape_t))
        if len(names) != len(shape_t) or len(set(names)) != len(names):
            raise MeshError(
                f"axis_names {tuple(names)} must be {len(shape_t)} distinct names, one per mesh axis"
            )
        object.__setattr__(self, "shape", shape_t)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "hardware", hardware)
        object.__setattr__(self, "job_size", None if job_size in (None, math.prod(shape_t)) else int(job_size))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def processes(self) -> int:
        """Processes of the job: this mesh's devices, or the whole job's where it is a part of one."""
        return self.job_size or self.size

    def describe(self) -> str:
        axes = " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        return f"{self.size} devices ({axes}) of {self.hardware}"

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names), "hardware": self.hardware}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MeshSpec":
        return cls(tuple(d["shape"]), tuple(d["axis_names"]), d["hardware"])


def split_first_axis(mesh: MeshSpec, stages: int, name: str = "pp") -> MeshSpec:
    """``mesh`` with its first axis cut into ``stages`` x the rest (a pipeline over a factor of it:
    rank order unchanged, so each pipeline stage is a block of consecutive ranks of that axis)."""
    n = mesh.shape[0]
    if stages < 1 or n % stages:
        raise MeshError(f"{stages} pipeline stages do not divide the first axis of {mesh.describe()}")
    if stages == n:
        return mesh
    taken = set(mesh.axis_names)
    new = name if name not in taken else next(f"{name}{i}" for i in range(2, 100) if f"{name}{i}" not in taken)
    return MeshSpec((stages, n // stages, *mesh.shape[1:]), (new, *mesh.axis_names), mesh.hardware)


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """Names a reader recognises: outer axes data-like, the inner axis tensor-like."""
    return {1: ("x",), 2: ("dp", "tp"), 3: ("dp", "sp", "tp")}.get(ndim) or tuple(f"axis{i}" for i in range(ndim))


def hardware_for_device(device_type: str) -> str:
    """Infer a hardware preset from a live device type (and the GPU's name on CUDA)."""
    if device_type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    for key, preset in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-80gb")):
        if key in name:
            if preset == "a100-80gb" and "40gb" in name:
                return "a100-40gb"
            return preset
    return "h100-80gb"


def as_mesh_spec(mesh: Any, hardware: str | None = None) -> MeshSpec:
    """Accept a ``DeviceMesh`` or ``MeshSpec``; anything else is a clear error."""
    if isinstance(mesh, MeshSpec):
        return mesh if hardware is None else MeshSpec(mesh.shape, mesh.axis_names, hardware, mesh.job_size)
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names or default_axis_names(mesh.ndim)
        return MeshSpec(tuple(mesh.shape), tuple(names), hardware or hardware_for_device(mesh.device_type))
    raise MeshError(
        f"mesh must be a torch.distributed.device_mesh.DeviceMesh or an autopar.MeshSpec, "
        f"got {type(mesh).__name__}. Build one with init_device_mesh('cpu', (2, 2)) or MeshSpec((2, 2))."
    )

"""Hardware descriptions for the cost model.

Units (one per quantity, never mixed):

* compute throughput: FLOP/s (``peak_flops``), dense, no structured sparsity
* bandwidths: bytes/s (``memory_bandwidth``, ``intra_node_bandwidth``, ``inter_node_bandwidth``)
* capacities: bytes (``memory_bytes``)
* latencies and overheads: seconds

A :class:`Hardware` describes ONE device (one GPU, or one CPU process of a
local gloo mesh) plus the links it uses to talk to its peers.  Presets live in
:data:`PRESETS`; :func:`get_hardware` resolves a preset name or a JSON file
that overrides fields of a preset.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from autopar.core.errors import HardwareError

__all__ = [
    "Hardware",
    "PRESETS",
    "get_hardware",
    "hardware_to_dict",
    "hardware_from_dict",
]


class _FrozenDict(dict):
    """A ``dict`` that refuses mutation; picklable, JSON-serialisable, hashable."""

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Hardware.peak_flops is read-only; use dataclasses.replace() to change it")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __reduce__(self):  # pickle / copy.deepcopy without going through __setitem__
        return (_FrozenDict, (dict(self),))

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Hardware:
    """One device and its interconnect.

    ``peak_flops`` maps a dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``,
    ``"tf32"`` where tensor-core TF32 exists, optionally ``"float64"`` and
    ``"float8_e4m3fn"``/``"float8_e5m2"``) to dense peak FLOP/s.  It must contain
    ``"float32"``, which is the fallback for every dtype without an entry.

    ``memory_bytes`` is the device memory capacity.  For GPUs it is the
    datasheet's nominal capacity in decimal bytes (slightly below what the
    driver reports, which leaves some room for the CUDA context).  For the
    ``"cpu"`` preset it is the host's total RAM, which all ranks on the host
    share.

    ``op_overhead_s`` is a fixed per-operator cost (kernel launch / eager
    dispatch) that :func:`cost_models.compute.compute_time` adds to every op
    that does any work.

    ``efficiency`` names the table of what its kernels reach of these peaks
    (``cost_models/tables/<name>.json``, or a path to such a JSON file;
    ``cost_models.efficiency``); empty: every op is priced at the peaks (a roofline).

    ``host_bandwidth`` is bytes/s per direction between one device and host
    memory (its PCIe link), ``host_memory_bandwidth`` the host memory
    bandwidth one device's share of the host CPUs gets (what an optimizer step
    on offloaded states runs at).  Both 0 where the device *is* the host (the
    ``"cpu"`` preset): nothing can be offloaded to memory of its own.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_bytes: float
    devices_per_node: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    source: str
    op_overhead_s: float = 0.0
    host_bandwidth: float = 0.0
    host_memory_bandwidth: float = 0.0
    efficiency: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise HardwareError(f"Hardware.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise HardwareError(f"{self.name}: peak_flops must be a non-empty mapping of dtype name -> FLOP/s")
        flops: dict[str, float] = {}
        for key, value in self.peak_flops.items():
            if not isinstance(key, str) or not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise HardwareError(
                    f"{self.name}: peak_flops[{key!r}] = {value!r}; expected a positive finite FLOP/s number "
                    "keyed by a dtype name such as 'float32'"
                )
            flops[key.removeprefix("torch.")] = float(value)
        if "float32" not in flops:
            raise HardwareError(
                f"{self.name}: peak_flops must include 'float32' (the fallback for other dtypes); "
                f"got keys {sorted(flops)}"
            )
        object.__setattr__(self, "peak_flops", _FrozenDict(flops))

        positive = ("memory_bandwidth", "memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth")
        non_negative = ("intra_node_latency", "inter_node_latency", "op_overhead_s", "host_bandwidth",
                        "host_memory_bandwidth")
        for fname in positive + non_negative:
            value = getattr(self, fname)
            ok = _is_number(value) and math.isfinite(value) and (value > 0 if fname in positive else value >= 0)
            if not ok:
                kind = "positive" if fname in positive else "non-negative"
                raise HardwareError(f"{self.name}: {fname} = {value!r}; expected a {kind} finite number")
            object.__setattr__(self, fname, float(value))
        if not isinstance(self.devices_per_node, int) or isinstance(self.devices_per_node, bool) \
                or self.devices_per_node < 1:
            raise HardwareError(
                f"{self.name}: devices_per_node = {self.devices_per_node!r}; expected an integer >= 1"
            )
        if not isinstance(self.efficiency, str):
            raise HardwareError(f"{self.name}: efficiency must name a table (a string), got {self.efficiency!r}")
        if not isinstance(self.source, str):
            raise HardwareError(f"{self.name}: source must be a string, got {type(self.source).__name__}")

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    def flops_for(self, dtype: torch.dtype | str, *, allow_tf32: bool = False) -> float:
        """Dense peak FLOP/s for ``dtype``.

        ``allow_tf32=True`` makes float32 use the ``"tf32"`` tensor-core rate
        where the hardware has one (matmuls with TF32 enabled).  Dtypes without
        an entry fall back: float64 -> float32/2; float16 <-> bfloat16; float8
        -> bfloat16/float16; complex64 -> float32/4, complex128 -> float64/4;
        everything else (integers, bool, unknown) -> float32.
        """
        name = dtype if isinstance(dtype, str) else str(dtype)
        name = name.removeprefix("torch.")
        pf = self.peak_flops
        if name in ("float32", "float") and allow_tf32 and "tf32" in pf:
            return pf["tf32"]
        if name in pf:
            return pf[name]
        if name in ("float64", "double"):
            return pf["float32"] / 2.0
        if name in ("float16", "half", "bfloat16"):
            for alt in ("bfloat16", "float16"):
                if alt in pf:
                    return pf[alt]
            return pf["float32"]
        if name.startswith("float8"):
            for alt in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "bfloat16", "float16"):
                if alt in pf:
                    return pf[alt]
            return pf["float32"]
        if name in ("complex64", "cfloat"):
            return pf["float32"] / 4.0
        if name in ("complex128", "cdouble"):
            return self.flops_for(torch.float64) / 4.0
        return pf["float32"]


# --------------------------------------------------------------------------- presets

_GB = 1e9  # decimal gigabyte, as datasheets use
_TF = 1e12

_NV_LATENCY_NOTE = (
    "Latencies are per ring step, order-of-magnitude values (NVLink ~2 us, InfiniBand ~5 us incl. "
    "software), not datasheet numbers. Kernel-launch overhead 5 us per op (typical CUDA launch + "
    "framework dispatch)."
)

_A100_SRC = (
    "NVIDIA A100 Tensor Core GPU datasheet "
    "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM4: FP64 9.7 TF, FP32 19.5 TF, "
    "TF32 156 TF, BF16/FP16 312 TF dense (624 with sparsity); NVLink 3 600 GB/s bidirectional "
    "-> 300 GB/s per direction; inter-node: DGX A100 has one 200 Gb/s HDR InfiniBand "
    "ConnectX-6 NIC per GPU -> 25 GB/s per GPU (NVIDIA DGX A100 user guide). "
)
_HOPPER_SRC = (
    "NVIDIA H100 Tensor Core GPU datasheet "
    "(https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet), H100 SXM5: "
    "FP64 34 TF, FP32 67 TF, TF32 989 TF / BF16, FP16 1979 TF / FP8 3958 TF with sparsity, "
    "halved here for dense (494.5 / 989.5 / 1979 TF); NVLink 4 900 GB/s bidirectional -> "
    "450 GB/s per direction; inter-node: DGX H100/H200 has one 400 Gb/s NDR InfiniBand "
    "ConnectX-7 NIC per GPU -> 50 GB/s per GPU (NVIDIA DGX H100 user guide). "
)
_A100_FLOPS = {
    "float64": 9.7 * _TF,
    "float32": 19.5 * _TF,
    "tf32": 156 * _TF,
    "bfloat16": 312 * _TF,
    "float16": 312 * _TF,
}
_HOPPER_FLOPS = {
    "float64": 34 * _TF,
    "float32": 67 * _TF,
    "tf32": 494.5 * _TF,
    "bfloat16": 989.5 * _TF,
    "float16": 989.5 * _TF,
    "float8_e4m3fn": 1979 * _TF,
    "float8_e5m2": 1979 * _TF,
}

def _nvidia_8gpu_node(name: str, flops: Mapping[str, float], *, memory_bandwidth: float, memory_bytes: float,
                      nvlink: float, infiniband: float, pcie: float, host_memory: float, efficiency: str,
                      source: str) -> Hardware:
    """An 8-GPU NVLink node on InfiniBand; latencies and per-op overhead are shared estimates.
    ``pcie``: each GPU's link to the host, per direction; ``host_memory``: the node's host memory
    bandwidth, shared by its 8 GPUs."""
    return Hardware(name=name, peak_flops=dict(flops), memory_bandwidth=memory_bandwidth, memory_bytes=memory_bytes,
                    devices_per_node=8, intra_node_bandwidth=nvlink, intra_node_latency=2e-6,
                    inter_node_bandwidth=infiniband, inter_node_latency=5e-6, op_overhead_s=5e-6,
                    host_bandwidth=pcie, host_memory_bandwidth=host_memory / 8, efficiency=efficiency, source=source)


_A100_HOST = dict(pcie=25 * _GB, host_memory=410 * _GB)
_A100_HOST_SRC = (
    "Host: PCIe Gen4 x16 per GPU, 32 GB/s per direction nominal, 25 GB/s as pinned copies reach it; "
    "DGX A100 host memory 2 AMD EPYC 7742 x 8 channels DDR4-3200 = 410 GB/s, shared by 8 GPUs. "
)
_HOPPER_HOST = dict(pcie=50 * _GB, host_memory=614 * _GB)
_HOPPER_HOST_SRC = (
    "Host: PCIe Gen5 x16 per GPU, 64 GB/s per direction nominal, 50 GB/s as pinned copies reach it; "
    "DGX H100/H200 host memory 2 Xeon Platinum 8480C x 8 channels DDR5-4800 = 614 GB/s, shared by 8 GPUs. "
)


PRESETS: dict[str, Hardware] = {
    "cpu": Hardware(
        name="cpu",
        peak_flops={
            "float32": 150e9,
            "float16": 150e9,
            "bfloat16": 80e9,
            "float64": 80e9,
        },
        memory_bandwidth=11e9,
        memory_bytes=25_276_510_208.0,
        devices_per_node=64,
        intra_node_bandwidth=1e9,
        intra_node_latency=100e-6,
        inter_node_bandwidth=0.5e9,
        inter_node_latency=200e-6,
        op_overhead_s=4e-6,
        source=(
            "Measured on 2026-11-21 on this machine class (2-vCPU KVM VM, Intel Xeon with AVX-512 incl. "
            "avx512_bf16/avx512_fp16, no AMX, 23.5 GiB RAM; torch 2.13.0+cpu, one process, "
            "torch.set_num_threads(1)): torch.mm 1024x1024 best of 5 -> fp32 147-155, fp16 148-156, "
            "bf16 82-83, fp64 80 GFLOP/s; dst.copy_(src) of 64-256 MiB fp32, "
            "counting bytes read+written -> 10.5-12.7 GB/s; tiny eager op 1.6-2.7 us, ~4 us per aten op in "
            "a fwd+bwd chain -> op_overhead 4 us; memory = MemTotal of /proc/meminfo (23.5 GiB, shared by "
            "all ranks on the host). Intra-node link = gloo over loopback, 2 ranks, median of 5-20: "
            "all_reduce 1-64 MiB bus bandwidth 0.8-1.65 GB/s (all_gather only ~0.3 GB/s), 16 MiB send "
            "2.0 GB/s, ping-pong one-way latency 118 us, 8-byte all_reduce 170-230 us -> 1 GB/s, 100 us "
            "per step. 4 ranks on 2 cores oversubscribe the CPUs and run 3-5x slower. Inter-node values "
            "(0.5 GB/s, 200 us; gloo over TCP) are assumptions, not measured."
        ),
    ),
    "a100-40gb": _nvidia_8gpu_node(
        "a100-40gb", _A100_FLOPS, efficiency="a100", memory_bandwidth=1555 * _GB, memory_bytes=40 * _GB,
        nvlink=300 * _GB, infiniband=25 * _GB, **_A100_HOST,
        source=_A100_SRC + "A100 40GB SXM4: 40 GB HBM2, 1555 GB/s. " + _A100_HOST_SRC + _NV_LATENCY_NOTE,
    ),
    "a100-80gb": _nvidia_8gpu_node(
        "a100-80gb", _A100_FLOPS, efficiency="a100", memory_bandwidth=2039 * _GB, memory_bytes=80 * _GB,
        nvlink=300 * _GB, infiniband=25 * _GB, **_A100_HOST,
        source=_A100_SRC + "A100 80GB SXM4: 80 GB HBM2e, 2039 GB/s. " + _A100_HOST_SRC + _NV_LATENCY_NOTE,
    ),
    "h100-80gb": _nvidia_8gpu_node(
        "h100-80gb", _HOPPER_FLOPS, efficiency="h100", memory_bandwidth=3350 * _GB, memory_bytes=80 * _GB,
        nvlink=450 * _GB, infiniband=50 * _GB, **_HOPPER_HOST,
        source=_HOPPER_SRC + "H100 SXM5: 80 GB HBM3, 3.35 TB/s. " + _HOPPER_HOST_SRC + _NV_LATENCY_NOTE,
    ),
    "h200": _nvidia_8gpu_node(
        "h200", _HOPPER_FLOPS, efficiency="h200", memory_bandwidth=4800 * _GB, memory_bytes=141 * _GB,
        nvlink=450 * _GB, infiniband=50 * _GB, **_HOPPER_HOST,
        source=(
            _HOPPER_SRC
            + "H200 SXM (NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/): "
            "same compute and NVLink as H100 SXM5, 141 GB HBM3e, 4.8 TB/s. " + _HOPPER_HOST_SRC + _NV_LATENCY_NOTE
        ),
    ),
}

# Convenience spellings accepted by get_hardware (not listed as separate presets).
_ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm5-80gb": "h100-80gb",
    "h200-141gb": "h200",
    "h200-sxm": "h200",
}

_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Hardware))
_REQUIRED_FIELDS = tuple(
    f.name for f in dataclasses.fields(Hardware)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)


def _valid_names_text() -> str:
    return ", ".join(sorted(PRESETS))


def _lookup_preset(name: str) -> Hardware | None:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    return PRESETS.get(key)


# --------------------------------------------------------------------------- dict round trip


def hardware_to_dict(hw: Hardware) -> dict[str, Any]:
    """Plain, JSON-serialisable dict of every field (``peak_flops`` as a plain dict)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(hw):
        value = getattr(hw, f.name)
        out[f.name] = dict(value) if f.name == "peak_flops" else value
    return out


def hardware_from_dict(d: Mapping[str, Any]) -> Hardware:
    """Inverse of :func:`hardware_to_dict`; ``hardware_from_dict(hardware_to_dict(hw)) == hw``."""
    if not isinstance(d, Mapping):
        raise HardwareError(f"a hardware description must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(_FIELD_NAMES))
    if unknown:
        raise HardwareError(
            f"unknown hardware field(s) {unknown}; valid fields are {list(_FIELD_NAMES)}"
        )
    missing = [k for k in _REQUIRED_FIELDS if k not in d]
    if missing:
        raise HardwareError(
            f"hardware description is missing field(s) {missing}; give them, or start from a preset "
            f"with {{\"base\": <one of {_valid_names_text()}>, ...}}"
        )
    try:
        return Hardware(**dict(d))
    except TypeError as exc:  # pragma: no cover - guarded by the field checks above
        raise HardwareError(f"malformed hardware description: {exc}") from exc


# --------------------------------------------------------------------------- lookup


def _from_override_file(path: Path) -> Hardware:
    try:
        text = path.read_text()
    except OSError as exc:
        raise HardwareError(f"cannot read hardware file {str(path)!r}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HardwareError(f"hardware file {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise HardwareError(f"hardware file {str(path)!r} must hold a JSON object, got {type(data).__name__}")

    data = dict(data)
    base_name = data.pop("base", None)
    if base_name is None:
        return hardware_from_dict(data)
    if not isinstance(base_name, str):
        raise HardwareError(f"hardware file {str(path)!r}: 'base' must be a preset name string")
    base = _lookup_preset(base_name)
    if base is None:
        raise HardwareError(
            f"hardware file {str(path)!r}: unknown base preset {base_name!r}; valid names: {_valid_names_text()}"
        )
    unknown = sorted(set(data) - set(_FIELD_NAMES))
    if unknown:
        raise HardwareError(
            f"hardware file {str(path)!r}: unknown field(s) {unknown}; valid fields are "
            f"'base' and {list(_FIELD_NAMES)}"
        )
    merged = hardware_to_dict(base)
    overridden = sorted(data)
    if "peak_flops" in data:
        if not isinstance(data["peak_flops"], dict):
            raise HardwareError(f"hardware file {str(path)!r}: 'peak_flops' must be an object of dtype -> FLOP/s")
        # merge: entries given replace the base's, others are kept
        merged["peak_flops"] = {**merged["peak_flops"], **data.pop("peak_flops")}
    merged.update(data)
    if "name" not in overridden:
        merged["name"] = f"{base.name}+{path.name}"
    if "source" not in overridden:
        merged["source"] = (
            f"{base.source} | Overridden from {str(path)!r}: {', '.join(overridden) or 'nothing'}."
        )
    return hardware_from_dict(merged)


def get_hardware(name_or_path: str | os.PathLike[str] | Hardware) -> Hardware:
    """Resolve a preset name (case-insensitive), or a JSON file path.

    A JSON file holds ``{"base": "<preset>", <field>: <value>, ...}``; the listed
    fields replace the base preset's (``peak_flops`` is merged entry by entry).
    Without ``"base"`` the file must give every field.  A :class:`Hardware`
    instance is returned unchanged.  Raises :class:`autopar.core.errors.HardwareError`
    naming the valid presets when nothing matches.
    """
    if isinstance(name_or_path, Hardware):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise HardwareError(
            f"hardware must be a preset name or a JSON file path, got {type(name_or_path).__name__}; "
            f"valid names: {_valid_names_text()}"
        )
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, str):
        preset = _lookup_preset(text)
        if preset is not None:
            return preset
    path = Path(text)
    if path.is_file():
        return _from_override_file(path)
    if text.lower().endswith(".json") or isinstance(name_or_path, os.PathLike):
        raise HardwareError(f"hardware file {text!r} does not exist; valid preset names: {_valid_names_text()}")
    raise HardwareError(
        f"unknown hardware {text!r}; valid names: {_valid_names_text()} "
        "(or a path to a JSON file like {\"base\": \"h100-80gb\", \"memory_bytes\": 4e10})"
    )

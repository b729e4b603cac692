"""Measured costs of the machine at hand: the one data structure profiling hands to the cost model.

A ``Profile`` holds
* ``ops``: forward and backward seconds of one op at one set of local shapes (``op_key``);
* ``collectives``: a fitted ``Link`` (latency + bandwidth) per collective kind and group size,
  measured through the runtime's own ``redistribute`` (so its Python overhead is in the latency),
  or the ``torch.distributed`` call a kernel makes (``all_to_all_single``);
* ``overheads``: seconds the generated code's runtime adds per call site (see ``OVERHEADS``).

It is keyed by a hardware fingerprint: a profile taken on another device, torch version, thread
count or number of processes sharing the host (CPU cores are shared) does not describe this run,
and the cost model falls back to the roofline presets for it. Profiles are JSON, never pickle.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.core.errors import AutoparError
from autopar.core.mesh import MeshSpec, hardware_for_device
from cost_models.comm import COLLECTIVE_KINDS, Link

PROFILE_VERSION = 21   # 2: op times include making results contiguous; 3: calibrated on whole steps, collectives too;
                      # 4: collective factors per mesh shape; 5: op keys say which inputs need a gradient,
                      # runtime overheads of ops without one; 6: the overheads factor covers per-parameter
                      # and per-step costs too; 7: generated code on local tensors (ops as timed, moves
                      # and parameter reads its only wrappers); 8: gradient sync and ZeRO-3 gathers priced
                      # per bucket (calibration refitted), views timed with their local shape; 9: replicated
                      # parameters stepped as plain tensors (optimizer_per_plain_param), the loss summed with
                      # the gradients; 10: folded ops not timed, gradients of ops computed from parameters
                      # alone summed in the buckets (calibration refitted); 11: pipeline schedules' costs per
                      # microbatch and per step (pipeline_microbatch, pipeline_step); 12: those on three microbatch counts,
                      # not scaled by calibration; 13: gradient buckets summed by c10d's in-place all-reduce
                      # (a fifth of the functional one's launch): gradient sync's factor refitted; 14: that
                      # factor scales a bucket's latency, not its bytes (fitted on tiny models, it priced a
                      # large model's gradient bandwidth at 4x); 15: on a GPU, backward times are the
                      # kernels' (not the engine's per-call hand-off), ops not calibrated; 16: the ops factor
                      # scales only ops that fit in their rank's share of the CPU's last-level cache
                      # (``cache_bytes`` in the fingerprint); 17: the collective factors fitted on a heavier
                      # workload too, whose stretches of compute between collectives are real models';
                      # 18: a move's local copies (``relayout_per_mib``, ``fresh_per_mib``); 19: a gradient
                      # bucket summed over every axis of the job priced as the one all-reduce it is (refitted);
                      # 20: that all-reduce measured on a mesh of several axes before calibration (``JOB_KINDS``);
                      # 21: the experts' all-to-alls at an in-step factor of their own (``EXPERT_CALIBRATION``)

#: A collective kind profiles of an earlier autopar lack -> the measured kind that prices it there:
#: the same exchange, run as DTensor runs it (on gloo an all-gather and a chunk: an upper bound),
#: nearer this host than the roofline. ``autopar profile`` measures the kind where it is missing.
STAND_INS = {"all_to_all_single": "all_to_all"}

#: The collective kinds a profile measures (``autopar.profiling.profile_comm.time_collectives``):
#: all but broadcast, which no plan runs.
MEASURED_KINDS: tuple[str, ...] = tuple(k for k in COLLECTIVE_KINDS if k != "broadcast")

THREADS_PER_RANK = 1   # autopar.profiling.launch gives each local rank one thread
log = logging.getLogger(__name__)

#: Runtime overheads a profile measures, seconds per occurrence (forward + backward together).
#: Generated code runs each op as the ATen call the op profile times; what it adds is below.
OVERHEADS = {
    "move": "one placement change (codegen.runtime.move: wrapping as a DTensor, redistributing, unwrapping "
            "with a gradient node), beyond its collectives",
    "param_read": "one op's read of a parameter's shard (codegen.runtime.param_shard)",
    "grad_hook": "one parameter's gradient-sync hook when no collective is needed",
    "optimizer_per_param": "one DTensor parameter's optimizer update, beyond its bytes",
    "optimizer_per_plain_param": "one plain parameter's optimizer update, beyond its bytes (a plan replicating "
                                 "every parameter keeps them plain, as DDP does: codegen.runtime.replicated)",
    "step": "fixed cost of one training step (zero_grad, loss.backward entry, optimizer loop)",
    "pipeline_microbatch": "one microbatch's forward and backward on a pipeline stage beyond its ops: the "
                           "torch.distributed.pipelining schedule's actions, its point-to-point sends and waits",
    "pipeline_step": "fixed cost of one pipelined step beyond its microbatches' (the schedule splitting the batch, "
                     "filling and draining)",
    "relayout_per_mib": "seconds per MiB (not per occurrence) of the copy a placement change makes beside its "
                        "collective when the split dim is not the first (DTensor concatenates the gathered chunks, "
                        "or packs the chunks it scatters), every rank copying at once",
    "fresh_per_mib": "seconds per MiB (not per occurrence) beyond that copy of a buffer larger than "
                     "``FRESH_BUFFER_BYTES``, which the allocator maps afresh each time: its pages fault in",
}

#: Overheads priced per MiB of a placement change's local buffers, inside the move's cost
#: (``CostModel.redistribute``), not per occurrence.
PER_MIB_OVERHEADS = ("relayout_per_mib", "fresh_per_mib")

#: glibc's largest mmap threshold on 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``): the CPU
#: allocator returns a freed buffer above it to the OS, so the next one faults each page in on
#: first touch; buffers below it are reused. On 4 gloo processes sharing 2 cores, gathering
#: gpt2-125m's logits (196 MiB) over 2 ranks took 2.0x the all-gather's fit along the first dim
#: (the result's page faults) and 3.0x along the last (and the concatenation's).
FRESH_BUFFER_BYTES = 32 * 2**20


#: Overheads measured on whole steps (pipelined ones), not on calls apart: calibration's in-step
#: factor does not apply to them.
WHOLE_STEP_OVERHEADS = ("pipeline_microbatch", "pipeline_step")


def runtime_overhead(profile: "Profile | None", counts: dict[str, float]) -> float:
    """Seconds of ``counts[key]`` occurrences of each of the runtime's per-call costs
    (``OVERHEADS``, measured by the profile's micro-benchmarks), at the one in-step factor
    calibration fits for those timed apart from a step; 0 without a profile (the roofline knows
    no runtime)."""
    if profile is None:
        return 0.0
    factor = profile.calibration.get("overheads", 1.0)
    return sum(profile.overheads.get(key, 0.0) * n * (1.0 if key in WHOLE_STEP_OVERHEADS else factor)
               for key, n in counts.items())


class ProfileError(AutoparError):
    """A profile file is malformed, from another autopar version, or from other hardware."""


class StaleProfileError(ProfileError):
    """A profile file written by another version of autopar's profiler: measure again."""


@dataclass(frozen=True)
class OpTime:
    fwd_s: float
    bwd_s: float  # 0 for ops without a backward (integer outputs)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass
class Profile:
    fingerprint: dict[str, Any]
    ops: dict[str, OpTime] = field(default_factory=dict)
    collectives: dict[str, Link] = field(default_factory=dict)   # collective_key(kind, n) -> Link
    overheads: dict[str, float] = field(default_factory=dict)    # OVERHEADS key -> seconds
    # Inside a training step ops run slower than alone in a timing loop (cold caches, the
    # allocator), the runtime's per-call costs differ from their micro-benchmarks, and collectives
    # cost more than in lockstep: factors "ops" and "overheads", and per mesh shape "comm@AxB"
    # (blocking) and "sync@AxB" (queued gradient sync) (``calibration_key``), fitted on fixed
    # calibration workloads (``profiling``); and "overlap".
    calibration: dict[str, float] = field(default_factory=dict)

    def in_cache(self, working_bytes: float) -> bool:
        """Whether an op whose local inputs and output take ``working_bytes`` fits in its rank's
        share of the last-level cache (the ranks of a host share it), where calibration's "ops"
        factor applies: timed alone in a loop such an op finds its inputs in cache, and in a step,
        where the ops before evicted them, not. An op larger than that streams from memory in
        both and runs at its loop time: one factor on every op, fitted on tiny models (1.3 on 4
        CPU processes), priced gpt2-125m's matmuls a fifth slow (1.09x measured in a step). True where
        the size is unknown."""
        cache = self.fingerprint.get("cache_bytes", 0) / max(1, self.fingerprint.get("processes_per_host", 1))
        return not cache or working_bytes <= cache

    def link(self, kind: str, n: int) -> Link | None:
        """The fitted link of ``kind`` on groups of ``n``; where the profile lacks it (measured by
        an autopar that did not time that kind), its ``STAND_INS`` kind's; else None."""
        found = self.collectives.get(collective_key(kind, n))
        if found is None and kind in STAND_INS:
            return self.collectives.get(collective_key(STAND_INS[kind], n))
        return found

    def merge(self, other: "Profile") -> None:
        """Add ``other``'s measurements (same fingerprint) to this profile; newer numbers win."""
        if other.fingerprint != self.fingerprint:
            raise ProfileError("cannot merge profiles of different hardware fingerprints")
        self.ops.update(other.ops)
        self.collectives.update(other.collectives)
        self.overheads.update(other.overheads)
        self.calibration.update(other.calibration)

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        text = json.dumps({
            "autopar_profile_version": PROFILE_VERSION,
            "fingerprint": self.fingerprint,
            "ops": {k: [v.fwd_s, v.bwd_s] for k, v in sorted(self.ops.items())},
            "collectives": {k: {"latency_s": v.latency, "bandwidth_Bps": v.bandwidth}
                            for k, v in sorted(self.collectives.items())},
            "overheads": dict(sorted(self.overheads.items())),
            "calibration": dict(sorted(self.calibration.items())),
        }, indent=1)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> "Profile":
        text = str(text_or_path)
        where = "profile text"
        if not text.lstrip().startswith("{"):
            where = text
            try:
                text = Path(text).read_text()
            except OSError as e:
                raise ProfileError(f"cannot read profile file {where}: {e}") from e
        try:
            d = json.loads(text)
            version = d.get("autopar_profile_version")
            if version != PROFILE_VERSION:
                raise StaleProfileError(f"{where} is a version-{version} profile; this autopar reads version "
                                        f"{PROFILE_VERSION}: run `autopar profile` again")
            return cls(fingerprint=dict(d["fingerprint"]),
                       ops={k: OpTime(float(f), float(b)) for k, (f, b) in d["ops"].items()},
                       collectives={k: Link(bandwidth=float(v["bandwidth_Bps"]), latency=float(v["latency_s"]))
                                    for k, v in d["collectives"].items()},
                       overheads={k: float(v) for k, v in d["overheads"].items()},
                       calibration={k: float(v) for k, v in d["calibration"].items()})
        except ProfileError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ProfileError(f"{where} is not an autopar profile ({type(e).__name__}: {e})") from e


def collective_key(kind: str, n: int) -> str:
    return f"{kind}@{n}"


#: Kinds also run on a group of every rank of a mesh of several axes: the gradient buckets' sum
#: over all of them is one all-reduce of the job (``autopar.core.collectives.spans_job``).
JOB_KINDS = ("all_reduce",)


def group_sizes(kind: str, shape: Sequence[int]) -> set[int]:
    """The group sizes ``kind`` runs on over a mesh of ``shape``: each axis's (above 1), and the
    whole mesh's for ``JOB_KINDS`` where two axes or more are above 1."""
    axes = [n for n in shape if n > 1]
    return {*axes, *([math.prod(axes)] if len(axes) > 1 and kind in JOB_KINDS else [])}


def missing_kinds(profile: Profile | None, shape: Sequence[int]) -> tuple[str, ...]:
    """The ``MEASURED_KINDS`` that ``profile`` lacks on a group it runs on over a mesh of
    ``shape`` (``group_sizes``; all without a profile): what measuring this host for that mesh
    adds. Only those: the links held stay the ones calibration fitted its factors against."""
    held = profile.collectives if profile is not None else {}
    return tuple(k for k in MEASURED_KINDS if any(collective_key(k, n) not in held for n in group_sizes(k, shape)))


def calibration_key(factor: str, shape: tuple[int, ...]) -> str:
    """Key of an in-step collective factor ("comm", "experts" or "sync") of one mesh shape. It is fitted per
    shape, not per process count: which ranks wait for which, and how far apart they arrive,
    differs between a 2x2 and a 4 mesh of the same four processes."""
    return f"{factor}@{'x'.join(map(str, shape))}"


def hardware_fingerprint(device: str = "cpu", processes_per_host: int = 1, threads: int | None = None) -> dict[str, Any]:
    """What makes measured seconds transferable: the device model, the torch build, the threads
    each process uses and how many processes share the host (they share CPU cores)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = _cpu_model()
    fingerprint = {"device": device.split(":")[0], "device_name": name, "torch": torch.__version__,
                   "threads": torch.get_num_threads() if threads is None else int(threads),
                   "processes_per_host": int(processes_per_host), "cpus": os.cpu_count()}
    if fingerprint["device"] == "cpu":
        fingerprint["cache_bytes"] = _last_level_cache_bytes()
    return fingerprint


def fingerprint_id(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]


def default_profile_path(fingerprint: dict[str, Any]) -> Path:
    """Where ``autopar profile`` caches a profile (``$AUTOPAR_PROFILE_DIR``, else ~/.cache/autopar)."""
    root = Path(os.environ.get("AUTOPAR_PROFILE_DIR", Path.home() / ".cache" / "autopar" / "profiles"))
    return root / f"profile-{fingerprint_id(fingerprint)}.json"


def local_fingerprint(mesh: MeshSpec) -> dict[str, Any]:
    """The fingerprint a profile of ``mesh`` run on this host (one process per device of its job)
    carries."""
    device = "cuda" if mesh.hardware != "cpu" and torch.cuda.is_available() else "cpu"
    return hardware_fingerprint(device, processes_per_host=mesh.processes, threads=THREADS_PER_RANK)


def find_profile(mesh: MeshSpec) -> Profile | None:
    """The cached profile of this host for ``mesh``, if ``autopar profile`` made one and the mesh's
    hardware is this host's kind of device (planning for other hardware uses its preset). One left
    by an older autopar is not used, with a warning: plans still work, on the presets."""
    local_kind = hardware_for_device("cuda" if torch.cuda.is_available() else "cpu")
    if mesh.hardware != local_kind:
        return None
    path = default_profile_path(local_fingerprint(mesh))
    try:
        return Profile.from_json(path) if path.exists() else None
    except StaleProfileError as e:
        log.warning("autopar: %s; planning with the hardware presets meanwhile", e)
        return None


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


def op_key(target: Any, args: tuple, kwargs: dict[str, Any]) -> str:
    """Identify one op call by its target, the shapes and dtypes of its tensor arguments (local
    shapes: what one rank runs), which of them need a gradient (marked ``(grad)``: the backward
    computes only those) and the values of the others."""
    shown = torch.utils._pytree.tree_map_only(torch.Tensor, _TensorSig, (args, kwargs))
    return f"{target}{shown[0]!r}{shown[1]!r}"


class _TensorSig:
    def __init__(self, t: torch.Tensor) -> None:
        self.text = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}{'(grad)' if t.requires_grad else ''}"

    def __repr__(self) -> str:
        return self.text


def _last_level_cache_bytes() -> int:
    """The size of this CPU's largest cache (0 where the OS does not say)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes, default=0)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

"""What ``compile`` measures on its own while it plans on a live mesh: a first profile of this
host where none is cached (``measure_host``), and the ops of the model that the profile lacks
(``measure_missing_ops``).

A profile (``autopar profile``) holds the op calls of the models it was taken for. A user's own
model runs other ops, or the same ops at other local shapes, and the cost model prices every call
the profile lacks by the roofline, which on a CPU is 2-3x off: the plan is chosen, and its step
time predicted, on guesses. ``compile`` has the job's ranks at hand, so it measures those calls
first, the way ``autopar profile`` measures them (``time_on_every_rank``, shared by both): every
rank times every call at once, since ranks sharing a host's cores slow each other as in
training, and the slowest rank's time is kept, since a step waits for it. The calls join the
profile and are saved back to its file, so the next compile of the model measures nothing.

A new user has no profile at all: planned on the CPU preset's roofline, a small GPT's step was
predicted 4.5-8x faster than it ran. With ``profile="auto"`` and no profile of this host and mesh
size cached, ``compile`` first measures the collectives of the mesh's axes, the runtime's
overheads and the overlap of gradient sync with compute, with ``autopar profile``'s own
functions (``profile_comm``), on the job's ranks, and saves them to the cache before timing the
ops: later compiles here measure nothing. It fits no in-step factors (calibration trains whole
steps of its own workloads, minutes; ``autopar profile`` adds them). ``AUTOPAR_MEASURE_FIRST_PROFILE=0``
turns the first profile off (plans then rest on the roofline and say so).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.capture import CapturedGraph
from autopar.core.mesh import MeshSpec
from autopar.core.progress import note, say, working
from autopar.core.strategies import build_space
from autopar.core.together import one_process, together
from cost_models.profile import (
    MEASURED_KINDS,
    OpTime,
    Profile,
    ProfileError,
    StaleProfileError,
    default_profile_path,
    local_fingerprint,
    missing_kinds,
)
from cost_models.profile_ops import OpCall, op_calls, time_op_calls

Progress = Callable[[str], None]
log = logging.getLogger(__name__)

#: ``compile`` times each op call over batches of at least this many seconds in all (``time_op_calls``'s
#: ``min_time_s``), a quarter of ``autopar profile``'s: most calls of a small model take
#: microseconds, so the floor is their whole cost, and a first compile of a small GPT-2 on 2x2
#: timed its 373 calls in 75-84 s at 0.02 (a loaded 2-core host); the median of several batches
#: still discards a batch another process preempted.
COMPILE_MIN_TIME_S = 0.005
#: Set to "0" and ``compile`` measures no first profile where none is cached: it plans on the
#: roofline (and the plan says so). For jobs that must not spend the seconds, such as a test suite
#: that keeps its cache empty so that no measurement changes its plans.
FIRST_PROFILE_ENV = "AUTOPAR_MEASURE_FIRST_PROFILE"


def show_progress(line: str) -> None:
    """``compile``'s progress while it measures: one line to stderr (rank 0 only calls it)."""
    say(f"autopar: {line}")


def measure_missing_ops(workloads: Sequence[tuple[CapturedGraph, MeshSpec]], profile: Profile | None,
                        source: Profile | str | Path | None, progress: Progress = show_progress) -> None:
    """Time the op calls of each workload's strategy space (a captured graph on a mesh: every
    candidate strategy's local shapes; ``planning.planner.priced_workloads``, the job's mesh
    first) that ``profile`` lacks, on every rank at once; merge them into ``profile`` and,
    on rank 0, save it where ``source`` (the ``profile`` option it was resolved from) names a file.
    Every rank of the job calls it: ranks with nothing to time (no profile here, or a profile of
    other hardware) take part in the collectives alone.

    Nothing is measured for a profile of another fingerprint: op keys and times hold for the host,
    device, threads and process count it names (``local_fingerprint``), and ours would not. In one
    process simulating several ranks, calls are timed alone, an under-estimate where ranks would
    share cores: they serve this plan, and are not saved. ``progress`` gets a line (rank 0) when
    timing starts and one when it ends; each call's, to the log."""
    spec = workloads[0][1]
    calls = together("finding the ops the profile lacks",
                     lambda: list({c.key: c for captured, mesh in workloads
                                   for c in _missing_calls(captured, mesh, profile)}.values()))
    most = len(calls) if one_process() else max(_gathered(len(calls)))
    if most == 0:
        return
    say = progress if _rank() == 0 else None
    if say is not None:
        where = "in this process" if one_process() else f"on all {dist.get_world_size()} ranks at once"
        say(f"op calls: timing {most} the profile lacks {where} (once per model and mesh; "
            "`autopar profile --model` does it ahead of time)...")
    t0 = time.perf_counter()
    fingerprint = local_fingerprint(spec)
    with working(f"timing {most} op calls the profile lacks"):   # the status line: rank 0 only
        times = time_on_every_rank(calls, fingerprint, note if say is not None else None, min_time_s=COMPILE_MIN_TIME_S)
    path = None
    if profile is not None and profile.fingerprint == fingerprint:
        profile.merge(Profile(fingerprint, times))
        path = _file_to_update(source, spec)
        if path is not None:
            _save(Profile(fingerprint, times), path)
    if say is not None:
        say(f"op calls: timed {len(times)} in {time.perf_counter() - t0:.1f} s" + (f"; saved to {path}" if path else ""))


def measure_host(mesh: DeviceMesh, spec: MeshSpec, profile: Profile | None,
                 progress: Progress = show_progress) -> Profile | None:
    """The profile of this host for ``spec`` that ``compile`` plans on with ``profile="auto"``:
    the cached one (``profile``, as read on this rank), completed with what rank 0's copy lacks
    of what ``autopar profile`` measures apart from the ops (the collectives of each axis size of
    the mesh, the runtime's overheads, the overlap of an asynchronous all-reduce with compute),
    measured on every rank of the live ``mesh`` at once and saved to the cache; None where nothing
    may be measured here (``_may_measure_host``: one process, another kind of device, or
    ``FIRST_PROFILE_ENV`` set to 0) and none is cached. Every rank calls it; all follow rank 0's
    reading of the cache, since rank 0 plans. The ops come after (``measure_missing_ops``)."""
    if not _may_measure_host(spec):
        return profile
    fingerprint = local_fingerprint(spec)
    need = _gathered(_host_needs(profile, spec, fingerprint))[0]
    if not need:
        return profile
    say = progress if _rank() == 0 else None
    path = default_profile_path(fingerprint)
    kinds = [k for k in need if k in MEASURED_KINDS]
    what = " and ".join(([f"collectives ({', '.join(kinds)})"] if kinds else []) + [k for k in need if k not in kinds])
    if say is not None:
        say(f"{'no profile of this host' if profile is None else 'the profile of this host lacks ' + what} "
            f"for {spec.size} processes yet: measuring on all {spec.size} ranks at once, once "
            f"(cached in {path}; `autopar profile` adds in-step calibration)...")
    with working(f"measuring this host's {what}"):
        measured = together("measuring this host's collectives and overheads",
                            lambda: Profile(fingerprint, **_measure_host_parts(mesh, need, say)))
    if _rank() == 0:
        _save(measured, path)
    if profile is None or profile.fingerprint != fingerprint:
        return measured
    profile.merge(measured)
    return profile


def _may_measure_host(spec: MeshSpec) -> bool:
    """Whether ``compile`` may measure this host's collectives and overheads on ``spec``: ranks in
    processes of their own (one process simulating ranks would time none of their sharing the
    cores), on the CPU (gloo; on a GPU, CPU tensors say nothing of NCCL and the presets' links
    stay), and not turned off (``FIRST_PROFILE_ENV``: 0, false, no or off)."""
    return first_profile_allowed() and not one_process() and spec.hardware == "cpu"


def first_profile_allowed() -> bool:
    """Whether a first profile may be measured where none is cached (``compile``, ``autopar
    demo``): unless ``FIRST_PROFILE_ENV`` is 0, false, no or off."""
    return os.environ.get(FIRST_PROFILE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _host_needs(profile: Profile | None, spec: MeshSpec, fingerprint: dict[str, Any]) -> list[str]:
    """What of the host's own measurements ``profile`` lacks for ``spec``: the collective kinds it
    lacks at an axis size of the mesh (``missing_kinds``), "overheads" (the runtime's, with the
    overlap)."""
    if profile is not None and profile.fingerprint != fingerprint:
        return []   # resolve_profile refused it already, or it is for other hardware: not ours to fill
    need = list(missing_kinds(profile, spec.shape))
    if profile is None or not profile.overheads:
        need.append("overheads")
    return need


def _measure_host_parts(mesh: DeviceMesh, need: Sequence[str], say: Progress | None) -> dict[str, Any]:
    """``Profile`` fields of ``need`` (collective kinds, "overheads"), measured with ``autopar
    profile``'s own functions (``profile_comm``) on every rank; one progress line per part."""
    from autopar.profiling.profile_comm import time_collectives, time_overheads, time_overlap

    parts: dict[str, Any] = {}
    kinds = [k for k in need if k in MEASURED_KINDS]
    if kinds:
        t0 = time.perf_counter()
        parts["collectives"] = time_collectives(mesh, kinds=kinds)
        if say is not None:
            sizes = sorted({n for n in mesh.shape if n > 1})
            say(f"collectives: {len(parts['collectives'])} fitted (each kind on axes of {sizes} ranks) in "
                f"{time.perf_counter() - t0:.1f} s")
    if "overheads" in need:
        t0 = time.perf_counter()
        parts["overheads"] = time_overheads(mesh)   # all its repeats: halved, the per-parameter ones came out 100x
        overlap = time_overlap(mesh) if any(n > 1 for n in mesh.shape) else None
        parts["calibration"] = {} if overlap is None else {"overlap": overlap}
        if say is not None:
            shown = "" if overlap is None else f", {100 * overlap:.0f}% of an asynchronous all-reduce under compute"
            say(f"runtime overheads: {len(parts['overheads'])} timed{shown} in {time.perf_counter() - t0:.1f} s")
    return parts


def time_on_every_rank(calls: Sequence[OpCall], fingerprint: dict[str, Any], progress: Progress | None = None,
                       min_time_s: float = 0.02) -> dict[str, OpTime]:
    """Seconds of each of ``calls`` as a profile of ``fingerprint`` holds them: timed on its device
    with its threads per process, on every rank of the job at once, the slowest rank's kept (one
    process: this one's). A call timed on no rank (it cannot run standalone) gets no entry.

    The caller's state is left as it was: its random stream (inputs are random), thread count
    and grad mode (timing needs the backward); a LocalTensorMode simulating ranks is set aside.
    ``min_time_s``: the least seconds each of a call's forward and backward is timed over
    (``time_op_calls``)."""
    device = fingerprint["device"]
    if device == "cuda":   # each rank times on its own GPU
        device = f"cuda:{_rank() % torch.cuda.device_count()}"
    step = max(1, len(calls) // 10)

    def shown(i: int, n: int, key: str) -> None:
        if progress is not None and i % step == 0:
            progress(f"op {i + 1}/{n}: {key[:90]}")

    def mine() -> dict[str, OpTime]:
        forked = [torch.device(device)] if device.startswith("cuda") else []
        with _threads(fingerprint["threads"]), torch.random.fork_rng(devices=forked), torch.enable_grad(), \
                maybe_disable_local_tensor_mode():
            return time_op_calls(calls, device=device, progress=shown, min_time_s=min_time_s)

    times = together("timing op calls", mine)
    if one_process():
        return times
    everyone = _gathered(times)
    return {k: OpTime(max(r[k].fwd_s for r in everyone if k in r), max(r[k].bwd_s for r in everyone if k in r))
            for k in {k for r in everyone for k in r}}


def _rank() -> int:
    """This process's rank (0 in a single process, simulated ranks included)."""
    return 0 if one_process() else dist.get_rank()


def _missing_calls(captured: CapturedGraph, spec: MeshSpec, profile: Profile | None) -> list[OpCall]:
    """The distinct calls of the model's strategy space that ``profile`` lacks; none without a
    profile of this host and mesh size."""
    if profile is None or profile.fingerprint != local_fingerprint(spec):
        return []
    with quiet("autopar.core.strategies"):   # ops without a rule: the planner says so, once
        space = build_space(captured, spec)
    return [c for c in op_calls(space, spec.shape) if c.key not in profile.ops]


def _file_to_update(source: Profile | str | Path | None, spec: MeshSpec) -> Path | None:
    """Where rank 0 saves the measured calls: the file the profile came from (the cache for
    ``"auto"``, else the path given). None on other ranks, for a ``Profile`` object (merged in
    memory only), and where one process simulates several ranks (timed alone, the calls do not
    describe ranks sharing the host's cores)."""
    if _rank() != 0 or isinstance(source, Profile) or source is None or (one_process() and spec.size > 1):
        return None
    return default_profile_path(local_fingerprint(spec)) if source == "auto" else Path(source)


def _save(measured: Profile, path: Path) -> None:
    """Add ``measured`` to the profile file as it is now (another job may have added to it since
    it was read); a file an older autopar wrote is replaced (``find_profile`` ignores it). A file
    that cannot be written only costs the next compile the same measuring."""
    try:
        try:
            current = Profile.from_json(path) if path.exists() else Profile(measured.fingerprint)
        except StaleProfileError:
            current = Profile(measured.fingerprint)
        current.merge(measured)
        current.to_json(path)
    except (OSError, ProfileError) as e:
        log.warning("autopar: the measured op calls are not saved to %s (%s); this plan uses them", path, e)


def _gathered(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


@contextlib.contextmanager
def quiet(logger: str) -> Iterator[None]:
    """Silence ``logger`` below errors for the block: warnings that another step gives the user."""
    log_ = logging.getLogger(logger)
    level = log_.level
    log_.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log_.setLevel(level)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, as the profile's ranks run."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

"""Measuring, while ``compile`` plans on a live mesh, the ops of the model that the profile lacks.

A profile (``autopar profile``) holds the op calls of the models it was taken for. A user's own
model runs other ops, or the same ops at other local shapes, and the cost model prices every call
the profile lacks by the roofline, which on a CPU is 2-3x off: the plan is chosen, and its step
time predicted, on guesses. ``compile`` has the job's ranks at hand, so it measures those calls
first, the way ``autopar profile`` measures them (``time_on_every_rank``, shared by both): every
rank times every call at once, since ranks sharing a host's cores slow each other as in
training, and the slowest rank's time is kept, since a step waits for it. The calls join the
profile and are saved back to its file, so the next compile of the model measures nothing.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

from autopar.core.capture import CapturedGraph
from autopar.core.mesh import MeshSpec
from autopar.core.strategies import build_space
from autopar.core.together import one_process, together
from cost_models.profile import OpTime, Profile, ProfileError, default_profile_path, local_fingerprint
from cost_models.profile_ops import OpCall, op_calls, time_op_calls

Progress = Callable[[str], None]
log = logging.getLogger(__name__)


def _log_progress(line: str) -> None:
    log.info("autopar: %s", line)


def measure_missing_ops(workloads: Sequence[tuple[CapturedGraph, MeshSpec]], profile: Profile | None,
                        source: Profile | str | Path | None, progress: Progress = _log_progress) -> None:
    """Time the op calls of each workload's strategy space (a captured graph on a mesh: every
    candidate strategy's local shapes; ``planning.planner.priced_workloads``, the job's mesh
    first) that ``profile`` lacks, on every rank at once; merge them into ``profile`` and,
    on rank 0, save it where ``source`` (the ``profile`` option it was resolved from) names a file.
    Every rank of the job calls it: ranks with nothing to time (no profile here, or a profile of
    other hardware) take part in the collectives alone.

    Nothing is measured for a profile of another fingerprint: op keys and times hold for the host,
    device, threads and process count it names (``local_fingerprint``), and ours would not. In one
    process simulating several ranks, calls are timed alone, an under-estimate where ranks would
    share cores: they serve this plan, and are not saved."""
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
        say(f"measuring {most} op calls the profile lacks {where} (once per model and mesh; "
            "`autopar profile --model` does it ahead of time)...")
    t0 = time.perf_counter()
    fingerprint = local_fingerprint(spec)
    times = time_on_every_rank(calls, fingerprint, say)
    path = None
    if profile is not None and profile.fingerprint == fingerprint:
        profile.merge(Profile(fingerprint, times))
        path = _file_to_update(source, spec)
        if path is not None:
            _save(Profile(fingerprint, times), path)
    if say is not None:
        say(f"measured {len(times)} op calls in {time.perf_counter() - t0:.1f} s" + (f"; saved to {path}" if path else ""))


def time_on_every_rank(calls: Sequence[OpCall], fingerprint: dict[str, Any], progress: Progress | None = None
                       ) -> dict[str, OpTime]:
    """Seconds of each of ``calls`` as a profile of ``fingerprint`` holds them: timed on its device
    with its threads per process, on every rank of the job at once, the slowest rank's kept (one
    process: this one's). A call timed on no rank (it cannot run standalone) gets no entry.

    The caller's state is left as it was: its random stream (inputs are random), thread count
    and grad mode (timing needs the backward); a LocalTensorMode simulating ranks is set aside."""
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
            return time_op_calls(calls, device=device, progress=shown)

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
    it was read). A file that cannot be written only costs the next compile the same measuring."""
    try:
        current = Profile.from_json(path) if path.exists() else Profile(measured.fingerprint)
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

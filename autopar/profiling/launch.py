"""Run SPMD code on a local CPU device mesh.

Two back ends share one calling convention: ``fn(mesh, *args)`` is called once per
rank with a :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``mesh_shape``.

``run_on_gloo_mesh``
    Real multi-process execution: ``prod(mesh_shape)`` processes started with the
    ``spawn`` start method (or ``start_method="forkserver"``), each in a ``gloo``
    process group. Faithful (real collectives, real per-rank Python control flow)
    but slow to start with spawn (every rank imports torch: ~5 s for 4 ranks on 2
    idle cores, much more on a loaded machine); forkserver starts ranks in ~0.1 s
    after a one-off ~2 s server start. ``fn``, ``args`` and the results must be
    picklable; ``fn`` must be a module-level function. Returns the per-rank results.

``run_on_local_tensor_mesh``
    All ranks simulated in *this* process with
    :class:`torch.distributed._local_tensor.LocalTensorMode` on top of a ``fake``
    process group. Fast (milliseconds), works with pytest fixtures, closures and
    lambdas, but see the notes on that function for what ``fn`` sees.

``per_rank``
    Returns the per-rank plain tensors behind a LocalTensor / DTensor so tests can
    compare per-rank values.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait as _mp_wait
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from autopar.core.errors import AutoparError
from autopar.core.together import rank_map, told_by_another_rank

__all__ = [
    "DistributedRunError",
    "run_on_gloo_mesh",
    "run_on_local_tensor_mesh",
    "per_rank",
    "rank_map",
]

T = TypeVar("T")


class DistributedRunError(AutoparError):
    """A rank of a distributed run failed, crashed or the run timed out.

    Attributes:
        rank: the rank that failed first (``None`` for a timeout or a set-up failure).
        child_traceback: the full traceback text from that rank, if it reported one.
        exit_code: the exit code of the failed rank's process, if known.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        child_traceback: str | None = None,
        exit_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.child_traceback = child_traceback
        self.exit_code = exit_code


# ----------------------------------------------------------------------------
# shared validation
# ----------------------------------------------------------------------------


def _check_mesh(
    mesh_shape: tuple[int, ...], axis_names: tuple[str, ...] | None
) -> tuple[tuple[int, ...], tuple[str, ...] | None, int]:
    try:
        shape = tuple(int(s) for s in mesh_shape)
    except TypeError:
        raise DistributedRunError(
            f"mesh_shape must be a tuple of positive ints, e.g. (2, 2); got {mesh_shape!r}"
        ) from None
    if not shape or any(s < 1 for s in shape):
        raise DistributedRunError(
            f"mesh_shape must be a non-empty tuple of positive ints, e.g. (2, 2); got {mesh_shape!r}"
        )
    names = None
    if axis_names is not None:
        names = tuple(axis_names)
        if len(names) != len(shape) or not all(isinstance(a, str) for a in names):
            raise DistributedRunError(
                f"axis_names must be {len(shape)} strings, one per mesh axis of "
                f"mesh_shape={shape}; got {axis_names!r}"
            )
        if len(set(names)) != len(names):
            raise DistributedRunError(f"axis_names must be distinct; got {axis_names!r}")
    return shape, names, math.prod(shape)


# ----------------------------------------------------------------------------
# gloo: one real process per rank
# ----------------------------------------------------------------------------

_ERR_SUFFIX = ".err"
_OK_SUFFIX = ".ok"
_RANK_NAME = "autopar-gloo-rank"
#: Exit code of a rank that found, while importing the main module as it started, that this import
#: starts ranks again: the script has no ``if __name__ == "__main__":`` guard (``_starting_rank``).
_NO_MAIN_GUARD = 78


def _starting_rank() -> bool:
    """Is this process a rank of ``run_on_gloo_mesh`` still importing the main module as it starts
    (spawn and forkserver run the script again in every child, under the name ``__mp_main__``)?"""
    import multiprocessing

    current = multiprocessing.current_process()
    return getattr(current, "_inheriting", False) and current.name.startswith(_RANK_NAME)


def _main_guard_hint() -> str:
    """What to do when the ranks found the main script starting ranks again as they imported it."""
    main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return (f"{main} calls run_on_gloo_mesh when it is imported, and every rank (started by spawn or "
            "forkserver) imports it again as it starts, which would start ranks of its own. Put the code "
            'that runs at the top level of the script under `if __name__ == "__main__":`')


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _atomic_write(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


def _rank_environment(rank: int, world_size: int, port: int) -> None:
    """The variables ``init_process_group`` and torchrun-style code read, for rank ``rank`` of
    ``world_size`` on this host."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    if sys.platform.startswith("linux"):
        # All ranks are on this host: keep gloo on the loopback interface even when
        # the host name resolves to an address that is not reachable.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


class _Phase:
    """What a rank is doing, so that its error report can say where it failed."""

    def __init__(self) -> None:
        self.name = "unpickle"


def _rank_body(
    phase: _Phase,
    rank: int,
    world_size: int,
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...] | None,
    payload: bytes,
    timeout_s: float,
) -> bytes:
    """Join the process group, build the mesh, run ``fn`` and tear down; ``fn``'s result, pickled."""
    # Unpickling imports fn's module: do it before the rendezvous.
    fn, args = pickle.loads(payload)
    phase.name = "init"
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=max(timeout_s, 1.0)),
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=axis_names)
    phase.name = "fn"
    result = fn(mesh, *args)
    phase.name = "pickle-result"
    result_bytes = pickle.dumps(result)
    phase.name = "teardown"
    # Nobody tears down (rank 0 owns the TCPStore) before every rank is done.
    dist.barrier()
    dist.destroy_process_group()
    return result_bytes


def _exit_now(code: int) -> None:
    """Leave the rank without interpreter shutdown: it may hang on a wedged process group, and
    takes ~1-2 s with torch loaded (the result or the error is on disk already)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report_error(base: str, phase: str, e: BaseException) -> None:
    """Write the error a rank is handling, with its traceback, for the parent; then exit."""
    try:
        _atomic_write(
            base + _ERR_SUFFIX,
            {
                "time": time.time(),
                "phase": phase,
                "exc": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            },
        )
    finally:
        _exit_now(1)


def _gloo_worker(
    rank: int,
    world_size: int,
    port: int,
    mesh_shape: tuple[int, ...],
    axis_names: tuple[str, ...] | None,
    payload: bytes,
    result_dir: str,
    timeout_s: float,
) -> None:
    """Body of one rank (runs in a spawned child process)."""
    # What the rank inherits (torch, transformers, autopar: ~350k objects) lives as long as it:
    # out of the collector's reach, a full collection no longer walks it (~0.3 s a rank) nor
    # copies the forkserver's pages it touches.
    gc.freeze()
    _rank_environment(rank, world_size, port)
    torch.set_num_threads(1)
    phase = _Phase()
    base = os.path.join(result_dir, f"rank{rank}")
    try:
        result_bytes = _rank_body(phase, rank, world_size, mesh_shape, axis_names, payload, timeout_s)
        _atomic_write(base + _OK_SUFFIX, result_bytes)
    except BaseException as e:  # noqa: BLE001 - report everything, incl. SystemExit
        _report_error(base, phase.name, e)
    _exit_now(0)


def _read_errors(result_dir: str) -> dict[int, dict[str, Any]]:
    errors = {}
    for name in os.listdir(result_dir):
        if name.endswith(_ERR_SUFFIX):
            rank = int(name[len("rank") : -len(_ERR_SUFFIX)])
            try:
                with open(os.path.join(result_dir, name), "rb") as f:
                    errors[rank] = pickle.load(f)
            except Exception as e:  # noqa: BLE001
                errors[rank] = {
                    "time": math.inf,
                    "phase": "?",
                    "exc": f"(could not read the error report: {e})",
                    "traceback": "",
                }
    return errors


def _stop_all(procs: list[Any]) -> None:
    """Terminate, kill and reap every process (no zombies left behind)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


_COMM_CONSEQUENCE_MARKERS = (
    "gloo/transport/",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)


def _is_comm_consequence(exc_text: str) -> bool:
    """Whether an error looks like a rank noticing that a peer went away, or being told that a peer
    failed (``autopar.core.together``: that peer's error is the one to show)."""
    return told_by_another_rank(exc_text) or any(m in exc_text for m in _COMM_CONSEQUENCE_MARKERS)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _PortInUse(Exception):
    pass


def _gloo_context(start_method: str) -> Any:
    """The multiprocessing context that starts the ranks."""
    ctx = torch_mp.get_context(start_method)
    if start_method == "forkserver":
        # Children fork from a server that has torch imported already: ~0.1 s per
        # run instead of ~1-2 s of CPU per rank for `import torch` (the server itself
        # starts once per parent process). Only effective before the server starts.
        # (torch._dynamo is imported lazily by the first DTensor op: ~1 s; torch.export's tracer by
        # the first capture: ~0.4 s a rank, and compile captures on every rank.)
        ctx.set_forkserver_preload(
            ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "torch.export._trace",
             __name__, *_PRELOADED,
             *(m for m in sys.modules if m in _PRELOADED_IF_IMPORTED or m.startswith(_MODELS_IF_IMPORTED)),
             *(_WITH_TRANSFORMERS if "transformers" in sys.modules else ())]
        )
    return ctx


#: What every rank that compiles or plans imports (autopar's modules), preloaded by the forkserver.
_PRELOADED = ("autopar.api", "codegen.module", "autopar.planning.planner")
#: Preloaded where the parent process has imported them already: Hugging Face's model classes
#: cost a rank ~1.7 s of CPU to import (the models the parent builds, its ranks build too);
#: pytest ~0.3 s (a function a test runs on the ranks is unpickled by importing its test module).
_PRELOADED_IF_IMPORTED = ("transformers", "transformers.modeling_utils", "pytest")
_MODELS_IF_IMPORTED = "transformers.models."
#: Preloaded where the parent has imported transformers: what capturing one of its models imports
#: (its experts' registry, ``autopar.core.expert_parallel.experts_as_one_op``: ~0.8 s a rank).
_WITH_TRANSFORMERS = ("transformers.integrations.moe",)


def _start_ranks(ctx: Any, procs: list[Any], worker_args: tuple, n: int) -> None:
    """Start ``n`` rank processes, appending each to ``procs`` as it starts (so that the caller
    stops those already started if a later one fails to start)."""
    port, shape, names, payload, result_dir, timeout_s = worker_args
    for r in range(n):
        p = ctx.Process(
            target=_gloo_worker,
            args=(r, n, port, shape, names, payload, result_dir, timeout_s),
            name=f"{_RANK_NAME}{r}",
            daemon=True,
        )
        p.start()
        procs.append(p)


def _crashed_silently(procs: list[Any], result_dir: str) -> list[int]:
    """The ranks that exited in failure without reporting an error. A rank that died silently
    (segfault, OOM kill, os._exit) is given a moment to be seen as dead: its peers' "connection
    closed" errors are consequences, the silent death is the cause."""
    time.sleep(0.1)
    errors = _read_errors(result_dir)
    return [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in errors]


def _timed_out(procs: list[Any], shape: tuple[int, ...], timeout_s: float) -> DistributedRunError:
    """Stop every rank; the error saying which ranks were still running at the deadline."""
    running = [r for r, p in enumerate(procs) if p.exitcode is None]
    done = [r for r, p in enumerate(procs) if p.exitcode == 0]
    _stop_all(procs)
    return DistributedRunError(
        f"gloo run on mesh {shape} timed out after {timeout_s:g} s; "
        f"ranks still running: {running}, ranks finished: {done}. "
        "A collective that not every rank calls hangs; raise timeout_s "
        "if the work is just slow."
    )


def _wait_for_ranks(
    procs: list[Any], result_dir: str, shape: tuple[int, ...], deadline: float, timeout_s: float
) -> list[int]:
    """Wait until every rank succeeded (returns ``[]``) or one failed (returns the ranks that
    crashed without a report); past ``deadline``, stop them all and raise."""
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    while True:
        if _read_errors(result_dir) or any(p.exitcode not in (None, 0) for p in procs):
            return _crashed_silently(procs, result_dir)
        if all(p.exitcode == 0 for p in procs):
            return []
        if time.monotonic() > deadline:
            raise _timed_out(procs, shape, timeout_s)
        live = [s for s, r in sentinels.items() if procs[r].exitcode is None]
        _mp_wait(live, timeout=min(0.05, max(0.0, deadline - time.monotonic())))


def _close(procs: list[Any]) -> dict[int, int | None]:
    """Each reaped rank's exit code; their process handles released."""
    exit_codes = {r: p.exitcode for r, p in enumerate(procs)}
    for p in procs:
        try:
            p.close()
        except Exception:  # noqa: BLE001
            pass
    return exit_codes


def _raise_silent_death(
    first: int, first_err: int | None, errors: dict[int, dict[str, Any]], exit_codes: dict, where: str
) -> None:
    """Rank ``first`` died without a report: say how it exited, and what rank ``first_err`` raised then."""
    context = ""
    if first_err is not None:
        err = errors[first_err]
        context = (
            f"\nrank {first_err} then raised: {err['exc']}\n"
            f"--- traceback from rank {first_err} ---\n{err['traceback']}"
        )
    raise DistributedRunError(
        f"rank {first} {where} died without reporting an error "
        f"({_describe_exit(exit_codes[first])}); it may have been killed by the "
        f"OS (out of memory?), crashed, or called os._exit().{context}",
        rank=first,
        child_traceback=None,
        exit_code=exit_codes[first],
    )


_PHASES = {
    "init": "while setting up the gloo process group / device mesh",
    "unpickle": "while unpickling fn and args",
    "fn": "in fn",
    "pickle-result": "while pickling fn's result (return picklable values: "
    "plain tensors such as dtensor.full_tensor() or .to_local(), not DTensors)",
    "teardown": "while tearing down the process group",
}


def _raise_rank_error(first: int, errors: dict[int, dict[str, Any]], exit_codes: dict, where: str) -> None:
    """Rank ``first`` raised: its error and traceback (``_PortInUse`` where it could not bind the port)."""
    err = errors[first]
    tb = err["traceback"]
    if err["phase"] == "init" and ("EADDRINUSE" in tb or "ddress already in use" in tb):
        raise _PortInUse(tb)
    others = sorted(r for r in errors if r != first)
    also = f"\n(ranks {others} failed too, later; often as a consequence of the first)" if others else ""
    phase = _PHASES.get(err["phase"], f"in phase {err['phase']!r}")
    raise DistributedRunError(
        f"rank {first} {where} raised {phase}: {err['exc']}{also}\n"
        f"--- traceback from rank {first} ---\n{tb}",
        rank=first,
        child_traceback=tb,
        exit_code=exit_codes.get(first),
    )


def _raise_failure(errors: dict[int, dict[str, Any]], crashed: list[int], exit_codes: dict, where: str) -> None:
    """Raise the root cause of a failed run, if any rank failed: the earliest reported error that
    is not just a peer noticing a dead connection; else a rank that died silently; else the
    earliest report. ``where``: "of N (mesh S)"."""
    by_time = sorted(errors, key=lambda r: (errors[r]["time"], r))
    causes = [r for r in by_time if not _is_comm_consequence(errors[r]["exc"])]
    first_err = causes[0] if causes else (by_time[0] if by_time else None)
    unguarded = [r for r in crashed if exit_codes[r] == _NO_MAIN_GUARD]
    if unguarded:
        raise DistributedRunError(f"rank {unguarded[0]} {where} could not start: {_main_guard_hint()}",
                                  rank=unguarded[0], exit_code=_NO_MAIN_GUARD)
    if crashed and not causes:
        _raise_silent_death(crashed[0], first_err, errors, exit_codes, where)
    if first_err is not None:
        _raise_rank_error(first_err, errors, exit_codes, where)
    bad = [r for r, c in exit_codes.items() if c != 0]
    if bad:  # pragma: no cover - every failure path above should catch this
        raise DistributedRunError(
            f"rank {bad[0]} {where} failed ({_describe_exit(exit_codes[bad[0]])}) without reporting an error.",
            rank=bad[0],
            exit_code=exit_codes[bad[0]],
        )


def _read_results(result_dir: str, n: int) -> list[Any]:
    """Every rank's result, ordered by rank."""
    results = []
    for r in range(n):
        path = os.path.join(result_dir, f"rank{r}{_OK_SUFFIX}")
        try:
            with open(path, "rb") as f:
                results.append(pickle.loads(pickle.load(f)))
        except Exception as e:  # noqa: BLE001
            raise DistributedRunError(
                f"could not read the result of rank {r} of {n}: {type(e).__name__}: {e}",
                rank=r,
            ) from e
    return results


def _run_gloo_once(
    payload: bytes,
    shape: tuple[int, ...],
    names: tuple[str, ...] | None,
    n: int,
    deadline: float,
    timeout_s: float,
    start_method: str,
) -> list[Any]:
    """One try at the run on a fresh port: start the ranks, wait for them, reap them, and return
    their results or raise the root cause of their failure."""
    ctx = _gloo_context(start_method)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="autopar-gloo-") as result_dir:
        procs: list[Any] = []
        try:
            _start_ranks(ctx, procs, (port, shape, names, payload, result_dir, timeout_s), n)
            crashed = _wait_for_ranks(procs, result_dir, shape, deadline, timeout_s)
        finally:
            # Kill everything first so that ranks blocked in collectives do not linger.
            _stop_all(procs)
        # All processes have been reaped here.
        exit_codes = _close(procs)
        _raise_failure(_read_errors(result_dir), crashed, exit_codes, f"of {n} (mesh {shape})")
        return _read_results(result_dir, n)


def run_on_gloo_mesh(
    fn: Callable[..., T],
    mesh_shape: tuple[int, ...],
    *args: Any,
    axis_names: tuple[str, ...] | None = None,
    timeout_s: float = 300,
    start_method: str = "spawn",
) -> list[T]:
    """Run ``fn(mesh, *args)`` on ``prod(mesh_shape)`` local gloo processes.

    Each rank is a fresh process (``spawn``) that sets ``MASTER_ADDR=127.0.0.1`` and a
    free ``MASTER_PORT``, calls ``init_process_group("gloo")``,
    ``torch.set_num_threads(1)``, builds
    ``init_device_mesh("cpu", mesh_shape, mesh_dim_names=axis_names)``, calls
    ``fn(mesh, *args)``, and tears the process group down.

    Args:
        fn: a module-level (picklable) function ``fn(mesh, *args)``.
        mesh_shape: e.g. ``(4,)`` or ``(2, 2)``.
        args: picklable arguments; every rank gets its own unpickled copy.
        axis_names: optional mesh dimension names, one per axis.
        timeout_s: wall-clock limit for the whole run (process start included).
        start_method: ``"spawn"`` (default: every rank imports torch afresh, ~1-2 s of
            CPU each) or ``"forkserver"`` (ranks fork from a server process that has
            torch preloaded; the first call in a process pays ~2 s to start it, later
            calls start ranks in ~0.1 s). Both need a picklable, module-level ``fn``.

    Returns:
        ``fn``'s results, ordered by rank. They are pickled in the child, so return
        plain tensors / Python values (``dtensor.full_tensor()``, ``.to_local()``), not
        DTensors.

    Raises:
        DistributedRunError: a rank raised (message names the rank and carries its
            traceback), crashed, or the timeout elapsed. All ranks are killed and
            reaped before this is raised. Every rank imports the main script again as it
            starts: a script must call this under ``if __name__ == "__main__":`` (one that
            does not is told so).
    """
    if _starting_rank():   # the parent names the missing guard, once (``_main_guard_hint``)
        os._exit(_NO_MAIN_GUARD)
    shape, names, n = _check_mesh(mesh_shape, axis_names)
    payload = _gloo_payload(fn, args, start_method)
    deadline = time.monotonic() + timeout_s
    last_error: _PortInUse | None = None
    for _attempt in range(3):
        try:
            return _run_gloo_once(payload, shape, names, n, deadline, timeout_s, start_method)
        except _PortInUse as e:  # the free port was grabbed by someone else: retry
            last_error = e
    raise DistributedRunError(
        f"could not bind a free MASTER_PORT for the gloo run after 3 tries:\n{last_error}"
    )


def _gloo_payload(fn: Callable[..., Any], args: tuple, start_method: str) -> bytes:
    """``(fn, args)`` pickled for the ranks, after checking the start method."""
    if start_method not in ("spawn", "forkserver"):
        raise DistributedRunError(
            f"start_method must be 'spawn' or 'forkserver'; got {start_method!r} "
            "('fork' is unsafe once torch has started threads)"
        )
    try:
        return pickle.dumps((fn, args))
    except Exception as e:  # noqa: BLE001
        raise DistributedRunError(
            "run_on_gloo_mesh needs a picklable fn and args because every rank is a "
            f"separate process: {type(e).__name__}: {e}. Define fn at module level "
            "(no lambdas / closures / local functions)."
        ) from e


# ----------------------------------------------------------------------------
# LocalTensorMode: all ranks in this process
# ----------------------------------------------------------------------------


def run_on_local_tensor_mesh(
    fn: Callable[..., T],
    mesh_shape: tuple[int, ...],
    *args: Any,
    axis_names: tuple[str, ...] | None = None,
) -> T:
    """Run ``fn(mesh, *args)`` for all ranks at once, in this process.

    Set-up (the same as torch's ``LocalDTensorTestBase``)::

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        with LocalTensorMode(n):
            with maybe_disable_local_tensor_mode():
                mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=axis_names)
            result = fn(mesh, *args)
        # finally: dist.destroy_process_group(); DTensor RNG tracker reset

    ``fn`` runs ONCE (not once per rank). What it sees:

    * Every tensor created inside ``fn`` by a factory (``torch.randn``, ``zeros``,
      ...) is a ``LocalTensor``: one plain tensor per rank (identical values at
      creation: all ranks start from the same RNG state). Ops on LocalTensors run
      per rank; collectives issued by DTensor are simulated exactly.
    * Plain tensors passed in ``args`` stay plain tensors (the same on every rank);
      ``distribute_tensor(x, mesh, ...)`` accepts them and returns a DTensor whose
      ``_local_tensor`` is a LocalTensor holding each rank's shard (uneven shards
      included, e.g. 5 rows on 2 ranks -> 3 + 2).
    * ``dtensor.full_tensor()`` is a LocalTensor whose per-rank values are equal;
      ``torch.allclose``/``torch.equal`` against a plain tensor returns a Python
      bool when all ranks agree, and ``.item()`` / ``.tolist()`` work when they do.
    * ``mesh.get_rank()``, ``mesh.get_local_rank(...)`` and ``mesh.get_coordinate()``
      return per-rank symbolic ints (``LocalIntNode``), not Python ints; use
      :func:`rank_map` to build rank-dependent tensors.
    * Python control flow runs once, so code that branches on a per-rank value
      cannot diverge per rank.

    The result is returned as is (it may hold LocalTensors / DTensors; use
    :func:`per_rank` or ``LocalTensor.reconcile()`` on it). Exceptions from ``fn``
    propagate unchanged. The fake process group is destroyed even on error, so this
    can be called any number of times in one process (but not while another default
    process group is initialised, nor nested).
    """
    shape, names, n = _check_mesh(mesh_shape, axis_names)
    _check_no_process_group()
    return _run_in_local_tensor_mode(fn, shape, names, n, args)


def _check_no_process_group() -> None:
    """``run_on_local_tensor_mesh`` makes its own default process group and mode: refuse to nest."""
    from torch.distributed._local_tensor import local_tensor_mode

    if dist.is_initialized():
        raise DistributedRunError(
            "run_on_local_tensor_mesh needs to create its own (fake) default process "
            "group, but one is already initialised in this process; call "
            "torch.distributed.destroy_process_group() first, or do not nest it in "
            "run_on_gloo_mesh / another run_on_local_tensor_mesh."
        )
    if local_tensor_mode() is not None:
        raise DistributedRunError(
            "run_on_local_tensor_mesh cannot run inside an active LocalTensorMode."
        )


def _run_in_local_tensor_mode(
    fn: Callable[..., T], shape: tuple[int, ...], names: tuple[str, ...] | None, n: int, args: tuple
) -> T:
    """``fn(mesh, *args)`` under ``LocalTensorMode(n)`` on a fake process group, which is torn
    down (and DTensor's RNG tracker reset) even on error."""
    from torch.distributed._local_tensor import LocalTensorMode, maybe_disable_local_tensor_mode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import _random as dtensor_random
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        with LocalTensorMode(n):
            with maybe_disable_local_tensor_mode():
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            return fn(mesh, *args)
    finally:
        dtensor_random._rng_tracker = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _local_tensor_cls() -> type[Any] | None:
    try:
        from torch.distributed._local_tensor import LocalTensor
    except ImportError:  # pragma: no cover - torch without LocalTensor
        return None
    return LocalTensor


def _default_world_size() -> int:
    try:
        from torch.distributed._local_tensor import local_tensor_mode

        lm = local_tensor_mode()
    except ImportError:  # pragma: no cover
        lm = None
    if lm is not None:
        return len(lm.ranks)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def per_rank(t: Any, world_size: int | None = None) -> list[torch.Tensor]:
    """Per-rank plain tensors of ``t``, ordered by rank.

    * ``LocalTensor``: the plain tensor each simulated rank holds.
    * ``DTensor``: each rank's local shard (``per_rank`` of its local tensor). Under
      ``run_on_local_tensor_mesh`` this is every rank's shard; in a real process it
      is only this process's shard, repeated like a plain tensor.
    * plain tensor (value identical on every rank): ``[t] * world_size``, where
      ``world_size`` defaults to the active LocalTensorMode's rank count, else the
      default process group's world size, else 1.

    Works inside and after ``run_on_local_tensor_mesh`` (no mode needs to be active).
    """
    from torch.distributed.tensor import DTensor

    lt_cls = _local_tensor_cls()
    if isinstance(t, DTensor):
        local = t._local_tensor
        if lt_cls is not None and isinstance(local, lt_cls):
            return per_rank(local)
        return per_rank(local, world_size if world_size is not None else t.device_mesh.size())
    if lt_cls is not None and isinstance(t, lt_cls):
        local = t._local_tensors
        return [local[r] for r in sorted(local)]
    if isinstance(t, torch.Tensor):
        n = world_size if world_size is not None else _default_world_size()
        return [t] * n
    raise TypeError(f"per_rank expects a tensor, LocalTensor or DTensor; got {type(t).__name__}")



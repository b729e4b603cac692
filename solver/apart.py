"""A solve in a process of its own, stopped at a hard deadline.

HiGHS keeps its time limit between its own checks, and on large sharding ILPs those are far
apart: an interrupted root LP of 0.7M variables (gpt-oss-120b on 8x8) took 45 s to give up under
a limit of 11 s, longer than solving it did without one. A solve in this process cannot be
stopped from outside, so ``solve_apart`` runs it in a fresh interpreter (``main``, this file run
by path: not forked from a process holding threads and process groups, not re-running the
caller's script as multiprocessing's spawn would, and importing OR-Tools alone, not the
``solver`` package and NumPy: 0.4 s to start, not 1 s), sends it the model, its
parameters and its hints as serialized protos, and kills it where it has not answered by the
deadline. The caller then keeps what it already holds (the hint, a feasible solution).
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from typing import BinaryIO

from ortools.math_opt import callback_pb2, model_parameters_pb2, model_pb2, parameters_pb2, result_pb2
from ortools.math_opt.core.python import solver as core_solver
from ortools.math_opt.python import init_arguments

#: Set in the child by tests: seconds it sleeps before solving (a solver that overruns).
STALL_ENV = "AUTOPAR_SOLVE_APART_STALL_S"


def _framed(*parts: bytes) -> bytes:
    """``parts``, each after its length: what the child reads one by one (``_receive``)."""
    return b"".join(struct.pack("<Q", len(part)) + part for part in parts)


def _receive(src: BinaryIO) -> bytes:
    (size,) = struct.unpack("<Q", src.read(8))
    return src.read(size)


def solve_proto(model: model_pb2.ModelProto, solver_type: int, params: parameters_pb2.SolveParametersProto,
                model_params: model_parameters_pb2.ModelSolveParametersProto) -> result_pb2.SolveResultProto:
    """math_opt's solver binding on protos (no Python ``Model``): what both processes run."""
    return core_solver.solve(model, solver_type, init_arguments.StreamableSolverInitArguments().to_proto(), params,
                             model_params, None, callback_pb2.CallbackRegistrationProto(), None, None)


def solve_apart(model: model_pb2.ModelProto, solver_type: int, params: parameters_pb2.SolveParametersProto,
                model_params: model_parameters_pb2.ModelSolveParametersProto,
                seconds: float) -> result_pb2.SolveResultProto | None:
    """``solve_proto`` in a child process; None where it has not answered within ``seconds``
    (it is killed). A solver error in the child is raised here as ``RuntimeError``."""
    deadline = time.perf_counter() + seconds
    # the child runs this file (its folder not on its path) and imports OR-Tools where the parent does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen([sys.executable, "-c", f"import runpy; runpy.run_path({__file__!r}, run_name='__main__')"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    payload = _framed(struct.pack("<i", solver_type), model.SerializeToString(), params.SerializeToString(),
                      model_params.SerializeToString())
    try:
        out, err = child.communicate(payload, timeout=max(deadline - time.perf_counter(), 0.0))
    except subprocess.TimeoutExpired:
        return None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if child.returncode != 0:
        raise RuntimeError(f"the solver's process failed (exit {child.returncode}): {err.decode()[-2000:]}")
    return result_pb2.SolveResultProto.FromString(out)


def main() -> None:
    """The child: read the solver type, model, parameters and model parameters; write the result."""
    src = sys.stdin.buffer
    (solver_type,) = struct.unpack("<i", _receive(src))
    model = model_pb2.ModelProto.FromString(_receive(src))
    params = parameters_pb2.SolveParametersProto.FromString(_receive(src))
    model_params = model_parameters_pb2.ModelSolveParametersProto.FromString(_receive(src))
    time.sleep(float(os.environ.get(STALL_ENV, "0")))
    result = solve_proto(model, solver_type, params, model_params)
    sys.stdout.buffer.write(result.SerializeToString())
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()

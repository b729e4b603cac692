"""Settings every test runs under.

* Hermetic: no profile cached by `autopar profile` on this machine may change a plan, and no
  compile measures one on its own (a first profile, cached in the session's folder, would change
  the plans of every later test on that many processes, and cost each model's first compile its
  op timings): tests that measure say so (tests/test_missing_ops.py).
* Strict runtime: a placement mismatch between a plan and what the runtime produces is a rule
  bug, so it fails instead of being silently redistributed; in this process (the fixture) and in
  the gloo processes tests start (the environment variable, read when they import the runtime).
"""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

# The workers share the host's cores (CI: -n 2 on two): one intra-op thread each where they fill
# them. An idle OpenMP thread spins in its barrier after every parallel op, taking a core the
# other worker needed (a sixth of a worker's CPU in a cold CI run on a 2-core VM).
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ["AUTOPAR_PROFILE_DIR"] = tempfile.mkdtemp(prefix="autopar-test-profiles-")
atexit.register(shutil.rmtree, os.environ["AUTOPAR_PROFILE_DIR"], ignore_errors=True)   # one per worker; left none behind
os.environ["AUTOPAR_MEASURE_FIRST_PROFILE"] = "0"   # autopar.profiling.missing_ops.FIRST_PROFILE_ENV
os.environ["AUTOPAR_STRICT"] = "1"


@pytest.fixture(autouse=True)
def strict_runtime(monkeypatch):
    import codegen.runtime

    monkeypatch.setattr(codegen.runtime, "STRICT", True)

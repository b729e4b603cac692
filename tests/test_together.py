"""A failure on one rank during compile fails every rank within seconds, with that rank's message,
instead of leaving the others at a collective until the process group times out."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from autopar.models.zoo import get_model
from autopar.profiling.launch import run_on_gloo_mesh


def _compile_failing_on(mesh, failing_rank: int, how: str) -> tuple[str, str, bool]:
    import autopar

    entry = get_model("gpt-tiny")
    torch.manual_seed(0)
    model = entry.build()
    args, kwargs = entry.example(4, 8)
    options = {"time_limit": 5.0}
    if dist.get_rank() == failing_rank:
        if how == "capture":    # inputs forward does not take
            kwargs = {**kwargs, "no_such_input": args[0]}
        else:                   # a budget no plan fits (rank 0 plans for everyone)
            options["memory_budget"] = 1.0
    try:
        autopar.compile(model, mesh, args, kwargs, **options)
    except Exception as e:
        return type(e).__name__, str(e), torch.is_grad_enabled()
    return "none", "", torch.is_grad_enabled()


@pytest.mark.parametrize("how, failing_rank, error", [("capture", 1, "InputMismatchError"),
                                                       ("planning", 0, "InfeasibleError")])
def test_a_failure_on_one_rank_fails_every_rank_within_seconds(how, failing_rank, error):
    t0 = time.perf_counter()
    results = run_on_gloo_mesh(_compile_failing_on, (2,), failing_rank, how, timeout_s=120, start_method="forkserver")
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"ranks took {elapsed:.0f} s to fail"
    for rank, (kind, message, grad_enabled) in enumerate(results):
        assert grad_enabled, f"rank {rank} left gradients disabled"
        if rank == failing_rank:
            assert kind == error, (kind, message)
        else:
            assert kind == "RankFailedError", (kind, message)
            assert f"rank {failing_rank}" in message and error in message, message

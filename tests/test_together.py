"""A failure on one rank during compile fails every rank within seconds, with that rank's message,
instead of leaving the others at a collective until the process group times out."""
from __future__ import annotations

import json
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from autopar.models.zoo import get_model
from autopar.profiling.launch import DistributedRunError, run_on_gloo_mesh
from tests.tiers import slow


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
@slow
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


def _compile_failing_everywhere(mesh, folder: str) -> None:
    """Every rank fails the same way (inputs forward does not take); each writes what it raised
    and how Python prints it to ``folder``, then raises it."""
    import autopar

    entry = get_model("gpt-tiny")
    model = entry.build()
    args, kwargs = entry.example(4, 8)
    try:
        autopar.compile(model, mesh, args, {**kwargs, "no_such_input": args[0]}, time_limit=5.0)
    except Exception as e:
        with open(f"{folder}/rank{dist.get_rank()}.json", "w") as f:
            json.dump([type(e).__name__, str(e), "".join(traceback.format_exception(e))], f)
        raise


@slow
def test_an_error_on_every_rank_is_printed_once(tmp_path):
    """The first rank prints the error; the others raise it too (of its type, so that every rank can
    catch it) in one line pointing to the first, without its traceback; the launcher shows the first
    rank's error."""
    with pytest.raises(DistributedRunError) as info:
        run_on_gloo_mesh(_compile_failing_everywhere, (2,), str(tmp_path), timeout_s=120, start_method="forkserver")
    assert info.value.rank == 0 and "InputMismatchError" in str(info.value), str(info.value)
    (kind0, message0, printed0), (kind1, message1, printed1) = (
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert kind0 == "InputMismatchError" and message0 in printed0
    assert kind1 == "InputMismatchError", (kind1, message1)
    assert "the same error as rank 0's" in message1 and "\n" not in message1, message1
    assert message0 not in printed1 and "direct cause" not in printed1, printed1

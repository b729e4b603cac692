"""Errors as a new user meets them: in the right order, each said once, with advice that holds.

A plan for another model and mesh is refused for the model first; control-flow advice never
recommends what autopar then refuses (torch.cond); Hugging Face decoders train without
``use_cache=False`` by hand, and their ``gradient_checkpointing_enable()`` is ignored with a
warning; a script without a ``__main__`` guard is told so; an evaluation forward leaves no
collective unwaited; ``dir(autopar)`` lists the public API. (An error raised on every rank is
printed once: tests/test_together.py.)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.core.errors import CaptureError, InfeasibleError, PlanFileError
from autopar.core.mesh import MeshSpec
from autopar.profiling.launch import run_on_local_tensor_mesh
from tests.equivalence import build, check_training, local_runner, make_batches
from tests.tiers import slow

SOLVE_S = 10.0
VOCAB = 96


def test_dir_lists_the_public_api():
    names = dir(autopar)
    assert {"plan", "compile", "full_state_dict", "PlanOptions", "MeshSpec", "Plan", "AutoparError"} <= set(names)
    assert "Any" not in names and "annotations" not in names


def test_each_public_name_loads_its_own_module_only():
    """Every name of ``autopar.__all__`` is the object its module defines; using ``compile`` (as
    each rank of a launch does) loads neither checkpointing nor torch.distributed.checkpoint."""
    import subprocess
    import sys

    code = ("import sys, autopar; autopar.compile; print(sorted(m for m in ('autopar.checkpoint', "
            "'torch.distributed.checkpoint') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from autopar import api, checkpoint
    from autopar.core import errors
    assert autopar.save is checkpoint.save and autopar.full_state_dict is api.full_state_dict
    assert all(getattr(autopar, name) is getattr(errors, name) for name in autopar.__all__ if name.endswith("Error"))
    assert {getattr(autopar, name).__name__ for name in autopar.__all__} == set(autopar.__all__)


# ------------------------------------------------------------------ plan files: the model first, then the mesh
def _compile_error(model_name: str, mesh_shape: tuple[int, ...], plan: autopar.Plan) -> Exception:
    model = build(model_name)
    args, kwargs = make_batches(model_name, 8, 16, steps=1)[0]
    with pytest.raises(Exception) as info:
        run_on_local_tensor_mesh(lambda mesh: autopar.compile(model, mesh, args, kwargs, plan=plan), mesh_shape)
    return info.value


def test_a_plan_for_another_model_and_mesh_is_refused_for_the_model_first():
    """A pipeline plan of four stages on a 4 x 1 mesh, compiled on a 2 x 2 mesh whose first axis
    four stages do not divide: another model is told so (its fingerprint), not that the stages do
    not fit; the plan's own model is told the mesh differs. Both before the pipeline's own checks
    (one process per rank)."""
    name = "tests.pipeline_models:gpt"
    args, kwargs = make_batches(name, 8, 16, steps=1)[0]
    plan = autopar.plan(build(name), MeshSpec((4, 1), ("pp", "dp")), args, kwargs, profile=None, time_limit=SOLVE_S,
                        pipeline={"axis": "pp", "schedule": "Schedule1F1B", "microbatches": 4})
    assert plan.pipeline is not None and plan.pipeline.num_stages == 4
    error = _compile_error("gpt-tiny", (2, 2), plan)
    assert isinstance(error, PlanFileError) and "another model or input shapes" in str(error), error
    error = _compile_error(name, (2, 2), plan)
    assert isinstance(error, PlanFileError) and "this plan is for mesh (4, 1)" in str(error), error


def test_a_plan_for_another_model_is_refused_for_the_model_before_the_mesh():
    args, kwargs = make_batches("gpt-tiny", 8, 16, steps=1)[0]
    plan = autopar.plan(build("gpt-tiny"), MeshSpec((2,)), args, kwargs, profile=None, time_limit=SOLVE_S)
    error = _compile_error("tests.pipeline_models:gpt", (2, 2), plan)
    assert isinstance(error, PlanFileError) and "another model or input shapes" in str(error), error


def test_a_model_built_with_its_ranks_simulated_is_told_to_be_built_outside():
    """Built inside ``run_on_local_tensor_mesh`` its parameters are LocalTensors, which export
    traces only in the simplest models: where it fails, said so, not a bare StopIteration."""
    args, kwargs = make_batches("gpt-tiny", 4, 8, steps=1)[0]
    with pytest.raises(CaptureError, match=r"built with every rank simulated .*Build the model outside it"):
        run_on_local_tensor_mesh(lambda mesh: autopar.compile(build("gpt-tiny"), mesh, args, kwargs), (2,))


# ------------------------------------------------------------------ control flow: never advise torch.cond
class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:   # data-dependent control flow
            return self.lin(x).sum()
        return x.sum()


class Cond(nn.Module):
    """The same as ``torch.cond``, as its documentation writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: self.lin(x).sum(), lambda x: x.sum(), (x,))


class CondReturningInput(Cond):
    """A branch that returns its input as it is: export cannot trace that ``torch.cond``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: self.lin(x), lambda x: x, (x,)).sum()


@pytest.mark.parametrize("model", [DataDependent, Cond, CondReturningInput])
def test_control_flow_advice_is_torch_where_never_torch_cond(model):
    """Whatever the user tried (Python ``if``, ``torch.cond`` export traces, one it cannot), the
    advice is what autopar can shard, ``torch.where``, and no step of it is ``torch.cond``."""
    with pytest.raises(CaptureError) as info:
        autopar.plan(model(), MeshSpec((2,)), (torch.randn(2, 4),))
    message = str(info.value)
    assert "torch.where" in message, message
    assert not re.search(r"(with|use|to) torch\.cond", message), message


class LoopedExperts(nn.Module):
    """A mixture of experts as often written by hand: each expert's tokens picked by ``torch.where``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 3, bias=False)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(x[rows]) * weight[rows, slot, None])
        return out.sum()


class HitExperts(LoopedExperts):
    """Looping over the experts a batch hits (transformers 4.4x's Mixtral): a loop of a length
    that depends on values, which export cannot trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e in torch.bincount(chosen.flatten(), minlength=3).nonzero():
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, self.experts[int(e)](x[rows]) * weight[rows, slot, None])
        return out.sum()


def test_a_loop_over_the_experts_hit_is_told_to_loop_over_every_expert():
    with pytest.raises(CaptureError, match=r"HitExperts at .*\(for e in .*\): a Python loop over a tensor whose "
                                           r"length depends on its values .* range\(num_experts\)"):
        autopar.plan(HitExperts(), MeshSpec((2,)), (torch.randn(6, 4),))


class SkippingExperts(LoopedExperts):
    """Every expert, but one that no token chose skipped (transformers 4.36's Mixtral): a branch on
    a size that depends on values, which export cannot trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.shape[0] == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]) * weight[rows, slot, None])
        return out.sum()


def test_skipping_an_expert_no_token_chose_is_told_to_drop_the_branch():
    with pytest.raises(CaptureError, match=r"SkippingExperts at .*\(if rows.shape\[0\] == 0:\): a branch on how many "
                                           r"rows a value-dependent selection picked .* drop the branch"):
        autopar.plan(SkippingExperts(), MeshSpec((2,)), (torch.randn(6, 4),))


def test_sizes_that_depend_on_values_are_refused_by_op_and_module():
    """Export traces ``torch.where(cond)`` with a size it cannot know; planning must say so, by op
    and module, never fail later on the symbol."""
    with pytest.raises(CaptureError, match=r"LoopedExperts: aten\.where\.default in its own forward makes a tensor whose size depends on "
                                           r"tensor values.*list of MLPs of linears.*here, where: its experts are not all one kind of MLP"):
        autopar.plan(LoopedExperts(), MeshSpec((2,)), (torch.randn(6, 4),))


# ------------------------------------------------------------------ Hugging Face decoders as they are
def llama() -> nn.Module:
    """HF Llama as ``from_config`` builds it: forward's ``use_cache`` defaults to the config's (True)."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config)


def llama_checkpointed() -> nn.Module:
    model = llama()
    model.gradient_checkpointing_enable()
    return model


def _batches(steps: int = 3) -> list[tuple[tuple, dict]]:
    """Token ids and labels, as a user passes them: no ``use_cache``."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 16), generator=gen)
        out.append(((), {"input_ids": ids, "labels": ids}))
    return out


def _sharding_budget(build_model, batches) -> float:
    """Halfway between the least memory a 2 x 2 plan needs and what replication needs: the plan must
    shard (``tests.equivalence.tight_budget``, for a model outside the zoo)."""
    args, kwargs = batches[0]
    replicated = autopar.plan(build_model(), MeshSpec((1,)), args, kwargs).predicted.peak_memory_bytes
    with pytest.raises(InfeasibleError) as info:
        autopar.plan(build_model(), MeshSpec((2, 2)), args, kwargs, memory_budget=1.0)
    return info.value.min_memory_bytes + 0.5 * (replicated - info.value.min_memory_bytes)


@pytest.mark.parametrize("mesh_shape, budget", [((2,), False), ((2, 2), True)], ids=["free-2", "sharding-2x2"])
@slow
def test_hf_decoder_trains_without_use_cache_given(mesh_shape, budget):
    """Llama called with ids and labels only (its forward would return a key/value cache): autopar
    passes ``use_cache=False`` itself, says so in the plan, and 3 AdamW steps equal one device's, on
    a free plan and on one a memory budget makes shard."""
    batches = _batches()
    options = {"time_limit": SOLVE_S}
    if budget:
        options["memory_budget"] = _sharding_budget(llama, batches)
    plan = check_training(llama, 0, 0, mesh_shape, local_runner, options, batches=batches)
    assert any("use_cache=False" in w for w in plan.warnings), plan.warnings
    if budget:
        assert any(not all(p.is_replicate() for p in n.storage) for n in plan.parameters.values())


@slow
def test_gradient_checkpointing_enable_is_ignored_with_a_warning():
    """``gradient_checkpointing_enable()``: autopar warns that it plans recomputation itself, and the
    model trains as one device does (2 ranks)."""
    with pytest.warns(UserWarning, match="plans recomputation itself"):
        plan = check_training(llama_checkpointed, 0, 0, (2,), local_runner, {"time_limit": SOLVE_S},
                              batches=_batches())
    assert any("gradient checkpointing" in w for w in plan.warnings), plan.warnings


class Checkpointed(nn.Module):
    """A hand-written model checkpointing its block with ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(4, 4), nn.Linear(4, 4), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = lambda y: self.b(torch.relu(self.a(y)))   # noqa: E731
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant).sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_calls_are_ignored_with_a_warning(reentrant):
    """Export inlines ``torch.utils.checkpoint``: the graph no longer shows it, the plan says so."""
    from autopar.core.capture import capture

    with pytest.warns(UserWarning, match="1 torch.utils.checkpoint call.* plans recomputation itself"):
        captured = capture(Checkpointed(reentrant), (torch.randn(2, 4),))
    assert any("torch.utils.checkpoint" in w for w in captured.warnings), captured.warnings


# ------------------------------------------------------------------ processes
NO_GUARD = """
import torch.distributed as dist
from autopar.profiling.launch import run_on_gloo_mesh


def rank(mesh):
    return dist.get_rank()


print(run_on_gloo_mesh(rank, (2,), timeout_s=120))
"""


@slow
def test_a_script_without_main_guard_is_told_so(tmp_path):
    """The launch helper called at a script's top level: each rank, importing the script as it
    starts, would start ranks again. The error names the missing guard, not the OS or memory."""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(NO_GUARD))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr, done.stderr[-3000:]
    assert "out of memory" not in done.stderr, done.stderr[-3000:]


UNREAD_OUTPUTS = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.models.zoo import get_model

dist.init_process_group("gloo")
torch.set_num_threads(1)
entry = get_model("llama-tiny")
torch.manual_seed(0)
args, kwargs = entry.example(4, 8)
pmodel = autopar.compile(entry.build(), init_device_mesh("cpu", (2,)), args, kwargs, time_limit=10.0, profile=None)
pmodel(*args, **kwargs).loss.backward()   # a training step whose loss is not read
pmodel.eval()
with torch.no_grad():
    pmodel(*args, **kwargs)               # an evaluation whose outputs are not read
print("done", flush=True)
dist.destroy_process_group()   # torch warns here of collectives never waited for (and gloo ends cleanly)
"""


@slow
def test_outputs_left_unread_leave_no_collective_unwaited_at_exit(tmp_path):
    """Two ranks (torchrun) end after a training forward and an evaluation whose outputs they do
    not read: torch says nothing of unwaited collectives as the processes end."""
    script = tmp_path / "unread.py"
    script.write_text(textwrap.dedent(UNREAD_OUTPUTS))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), str(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ":".join(sys.path), "GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0 and done.stdout.count("done") == 2, done.stderr[-3000:]
    assert "unwaited" not in done.stderr, done.stderr[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""The GPU paths of compiled modules, where a CUDA GPU is: training on CUDA tensors equals one
device's eager training on the same GPU.

What only a GPU runs: NCCL (a one-rank group), offload's pinned host copies and their
``non_blocking`` transfers, bf16 kernels, and CUDA's own reduction orders. Their logic is tested
on the CPU elsewhere (tests/test_memory_knobs.py, test_precision.py); here it runs on the device.
Two ranks share the one GPU over gloo (NCCL refuses two ranks on one device). Each case runs in
fresh processes so that its process group does not outlive it.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.core.precision import ComputeIn
from autopar.planning.baselines import candidates
from tests.equivalence import TOLERANCES, build, make_batches, train, train_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA paths need a CUDA GPU")

#: (model, ranks, backend, plan options, hand plan or None)
CASES = [
    ("gpt-tiny", 1, "nccl", {}, None),
    ("llama-tiny", 1, "nccl", {"recompute": "full", "microbatches": 2}, None),
    ("gpt2-tiny", 1, "nccl", {"precision": "bf16"}, None),
    ("gpt2-tiny", 2, "gloo", {"offload": "optimizer", "microbatches": 2}, "zero2"),
    ("llama-tiny", 2, "gloo", {"offload": "optimizer"}, "fsdp"),
]


def _on_cuda(batches):
    move = (lambda v: v.cuda() if isinstance(v, torch.Tensor) else v)
    return [(tuple(map(move, a)), {k: move(v) for k, v in kw.items()}) for a, kw in batches]


def _older_torch_names() -> None:
    """The lent GPU machines run torch 2.11, which lacks three names of the collectives autopar
    calls (torch 2.13's): alias them to 2.11's equivalents there, so that the GPU paths run."""
    for module, name, older in ((funcol, "all_gather_single", "all_gather_tensor"),
                                (funcol, "reduce_scatter_single", "reduce_scatter_tensor"),
                                (dist, "all_gather_single", "all_gather_into_tensor")):
        if not hasattr(module, name):
            setattr(module, name, getattr(module, older))


def _worker(rank, world, port, backend, name, options, hand_plan, out):
    _older_torch_names()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cuda", (world,))
        batches = _on_cuda(make_batches(name, 8, 16))
        with torch.device("cuda"):
            model = build(name)
        plan_options = dict(options)
        if hand_plan:
            plan_options = {"plan": candidates(model, mesh, *batches[0], **options)[hand_plan], "bucket_bytes": 4096}
        pmodel = autopar.compile(model, mesh, *batches[0], **plan_options)
        losses = [float(l) for l in train_steps(pmodel, batches)]
        state = {k: v.detach().cpu() for k, v in autopar.full_state_dict(pmodel).items()}
        offloaded = any(p.offloaded for p in pmodel.plan.parameters.values())
        torch.save({"losses": losses, "state": state, "offloaded": offloaded}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name, world, backend, options, hand_plan", CASES)
def test_training_on_cuda_equals_one_device(tmp_path, name, world, backend, options, hand_plan):
    batches = _on_cuda(make_batches(name, 8, 16))
    precision = options.get("precision", "fp32")
    with torch.device("cuda"):
        model = build(name)
    ref_losses = [float(l) for l in train(model if precision == "fp32" else ComputeIn(model, precision), batches)]
    mp.spawn(_worker, args=(world, _free_port(), backend, name, options, hand_plan, str(tmp_path)), nprocs=world)
    rtol, loss_atol, param_atol = TOLERANCES[precision]
    for rank in range(world):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["offloaded"] == (options.get("offload") == "optimizer")
        torch.testing.assert_close(got["losses"], ref_losses, rtol=rtol, atol=loss_atol)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(got["state"][key], value.cpu(), rtol=rtol, atol=param_atol, msg=key)

"""The GPU paths of compiled modules, where a CUDA GPU is: training on CUDA tensors equals one
device's eager training on the same GPU.

What only a GPU runs: NCCL (a one-rank group), bf16 kernels, CUDA's own reduction orders, the
ring attention's fused block kernels and the experts' grouped GEMMs. Their logic is tested on the
CPU elsewhere (tests/test_precision.py, test_context_parallel.py, test_expert_parallel.py); here
it runs on the device. Each case runs in fresh processes so that its process group does not
outlive it.

Two ranks can share the one GPU only over gloo (NCCL refuses two ranks on one device), and
gloo's all-gather of CUDA tensors crashes the process (SIGSEGV in ``wait_tensor``; an H200 with
torch 2.11): training on two ranks cannot run there, and offload's pinned copies, which only
multi-rank plans choose, run on no GPU here. Context-parallel attention, whose ring sends
through host memory over gloo and whose Ulysses all-to-all gloo runs on CUDA tensors, does.
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
import autopar.core.context_parallel as cp
import autopar.core.expert_parallel as ep
from autopar.core.precision import ComputeIn
from autopar.profiling.launch import run_on_gloo_mesh
from tests.equivalence import TOLERANCES, build, make_batches, train, train_steps
from tests.test_context_parallel import BF16, CASES as ATTENTION_CASES, _all_cases, _check, _inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA paths need a CUDA GPU")

#: (model, plan options), each trained by one NCCL rank
CASES = [
    ("gpt-tiny", {}),
    ("llama-tiny", {"recompute": "full", "microbatches": 2}),
    ("gpt2-tiny", {"precision": "bf16"}),
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


def _worker(rank, port, name, options, out):
    _older_torch_names()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        batches = _on_cuda(make_batches(name, 8, 16))
        with torch.device("cuda"):
            model = build(name)
        pmodel = autopar.compile(model, mesh, *batches[0], **options)
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


@pytest.mark.parametrize("name, options", CASES)
def test_training_on_cuda_equals_one_device(tmp_path, name, options):
    batches = _on_cuda(make_batches(name, 8, 16))
    precision = options.get("precision", "fp32")
    with torch.device("cuda"):
        model = build(name)
    ref_losses = [float(l) for l in train(model if precision == "fp32" else ComputeIn(model, precision), batches)]
    mp.spawn(_worker, args=(_free_port(), name, options, str(tmp_path)), nprocs=1)
    rtol, loss_atol, param_atol = TOLERANCES[precision]
    got = torch.load(tmp_path / "0.pt")
    assert not got["offloaded"]   # none of the cases asks for offload
    torch.testing.assert_close(got["losses"], ref_losses, rtol=rtol, atol=loss_atol)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(got["state"][key], value.cpu(), rtol=rtol, atol=param_atol, msg=key)


#: Fused kernels against the fp32 matmul kernel: they sum in another order (fp32: 1.3e-5 seen).
CUDA_FP32 = {"atol": 5e-5, "rtol": 5e-5}


def test_the_ring_runs_a_fused_kernel_on_cuda():
    for dtype in (torch.float32, torch.bfloat16):
        assert cp._kernel_for(torch.zeros(1, 4, 64, 64, device="cuda", dtype=dtype)) != "math"


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, kernel", [(torch.float32, "efficient_cuda"), (torch.bfloat16, "flash_cuda"),
                                           (torch.bfloat16, "cudnn_cuda")])
def test_the_ring_blocks_cuda_kernels_match_the_matmul_kernel(dtype, kernel, causal, kv_heads):
    """Each of the ring's block kernels on CUDA (those SDPA may pick): output, log-sum-exp and
    q/k/v gradients as the fp32 matmul kernel gives them."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, d_out = (torch.randn(2, 4, 96, 64, device="cuda", generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, 96, 64, device="cuda", generator=gen).to(dtype) for _ in range(2))
    tolerance = BF16 if dtype == torch.bfloat16 else CUDA_FP32
    fused, exact = (cp._block_forward(kind, q, k, v, causal, 0.3) for kind in (kernel, "math"))
    for got, want in zip(fused, exact, strict=True):
        torch.testing.assert_close(got, want, **tolerance)
    grads = (d_out, exact[0].to(dtype), exact[1])
    for got, want in zip(cp._block_backward(kernel, grads, q, k, v, causal, 0.3),
                         cp._block_backward("math", grads, q, k, v, causal, 0.3), strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want, **tolerance)


def test_context_parallel_attention_on_cuda_tensors_over_two_gloo_ranks():
    """Ring (its blocks on CUDA's fused kernels, its messages through host memory) and Ulysses on
    CUDA tensors, two processes sharing the GPU: every case of tests/test_context_parallel.py
    against attention on the whole sequence."""
    inputs = {name: _inputs(case, 16, seed) for seed, (name, case) in enumerate(ATTENTION_CASES.items())}
    per_rank = run_on_gloo_mesh(_all_cases, (2,), ATTENTION_CASES, inputs, "cuda", timeout_s=120,
                                start_method="forkserver")
    for name, case in ATTENTION_CASES.items():
        _check(name, case, [r[name] for r in per_rank], inputs[name], 2)


def test_experts_run_as_grouped_gemms_on_cuda_equal_the_loop():
    """In bf16 on a Hopper GPU experts without biases run as two ``torch._grouped_mm``: outputs
    and the gradients of rows and weights within twice the bf16 loop's distance from the fp32
    loop, with an expert that receives no rows. Experts with biases run the loop."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [5, 0, 9, 2]
    values = [(torch.randn(*s, device="cuda", generator=gen) * 0.3).bfloat16() for s in ((16, 64), (4, 64, 64),
                                                                                         (4, 64, 32))]
    grad = torch.randn(16, 64, device="cuda", generator=gen).bfloat16()
    assert not ep._grouped_mm_runs(*values, values[0][:4], None)
    results = []
    for dtype, run in ((torch.bfloat16, ep.grouped_experts), (torch.bfloat16, ep.looped_experts),
                       (torch.float32, ep.looped_experts)):
        leaves = [v.to(dtype, copy=True).requires_grad_() for v in values]
        assert ep._grouped_mm_runs(*leaves) == (dtype == torch.bfloat16)
        out = run(*leaves[:1], counts, *leaves[1:], "silu", None, None)
        out.backward(grad.to(dtype))
        results.append([out.detach(), *(t.grad for t in leaves)])
    for grouped, looped, exact in zip(*results, strict=True):
        assert (grouped.float() - exact).abs().max() <= 2 * (looped.float() - exact).abs().max() + 1e-3

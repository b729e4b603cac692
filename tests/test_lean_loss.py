"""The lean cross-entropy (``autopar::cross_entropy``, ``autopar.core.ops.cross_entropy``): equal to
the upcast then aten's loss in value and gradient, chunk by chunk; made by capture in place of the
upcast and the loss; priced without the fp32 copies of the logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import autopar.core.lean_loss as ce
from autopar.core.capture import capture, tensor_val
from autopar.core.lean_loss import CROSS_ENTROPY, LEAN
from autopar.core.mesh import MeshSpec
from autopar.core.strategies import build_space
from autopar.planning.baselines import candidates
from cost_models.estimate import CostModel
from tests.equivalence import build, check_training, local_runner, make_batches
from tests.tiers import slow

aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_the_lean_loss_equals_the_upcast_then_cross_entropy(monkeypatch, dtype, reduction, ignore_index):
    """Values and gradients (in the logits' dtype) of 11 rows in chunks of 3, some targets
    ignored, against one device's ``F.cross_entropy(logits.float(), ...)``."""
    monkeypatch.setattr(ce, "CHUNK_BYTES", 3 * 40 * 4)
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(11, 40, generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, 40, (11,), generator=gen)
    target[[1, 6, 7]] = ignore_index
    seed = torch.tensor(0.7)   # a backward seed other than 1
    want = F.cross_entropy(logits.float(), target, reduction=reduction, ignore_index=ignore_index)
    (want_grad,) = torch.autograd.grad(want * seed, logits)
    got = LEAN(logits, target, None, 1 if reduction == "mean" else 2, ignore_index, dtype=torch.float32)
    (got_grad,) = torch.autograd.grad(got * seed, logits)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-7)
    assert got_grad[[1, 6, 7]].abs().sum() == 0


def _llama(precision: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=4096, max_position_embeddings=64)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    return capture(model, (ids,), {"labels": ids, "use_cache": False}, precision=precision)


def _loss_memory(captured) -> tuple[torch.fx.Node, float, float]:
    """The loss node, and its saved and working bytes replicated on one device."""
    space = build_space(captured, MeshSpec((1,), hardware="h100-80gb"))
    costs = CostModel(space.mesh, space)
    nc = next(nc for nc in space.nodes if nc.node.target in (LEAN, CROSS_ENTROPY))
    cost = costs.node(nc, nc.strategies[0])
    return nc.node, cost.saved_bytes, cost.transient_bytes


@slow
def test_capture_makes_the_bf16_loss_lean_and_its_priced_memory_drops(monkeypatch):
    """transformers' Llama in bf16: the loss reads the bf16 logits (no fp32 copy in the graph) and
    keeps them with one float a row; as aten's loss after the upcast it kept the fp32
    log-probabilities and worked on fp32 copies."""
    rows, vocab = 128, 4096
    monkeypatch.setattr(ce, "CHUNK_BYTES", 16 * vocab * 4)   # chunks of 16 rows
    node, saved, working = _loss_memory(_llama("bf16"))
    assert node.target is LEAN and tensor_val(node.args[0]).dtype == torch.bfloat16
    assert not any(n.target in (aten.to.dtype, aten._to_copy.default) and tensor_val(n).shape[-1] == vocab
                   for n in node.graph.nodes if n.op == "call_function")
    assert saved == rows * vocab * 2 + rows * (8 + 4)   # bf16 logits, targets, the log-sum-exp
    assert working == 2 * 16 * vocab * 4 + rows * 4 + 4   # two fp32 chunks, the log-sum-exp, the loss
    monkeypatch.setattr(ce, "lean_losses", lambda graph: 0)   # capture as before: upcast, then aten's loss
    node, saved_before, working_before = _loss_memory(_llama("bf16"))
    assert node.target is CROSS_ENTROPY
    assert saved_before >= rows * vocab * 4 and saved_before + working_before >= 2 * rows * vocab * 4


def test_an_upcast_read_elsewhere_stays():
    """Logits upcast and returned too: the loss reads the upcast copy (nothing to absorb)."""
    class Returned(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(8, 16)

        def forward(self, x, y):
            logits = self.head(x).float()
            return F.cross_entropy(logits.view(-1, 16), y.view(-1)), logits

    captured = capture(Returned(), (torch.randn(2, 3, 8), torch.randint(0, 16, (2, 3))), precision="bf16")
    loss = next(n for n in captured.graph.nodes if n.target is LEAN)
    assert tensor_val(loss.args[0]).dtype == torch.float32 and loss.args[0].args[0].target is aten.to.dtype


@slow
def test_llama_trains_with_the_lean_loss_in_chunks_like_one_device(monkeypatch):
    """HF Llama as built, its loss split by batch over 2 ranks, 5 rows a chunk: losses and
    parameters over 3 AdamW steps equal one device's (aten's loss)."""
    monkeypatch.setattr(ce, "CHUNK_BYTES", 5 * 256 * 4)
    batches = make_batches("llama-tiny", 4, 16)
    plan = candidates(build("llama-tiny"), MeshSpec((2,)), *batches[0], names=["ddp"])["ddp"]
    check_training("llama-tiny", 4, 16, (2,), local_runner, {"plan": plan}, batches=batches)
    loss = next(n for n in plan.nodes if n.op == "autopar.cross_entropy.default")
    assert loss.ins[0] == (Shard(0),)


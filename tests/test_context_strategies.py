"""Attention split by sequence as planner strategies (``autopar.core.ops.attention``): which SDPA
calls get the "context-ring" / "context-ulysses" rules, what the cost model is told they move,
and a model trained with the ring forced across gloo processes, against one device. The numbers
of each strategy on simulated meshes are checked by tests/test_strategies_numeric.py (the
``sdpa-context-*`` cases of tests/strategy_cases.py)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.cli import _plan_options, build_parser
from autopar.core import from_shapes
from autopar.core.capture import capture
from autopar.core.errors import AutoparError, PlanningTimeout
from autopar.core.mesh import MeshSpec
from autopar.core.ops.attention import SDPA, context_moves, fused_kernel
from autopar.core.plan import Plan
from autopar.core.strategies import build_space
from autopar.planning.baselines import candidates, context_role_sets, plan_name
from autopar.planning.context import ContextChoice, context_choice, restrict_context
from autopar.planning.options import PlanOptions
from autopar.planning.planner import plan_captured
from autopar.profiling.launch import run_on_gloo_mesh
from codegen.generate import generate
from cost_models.activations import gradients
from cost_models.estimate import CostModel
from cost_models.profile_ops import op_call
from tests.equivalence import (
    ATOL,
    RTOL,
    TOLERANCES,
    build,
    check_training,
    gloo_runner,
    local_runner,
    make_batches,
    meta_model,
    padded_batches,
    train_reference,
    train_steps,
)
from tests.tiers import slow

VOCAB, DIM, HEADS, SEQ = 11, 8, 2, 8


class CausalLM(nn.Module):
    """Embeddings, one causal self-attention (SDPA, is_causal) with a residual, an LM head and
    the mean cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.qkv, self.proj, self.head = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device))
        q, k, v = (t.view(B, T, HEADS, DIM // HEADS).transpose(1, 2) for t in self.qkv(x).split(DIM, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, DIM)
        return F.cross_entropy(self.head(x + self.proj(y)).view(-1, VOCAB), labels.view(-1))


class MaskedAttention(nn.Module):
    """SDPA reading a mask built from sizes (``window``: a sliding window, not causal) or given."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window

    def forward(self, q, k, v, mask=None):
        if mask is None:
            pos = torch.arange(q.shape[2])
            mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.window)
        return F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, attn_mask=mask)


class ShiftedMask(nn.Module):
    """SDPA under a mask from sizes that hides the diagonal too (strictly causal)."""

    def forward(self, q, k, v):
        pos = torch.arange(q.shape[2])
        return F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, attn_mask=pos[None, :] < pos[:, None])


def _batches(steps: int = 3, batch: int = 2) -> list:
    gen = torch.Generator().manual_seed(5)
    return [((torch.randint(0, VOCAB, (batch, SEQ), generator=gen), torch.randint(0, VOCAB, (batch, SEQ), generator=gen)),
             {}) for _ in range(steps)]


def _sdpa_rules(model: nn.Module, inputs: tuple, mesh_shape: tuple[int, ...] = (2,)) -> set[str]:
    captured = capture(model, inputs)
    space = build_space(captured, MeshSpec(mesh_shape))
    return {name for nc in space.nodes if nc.node.target is SDPA for s in nc.strategies for name in s.names}


def test_only_a_causal_or_open_mask_from_sizes_lets_attention_split_by_sequence():
    qkv = tuple(torch.randn(2, 2, 6, 4) for _ in range(3))
    assert {"context-ring", "context-ulysses"} <= _sdpa_rules(MaskedAttention(6), qkv)   # the window spans it all
    assert not {"context-ring", "context-ulysses"} & _sdpa_rules(MaskedAttention(2), qkv)
    given = torch.ones(6, 6, dtype=torch.bool).tril()   # an input: not known when planned
    assert not {"context-ring", "context-ulysses"} & _sdpa_rules(MaskedAttention(None), (*qkv, given))
    odd = tuple(torch.randn(2, 2, 5, 4) for _ in range(3))
    assert "context-ring" not in _sdpa_rules(MaskedAttention(5), odd)


def test_a_long_sequences_mask_is_known_from_a_grid_of_positions():
    """Past ``from_shapes.LIMIT`` (4200 x 4200 booleans) the mask is computed at a grid of
    positions only (``mask_grid``): a window spanning the sequence is causal there, a shorter
    one (1000) or a diagonal shifted by one is not."""
    long = tuple(torch.zeros(1, 1, 4200, 2) for _ in range(3))
    assert "context-ring" in _sdpa_rules(MaskedAttention(4200), long)
    assert "context-ring" not in _sdpa_rules(MaskedAttention(1000), long)
    shifted = ShiftedMask()
    assert "context-ring" not in _sdpa_rules(shifted, long)


class BatchedMask(MaskedAttention):
    """``MaskedAttention``'s mask from sizes, as Hugging Face builds it: from each sequence's positions."""

    def forward(self, q, k, v):
        pos = torch.arange(q.shape[2]).expand(q.shape[0], -1)
        i, j = pos[:, None, :, None], pos[:, None, None, :]
        mask = (j <= i) & (i - j < self.window)
        return F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, attn_mask=mask)


def test_a_large_batchs_mask_is_known_from_a_thinner_grid():
    """A mask per sequence of a large batch is computed on a grid thin enough that the batch of
    them fits ``GRID_ELEMENTS`` (the densest grid for Mixtral's 256 x 4096 held 2.3G booleans),
    and still tells a window spanning the sequence from a shorter one."""
    from autopar.core.ops.attention import GRID_ELEMENTS, mask_grid
    assert 256 * len(mask_grid(4200, 256)) ** 2 <= GRID_ELEMENTS < 256 * len(mask_grid(4200)) ** 2
    long = tuple(torch.zeros(256, 1, 4200, 2) for _ in range(3))
    assert "context-ring" in _sdpa_rules(BatchedMask(4200), long)
    assert "context-ring" not in _sdpa_rules(BatchedMask(1000), long)


def test_one_axis_splits_the_sequence_and_ulysses_needs_the_heads_to_divide():
    qkv = tuple(torch.randn(2, 3, 8, 4) for _ in range(3))
    captured = capture(MaskedAttention(8), qkv)
    space = build_space(captured, MeshSpec((2, 2)))
    names = {s.names for nc in space.nodes if nc.node.target is SDPA for s in nc.strategies}
    assert ("context-ring", "batch") in names and ("batch", "context-ring") in names
    assert not any(n[0].startswith("context") and n[1].startswith("context") for n in names)
    assert not any("context-ulysses" in n for n in names)   # 3 heads on 2 ranks


def test_the_cost_model_is_told_what_moves():
    captured = capture(CausalLM(), _batches(1)[0][0])
    space = build_space(captured, MeshSpec((2,)))
    nc = next(nc for nc in space.nodes if nc.node.target is SDPA)
    by = {s.names[0]: s for s in nc.strategies}
    shape = (2, HEADS, SEQ, DIM // HEADS)
    ring = context_moves(nc.node, by["context-ring"], (2,), True, None)
    gather, scatter = ((Shard(2),), (Replicate(),)), ((Partial(),), (Shard(2),))
    # keys, then values: sent round in the forward and again in the backward (recomputed), their
    # gradients brought back in fp32; each under the other block's attention
    assert [(m.shape, m.src, m.dst, m.dtype) for m in ring] == [
        (shape, *gather, torch.float32), (shape, *gather, torch.float32), (shape, *scatter, torch.float32)] * 2
    assert all(m.hidden_by == 0.5 for m in ring)
    assert len(context_moves(nc.node, by["context-ring"], (2,), False, None)) == 2   # no backward
    ulysses = context_moves(nc.node, by["context-ulysses"], (2,), True, None)
    assert len(ulysses) == 8 and all({m.src, m.dst} == {(Shard(2),), (Shard(1),)} for m in ulysses)
    # the all_to_all_single its kernel calls, not DTensor's all-to-all (gloo: an all-gather); the ring's DTensor's kinds
    assert {m.kind for m in ulysses} == {"all_to_all_single"} and {m.kind for m in ring} == {None}
    assert context_moves(nc.node, by["heads"], (2,), True, None) == []


@pytest.mark.parametrize("overlap", [0.0, 1.0])
def test_the_rings_transfers_are_hidden_by_the_blocks_computed_meanwhile_as_far_as_the_host_overlaps(overlap):
    """Priced blocking where this host hides no asynchronous collective under compute (as this
    CPU measured), and beyond the other block's attention only where it does (a GPU)."""
    captured = capture(CausalLM(), _batches(1)[0][0])
    space = build_space(captured, MeshSpec((2,)))
    nc = next(nc for nc in space.nodes if nc.node.target is SDPA)
    ring = next(s for s in nc.strategies if s.names == ("context-ring",))
    model = CostModel(MeshSpec((2,)), space)
    model.overlap_efficiency = overlap
    moved = sum(model.redistribute(m.shape, m.dtype, m.src, m.dst).comm_s
                for m in context_moves(nc.node, ring, (2,), True, None))
    compute = model._compute(nc, ring, nc.node.meta["val"]).compute_s
    assert moved > 0 and model.node(nc, ring).comm_s == pytest.approx(max(0.0, moved - overlap * compute / 2))
    assert model._inside(nc, ring, compute).transient_bytes == 0   # its blocks are the op's working memory


def test_the_rings_working_memory_is_its_backwards_accumulators_blocks_and_kernel_scratch():
    """Ring attention on 2 ranks (CausalLM: [2, 2, 8, 4] split into blocks of 4 positions, fp32,
    on the CPU) holds at its heaviest, in the backward, beside its output and log-sum-exp: dq's
    accumulator (256 bytes), one key/value block in flight (512), three sets of fp32 dk/dv
    accumulators (1536) and two of each block's gradients (1536), less the input gradients the
    schedule holds (768), and the flash kernel's scratch of one block (400): 3472 bytes. Priced
    as six blocks of the collectives before (3072), missing the accumulators."""
    captured = capture(CausalLM(), _batches(1)[0][0])
    space = build_space(captured, MeshSpec((2,)))
    nc = next(nc for nc in space.nodes if nc.node.target is SDPA)
    ring = next(s for s in nc.strategies if s.names == ("context-ring",))
    out, lse = 2 * HEADS * (SEQ // 2) * (DIM // HEADS) * 4, 2 * HEADS * (SEQ // 2) * 4
    assert CostModel(MeshSpec((2,)), space).node(nc, ring).transient_bytes == out + lse + 3472


def test_ulysses_all_to_alls_run_one_after_another_so_it_holds_one_at_a_time():
    """Its eight all-to-alls (q, k, v, the output; their gradients) each hold the result and a
    staging copy of one rank's part (2 x 256 bytes here), one at a time: the largest's, not the
    sum of all eight (4096 bytes, as priced before)."""
    captured = capture(CausalLM(), _batches(1)[0][0])
    space = build_space(captured, MeshSpec((2,)))
    nc = next(nc for nc in space.nodes if nc.node.target is SDPA)
    ulysses = next(s for s in nc.strategies if s.names == ("context-ulysses",))
    local = 2 * HEADS * (SEQ // 2) * (DIM // HEADS) * 4
    assert CostModel(MeshSpec((2,)), space)._inside(nc, ulysses, 0.0).transient_bytes == 2 * local


def test_ulysses_where_tensor_parallelism_left_too_few_heads_is_priced_as_the_ring_it_runs():
    """Llama's 2 key/value heads split by heads on one axis leave one a rank: Ulysses over the
    other axis cannot split it, runs the ring, and is priced so (not as attention on no heads)."""
    q, kv = torch.randn(2, 4, 8, 4), torch.randn(2, 2, 8, 4)
    model = lambda q, k, v: F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, is_causal=True,  # noqa: E731
                                                           enable_gqa=True)
    space = build_space(capture(_Fn(model), (q, kv, kv)), MeshSpec((2, 2)))
    nc = next(nc for nc in space.nodes if nc.node.target is SDPA)
    by = {s.names: s for s in nc.strategies}
    for names, like in ((("context-ulysses", "heads"), ("context-ring", "heads")),
                        (("context-ulysses", "batch"), None)):
        moves = [(m.src, m.dst) for m in context_moves(nc.node, by[names], (2, 2), True, None)]
        call = op_call(nc, by[names], (2, 2), gradients(space))
        if like is None:   # 4 and 2 heads split over 2: Ulysses
            assert len(moves) == 8 and min(t.shape[1] for t in call.args[:3]) == 1
        else:
            assert moves == [(m.src, m.dst) for m in context_moves(nc.node, by[like], (2, 2), True, None)]
            assert call.key == op_call(nc, by[like], (2, 2), gradients(space)).key


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_attention_under_a_mask_found_causal_keeps_what_the_fused_kernel_keeps():
    """A mask from sizes found causal runs as is_causal: the backward keeps q, k, v, the output
    and a log-sum-exp per row, not the masked math path's seq x seq matrices fake tensors show."""
    qkv = tuple(torch.randn(2, HEADS, 64, 4) for _ in range(3))
    for window, extra in ((64, 2 * HEADS * 64 * 4), (3, None)):   # causal; a sliding window (not causal)
        space = build_space(capture(MaskedAttention(window), qkv), MeshSpec((2,)))
        nc = next(nc for nc in space.nodes if nc.node.target is SDPA)
        kept = fused_kernel(nc.node, (True, True, True))
        assert (kept and kept.extra_bytes) == extra, window


def test_profiling_times_the_slowest_ranks_attention():
    """Ring (causal, 2 ranks): the last rank's queries against the keys of 1.5 blocks, unmasked
    (the first block whole, its own half-masked); balanced, of one block (half of the other,
    its own half-masked); Ulysses: half the heads over the whole sequence, causal."""
    captured = capture(CausalLM(), _batches(1)[0][0])
    space = build_space(captured, MeshSpec((2,)))
    nc = next(nc for nc in space.nodes if nc.node.target is SDPA)
    grad = gradients(space)
    call = {s.names[0]: op_call(nc, s, (2,), grad) for s in nc.strategies}
    shapes = {name: [tuple(a.shape) for a in c.args[:3]] for name, c in call.items()}
    local, half_heads = (2, HEADS, SEQ // 2, DIM // HEADS), (2, HEADS // 2, SEQ, DIM // HEADS)
    blocks = (2, HEADS, SEQ * 3 // 4, DIM // HEADS)
    assert shapes["context-ring"] == [local, blocks, blocks] and call["context-ring"].args[3:] == ()
    assert shapes["context-ring-balanced"] == [local] * 3
    assert shapes["context-ulysses"] == [half_heads] * 3 and call["context-ulysses"].args[5] is True


@slow
def test_ring_attention_forced_trains_as_one_device_across_processes():
    """Two gloo processes, SDPA forced to the ring (point-to-point between the processes): the
    losses and parameters after 3 AdamW steps equal one device's."""
    batches = _batches()
    captured = capture(build(CausalLM), *batches[0])
    mesh = MeshSpec((2,))
    space = build_space(captured, mesh)
    forced = {nc.node.name: next(s for s in nc.strategies if s.names == ("context-ring",))
              for nc in space.nodes if nc.node.target is SDPA}
    plan = plan_captured(captured, mesh, forced=forced)
    assert "kernels.context_attention(" in generate(captured, plan).source
    check_training(CausalLM, 0, 0, (2,), gloo_runner, {"plan": plan}, batches=batches)


@pytest.mark.parametrize("kind, long", [("context-ring", False), ("context-ulysses", False), ("context-ring", True)])
@slow
def test_llama_with_attention_split_by_sequence_trains_as_one_device(kind, long, monkeypatch):
    """Llama's folded causal mask is found causal when planned (the rules are offered) and when
    run; rotary embeddings reach attention split as their positions are; a batch of one, its
    logits flattened for the loss with the sequence still split: 3 AdamW steps on 2 simulated
    ranks equal one device's. ``long``: the mask is past ``from_shapes.LIMIT`` (as a long
    sequence's), known causal from a grid of positions when planned: the generated code never
    builds it and tells SDPA it is causal."""
    if long:
        monkeypatch.setattr(from_shapes, "LIMIT", 64)   # the 1 x 1 x 16 x 16 mask is over it
    name, mesh = "llama-tiny", MeshSpec((2,))
    captured = capture(build(name), *make_batches(name, 1, 16, steps=1)[0])
    space = build_space(captured, mesh)
    forced = {nc.node.name: next(s for s in nc.strategies if s.names == (kind,))
              for nc in space.nodes if nc.node.target is SDPA}
    assert len(forced) == 2
    plan = plan_captured(captured, mesh, forced=forced)
    assert any(n.op == "aten.view.default" and n.ins == ((Shard(1),),) and n.out == (Shard(0),) for n in plan.nodes)
    source = generate(captured, plan).source
    unbuilt = [line for line in source.splitlines() if "never built" in line]
    assert len(unbuilt) == long and all(" = 'causal'" in line for line in unbuilt), unbuilt
    check_training(name, 1, 16, (2,), local_runner, {"plan": plan})


# ---------------------------------------------------------------- the planning option

def test_the_context_parallel_option_is_checked_and_taken_from_the_command_line():
    for bad in (True, "ring", {"axis": "cp", "kind": "zigzag"}, {"kind": "ring"}, {"axis": "cp", "degree": 2}):
        with pytest.raises(AutoparError, match="context_parallel"):
            PlanOptions(context_parallel=bad)
    assert PlanOptions(context_parallel={"axis": "cp"}).context_parallel == {"axis": "cp"}
    parser = build_parser()
    for text, want in (("auto", "auto"), ("none", False), ("ulysses:cp", ContextChoice("cp", "ulysses"))):
        args = parser.parse_args(["plan", "--model", "gpt-tiny", "--mesh", "2", "--context-parallel", text])
        assert _plan_options(args).context_parallel == want
    with pytest.raises(AutoparError, match="KIND:AXIS"):
        _plan_options(parser.parse_args(["plan", "--model", "gpt-tiny", "--mesh", "2", "--context-parallel", "cp"]))


def _restricted(model: nn.Module, inputs: tuple, mesh: MeshSpec, setting) -> set[str]:
    space = build_space(capture(model, inputs), mesh)
    restrict_context(space, setting)
    return {name for nc in space.nodes if nc.node.target is SDPA for s in nc.strategies for name in s.names}


def test_forcing_context_parallelism_narrows_attention_or_says_why_it_cannot():
    qkv = tuple(torch.randn(2, 2, 8, 4) for _ in range(3))
    mesh = MeshSpec((2, 2), ("dp", "cp"))
    forced = _restricted(MaskedAttention(8), qkv, mesh, {"axis": "cp", "kind": "ulysses"})
    assert "context-ulysses" in forced and not {"context-ring", "heads"} & forced
    assert not {"context-ring", "context-ulysses"} & _restricted(MaskedAttention(8), qkv, mesh, False)
    assert {"context-ring", "context-ulysses", "heads"} <= _restricted(MaskedAttention(8), qkv, mesh, "auto")
    refused = [({"axis": "sp", "kind": "ring"}, MaskedAttention(8), "mesh's axes are 'dp', 'cp'"),
               ({"axis": "cp", "kind": "ring"}, MaskedAttention(3), "neither|not known to be causal"),
               ({"axis": "cp", "kind": "ring"}, nn.Linear(4, 4), "no attention")]
    for setting, model, why in refused:
        with pytest.raises(AutoparError, match=why):
            _restricted(model, qkv[:1] if isinstance(model, nn.Linear) else qkv, mesh, setting)
    odd_heads = tuple(torch.randn(2, 3, 8, 4) for _ in range(3))
    with pytest.raises(AutoparError, match="3 query heads and 3 key/value heads do not both divide by 2"):
        _restricted(MaskedAttention(8), odd_heads, mesh, {"axis": "cp", "kind": "ulysses"})


def test_the_plan_records_attention_split_by_sequence_in_json_and_reports():
    captured = capture(CausalLM(), _batches(1)[0][0])
    mesh = MeshSpec((2,), ("cp",))
    plan = plan_captured(captured, mesh, PlanOptions(context_parallel={"axis": "cp", "kind": "ring"}, progress=False))
    cp = plan.context_parallel
    assert cp is not None and (cp.axis, cp.kind, cp.load_balance) == ("cp", "ring", "contiguous")
    assert list(cp.nodes) == [nc.node.name for nc in build_space(captured, mesh).nodes if nc.node.target is SDPA]
    back = Plan.from_json(plan.to_json())
    assert back.context_parallel == cp and json.loads(plan.to_json())["context_parallel"]["kind"] == "ring"
    assert "context         ring attention" in plan.report() and "context parallel" in plan.to_html()
    older = json.loads(plan.to_json())
    del older["context_parallel"]   # files written before the field still load
    assert Plan.from_json(json.dumps(older)).context_parallel == cp
    unsplit = plan_captured(captured, mesh, PlanOptions(context_parallel=False, progress=False))
    assert unsplit.context_parallel is None and "context         none" in unsplit.report()


@slow
def test_ulysses_forced_through_compile_trains_as_one_device():
    """``autopar.compile(..., context_parallel={"axis": "x", "kind": "ulysses"})`` on 2 simulated
    ranks: every attention split by heads around all-to-alls; 3 AdamW steps equal one device's."""
    plan = check_training(CausalLM, 0, 0, (2,), local_runner,
                          {"context_parallel": {"axis": "x", "kind": "ulysses"}, "profile": None}, batches=_batches())
    assert plan.context_parallel is not None and plan.context_parallel.kind == "ulysses"


def test_torchtitans_context_parallel_hand_plans_are_candidates():
    """FSDP x CP (CP on the last axis) and FSDP x TP x CP (TP on the last, CP on the one before),
    where attention can be split there; costed as candidates, none where context parallelism is
    off."""
    mesh = MeshSpec((2, 2), ("dp", "cp"))
    assert [plan_name(mesh, roles) for roles in context_role_sets(mesh, {0, 1})] == [
        "fsdp(dp) x fsdp+cp(cp)", "fsdp+cp(dp) x tp(cp)"]
    cube = MeshSpec((2, 2, 2), ("dp", "cp", "tp"))
    assert [plan_name(cube, roles) for roles in context_role_sets(cube, {1})] == ["fsdp(dp) x fsdp+cp(cp) x tp(tp)"]
    assert context_role_sets(mesh, set()) == []
    batch, line = _batches(1, batch=1)[0][0], MeshSpec((2,), ("cp",))
    plan = candidates(CausalLM(), line, batch, profile=None, progress=False, names=["fsdp+cp"])["fsdp+cp"]
    assert plan.context_parallel is not None and plan.context_parallel.kind == "ring"
    assert all(isinstance(n.storage[0], Shard) for n in plan.nodes if n.op == "parameter")   # FSDP on that axis
    off = candidates(CausalLM(), line, batch, profile=None, progress=False, context_parallel=False)
    assert "fsdp+cp" not in off and all(p.context_parallel is None for p in off.values())


@slow
def test_a_long_sequences_causal_mask_is_held_once_not_per_recomputed_block():
    """Llama at 4200 tokens on meta (its mask past ``from_shapes.LIMIT``): attention may split by
    sequence, and the mask, computed once (folded; an assert reading it does not keep it), is no
    input a recomputed block keeps: 32 Llama-3 8B blocks kept 64 GiB of mask each at 256k tokens."""
    from autopar.planning.problem import prepare

    model, args, kwargs = meta_model("llama-tiny", 1, 4200)
    captured = capture(model, args, kwargs)
    planning = prepare(captured, MeshSpec((4,), ("cp",), hardware="h100-80gb"), recompute="full")
    attention = [nc for nc in planning.space.nodes if nc.node.target is SDPA]
    assert attention and all(any("context-ring" in s.names for s in nc.strategies) for nc in attention)
    masks = {nc.node.args[3] for nc in attention}
    assert len(masks) == 1 and masks.pop().name in planning.space.folded
    assert all(3 not in planning.model._block_inputs[nc.node] for nc in attention)


# ---------------------------------------------------------------- the models as built, forced

CP_MODELS = ("gpt-tiny", "llama-tiny", "gpt2-tiny")
CP_SEQ = 32   # 8 tokens a rank on 4 ranks


def _forced_plan(name: str, mesh: MeshSpec, batches: list, kind: str, axis: str = "cp") -> str:
    """``name`` planned for ``batches[0]`` with attention forced to ``kind`` on ``axis``, as JSON."""
    args, kwargs = batches[0]
    plan = autopar.plan(build(name), mesh, args, kwargs, context_parallel={"axis": axis, "kind": kind},
                        profile=None, progress=False)
    assert plan.context_parallel is not None and plan.context_parallel.kind == kind, (name, kind)
    return plan.to_json()


def _train_each(mesh, cases: list[tuple[str, str, list]]) -> list[tuple[list[float], dict]]:
    """On every rank: each (model, plan JSON, batches) compiled and trained; its losses and whole state."""
    out = []
    for name, text, batches in cases:
        args, kwargs = batches[0]
        pmodel = autopar.compile(build(name), mesh, args, kwargs, plan=Plan.from_json(text))
        out.append(([float(l) for l in train_steps(pmodel, batches)], autopar.full_state_dict(pmodel)))
    return out


def _check_as_one_device(label: str, name: str, batches: list, losses: list[float], state: dict,
                         precision: str = "fp32") -> None:
    rtol, loss_atol, atol = TOLERANCES[precision]
    ref_losses, ref_state = train_reference(name, batches, precision)
    assert losses == pytest.approx(ref_losses, rel=rtol, abs=loss_atol), f"{label}: losses"
    assert state.keys() == ref_state.keys(), label
    for key, want in ref_state.items():
        torch.testing.assert_close(state[key], want, rtol=rtol, atol=atol, msg=lambda m, key=key: f"{label} {key}: {m}")


@pytest.mark.parametrize("n", [2, 4])
@slow
def test_models_as_built_with_attention_forced_by_sequence_train_as_one_device_on_gloo(n):
    """gpt-tiny, HF Llama and HF GPT-2 as built, causal, attention forced to the ring and to
    Ulysses over ``n`` gloo processes (one launch trains every plan in turn), and on 2 a padded
    batch (labels -100) under the ring: 3 AdamW steps equal one device's on every rank."""
    mesh = MeshSpec((n,), ("cp",))
    cases = [(name, kind, make_batches(name, 2, CP_SEQ)) for name in CP_MODELS for kind in ("ring", "ulysses")]
    if n == 2:
        cases.append(("gpt2-tiny", "ring", padded_batches("gpt2-tiny")))
    plans = [(name, _forced_plan(name, mesh, batches, kind), batches) for name, kind, batches in cases]
    results = run_on_gloo_mesh(_train_each, mesh.shape, plans, axis_names=mesh.axis_names,
                               start_method="forkserver", timeout_s=600)
    for k, (name, kind, batches) in enumerate(cases):
        for r, per_plan in enumerate(results):
            _check_as_one_device(f"{name} {kind} rank {r}/{n}", name, batches, *per_plan[k])


def _ulysses_beside_batch(name: str, mesh: MeshSpec, batches: list) -> str:
    """``name`` with every attention split by batch on the first axis and by Ulysses on the second."""
    captured = capture(build(name), *batches[0])
    space = build_space(captured, mesh)
    forced = {nc.node.name: next(s for s in nc.strategies if s.names == ("batch", "context-ulysses"))
              for nc in space.nodes if nc.node.target is SDPA}
    return plan_captured(captured, mesh, PlanOptions(profile=None, progress=False), forced=forced).to_json()


def _hand_plan(name: str, mesh: MeshSpec, batches: list, which: str) -> str:
    plan = candidates(build(name), mesh, *batches[0], profile=None, progress=False, names=[which])[which]
    assert plan.context_parallel is not None and plan.context_parallel.kind == "ring", which
    return plan.to_json()


@pytest.mark.parametrize("presolve", [True, False])
def test_a_context_hand_plan_runs_its_rings_in_one_layout_however_ties_fall(presolve, monkeypatch):
    """Each attention of a context-parallel hand plan picks its ring's layout, so where they cost
    alike the solver may mix them (HiGHS without presolve does, on gpt-tiny): the hand plan is then
    solved again with its rings contiguous, as the planner's own plan is, and runs."""
    from ortools.math_opt import parameters_pb2

    from autopar.core.seq_layout import plan_layout
    from solver import ilp

    real = ilp.solve_proto
    if not presolve:   # the same problems, their ties broken another way
        monkeypatch.setattr(ilp, "solve_proto", lambda model, kind, params, *rest: (
            params.__setattr__("presolve", parameters_pb2.EMPHASIS_OFF), real(model, kind, params, *rest))[1])
    mesh = MeshSpec((2, 2), ("a", "b"))
    args, kwargs = make_batches("gpt-tiny", 2, CP_SEQ, steps=1)[0]
    which = "fsdp(a) x fsdp+cp(b)"
    plan = candidates(build("gpt-tiny"), mesh, args, kwargs, profile=None, progress=False, names=[which])[which]
    assert plan.context_parallel is not None and plan.context_parallel.kind == "ring"
    plan_layout(capture(build("gpt-tiny"), args, kwargs), plan)


@slow
def test_models_as_built_split_by_sequence_beside_data_or_tensor_parallelism_on_2x2():
    """On a 2 x 2 mesh of gloo processes, one launch: each model with its attention split by
    sequence on the second axis and data parallel on the first (torchtitan's FSDP x CP with the
    ring; Ulysses with attention split by batch beside it), and gpt-tiny with the ring on the first
    axis and tensor parallelism on the second (FSDP x TP x CP): every rank as one device."""
    mesh = MeshSpec((2, 2), ("a", "b"))
    cases, plans = [], []
    for name in CP_MODELS:
        batches = make_batches(name, 2, CP_SEQ)
        cases += [(f"{name} fsdp x ring", name, batches), (f"{name} batch x ulysses", name, batches)]
        plans += [_hand_plan(name, mesh, batches, "fsdp(a) x fsdp+cp(b)"), _ulysses_beside_batch(name, mesh, batches)]
    batches = make_batches("gpt-tiny", 2, CP_SEQ)
    cases.append(("gpt-tiny ring x tp", "gpt-tiny", batches))
    plans.append(_hand_plan("gpt-tiny", mesh, batches, "fsdp+cp(a) x tp(b)"))
    trained = [(name, text, b) for (_, name, b), text in zip(cases, plans, strict=True)]
    results = run_on_gloo_mesh(_train_each, mesh.shape, trained, axis_names=mesh.axis_names, start_method="forkserver", timeout_s=600)
    for k, (label, name, batches) in enumerate(cases):
        for r, per_plan in enumerate(results):
            _check_as_one_device(f"{label} rank {r}", name, batches, *per_plan[k])


@slow
def test_attention_split_by_sequence_trains_in_bf16_and_inside_pipeline_stages():
    """HF Llama as built: the ring and Ulysses forced over 2 gloo processes in bf16 (against one
    device in bf16), and a pipeline of 2 stages whose rings run over the other axis of 2 x 2
    (fp32): every rank as one device, each launch training its plans in turn."""
    name = "llama-tiny"
    batches = make_batches(name, 2, CP_SEQ)
    half, kinds = MeshSpec((2,), ("cp",)), ("ring", "ulysses")
    plans = [(name, autopar.plan(build(name), half, *batches[0], profile=None, progress=False, precision="bf16",
                                 context_parallel={"axis": "cp", "kind": kind}).to_json(), batches)
             for kind in kinds]
    results = run_on_gloo_mesh(_train_each, half.shape, plans, axis_names=half.axis_names, start_method="forkserver",
                               timeout_s=600)
    for k, kind in enumerate(kinds):
        for r, per_plan in enumerate(results):
            _check_as_one_device(f"bf16 {kind} rank {r}", name, batches, *per_plan[k], precision="bf16")
    staged = MeshSpec((2, 2), ("pp", "cp"))
    batches = make_batches(name, 4, CP_SEQ)
    plan = autopar.plan(build(name), staged, *batches[0], profile=None, progress=False,
                        pipeline={"axis": "pp", "microbatches": 2}, context_parallel={"axis": "cp", "kind": "ring"})
    assert plan.pipeline is not None and plan.context_parallel is not None
    results = run_on_gloo_mesh(_train_each, staged.shape, [(name, plan.to_json(), batches)],
                               axis_names=staged.axis_names, start_method="forkserver", timeout_s=600)
    for r, (trained,) in enumerate(results):
        _check_as_one_device(f"pipeline x ring rank {r}", name, batches, *trained)


def test_a_sequence_the_axis_cannot_split_evenly_is_refused_saying_how_to_pad_it():
    """15 tokens forced onto 2 ranks: refused when planned, saying the length and the padding that fits."""
    args, kwargs = make_batches("llama-tiny", 2, 15, steps=1)[0]
    for kind in ("ring", "ulysses"):
        with pytest.raises(AutoparError, match="its sequence of 15 does not split into 2 equal parts: pad it to 16 "
                                               "tokens .* labels -100"):
            autopar.plan(build("llama-tiny"), MeshSpec((2,), ("cp",)), args, kwargs,
                         context_parallel={"axis": "cp", "kind": kind}, profile=None, progress=False)


@slow
def test_ulysses_beside_tensor_parallelism_trains_as_one_device_on_simulated_2x2():
    """HF GPT-2 as built, every attention split by sequence as Ulysses on the first axis and by
    heads (tensor parallelism) on the second, on 4 simulated ranks (the all-to-alls are
    collectives, so LocalTensorMode runs them as gloo would): 3 AdamW steps equal one device's.
    Each rank's 2 heads are regrouped over the Ulysses axis, one a rank."""
    name = "gpt2-tiny"
    batches = make_batches(name, 2, CP_SEQ)
    captured = capture(build(name), *batches[0])
    mesh = MeshSpec((2, 2))
    space = build_space(captured, mesh)
    forced = {nc.node.name: next(s for s in nc.strategies if s.names == ("context-ulysses", "heads"))
              for nc in space.nodes if nc.node.target is SDPA}
    assert forced
    plan = plan_captured(captured, mesh, PlanOptions(profile=None, progress=False), forced=forced)
    assert plan.context_parallel is not None and plan.context_parallel.kind == "ulysses"
    check_training(name, 2, CP_SEQ, (2, 2), local_runner, {"plan": plan}, batches=batches)


# ---------------------------------------------------------------- the balanced layout of a causal ring

BALANCED = {"kind": "ring", "load_balance": "balanced"}


def test_the_balanced_ring_is_offered_for_causal_attention_of_2n_equal_chunks_only():
    """Causal and 8 positions on 2 ranks (4 chunks): offered; 6 positions (not 4 equal chunks) or
    no mask (nothing to balance): not; forced where it cannot run, refused saying why."""
    causal = lambda q, k, v: F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, is_causal=True)  # noqa: E731
    qkv = lambda seq: tuple(torch.randn(2, 2, seq, 4) for _ in range(3))  # noqa: E731
    assert "context-ring-balanced" in _sdpa_rules(_Fn(causal), qkv(8))
    assert "context-ring-balanced" not in _sdpa_rules(_Fn(causal), qkv(6))
    open_ = lambda q, k, v: F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0)  # noqa: E731
    assert "context-ring-balanced" not in _sdpa_rules(_Fn(open_), qkv(8))
    mesh = MeshSpec((2,), ("cp",))
    assert _restricted(_Fn(causal), qkv(8), mesh, {"axis": "cp", **BALANCED}) == {"context-ring-balanced"}
    assert _restricted(_Fn(causal), qkv(8), mesh, {"axis": "cp", "kind": "ring", "load_balance": "contiguous"}) == {
        "context-ring"}
    with pytest.raises(AutoparError, match="does not cut into 4 equal chunks .* pad it to 8 tokens"):
        _restricted(_Fn(causal), qkv(6), mesh, {"axis": "cp", **BALANCED})
    with pytest.raises(AutoparError, match="not causal"):
        _restricted(_Fn(open_), qkv(8), mesh, {"axis": "cp", **BALANCED})
    for bad in ({"axis": "cp", "kind": "ulysses", "load_balance": "balanced"}, {"load_balance": "zigzag"}):
        with pytest.raises(AutoparError, match="load_balance"):
            PlanOptions(context_parallel=bad)
    args = build_parser().parse_args(["plan", "--model", "gpt-tiny", "--mesh", "2", "--context-parallel", "ring:cp:balanced"])
    assert _plan_options(args).context_parallel == ContextChoice("cp", "ring", "balanced")


def test_a_balanced_ring_is_priced_below_the_contiguous_rings_busiest_rank_and_chosen():
    """Llama at 2048 tokens on 4 ranks, the ring forced: in the contiguous layout its last rank
    computes 3.5 blocks' work (3 earlier blocks, its own half-masked), balanced every rank 2 (half
    of each other block, its own half-masked); the search picks balanced, its step predicted
    faster, and the plan's JSON and report say so."""
    model, args, kwargs = meta_model("llama-tiny", 1, 2048)
    captured = capture(model, args, kwargs)
    mesh = MeshSpec((4,), ("cp",))
    plans = {lb: plan_captured(captured, mesh, PlanOptions(context_parallel={"axis": "cp", "kind": "ring"} | (
        {"load_balance": lb} if lb else {}), profile=None, progress=False)) for lb in (None, "balanced", "contiguous")}
    attention = {lb: [n.compute_s for n in p.nodes if n.op == str(SDPA)] for lb, p in plans.items()}
    assert attention["balanced"] == pytest.approx([c * 2 / 3.5 for c in attention["contiguous"]], rel=0.05)
    assert plans[None].context_parallel.load_balance == "balanced"
    assert plans["balanced"].predicted.step_time_s < plans["contiguous"].predicted.step_time_s
    back = Plan.from_json(plans[None].to_json())
    assert back.context_parallel == plans[None].context_parallel
    assert json.loads(plans[None].to_json())["context_parallel"]["load_balance"] == "balanced"
    assert "balanced layout" in plans[None].report()


def test_a_balanced_ring_trains_as_one_device_on_simulated_ranks():
    """CausalLM (learned positions of ``arange``, labels read whole) with its ring balanced on 2
    simulated ranks: the inputs and positions are permuted where split, the logits put back in
    order where gathered; 3 AdamW steps equal one device's."""
    batches = _batches()
    plan = check_training(CausalLM, 0, 0, (2,), local_runner, {"context_parallel": {"axis": "x", **BALANCED},
                                                                "profile": None}, batches=batches)
    assert plan.context_parallel is not None and plan.context_parallel.load_balance == "balanced"
    source = generate(capture(build(CausalLM), *batches[0]), plan).source
    assert "layout='balanced'" in source and "move_balanced(arange" in source
    # the ids permuted where split: as they come in, or moved later (the two cost alike here)
    assert "ids = balance(ids" in source or "move_balanced(ids" in source


def _balanced_plan(name: str, mesh: MeshSpec, batches: list, axis: str = "cp") -> str:
    args, kwargs = batches[0]
    plan = autopar.plan(build(name), mesh, args, kwargs, context_parallel={"axis": axis, **BALANCED},
                        profile=None, progress=False)
    assert plan.context_parallel is not None and plan.context_parallel.load_balance == "balanced", name
    return plan.to_json()


@pytest.mark.parametrize("n", [2, 4])
@slow
def test_models_as_built_with_a_balanced_ring_train_as_one_device_on_gloo(n):
    """gpt-tiny, HF Llama and HF GPT-2 as built, causal, their rings balanced over ``n`` gloo
    processes (point-to-point, each rank chunks r and 2n-1-r; one launch trains every model):
    3 AdamW steps equal one device's on every rank."""
    mesh = MeshSpec((n,), ("cp",))
    cases = [(name, make_batches(name, 2, CP_SEQ)) for name in CP_MODELS]
    plans = [(name, _balanced_plan(name, mesh, batches), batches) for name, batches in cases]
    results = run_on_gloo_mesh(_train_each, mesh.shape, plans, axis_names=mesh.axis_names,
                               start_method="forkserver", timeout_s=600)
    for k, (name, batches) in enumerate(cases):
        for r, per_plan in enumerate(results):
            _check_as_one_device(f"{name} balanced rank {r}/{n}", name, batches, *per_plan[k])


@slow
def test_models_as_built_with_a_balanced_ring_beside_data_parallelism_train_as_one_device_on_2x2():
    """torchtitan's FSDP x CP hand plan with the ring balanced (data parallel on the first axis,
    the sequence over the second), for each model, on 4 gloo processes: every rank as one device."""
    mesh = MeshSpec((2, 2), ("a", "b"))
    cases = [(name, make_batches(name, 2, CP_SEQ)) for name in CP_MODELS]
    plans = []
    for name, batches in cases:
        plan = candidates(build(name), mesh, *batches[0], profile=None, progress=False,
                          context_parallel={"load_balance": "balanced"}, names=["fsdp(a) x fsdp+cp(b)"])["fsdp(a) x fsdp+cp(b)"]
        assert plan.context_parallel is not None and plan.context_parallel.load_balance == "balanced", name
        plans.append((name, plan.to_json(), batches))
    results = run_on_gloo_mesh(_train_each, mesh.shape, plans, axis_names=mesh.axis_names,
                               start_method="forkserver", timeout_s=600)
    for k, (name, batches) in enumerate(cases):
        for r, per_plan in enumerate(results):
            _check_as_one_device(f"{name} fsdp x balanced ring rank {r}", name, batches, *per_plan[k])


class PositionsParamLM(nn.Module):
    """Learned positions as a parameter the length of the sequence, added to the embeddings (as
    ViT adds its ``pos_embed``): split by sequence, the parameter is read split beside it."""

    def __init__(self, seq: int, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Parameter(torch.randn(seq, dim))
        self.qkv, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        x = self.tok(ids) + self.pos
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        return F.cross_entropy(self.head(x + y).view(-1, VOCAB), labels.view(-1))


def test_a_pipeline_plans_its_rings_contiguous_in_one_search():
    """A pipeline stage holds no balanced ring (``seq_layout``): the stages are planned with
    contiguous rings from the start. They were planned balanced and the whole search run again,
    which DeepSeek-V2-Lite on 8x8 began with its 60 s spent: ``PlanningTimeout``, no plan."""
    model, args, kwargs = meta_model("llama-tiny", 2, 2048)
    plan = autopar.plan(model, MeshSpec((2, 2), ("pp", "cp")), args, kwargs, profile=None, progress=False,
                        pipeline={"axis": "pp", "microbatches": 2}, context_parallel={"axis": "cp", "kind": "ring"})
    assert plan.pipeline is not None and plan.context_parallel.load_balance == "contiguous"
    assert not any("balanced layout was refused" in w for w in plan.warnings)
    off = autopar.plan(model, MeshSpec((2, 2), ("pp", "cp")), args, kwargs, profile=None, progress=False,
                       pipeline={"axis": "pp", "microbatches": 2}, context_parallel=False)
    assert off.pipeline is not None and off.context_parallel is None   # none asked: none planned


def test_where_the_balanced_order_cannot_hold_the_ring_is_planned_contiguous_or_refused_if_forced():
    """A parameter split over the ring's axis beside the sequence would be read in the contiguous
    order: forced balanced, refused naming it; left to the search (which prefers balanced at 2048
    tokens), planned again contiguous, saying why."""
    seq = 2048
    ids, labels = (torch.randint(0, VOCAB, (1, seq)) for _ in range(2))
    captured = capture(PositionsParamLM(seq), (ids, labels))
    mesh = MeshSpec((2,), ("cp",))
    with pytest.raises(AutoparError, match="reaches p_pos .* a parameter or buffer split over the ring's axis"):
        plan_captured(captured, mesh, PlanOptions(context_parallel={"axis": "cp", **BALANCED}, profile=None, progress=False))
    plan = plan_captured(captured, mesh, PlanOptions(context_parallel={"axis": "cp", "kind": "ring"}, profile=None,
                                                     progress=False))
    assert plan.context_parallel is not None and plan.context_parallel.load_balance == "contiguous"
    assert any("the balanced layout was refused" in w and "p_pos" in w for w in plan.warnings)


def test_a_balanced_ring_refused_with_no_time_left_to_plan_it_contiguous_says_what_to_do(monkeypatch):
    """Where the search that replaces a refused balanced ring finds no time left, the timeout
    says why the search ran twice and how to plan it once."""
    import autopar.planning.planner as planner

    seq = 2048
    ids, labels = (torch.randint(0, VOCAB, (1, seq)) for _ in range(2))
    captured = capture(PositionsParamLM(seq), (ids, labels))
    searched = planner._planned

    def second_late(*args, **kwargs):
        if context_choice(args[2].context_parallel).load_balance == "contiguous":
            raise PlanningTimeout("no time was left")
        return searched(*args, **kwargs)

    monkeypatch.setattr(planner, "_planned", second_late)
    with pytest.raises(PlanningTimeout, match="balanced.*p_pos.*ran out of time.*'load_balance': 'contiguous'"):
        plan_captured(captured, MeshSpec((2,), ("cp",)), PlanOptions(context_parallel={"axis": "cp", "kind": "ring"},
                                                                       profile=None, progress=False))


@slow
def test_a_balanced_ring_trains_as_one_device_with_microbatches_and_recomputation():
    """HF Llama as built, its ring balanced on 2 simulated ranks, 2 microbatches a step and every
    block recomputed (the recomputed forward permutes as the first did): 3 AdamW steps equal one
    device's."""
    batches = make_batches("llama-tiny", 4, CP_SEQ)
    plan = check_training("llama-tiny", 0, 0, (2,), local_runner, {
        "context_parallel": {"axis": "x", **BALANCED}, "profile": None, "microbatches": 2, "recompute": "full"},
        batches=batches)
    assert plan.context_parallel.load_balance == "balanced" and plan.microbatches == 2 and plan.recompute


def _logits_each(mesh, name: str, texts: list[str], batches: list) -> list[torch.Tensor]:
    """On every rank: the logits of ``batches[0]`` under each plan, whole (a plan keeping outputs
    sharded: its DTensor's ``full_tensor()``)."""
    args, kwargs = batches[0]
    out = []
    for text in texts:
        plan = Plan.from_json(text)
        logits = autopar.compile(build(name), mesh, args, kwargs, plan=plan)(*args, **kwargs).logits
        out.append((logits if plan.gather_outputs else logits.full_tensor()).detach().clone())
    return out


@slow
def test_a_balanced_rings_outputs_come_back_in_sequence_order():
    """HF Llama's logits under a balanced ring on 2 gloo processes, gathered when read (and kept
    sharded, then gathered by the reader): one device's, in sequence order."""
    name, mesh = "llama-tiny", MeshSpec((2,), ("cp",))
    batches = make_batches(name, 2, CP_SEQ, steps=1)
    args, kwargs = batches[0]
    texts = [autopar.plan(build(name), mesh, args, kwargs, context_parallel={"axis": "cp", **BALANCED}, profile=None,
                          progress=False, gather_outputs=gather).to_json() for gather in (True, False)]
    assert all(Plan.from_json(t).context_parallel.load_balance == "balanced" for t in texts)
    want = build(name)(*args, **kwargs).logits.detach()
    results = run_on_gloo_mesh(_logits_each, mesh.shape, name, texts, batches, axis_names=mesh.axis_names,
                               start_method="forkserver", timeout_s=600)
    for r, per_plan in enumerate(results):
        for got, gather in zip(per_plan, (True, False), strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m, r=r, g=gather: f"rank {r} {g}: {m}")

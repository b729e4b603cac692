"""Expert parallelism: a mixture-of-experts layer split by expert over the ranks of a group.

Rank r of n holds experts ``[r*E/n, (r+1)*E/n)``. Each rank routes its own tokens: ``dispatch``
sends every (token, choice) pair to the rank of its expert by an all-to-all and hands back the
received rows grouped by local expert (contiguous, for a grouped GEMM); the local experts run on
them; ``combine`` sends the results back by the reverse all-to-all and sums each token's k
results weighted by its router weights. Exact for any routing: an expert, or a whole rank, may
receive no tokens, and nothing is dropped (no capacity factor).

Counts travel first: each rank sends every other the number of its pairs per expert there
(an even all-to-all of ``[n, E/n]`` integers), so both ends know the uneven split sizes of the
token all-to-all, and the receiver knows which rows belong to which local expert. The split
sizes (and the ids' range, checked) are read on the host: ``dispatch`` syncs with the device.

Backward needs no code of its own: the token all-to-alls are ``_functional_collectives``'
``all_to_all_single``, which in torch 2.13 carries autograd (its backward is the all-to-all
with the split sizes swapped, uneven ones included), and the permutations are indexing, whose
backward scatters (summing a token's k gradients). Gradients reach the tokens, the router
weights (through ``combine``'s weighting) and the experts' parameters.

How transformers 5 builds the block. ``MixtralSparseMoeBlock`` (also OLMoE's; Qwen2-MoE's adds
a gated shared expert beside it) is ``gate`` (``MixtralTopKRouter``: ``linear`` to logits,
``softmax`` in fp32, ``topk``, top values renormalised to sum to 1) then ``experts``
(``MixtralExperts``: fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] parameters,
its forward picked by ``@use_experts_implementation`` from ``config._experts_implementation``
through transformers' ``ALL_EXPERTS_FUNCTIONS`` registry: "grouped_mm" by default, "batched_mm",
or "eager", a Python loop over the experts hit, which export refuses). Exported as it is, the
default gives some twenty nodes per layer (sort by expert, gather, ``histc`` and ``cumsum`` to
offsets, two grouped matmuls, an inverse permutation written in place, a sum over k) that no
sharding rule can split by expert. So capture exports under ``experts_as_one_op``, which points
the registry's implementations at ``moe_experts``, one custom op per layer (the router stays as
it is); ``autopar.core.ops.moe`` says how that op splits, and runs it split by expert with
``routed_experts`` over an axis's group.
"""
from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

from autopar.core.errors import AutoparError

# (rows grouped by local expert, rows per local expert) -> one output row per input row
ExpertsFn = Callable[[torch.Tensor, list[int]], torch.Tensor]
# (global expert id, that expert's rows) -> its output rows
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Dispatched:
    """What ``dispatch`` delivered to this rank and what ``combine`` needs to send it back.

    ``tokens`` holds the rows of local expert 0, then of local expert 1, ... (``counts`` rows
    each; global id of local expert i is ``first_expert + i``), each expert's rows in
    source-rank order. The rest is the bookkeeping of the two permutations and the splits.
    """

    tokens: torch.Tensor             # [received rows, H], grouped by local expert
    counts: list[int]                # rows per local expert
    first_expert: int                # global id of local expert 0
    group: dist.ProcessGroup | None  # None: one rank, nothing communicated
    unsort: torch.Tensor             # send order -> (token, choice) order, [T*k]
    ungroup: torch.Tensor            # expert-major rows -> received (source-major) order
    sent: list[int]                  # rows sent to each rank
    received: list[int]              # rows received from each rank


def _size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size(), group.rank())


def experts_per_rank(num_experts: int, ranks: int) -> int:
    """E/n, checked: experts split contiguously and evenly over the ranks."""
    if ranks < 1 or num_experts % ranks:
        raise AutoparError(f"{num_experts} experts cannot split evenly over {ranks} ranks: expert parallelism "
                           "needs a group whose size divides the number of experts")
    return num_experts // ranks


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The permutation undoing ``perm`` (``x[perm][_inverse(perm)] == x``)."""
    return torch.argsort(perm)   # (no arange of a size: under LocalTensorMode sizes differ by rank)


def _all_to_all(x: torch.Tensor, received: list[int], sent: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows ``x`` split by ``sent`` to the ranks; the rows each rank sent here, by ``received``.
    Autograd-aware: its backward is the same exchange with the splits swapped."""
    if group is None:
        return x
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), received, sent, group))


def _exchange_counts(per_expert: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[n, E/n] counts of this rank's pairs per expert (row r: rank r's experts) -> [n, E/n]
    counts of the pairs each rank sends to this rank's experts (row s: from rank s)."""
    if group is None:
        return per_expert
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert, group=group)
    return received


def _check_routing(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> None:
    if tokens.dim() != 2 or expert_ids.dim() != 2 or expert_ids.size(0) != tokens.size(0):
        raise AutoparError(f"dispatch takes tokens [T, H] and expert ids [T, k]; got shapes {tuple(tokens.shape)} "
                           f"and {tuple(expert_ids.shape)}")
    if expert_ids.numel():
        low, high = torch.stack(expert_ids.aminmax()).tolist()
        if low < 0 or high >= num_experts:
            raise AutoparError(f"expert ids must lie in [0, {num_experts}); got ids from {low} to {high}")


def dispatch(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
             group: dist.ProcessGroup | None) -> Dispatched:
    """Send this rank's tokens [T, H] to the ranks holding their top-k experts (``expert_ids``
    [T, k], global ids); receive the rows for this rank's experts, grouped by expert.

    Pairs are sorted by global expert (stable), which also groups them by destination rank;
    each source's rows arrive grouped by local expert, and a stable sort by expert makes each
    expert's rows contiguous over all sources. ``group`` None is one rank (no communication).
    """
    n, rank = _size_rank(group)
    local = experts_per_rank(num_experts, n)
    _check_routing(tokens, expert_ids, num_experts)
    flat = expert_ids.reshape(-1)
    per_expert = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)
    outgoing = tokens[order // expert_ids.size(1)]
    incoming = _exchange_counts(per_expert.view(n, local), group)   # [source rank, local expert]
    sizes = torch.cat([per_expert.view(n, local).sum(1), incoming.sum(1), incoming.sum(0)]).tolist()   # one sync
    sent, received, counts = sizes[:n], sizes[n:2 * n], sizes[2 * n:]
    rows = _all_to_all(outgoing, received, sent, group)
    expert_of_row = torch.arange(local, device=rows.device).repeat(n).repeat_interleave(incoming.flatten())
    regroup = torch.argsort(expert_of_row, stable=True)
    return Dispatched(rows[regroup], counts, rank * local, group, _inverse(order), _inverse(regroup), sent, received)


def combine(expert_out: torch.Tensor, dispatched: Dispatched, weights: torch.Tensor) -> torch.Tensor:
    """[T, H'] for this rank's tokens: the experts' outputs (one row per row of
    ``dispatched.tokens``) sent back, weighted by the router ``weights`` [T, k] and summed over
    the k choices. The products are summed in the wider of the two dtypes, as transformers does,
    and the result has the experts' dtype."""
    d = dispatched
    if expert_out.size(0) != d.tokens.size(0):
        raise AutoparError(f"the experts returned {expert_out.size(0)} rows for {d.tokens.size(0)} dispatched rows")
    if weights.dim() != 2 or weights.numel() != d.unsort.numel():
        raise AutoparError(f"router weights must be [T, k] with T*k = {d.unsort.numel()}; got {tuple(weights.shape)}")
    returned = _all_to_all(expert_out[d.ungroup], d.sent, d.received, d.group)
    pairs = returned[d.unsort].view(*weights.shape, returned.size(-1))
    return (pairs * weights.unsqueeze(-1)).sum(1).to(expert_out.dtype)


def expert_parallel_moe(tokens: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                        experts: ExpertsFn, num_experts: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The MoE layer's output for this rank's tokens: ``dispatch``, this rank's ``experts`` on the
    received rows (grouped by local expert, with their counts), ``combine``."""
    d = dispatch(tokens, expert_ids, num_experts, group)
    return combine(experts(d.tokens, d.counts), d, weights)


#: The experts' activations: applied to the gate of a gated MLP (``down(act(gate x) * up x)``,
#: ``gate_up`` [2I, H]: SwiGLU with "silu", GeGLU with "gelu") or to the whole of a plain one
#: (``down(act(up x))``, ``gate_up`` [I, H]); which of the two from the weights' shapes (``gated``).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "relu": F.relu}
#: Gates taken from a model's experts class at capture (``_activation_of``), by the name the op's
#: ``activation`` gives them: a function of the up projection's rows [.., 2I or I] to [.., I]
#: (transformers' ``_apply_gate`` where a class has its own, e.g. gpt-oss's clamped, interleaved
#: SwiGLU; or an activation of its own). Per process: each rank captures, and so registers, its own.
GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


@functools.cache
def gate_kept(activation: str, fused: int) -> int:
    """Values per row that autograd keeps of a gate captured from a model (``GATES[activation]``)
    and of the down projection reading it, on rows of ``fused`` up-projection values (2I or I):
    counted by running it on a few rows, each storage once (SwiGLU's default gate keeps 4I: the
    fused rows, the activation and the product)."""
    rows, kept = 2, {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    # real tensors on the CPU, whatever mode or default device the caller planned under
    with maybe_disable_local_tensor_mode(), unset_fake_temporarily(), torch.device("cpu"), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
        gated_rows = GATES[activation](torch.randn(rows, fused, requires_grad=True))
        down = torch.zeros(1, gated_rows.shape[-1], requires_grad=True)
        F.linear(gated_rows, down)
    kept.pop(down.untyped_storage().data_ptr(), None)
    return sum(kept.values()) // rows


def gated(gate_up: torch.Size | tuple[int, ...], down: torch.Size | tuple[int, ...]) -> bool:
    """Are experts ``gate_up`` [.., 2I, H] and ``down`` [.., H, I] a gated MLP (else [.., I, H])?"""
    return gate_up[-2] == 2 * down[-1]


def _activated(inner: torch.Tensor, gated_mlp: bool, activation: str) -> torch.Tensor:
    """Rows of the first product [.., 2I or I] through the experts' activation (row by row): a
    model's own gate, or ``act(gate) * up`` (gated), or ``act``."""
    if activation in GATES:
        return GATES[activation](inner)
    act = ACTIVATIONS[activation]
    if gated_mlp:
        gate, up = inner.chunk(2, dim=-1)
        return act(gate) * up
    return act(inner)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, activation: str = "silu",
               gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert on its rows ``x``: ``gate_up`` [2I, H] (gate rows first) or [I, H], ``down`` [H, I],
    each with its bias where given."""
    inner = F.linear(x, gate_up, gate_up_bias)
    return F.linear(_activated(inner, gated(gate_up.shape, down.shape), activation), down, down_bias)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert in transformers' fused layout: ``gate_up`` [2I, H] (gate rows first),
    ``down`` [H, I]."""
    return expert_mlp(x, gate_up, down, "silu")


def grouped_experts(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                    activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Experts on rows grouped by expert (``counts`` rows for each of ``gate_up`` [E, 2I or I, H]
    and ``down`` [E, H, I], and their biases [E, 2I or I], [E, H] where given): an ``ExpertsFn``.
    An expert without rows gets zero gradients."""
    if len(counts) != gate_up.size(0) or gate_up.size(0) != down.size(0):
        raise AutoparError(f"{len(counts)} row counts for {gate_up.size(0)} gate_up and {down.size(0)} down experts")
    if _grouped_mm_runs(x, gate_up, down, gate_up_bias, down_bias):
        return _grouped_mm_experts(x, counts, gate_up, down, activation)
    return looped_experts(x, counts, gate_up, down, activation, gate_up_bias, down_bias)


def looped_experts(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                   activation: str, gate_up_bias: torch.Tensor | None,
                   down_bias: torch.Tensor | None) -> torch.Tensor:
    """``grouped_experts`` one expert after another. The weights are unbound, not indexed: the
    backward of ``gate_up[e]`` is a zero tensor the size of all the experts for each expert
    (quadratic in their number), unbind's one stack of their gradients."""
    ups, downs = gate_up.unbind(0), down.unbind(0)
    up_biases, down_biases = (([None] * len(counts)) if b is None else b.unbind(0) for b in (gate_up_bias, down_bias))
    return torch.cat([expert_mlp(part, ups[e], downs[e], activation, up_biases[e], down_biases[e])
                      for e, part in enumerate(x.split(counts))])


def _grouped_mm_runs(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *biases: torch.Tensor | None) -> bool:
    """Does ``torch._grouped_mm`` take these experts, and gain: several of them (one runs faster as
    plain GEMMs), in bf16 on a CUDA GPU of compute capability 9 or more, every product's dimensions
    multiples of 8 (16 bytes), no biases? (It adds none: added after it, in bf16, they took
    outputs further from fp32 than the loop's linear, which adds them before rounding.)"""
    return (x.is_cuda and gate_up.size(0) > 1 and x.dtype == gate_up.dtype == down.dtype == torch.bfloat16
            and all(b is None for b in biases)
            and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and all(d % 8 == 0 for d in (*gate_up.shape[1:], *down.shape[1:])))


def _grouped_mm_experts(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor,
                        activation: str) -> torch.Tensor:
    """``grouped_experts`` without biases as two grouped GEMMs (every expert's rows in one kernel
    each, as transformers' "grouped_mm" experts run), not kernels an expert
    (``benchmarks/gpu_experts.py``)."""
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    inner = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(_activated(inner, gated(gate_up.shape, down.shape), activation),
                             down.transpose(-2, -1), offs=offs)


def grouped_swiglu(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert (``grouped_experts`` with SiLU)."""
    return grouped_experts(x, counts, gate_up, down, "silu")


def reference_moe(tokens: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, expert: ExpertFn,
                  num_experts: int) -> torch.Tensor:
    """The same layer on one device, written independently of dispatch/combine: for each expert,
    its tokens (found by mask), ``expert(e, rows)`` weighted by their router weights, added to
    the tokens' outputs. What expert-parallel results are checked against."""
    out = torch.zeros(tokens.shape, dtype=torch.promote_types(tokens.dtype, weights.dtype), device=tokens.device)
    for e in range(num_experts):
        rows, choice = (expert_ids == e).nonzero(as_tuple=True)
        if rows.numel():
            out = out.index_add(0, rows, expert(e, tokens[rows]) * weights[rows, choice].unsqueeze(-1))
    return out.to(tokens.dtype)


# ----------------------------------------------------------------------------
# The experts as one op, for capture
# ----------------------------------------------------------------------------


def routed_experts(hidden: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, group: dist.ProcessGroup | None = None, activation: str = "silu",
                   gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Experts (``expert_mlp``: transformers' SwiGLU ones with "silu") on this rank's tokens ``hidden``
    [T, H], routed by ``top_idx`` / ``top_w`` [T, k] (global expert ids, router weights) to experts
    ``gate_up`` [E', 2I or I, H] and ``down`` [E', H, I]: this rank's slice of the experts when
    ``group`` splits them by expert (``expert_parallel_moe``), else all of them. Computed in the
    experts' dtype, returned in the tokens', as ``grouped_mm_experts_forward`` does."""
    n = _size_rank(group)[0]
    out = expert_parallel_moe(hidden.to(gate_up.dtype), top_w, top_idx,
                              lambda rows, counts: grouped_experts(rows, counts, gate_up, down, activation,
                                                                   gate_up_bias, down_bias),
                              gate_up.size(0) * n, group)
    return out.to(hidden.dtype)


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """A mixture-of-experts layer's experts as one op (``routed_experts`` on one device): what
    capture records in place of the ops of transformers' experts implementations (and of a
    hand-written loop over experts: ``autopar.core.expert_lists``), so that the planner sees one
    node per MoE layer (``autopar.core.ops.moe`` says how it splits)."""
    if activation not in ACTIVATIONS and activation not in GATES:
        raise AutoparError(f"moe_experts' activation is one of {sorted(ACTIVATIONS)} or a gate this process captured "
                           f"from a model ({sorted(GATES)}); got {activation!r}")
    return routed_experts(hidden, top_idx, top_w, gate_up, down, None, activation, gate_up_bias, down_bias)


@moe_experts.register_fake
def _moe_experts_fake(hidden, top_idx, top_w, gate_up, down, activation="silu", gate_up_bias=None, down_bias=None):
    if hidden.dim() != 2 or top_idx.shape != top_w.shape or top_idx.size(0) != hidden.size(0):
        raise AutoparError(f"moe_experts takes hidden [T, H] and top-k ids and weights [T, k]; got "
                           f"{tuple(hidden.shape)}, {tuple(top_idx.shape)}, {tuple(top_w.shape)}")
    return hidden.new_empty(hidden.shape)


_TENSORS = (0, 1, 2, 3, 4, 6, 7)   # the op's tensor arguments (5: its activation)


def _keep_inputs(ctx, inputs, output) -> None:
    inputs = tuple(inputs) + (None,) * (8 - len(inputs))
    ctx.save_for_backward(*(inputs[i] for i in _TENSORS))
    ctx.activation = inputs[5] if inputs[5] is not None else "silu"


def _moe_experts_backward(ctx, grad: torch.Tensor) -> tuple:
    """Gradients by running ``routed_experts`` again under autograd (the op is opaque to it)."""
    needs = [ctx.needs_input_grad[i] if i < len(ctx.needs_input_grad) else False for i in _TENSORS]
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(ctx.saved_tensors, needs, strict=True)]
        wanted = [t for t, need in zip(leaves, needs, strict=True) if need and t is not None]
        hidden, top_idx, top_w, gate_up, down, gate_up_bias, down_bias = leaves
        out = routed_experts(hidden, top_idx, top_w, gate_up, down, None, ctx.activation, gate_up_bias, down_bias)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
    by_input = {i: next(grads) if need and t is not None else None
                for i, t, need in zip(_TENSORS, leaves, needs, strict=True)}
    return tuple(by_input.get(i) for i in range(len(ctx.needs_input_grad)))


torch.library.register_autograd("autopar::moe_experts", _moe_experts_backward, setup_context=_keep_inputs)


#: transformers' activation classes by the name ``ACTIVATIONS`` gives their function.
_KNOWN_ACTS = {"SiLU": "silu", "SiLUActivation": "silu", "GELU": "gelu", "GELUActivation": "gelu",
               "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
               "ReLU": "relu"}


def _interface_args(module: torch.nn.Module) -> tuple | None:
    """``moe_experts``' weights and activation for ``module``, a transformers experts class
    (``@use_experts_implementation``): [gate; up] or up weights as [E, 2I or I, H] and down as
    [E, H, I] (views of transposed ones), their biases where it has them, and its gate (``activation``:
    ``_activation_of``); None where the op cannot compute it (a norm after each expert, experts
    already split by transformers' own expert parallelism, weights of another rank)."""
    has_gate = getattr(module, "has_gate", None)
    up = getattr(module, "gate_up_proj" if has_gate else "up_proj", None)
    down = getattr(module, "down_proj", None)
    if (has_gate is None or getattr(module, "has_post_expert_norm", True) or getattr(module, "_is_expert_parallel", True)
            or not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or up.dim() != 3 or down.dim() != 3):
        return None
    if getattr(module, "is_transposed", False):
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    biases = ((getattr(module, "gate_up_proj_bias" if has_gate else "up_proj_bias"), module.down_proj_bias)
              if getattr(module, "has_bias", False) else (None, None))
    return (up, down, _activation_of(module, bool(has_gate)), *biases)


def _activation_of(module: torch.nn.Module, has_gate: bool) -> str:
    """The name of ``module``'s activation in ``ACTIVATIONS`` where it is one of them applied as
    transformers' default gate does (``act(gate) * up``, gate rows first), else a gate of its own
    registered in ``GATES`` (its class's ``_apply_gate``, or its activation on a plain MLP) under a
    name that says its class and settings, the same on every rank."""
    from transformers.integrations.moe import _default_apply_gate

    act = getattr(module, "act_fn", None)
    known = _KNOWN_ACTS.get(type(act).__name__)
    default = not has_gate or type(module)._apply_gate is _default_apply_gate
    if known is not None and default:
        return known
    settings = ",".join(f"{k}={v!r}" for k, v in sorted(vars(module).items())
                        if isinstance(v, (bool, int, float, str)) and not k.startswith("_") and k != "training")
    cls = type(module)
    name = f"{cls.__module__}.{cls.__qualname__}({settings}; act={type(act).__name__})"
    GATES.setdefault(name, functools.partial(cls._apply_gate, _without_weights(module)) if has_gate else act)
    return name


def _without_weights(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` holding its settings and weightless submodules (its activation)
    but none of its parameters and buffers: what its gate reads, kept in ``GATES`` without keeping
    the experts' weights alive after the model is gone."""
    light = copy.copy(module)
    light._parameters, light._buffers = {}, {}
    light._modules = {k: m for k, m in module._modules.items()
                      if m is not None and not any(True for _ in m.parameters()) and not any(True for _ in m.buffers())}
    return light


@contextmanager
def experts_as_one_op() -> Iterator[None]:
    """While it is open, transformers 5's experts (classes decorated ``@use_experts_implementation``,
    whichever of "eager", "batched_mm" or "grouped_mm" their config picks) run as ``moe_experts``
    where it computes them (``_interface_args``), else as they would. Capture exports
    under it; the registry of implementations is restored after, the model itself untouched.
    Where transformers was never imported the model holds none of its classes: nothing to route
    (and no ~0.8 s import in every rank that captures a model of its own)."""
    if "transformers" not in sys.modules:
        yield
        return
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:   # a transformers without the experts interface: nothing to route
        yield
        return
    local = ALL_EXPERTS_FUNCTIONS._local_mapping
    saved = dict(local)
    for name in ("eager", "batched_mm", "grouped_mm"):
        original = ALL_EXPERTS_FUNCTIONS.get(name)
        local[name] = functools.partial(_as_one_op, original)
    try:
        yield
    finally:
        local.clear()
        local.update(saved)


def _as_one_op(original: Callable | None, module: torch.nn.Module, hidden_states: torch.Tensor,
               top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    args = _interface_args(module)
    if args is not None:
        return moe_experts(hidden_states, top_k_index, top_k_weights, *args)
    forward = original or type(module).forward.__wrapped__   # "eager": the class's own forward
    return forward(module, hidden_states, top_k_index, top_k_weights)

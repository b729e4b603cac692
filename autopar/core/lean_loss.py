"""The lean cross-entropy, ``autopar::cross_entropy``: what capture makes of a language model's
loss (``lean_losses``); how it splits and runs over ranks, and what it costs, is
``autopar.core.ops.cross_entropy``'s.

A language model's loss is usually its logits upcast to fp32 then cross-entropy (transformers'
``ForCausalLMLoss``): run as written, it holds an fp32 copy of the logits, the log-probabilities
its backward keeps, and their fp32 gradients, each [tokens, vocabulary] (15.7 GiB each for 32k
tokens of Llama-3's 128k vocabulary). The lean loss reads the logits in their own dtype and
computes each chunk of rows in the loss's dtype (``dtype``, as the upcast did), keeps the logits
and one log-sum-exp a row for its backward, which recomputes the softmax chunk by chunk and
writes the logits' gradient in their dtype (``LeanCrossEntropy``, as Liger's and torchtune's
chunked losses do). Each row's values are those of the upcast then aten's loss; only the order of
the sums over rows differs.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from autopar.core.errors import AutoparError

aten = torch.ops.aten
CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default
_MEAN, _SUM = 1, 2   # torch's reduction enum (``torch.nn._reduction``)

#: Bytes of one chunk of rows in the loss's dtype: the lean loss's working memory is two of them.
CHUNK_BYTES = 256 * 2**20


_LIB = torch.library.Library("autopar", "FRAGMENT")
_LIB.define("cross_entropy(Tensor logits, Tensor target, Tensor? weight=None, int reduction=1, "
            "SymInt ignore_index=-100, *, ScalarType dtype) -> Tensor")


def chunk_rows(vocab: int, dtype: torch.dtype) -> int:
    """Rows of [*, vocab] logits computed at once: one chunk of ``CHUNK_BYTES`` in ``dtype``."""
    return max(1, CHUNK_BYTES // max(1, vocab * dtype.itemsize))


def _step(logits: torch.Tensor, dtype: torch.dtype) -> int | None:
    """Rows a chunk, or None for one chunk: fewer rows than a chunk, or fake tensors (planning:
    the same ops, shapes and kept tensors without a loop over a million rows), or sizes that
    differ by rank (``LocalTensorMode``)."""
    rows = logits.shape[0]
    if is_fake(logits) or logits.device.type == "meta" or not isinstance(rows, int):
        return None
    step = chunk_rows(logits.shape[1], dtype)
    return step if rows > step else None


def _rows(t: torch.Tensor, step: int | None) -> tuple[torch.Tensor, ...]:
    """``t`` as chunks of ``step`` rows (views)."""
    return (t,) if step is None else t.split(step)


class LeanCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits.to(dtype), target, reduction=..., ignore_index=...)`` for [N, C]
    logits, chunk by chunk of rows: keeps the logits (their dtype) and each row's log-sum-exp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int,
                dtype: torch.dtype) -> torch.Tensor:
        step = _step(logits, dtype)
        parts = [torch.logsumexp(chunk.to(dtype), dim=-1) for chunk in _rows(logits, step)]
        lse = parts[0] if len(parts) == 1 else torch.cat(parts)
        valid = target != ignore_index
        picked = logits.gather(1, target.masked_fill(~valid, 0).unsqueeze(1)).squeeze(1).to(dtype)
        loss = (lse - picked).masked_fill(~valid, 0).sum()
        ctx.save_for_backward(logits, target, lse)
        ctx.reduction, ctx.ignore_index, ctx.step = reduction, ignore_index, step
        return loss / valid.sum() if reduction == _MEAN else loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        logits, target, lse = ctx.saved_tensors
        valid = target != ctx.ignore_index
        scale = grad / valid.sum() if ctx.reduction == _MEAN else grad
        row_scale = torch.where(valid, scale, 0).to(lse.dtype).unsqueeze(1)   # ignored rows: no gradient
        safe = target.masked_fill(~valid, 0).unsqueeze(1)
        out = torch.empty_like(logits)
        for x, m, t, r, o in zip(*(_rows(v, ctx.step) for v in (logits, lse.unsqueeze(1), safe, row_scale, out)),
                                 strict=True):
            p = x.to(lse.dtype, copy=True).sub_(m).exp_()   # the softmax
            p.scatter_add_(1, t, torch.full_like(t, -1, dtype=p.dtype))
            o.copy_(p.mul_(r))
        return out, None, None, None, None


def _lean(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None, reduction: int = _MEAN,
          ignore_index: int = -100, *, dtype: torch.dtype) -> torch.Tensor:
    """``autopar::cross_entropy``: ``LeanCrossEntropy``, in aten's argument places (``weight``'s
    kept for them, always None: ``lean_losses`` rewrites no weighted loss)."""
    if weight is not None or reduction not in (_MEAN, _SUM) or logits.dim() != 2 or target.dim() != 1:
        raise AutoparError("autopar::cross_entropy takes [N, C] logits and [N] class indices, no weight, and a "
                           f"mean or sum (reduction 1 or 2); got logits {tuple(logits.shape)}, target "
                           f"{tuple(target.shape)}, weight {weight is not None}, reduction {reduction}")
    if logits.dtype == dtype and _fits_one_chunk(logits, dtype):
        return aten.cross_entropy_loss(logits, target, None, reduction, ignore_index)
    return LeanCrossEntropy.apply(logits, target, reduction, ignore_index, dtype)


def _fits_one_chunk(logits: torch.Tensor, dtype: torch.dtype) -> bool:
    """Are ``logits`` (already in the loss's dtype) one chunk of rows? Then aten's loss runs: it keeps
    its log-probabilities where the lean loss keeps the logits, as many bytes, in 2-3x fewer ops (a
    small loss on the host is dispatch-bound). Decided by shape, so planning's fake tensors take
    the path the run takes."""
    rows = logits.shape[0]
    return isinstance(rows, int) and rows <= chunk_rows(logits.shape[1], dtype)


_LIB.impl("cross_entropy", _lean, "CompositeImplicitAutograd")
LEAN = torch.ops.autopar.cross_entropy.default


# ----------------------------------------------------------------------------
# Capture: each cross-entropy over class indices made lean
# ----------------------------------------------------------------------------

# Capture: each cross-entropy over class indices made lean

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}
_CASTS = {aten.to.dtype, aten._to_copy.default}
_ASSERT = aten._assert_tensor_metadata.default


def lean_losses(graph: fx.Graph) -> int:
    """Rewrite each ``aten.cross_entropy_loss`` the lean loss can compute (class indices, no weight
    or label smoothing, a mean or a sum, logits [N, C] in fp32 or fp64) into ``autopar::cross_entropy``
    in place (its name, users and value unchanged), absorbing an upcast of the logits that feeds
    only it. Returns how many were rewritten."""
    done = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is CROSS_ENTROPY]:
        logits, target, weight, reduction, ignore_index, smoothing = _loss_args(node)
        lv, tv = _val(logits), _val(target)
        if (weight is not None or smoothing != 0.0 or reduction not in (_MEAN, _SUM) or lv is None or tv is None
                or lv.dim() != 2 or tv.dim() != 1 or tv.dtype.is_floating_point
                or lv.dtype not in (torch.float32, torch.float64)):
            continue
        _absorb_upcast(graph, logits)
        tail = () if (reduction, ignore_index) == (_MEAN, -100) else (None, reduction, ignore_index)
        node.target, node.args, node.kwargs = LEAN, (logits, target, *tail), {"dtype": lv.dtype}
        done += 1
    return done


def _loss_args(node: fx.Node) -> tuple:
    """(logits, target, weight, reduction, ignore_index, label_smoothing) of an aten cross-entropy."""
    names = ("weight", "reduction", "ignore_index", "label_smoothing")
    defaults = (None, _MEAN, -100, 0.0)
    rest = [node.args[2 + i] if len(node.args) > 2 + i else node.kwargs.get(k, d)
            for i, (k, d) in enumerate(zip(names, defaults, strict=True))]
    return (node.args[0], node.args[1], *rest)


def _absorb_upcast(graph: fx.Graph, logits: fx.Node) -> None:
    """Where ``logits`` is (views of) a cast of floating values to a dtype at least as wide, read
    by nothing else, make the views read the cast's input (their values recomputed): the loss
    upcasts chunk by chunk instead."""
    chain, x = [], logits
    while x.op == "call_function" and x.target in _VIEWS and len(x.users) == 1:
        chain.append(x)
        x = x.args[0]
    if not chain or x.op != "call_function" or x.target not in _CASTS or not isinstance(x.args[0], fx.Node):
        return
    source, cast = _val(x.args[0]), _val(x)
    readers = [u for u in x.users if u.target is not _ASSERT]
    extra = set(x.kwargs) - {"dtype", "copy", "non_blocking"} if x.target is aten._to_copy.default else set()
    if (source is None or cast is None or readers != [chain[-1]] or extra or not source.dtype.is_floating_point
            or source.dtype.itemsize > cast.dtype.itemsize):
        return
    chain[-1].replace_input_with(x, x.args[0])
    for view in reversed(chain):
        val = _val(view.args[0])
        with val.fake_mode:
            view.meta["val"] = view.target(val, *view.args[1:], **view.kwargs)
    for check in [u for u in x.users if u.target is _ASSERT]:
        graph.erase_node(check)
    graph.erase_node(x)


def _val(node: object) -> torch.Tensor | None:
    """A graph value's fake tensor, or None (not a tensor)."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None

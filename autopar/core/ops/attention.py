"""Scaled dot-product attention (``aten.scaled_dot_product_attention``): split by batch or heads;
a folded mask that is causal (or lets everything through) on this rank is passed as ``is_causal``
(or no mask), as eager Hugging Face calls it; its backward keeps what the fused kernels keep.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode
from torch.distributed.tensor import Replicate, Shard
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_flop_count

from autopar.core.capture import tensor_val
from autopar.core.ops.base import Emitter, Kept, Site, emitter, kernel, rule, saved
from autopar.core.rules import AxisRule, OpView, fits, replicate

aten = torch.ops.aten
SDPA = torch.ops.aten.scaled_dot_product_attention.default


@rule(SDPA)
def split_attention(v: OpView, n: int) -> list[AxisRule]:
    """SDPA on [batch, heads, seq, dim]: batch or heads (GQA: kv heads split with q heads).

    Runs per shard locally, so both need an even split; a mask follows q where it has that dim.
    """
    q, k = v.in_shapes[0], v.in_shapes[1]
    rules = [replicate(v)]
    for d, name in ((0, "batch"), (1, "heads")):
        if not (fits(q[d], n, even=True) and fits(k[d], n, even=True)):
            continue
        ins = [Shard(d), Shard(d), Shard(d)]
        for extra in v.in_shapes[3:]:
            de = d - (len(q) - len(extra))
            if de >= 0 and extra[de] == q[d]:
                ins.append(Shard(de))
            elif de < 0 or extra[de] == 1:
                ins.append(Replicate())
            else:
                break
        else:
            rules.append(AxisRule(Shard(d), tuple(ins), name))
    return rules


@emitter(SDPA)
def emit(em: Emitter, site: Site) -> bool:
    """Where its mask is folded (``codegen.generate._Emitter.tell_attention``), the runtime's
    ``attention``, which reads what ``attention_mask`` made of the mask on this rank."""
    if site.node.name not in em.masked_attention:
        return False
    text = em.call_text(site.node, site.reads)
    em.emit(f"{site.node.name} = kernels.attention{text[text.index('('):]}",
            site.comment + "; its mask, made once, may be causal or let everything through: then SDPA runs "
            "is_causal or unmasked, as eager Hugging Face calls it")
    return True


@saved(SDPA)
def fused_kernel(node: fx.Node, flags: tuple[bool, ...]) -> Kept | None:
    """On ``meta`` (planning for a cluster that is not here) SDPA takes its math path, which keeps
    the batch x heads x seq x seq attention matrix; the fused kernels training really runs (flash /
    memory-efficient on CUDA, flash on CPU) keep q, k, v, the output and one fp32 log-sum-exp per
    query row instead. Elsewhere what the op keeps on fake tensors (None)."""
    out = tensor_val(node)
    if out.device.type != "meta":
        return None
    rows = 1
    for size in out.shape[:-1]:
        rows *= size
    return Kept(frozenset(i for i, f in enumerate(flags[:3]) if f), True, rows * 4)


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """CPU fused attention does the same work as the CUDA kernels PyTorch counts."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# FlopCounterMode counts the CUDA attention kernels but not the CPU one a CPU model's SDPA runs.
if torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in flop_registry:
    register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)(_cpu_flash_attention_flops)


#: ``attention_mask``'s answer for a mask that is exactly causal: SDPA's ``is_causal=True``.
CAUSAL = "causal"


@kernel
def attention_mask(mask: torch.Tensor) -> torch.Tensor | str | None:
    """A folded attention mask as SDPA needs it on this rank: None where it lets every query see
    every key, ``CAUSAL`` where it is exactly the causal mask of square attention, else the mask.
    Eager Hugging Face makes the same call on the batch (no padding: SDPA's is_causal); an
    exported graph builds the mask instead."""
    values = list(mask._local_tensors.values()) if isinstance(mask, LocalTensor) else [mask]
    with maybe_disable_local_tensor_mode():
        kinds = {_mask_kind(v) for v in values}
    return {"none": None, "causal": CAUSAL}.get(kinds.pop(), mask) if len(kinds) == 1 else mask


def _mask_kind(mask: torch.Tensor) -> str:
    if mask.dtype == torch.bool:
        if bool(mask.all()):
            return "none"
        if mask.dim() >= 2 and mask.shape[-1] == mask.shape[-2]:
            causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
            if torch.equal(mask, causal.expand_as(mask)):
                return "causal"
    elif mask.is_floating_point() and not bool(mask.any()):
        return "none"   # an additive mask of zeros
    return "mask"


@kernel
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` with a mask ``attention_mask`` has looked at."""
    if isinstance(attn_mask, str):   # CAUSAL
        return aten.scaled_dot_product_attention.default(query, key, value, None, dropout_p, True, **kwargs)
    return aten.scaled_dot_product_attention.default(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)

"""What a GPU's kernels reach of its datasheet peaks, by op class and shape.

A preset's peaks (``Hardware.peak_flops``, ``memory_bandwidth``) are what no kernel runs at: GEMMs
reach 60-90% of the tensor-core peak depending on their shape (tiles of the output computed per
SM, in waves over the SMs), attention kernels less, backward less than forward, memory-bound ops
70-90% of the datasheet bandwidth. Pricing ops at peak made every GPU prediction about 2x
optimistic and weighed compute against communication at the wrong rate.

The numbers are data, one versioned JSON file a GPU in ``cost_models/tables/`` (``Hardware.efficiency``
names it), each with where it was measured or found; ``benchmarks/gpu_op_tables.py`` measures
them on a GPU. A profile measured on the user's own machine (``autopar profile``) takes precedence
over them (``CostModel._compute``).
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import sympy
import torch

from autopar.core.errors import HardwareError
from autopar.core.hardware import Hardware
from autopar.core.ops.attention import SDPA
from autopar.core.ops.moe import MOE, grouped_gemms
from autopar.core.sizes import maximum, minimum

__all__ = ["ATTENTION_OPS", "Efficiency", "GEMM_OPS", "GemmShape", "TABLES", "attention_seconds", "efficiency_of",
           "gemm_seconds", "load_table", "memory_seconds", "op_seconds"]

TABLES = Path(__file__).parent / "tables"
TABLE_VERSION = 1
Pass = Literal["forward", "backward"]


@dataclass(frozen=True)
class Tile:
    """An output tile one SM computes (``rows`` x ``cols``) and the fraction of the large-GEMM rate a
    kernel with that tile reaches (smaller tiles re-read more operands: less efficient)."""

    rows: int
    cols: int
    relative: float


@dataclass(frozen=True)
class Efficiency:
    """One GPU's achieved rates, as fractions of its preset's peaks (see the module docstring).

    ``gemm``: dtype name -> fraction of ``Hardware.flops_for`` a large GEMM reaches; ``tiles``: the
    kernel tiles a GEMM may run in (the fastest is taken, as cuBLAS's heuristics choose);
    ``backward_gemm``: the rate of the backward's GEMMs relative to the forward's (transposed
    operands); ``attention``: fraction of peak of the fused attention kernels at long sequences
    by pass and kernel (``flash``: causal or no mask; ``masked``: an explicit mask, the
    memory-efficient kernel), reached at half by ``attention_half_seq`` tokens; ``memory``: fraction
    of the datasheet bandwidth memory-bound kernels reach."""

    name: str
    sms: int
    gemm: dict[str, float]
    tiles: tuple[Tile, ...]
    backward_gemm: float
    attention: dict[str, dict[str, float]]
    attention_half_seq: float
    memory: float
    links: dict[str, float]
    sustained: float
    source: str

    def gemm_fraction(self, dtype: torch.dtype, allow_tf32: bool) -> float:
        name = str(dtype).removeprefix("torch.")
        if name == "float32" and allow_tf32 and "tf32" in self.gemm:
            return self.gemm["tf32"]
        return self.gemm.get(name, self.gemm["bfloat16"])


@dataclass(frozen=True)
class GemmShape:
    """A (batched) GEMM: ``batch`` products of an ``m`` x ``k`` and a ``k`` x ``n`` matrix."""

    m: int
    n: int
    k: int
    batch: int = 1

    def backward(self) -> tuple["GemmShape", "GemmShape"]:
        """The backward's two GEMMs: the input's gradient (m x n by n x k) and the weight's (k x m by m x n)."""
        return GemmShape(self.m, self.k, self.n, self.batch), GemmShape(self.k, self.n, self.m, self.batch)


def load_table(path: Path) -> Efficiency:
    """An efficiency table from its JSON file (``TABLE_VERSION``); a clear error where it is malformed."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {TABLE_VERSION}")
        return Efficiency(
            name=data["name"], sms=int(data["sms"]), gemm=dict(data["gemm"]["peak_fraction"]),
            tiles=tuple(Tile(*t) for t in data["gemm"]["tiles"]), backward_gemm=float(data["gemm"]["backward"]),
            attention={k: dict(v) for k, v in data["attention"]["peak_fraction"].items()},
            attention_half_seq=float(data["attention"]["half_at_seq"]), memory=float(data["memory"]["bandwidth_fraction"]),
            links=dict(data["collectives"]["bandwidth_fraction"]), sustained=float(data["sustained"]["fraction"]),
            source=" | ".join(f"{k}: {data[k]['source']}" for k in ("gemm", "attention", "memory", "collectives",
                                                                    "sustained")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HardwareError(f"efficiency table {str(path)!r} is malformed ({type(e).__name__}: {e}); "
                            f"see the files in {TABLES} for the format") from e


@functools.cache
def _table(name: str) -> Efficiency:
    path = Path(name) if name.endswith(".json") else TABLES / f"{name}.json"
    return load_table(path)


def efficiency_of(hw: Hardware) -> Efficiency | None:
    """The table ``hw.efficiency`` names (a preset's table, or a JSON file); None: priced at the peaks."""
    return _table(hw.efficiency) if hw.efficiency else None


def gemm_seconds(shape: GemmShape, eff: Efficiency, hw: Hardware, dtype: torch.dtype, *,
                 allow_tf32: bool = False, pass_: Pass = "forward") -> float:
    """Seconds of one GEMM: its output cut into tiles, the tiles run in waves of one per SM, each
    wave as long as one tile's work at the SM's share of the achieved rate; the fastest tile wins.
    Symbolic sizes (``planning.symbolic``) are priced without quantisation."""
    rate = hw.flops_for(dtype, allow_tf32=allow_tf32) * eff.gemm_fraction(dtype, allow_tf32)
    if pass_ == "backward":
        rate *= eff.backward_gemm
    dims = (shape.m, shape.n, shape.k, shape.batch)
    if any(isinstance(d, sympy.Basic) for d in dims):
        return 2 * shape.m * shape.n * shape.k * shape.batch / rate
    best = math.inf
    for tile in eff.tiles:
        count = math.ceil(shape.m / tile.rows) * math.ceil(shape.n / tile.cols) * shape.batch
        waves = math.ceil(count / eff.sms)
        best = min(best, waves * 2 * tile.rows * tile.cols * shape.k / (rate * tile.relative / eff.sms))
    return best


def attention_seconds(flops: float, seq: float, eff: Efficiency, hw: Hardware, dtype: torch.dtype, *,
                      kernel: Literal["flash", "masked"], causal: bool, pass_: Pass) -> float:
    """Seconds of a fused attention kernel doing ``flops`` (as ``FlopCounterMode`` counts them:
    the whole score matrix) over ``seq`` query tokens: a causal kernel skips the blocks above the
    diagonal (half the work, and the diagonal's blocks), short sequences reach less of the rate."""
    fraction = eff.attention[kernel][pass_] * seq / (seq + eff.attention_half_seq)
    work = flops * minimum(1.0, 0.5 + 64 / seq) if causal else flops
    return work / (hw.flops_for(dtype) * fraction)


def memory_seconds(nbytes: float, eff: Efficiency, hw: Hardware) -> float:
    """Seconds of a memory-bound kernel reading and writing ``nbytes``."""
    return nbytes / (hw.memory_bandwidth * eff.memory)


def matmul_shapes(a: Sequence[int], b: Sequence[int]) -> GemmShape | None:
    """The GEMM of ``a @ b`` (torch.matmul's broadcasting: a 2-D ``b`` folds ``a``'s leading dims
    into rows); None for a vector operand."""
    if len(a) < 2 or len(b) < 2:
        return None
    if len(b) == 2:
        return GemmShape(math.prod(a[:-1]), b[1], b[0])
    return GemmShape(a[-2], b[-1], a[-1], math.prod((a if len(a) >= len(b) else b)[:-2]))


aten = torch.ops.aten
# Each GEMM op's products, from its tensor inputs' local shapes in argument order.
GEMM_OPS: dict[Any, Callable[..., GemmShape | tuple[GemmShape, ...]]] = {
    aten.linear.default: lambda x, w, *bias: GemmShape(math.prod(x[:-1]), w[0], x[-1]),
    aten.mm.default: matmul_shapes,
    aten.bmm.default: matmul_shapes,
    aten.matmul.default: matmul_shapes,
    aten.addmm.default: lambda bias, a, b: matmul_shapes(a, b),
    aten.baddbmm.default: lambda c, a, b: matmul_shapes(a, b),
    MOE: lambda *shapes: tuple(GemmShape(*g) for g in grouped_gemms(*shapes)),   # each local expert's rows
}
ATTENTION_OPS = frozenset({SDPA})   # priced by their fused kernels (``autopar.core.ops.attention``)


def _gemms(node: torch.fx.Node, shapes: Sequence[Sequence[int]]) -> tuple[GemmShape, ...]:
    """The GEMMs an op runs, where it is one of ``GEMM_OPS`` with the inputs that op takes."""
    try:
        found = GEMM_OPS[node.target](*shapes) if node.target in GEMM_OPS else ()
    except (TypeError, IndexError):   # another overload's arguments: priced as any other op
        return ()
    return (found,) if isinstance(found, GemmShape) else found


def op_seconds(node: torch.fx.Node, shapes: Sequence[Sequence[int]], flops: float, nbytes: float,
               eff: Efficiency, hw: Hardware, dtype: torch.dtype) -> tuple[float, float]:
    """Forward and backward seconds of one op in a training step from the table: a GEMM by its
    shape, fused attention by its kernel, anything else at the large-GEMM rate or the achieved
    bandwidth, whichever is slower (backward twice the forward's work, as ``CostModel`` assumes);
    each pass at the sustained share of those rates, plus the per-kernel overhead. ``shapes``: the
    op's tensor inputs' local shapes."""
    memory = memory_seconds(nbytes, eff, hw)
    gemms = _gemms(node, shapes)
    if gemms:
        fwd = sum(gemm_seconds(gemm, eff, hw, dtype) for gemm in gemms)
        bwd = sum(gemm_seconds(g, eff, hw, dtype, pass_="backward") for gemm in gemms for g in gemm.backward())
    elif node.target in ATTENTION_OPS and len(shapes[0]) == 4:
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))
        kernel: Literal["flash", "masked"] = "masked" if mask is not None else "flash"
        fwd, bwd = (attention_seconds(flops * (2.5 if p == "backward" else 1), shapes[0][2], eff, hw, dtype,
                                      kernel=kernel, causal=causal, pass_=p) for p in ("forward", "backward"))
    else:
        fwd = flops / (hw.flops_for(dtype) * eff.gemm_fraction(dtype, False))
        bwd = 2 * fwd
    return (maximum(fwd, memory) / eff.sustained + hw.op_overhead_s,
            maximum(bwd, 2 * memory) / eff.sustained + hw.op_overhead_s)

"""Cost model v0: seconds and bytes of each node strategy and each resharding edge.

Compute is a roofline over the op's FLOPs (counted by ``FlopCounterMode`` on fake tensors) and
bytes moved, on the shard one device runs; forward + backward counted as 3x the forward.
Communication is alpha-beta per mesh axis, for the forward redistribution and for the gradient's
way back (which is where data-parallel all-reduces and ZeRO reduce-scatters appear).
Memory per device: parameters + gradients + AdamW states of each parameter shard, plus the
activations each op keeps for backward (all live at the end of the forward: the peak).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils.flop_counter import FlopCounterMode

from autopar.capture import tensor_val
from autopar.mesh import MeshSpec
from autopar.placements import Placements, grad_placement, is_split, shard_fraction
from autopar.strategies import VIEW_OPS, NodeChoices, Strategy
from cost_models.comm import collective_time, link_for_axis
from cost_models.compute import compute_time
from cost_models.hardware import Hardware, get_hardware

BACKWARD_FACTOR = 3.0          # forward + backward ~ 3x forward work (backward computes two grads)
OPTIMIZER_STATES = 2           # AdamW: exp_avg and exp_avg_sq
ADAMW_BYTES_PER_PARAM_BYTE = 7  # reads p, g, m, v; writes p, m, v


@dataclass(frozen=True)
class Cost:
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: float = 0.0
    comm_bytes: tuple[float, ...] = ()   # per mesh axis

    def __add__(self, o: "Cost") -> "Cost":
        n = max(len(self.comm_bytes), len(o.comm_bytes))
        a = self.comm_bytes + (0.0,) * (n - len(self.comm_bytes))
        b = o.comm_bytes + (0.0,) * (n - len(o.comm_bytes))
        return Cost(self.compute_s + o.compute_s, self.comm_s + o.comm_s, self.memory_bytes + o.memory_bytes,
                    tuple(x + y for x, y in zip(a, b)))

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class CostModel:
    mesh: MeshSpec
    hw: Hardware = field(init=False)

    def __post_init__(self) -> None:
        self.hw = get_hardware(self.mesh.hardware)
        self.links = [link_for_axis(self.hw, self.mesh.shape, a) for a in range(self.mesh.ndim)]
        self._flops: dict[tuple, float] = {}
        self._moves: dict[tuple, Cost] = {}

    # ------------------------------------------------------------ communication
    def redistribute(self, shape: Sequence[int], dtype: torch.dtype, src: Placements, dst: Placements) -> Cost:
        """Time and bytes of moving a tensor from placement ``src`` to ``dst`` (axis by axis)."""
        key = (tuple(shape), dtype, src, dst)
        if key not in self._moves:
            self._moves[key] = self._redistribute(shape, dtype, src, dst)
        return self._moves[key]

    def _redistribute(self, shape: Sequence[int], dtype: torch.dtype, src: Placements, dst: Placements) -> Cost:
        full = _numel(shape) * _itemsize(dtype)
        time, sent = 0.0, []
        for a, (s, d) in enumerate(zip(src, dst)):
            n = self.mesh.shape[a]
            others = tuple(p if i != a else Replicate() for i, p in enumerate(src))
            nbytes = full * shard_fraction(others, self.mesh.shape)
            kind = _collective(s, d)
            if kind is None or n == 1:
                sent.append(0.0)
                continue
            if kind == "all_to_all":
                nbytes /= n
            time += collective_time(kind, nbytes, n, self.links[a])
            sent.append(nbytes * (n - 1) / n * (2 if kind == "all_reduce" else 1))
        return Cost(comm_s=time, comm_bytes=tuple(sent))

    # ------------------------------------------------------------ nodes
    def node(self, nc: NodeChoices, s: Strategy) -> Cost:
        val = tensor_val(nc.node)
        if nc.kind == "param":
            local = _bytes(val) * shard_fraction(s.storage, self.mesh.shape)
            cost = Cost(compute_s=compute_time(0, ADAMW_BYTES_PER_PARAM_BYTE * local, self.hw, val.dtype),
                        memory_bytes=local * (2 + OPTIMIZER_STATES), comm_bytes=(0.0,) * self.mesh.ndim)
            if s.storage != s.out:  # ZeRO-3: gather on use, the gathered copy lives until backward
                gather = self.redistribute(val.shape, val.dtype, s.storage, s.out)
                cost = cost + gather + Cost(memory_bytes=_bytes(val) * shard_fraction(s.out, self.mesh.shape))
            return cost
        if nc.kind in ("input", "buffer"):
            return Cost(memory_bytes=_bytes(val) * shard_fraction(s.out, self.mesh.shape))
        if nc.kind == "output" or nc.node.target in VIEW_OPS or val is None:
            return Cost()
        split = 1
        for a, n in enumerate(self.mesh.shape):
            if is_split(s.out[a]) or any(is_split(i[a]) for i in s.ins):
                split *= n
        in_bytes = sum(_bytes(tensor_val(i)) * shard_fraction(p, self.mesh.shape) for i, p in zip(nc.inputs, s.ins))
        out_bytes = _bytes(val) * shard_fraction(s.out, self.mesh.shape)
        flops = self.flops(nc.node) / split
        t = compute_time(BACKWARD_FACTOR * flops, BACKWARD_FACTOR * (in_bytes + out_bytes), self.hw, val.dtype)
        return Cost(compute_s=t, memory_bytes=out_bytes)

    def flops(self, node: fx.Node) -> float:
        """Forward FLOPs of the whole (unsharded) op, counted by PyTorch's FlopCounterMode."""
        args = torch.utils._pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
        key = (node.target, repr(torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: tuple(t.shape), args)))
        if key not in self._flops:
            val = tensor_val(node)
            try:
                with val.fake_mode, FlopCounterMode(display=False) as counter:
                    node.target(*args[0], **args[1])
                self._flops[key] = float(counter.get_total_flops())
            except Exception:  # an op the counter cannot run on fake tensors: count it as memory-bound
                self._flops[key] = 0.0
        return self._flops[key]

    # ------------------------------------------------------------ edges
    def edge(self, src: NodeChoices, s: Strategy, dst: NodeChoices, d: Strategy, i: int) -> Cost:
        """Forward redistribution of ``src``'s output into input ``i`` of ``dst``, plus the backward
        redistribution of that input's gradient into ``src``'s gradient placement."""
        val = tensor_val(src.node)
        if val is None:
            return Cost()
        want = d.ins[i]
        fwd = self.redistribute(val.shape, val.dtype, s.out, want)
        if dst.kind == "output" or not val.dtype.is_floating_point:
            return fwd
        grad = grad_placement(d.ins[i], d.ins, d.out)
        target = s.storage if s.storage is not None else tuple(Replicate() if isinstance(p, Partial) else p for p in s.out)
        return fwd + self.redistribute(val.shape, val.dtype, grad, target)


def _collective(s: Placement, d: Placement) -> str | None:
    if s == d or (isinstance(s, Partial) and isinstance(d, Partial)):
        return None
    if isinstance(d, Replicate):
        return "all_reduce" if isinstance(s, Partial) else "all_gather"
    if isinstance(d, Shard):
        return "reduce_scatter" if isinstance(s, Partial) else "all_to_all" if isinstance(s, Shard) else None
    return "all_gather" if isinstance(s, Shard) else None   # to Partial: shard -> replicate first


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _bytes(val) -> float:
    return float(_numel(val.shape) * _itemsize(val.dtype)) if val is not None else 0.0

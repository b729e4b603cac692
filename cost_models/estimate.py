"""Seconds and bytes of each node strategy and each resharding edge, as one rank sees them.

Compute: the op's measured forward and backward seconds at its local shapes when a ``Profile``
of this machine has them, else a roofline over its FLOPs (``FlopCounterMode`` on fake tensors)
and bytes moved, backward = 2x forward (generated code runs the op as it was timed). Edges add
the runtime's wrapping where generated code moves a value or wraps a parameter read (measured by
the profile). Communication: alpha-beta per collective and mesh axis, with the profile's fitted
links when it has them. A parameter's gradient synchronisation is queued asynchronously during
the backward (``codegen.grad_sync``), so it is reported apart
(``overlap_s``) and hidden only by the backward compute that follows it (``schedule``).

Memory is split by lifetime, so that ``schedule`` can find the peak of the step instead of a
sum: parameter shards + optimizer states live all step; activations kept for backward (found
from the graph, ``activations``) live from their op's forward to its backward; gradients from
the backward to the optimizer step; and each node's working memory only while it runs.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import sympy
import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils.flop_counter import FlopCounterMode

from autopar.core.blocks import RECOMPUTE, RecomputeMode, block_of, recompute_modes, recomputed_regions
from autopar.core.capture import tensor_val
from autopar.core.errors import AutoparError
from autopar.core.execution import BUCKET_BYTES, VIEW_OPS, axis_collective, moves
from autopar.core.gradients import computed_from_parameters
from autopar.core.hardware import Hardware, get_hardware
from autopar.core.mesh import MeshSpec
from autopar.core.ops import entry_for  # (its attention entry teaches FlopCounterMode CPU fused attention)
from autopar.core.ops.base import CollectiveKind, InStep
from autopar.core.placements import (
    Placements,
    evenly_split,
    gathered_in_group,
    grad_placement,
    grad_target,
    is_split,
    largest_shard_shape,
    shard_fraction,
)
from autopar.core.precision import Precision, reduce_dtype
from autopar.core.sizes import maximum, minimum
from autopar.core.strategies import NodeChoices, Strategy, StrategySpace
from cost_models.activations import NOTHING, Saved, SavedTensors, gradients
from cost_models.comm import ALL_TO_ALLS, Link, collective_time, link_for_axis
from cost_models.compute import as_amount, compute_time
from cost_models.efficiency import efficiency_of, op_seconds
from cost_models.profile import (
    FRESH_BUFFER_BYTES,
    PER_MIB_OVERHEADS,
    OpTime,
    Profile,
    calibration_key,
    runtime_overhead,
)
from solver import Term

log = logging.getLogger(__name__)
BACKWARD_FACTOR = 2.0   # roofline: backward ~ 2x forward work (a gradient for the input and for the weight)


@dataclass(frozen=True)
class Optimizer:
    name: str
    states: int          # state tensors per parameter, each the parameter's size
    update_bytes: int    # bytes read + written per parameter byte by one update
    temp: int            # parameter-sized temporaries of one (single-tensor) update


OPTIMIZERS = {
    "adamw": Optimizer("adamw", states=2, update_bytes=7, temp=1),   # reads p, g, m, v; writes p, m, v
    "adam": Optimizer("adam", states=2, update_bytes=7, temp=1),
    "sgd": Optimizer("sgd", states=0, update_bytes=3, temp=0),
    "sgd-momentum": Optimizer("sgd-momentum", states=1, update_bytes=5, temp=0),
}


def get_optimizer(name: str) -> Optimizer:
    if name not in OPTIMIZERS:
        raise AutoparError(f"unknown optimizer {name!r}; autopar costs {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


@dataclass(frozen=True)
class Cost:
    """What one node costs per device under one strategy (or one edge under a pair of
    strategies), in seconds and bytes; made by ``CostModel.node``/``edge``, laid out in time by
    ``cost_models.schedule`` and summed by the planner into the ILP's costs and memory rows."""

    compute_s: float = 0.0        # forward + backward compute, runtime overhead included
    timed_s: float = 0.0          # of compute_s, what the profile measured: ops' times, runtime overheads
    backward_s: float = 0.0       # the part of compute_s in the backward (it can hide gradient sync)
    comm_s: float = 0.0           # blocking communication
    overlap_s: float = 0.0        # gradient synchronisation queued during the backward
    state_bytes: float = 0.0      # live all step: parameter shards, optimizer states, inputs
    saved_bytes: float = 0.0      # kept from the node's forward to its backward
    recomputed_bytes: float = 0.0  # in a recomputed block: rebuilt for, and kept during, the block's backward
    grad_bytes: float = 0.0       # parameter gradients: from the backward to the optimizer step
    output_grad_bytes: float = 0.0  # the gradient of an op's output: from its last user's backward to its own
    transient_bytes: float = 0.0  # working memory while the node runs
    synced_bytes: float = 0.0     # a parameter gradient all-reduced in a bucket: the sum's copy (``schedule``)
    comm_bytes: tuple[float, ...] = ()   # per mesh axis
    measured: frozenset[str] = frozenset()   # "comm" where the links came from the profile (compute: ``timed_s``)

    def __add__(self, o: "Cost") -> "Cost":
        n = max(len(self.comm_bytes), len(o.comm_bytes))
        a = self.comm_bytes + (0.0,) * (n - len(self.comm_bytes))
        b = o.comm_bytes + (0.0,) * (n - len(o.comm_bytes))
        summed = {name: getattr(self, name) + getattr(o, name) for name in _SUMMED}
        return Cost(**summed, comm_bytes=tuple(x + y for x, y in zip(a, b, strict=True)), measured=self.measured | o.measured)

    def busier(self, factor: float) -> "Cost":
        """This cost on a rank doing ``factor`` times the mean work (``CostModel.expert_skew``):
        its seconds, bytes moved and working memory scaled."""
        return replace(self, compute_s=self.compute_s * factor, timed_s=self.timed_s * factor,
                       backward_s=self.backward_s * factor,
                       comm_s=self.comm_s * factor, overlap_s=self.overlap_s * factor,
                       transient_bytes=self.transient_bytes * factor, comm_bytes=tuple(b * factor for b in self.comm_bytes))

    @property
    def time_s(self) -> float:
        """Seconds if nothing overlapped (the solver and ``schedule`` hide ``overlap_s``)."""
        return self.compute_s + self.comm_s + self.overlap_s

    @property
    def memory_bytes(self) -> float:
        """Bytes this node holds at its heaviest (working memory aside)."""
        return self.state_bytes + self.saved_bytes + self.recomputed_bytes + self.grad_bytes


#: The fields of ``Cost`` that add up (the planner sums millions of costs on large meshes).
_SUMMED = tuple(f.name for f in fields(Cost) if f.name not in ("comm_bytes", "measured"))


def _rows_dropped(grid: Cost, blocking: Sequence[Term], dropped: np.ndarray, held: np.ndarray
                  ) -> tuple[Cost, tuple[Term, ...]]:
    """An output's gather ``grid`` and its ``blocking`` terms with the rows ``dropped`` ([rows, 1]:
    gathered only where read) costing nothing, and ``held`` ([rows, 1]) bytes held at the end of
    the forward added to every row."""
    keep = (~dropped).astype(float)
    fields_ = {name: getattr(grid, name) * keep for name in _SUMMED}
    fields_["transient_bytes"] = fields_["transient_bytes"] + held
    terms = tuple(Term(np.arange(len(keep)), t.cols, np.asarray(t.core)[np.asarray(t.rows)] * keep) for t in blocking)
    moved = tuple(b * keep for b in grid.comm_bytes)
    return Cost(**fields_, comm_bytes=moved, measured=grid.measured), terms  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields


#: FLOPs per op signature (target, argument shapes and values), counted once per process: the
#: count depends on nothing else, and tests and repeated plans (microbatches, hand plans' models,
#: ``autopar compare``) price the same ops again. (flops, why counting failed, or None.)
_FLOP_COUNTS: dict[tuple, tuple[float, str | None]] = {}
_FLOP_COUNTS_MAX = 100_000


def _counted_flops(node: fx.Node) -> tuple[float, str | None]:
    """Forward FLOPs of ``node``'s whole op on fake tensors (FlopCounterMode), and why they could
    not be counted (then 0) where the counter cannot run it."""
    args = torch.utils._pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
    key = (node.target, repr(torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: tuple(t.shape), args)))
    if key not in _FLOP_COUNTS:
        if len(_FLOP_COUNTS) >= _FLOP_COUNTS_MAX:
            _FLOP_COUNTS.clear()
        try:
            with tensor_val(node).fake_mode, FlopCounterMode(display=False) as counter:
                node.target(*args[0], **args[1])
            _FLOP_COUNTS[key] = (as_amount(counter.get_total_flops()), None)
        except Exception as e:  # noqa: BLE001 - any op the counter cannot run on fake tensors
            _FLOP_COUNTS[key] = (0.0, f"{type(e).__name__}: {e}")
    return _FLOP_COUNTS[key]


@dataclass
class CostModel:
    """Prices every strategy of a ``StrategySpace`` on ``mesh``: each node's compute (the profile's
    measurement, else the hardware preset's roofline), each placement change's collectives (one
    per mesh axis, as ``autopar.core.execution`` says the runtime runs them; a gradient bucket
    summed over every axis of the job, one: ``_summed_by_job``) and the bytes each
    holds. Made once per planning request (``autopar.planning.problem.prepare``); its ``Cost``s
    feed the ILP and the plan's predictions.

    With ``microbatches`` k > 1 the graph is one microbatch's and a ``Cost`` is per step: what
    every microbatch runs (ops, their collectives, ZeRO-3 gathers, the runtime's per-call costs)
    counts k times, what the step does once (optimizer updates, the gradient synchronisation of
    the last backward) once; memory is one microbatch's (activations live one microbatch at a
    time, gradients accumulate in place) and ``backward_s`` one backward's (the last one's hides
    the queued synchronisation). ZeRO-3 groups reduce-scatter every backward: the k - 1 earlier
    ones count as blocking, less the share backward compute hides (``overlap_efficiency``).

    With ``recompute="full"`` the repeated blocks (``autopar.core.blocks``) run as checkpointed
    functions: an op inside one keeps nothing to its backward but the block's inputs it is the
    first to read (``saved_bytes``); what it would have kept is rebuilt by running the block's
    forward again at the start of the block's backward (``recomputed_bytes``, live until the
    block's backward is done; ``schedule.Timeline``), and that forward, with its placement changes
    and ZeRO-3 gathers, costs its time a second time (in ``backward_s`` too).

    With ``offload`` every parameter stored split and gathered to be used (ZeRO-2/3) keeps its
    shard, gradient and optimizer states in host memory, as FSDP2's ``CPUOffloadPolicy`` and
    ZeRO-Offload do (``offloads``): the device holds none of them, each gather first copies the
    shard to the device and each backward's reduced gradient goes back over the host link
    (``Hardware.host_bandwidth``, blocking), and the optimizer updates them at the host's memory
    bandwidth. Where the device is the host (no ``host_bandwidth``) this moves nothing and saves
    nothing, and is priced so."""

    mesh: MeshSpec
    space: StrategySpace
    profile: Profile | None = None
    optimizer: Optimizer = field(default_factory=lambda: OPTIMIZERS["adamw"])
    gather_outputs: bool = True      # outputs returned whole on every rank (``PlanOptions.gather_outputs``)
    microbatches: int = 1            # gradient accumulation: the graph is one microbatch's, run this many times a step
    recompute: str | Mapping[str, RecomputeMode] = "none"   # "full": every repeated block recomputed in the backward; "selective": their attention cores; or per block
    reduce_precision: Precision = "fp32"   # the dtype gradient synchronisation sums in (``PlanOptions``)
    offload: bool = False            # ZeRO-2/3 parameters' shards, gradients and optimizer states in host memory
    expert_skew: float | Mapping[int, float] = 1.0   # the busiest expert-parallel rank's routed rows over the mean,
                                     # or such factors by expert-axis size (``PlanOptions``, measured)
    hw: Hardware = field(init=False)

    def __post_init__(self) -> None:
        self.hw = get_hardware(self.mesh.hardware)
        self.efficiency = efficiency_of(self.hw)   # what kernels reach of the peaks, where a table says
        self.links = [link_for_axis(self.hw, self.mesh.shape, a) for a in range(self.mesh.ndim)]
        self.saved = SavedTensors(gradients(self.space)) if self.space.nodes else None
        self._counted = self._first_keepers()
        calibration = self.profile.calibration if self.profile is not None else {}
        # Share of backward compute that hides queued gradient sync (see schedule.Timeline).
        self.overlap_efficiency = calibration.get("overlap", 1.0)
        # Collectives inside a step cost more than alone in lockstep (ranks arrive apart, and on
        # CPU they share cores with compute): in-step factors, fitted on this mesh shape (1 where
        # it was not calibrated), of blocking collectives and of a gradient bucket's fixed cost
        # (its latency: the ranks' arrival after a whole backward of their own; its bytes move at
        # the link's bandwidth, as in lockstep).
        self.comm_scale = calibration.get(calibration_key("comm", self.mesh.shape), 1.0)
        # The experts' dispatch and combine follow whole blocks of compute: a factor of their own
        # (``Collective.in_step``), fitted on a mixture of experts split by expert; else comm's.
        self.experts_scale = calibration.get(calibration_key("experts", self.mesh.shape), self.comm_scale)
        self.sync_scale = calibration.get(calibration_key("sync", self.mesh.shape), 1.0)
        # A gradient bucket holds at most the model's parameters: a small model syncs in one.
        params = sum(_bytes(tensor_val(nc.node)) for nc in self.space.nodes if nc.kind == "param")
        self.bucket_bytes = min(float(BUCKET_BYTES), params) or float(BUCKET_BYTES)
        self._flop_failures: set[tuple[str, str]] = set()
        self._node_flops: dict[fx.Node, float] = {}
        self._moves: dict[tuple, Cost] = {}
        self.block_of = recomputed_blocks(self.space, self.recompute)
        self._block_inputs = self._first_block_readers()
        self._from_params = self._computed_from_parameters()

    # ------------------------------------------------------------ communication
    def redistribute(self, shape: Sequence[int], dtype: torch.dtype, src: Placements, dst: Placements, *,
                     queued: bool = False, batched: bool = False, once: bool = False,
                     kind: CollectiveKind | None = None, in_step: InStep = "comm") -> Cost:
        """Time and bytes of moving a tensor from placement ``src`` to ``dst`` (axis by axis):
        blocking (``comm_s``, at its in-step factor), or a gradient synchronisation queued during
        the backward (``queued``: ``overlap_s``, no staging buffers of its own) on the axes where
        it is a reduction (``_reduced``). Queued and ``batched`` ones (a ZeRO-3 gather) share one
        collective with others, a bucket: each pays its share of the collective's latency (a
        queued one at its in-step factor). A blocking one runs once per microbatch, or ``once`` a
        step (a ZeRO-2 gather). ``kind``: the collective an op's kernel runs for the move instead
        of DTensor's (``Collective.kind``); ``in_step``: the in-step factor of a blocking one
        (``Collective.in_step``)."""
        shape = tuple(_dim(s) for s in shape)   # symbolic sizes (SymInt) do not hash
        key = (shape, dtype, src, dst, queued, batched, once, kind, in_step)
        if key not in self._moves:
            full = _numel(shape) * _itemsize(dtype)
            times = 1 if once else self.microbatches
            blocking, waiting, sent, measured = 0.0, 0.0, [], False
            for a, (s, d) in enumerate(zip(src, dst, strict=True)):
                reduced = _reduced(queued, s)
                t, b, m = self._axis_move(a, s, d, full * _others_fraction(src, a, self.mesh.shape), reduced, batched,
                                          kind)
                blocking, waiting = (blocking, waiting + t) if reduced else (blocking + t, waiting)
                sent.append(b if reduced else b * times)
                measured = measured or m
            if queued and self._summed_by_job(src) and self._summed_by_job(dst, into=True):
                waiting, measured = self._job_all_reduce(full)
            largest = max(shard_fraction(src, self.mesh.shape), shard_fraction(dst, self.mesh.shape))
            scale = self.experts_scale if in_step == "experts" else self.comm_scale
            self._moves[key] = Cost(comm_s=blocking * scale * times, overlap_s=waiting, comm_bytes=tuple(sent),
                                    # a float here (a sympy expression in symbolic costs); arrays are edge_grid's
                                    transient_bytes=_collective_buffers(full, largest) if blocking else 0.0,  # type: ignore[arg-type]
                                    measured=frozenset({"comm"}) if measured else frozenset())
        return self._moves[key]

    def redistribute_grid(self, shape: Sequence[int], dtype: torch.dtype, srcs: Sequence[Placements],
                          dsts: Sequence[Placements], *, queued: bool = False) -> tuple[Cost, list[Term]]:
        """``redistribute`` from each of ``srcs`` to each of ``dsts``, as a grid ``Cost``: each field a
        [source, destination] array (of objects where the shape is symbolic), ``measured`` a bool
        array (the "comm" came from the profile). Each axis is priced once per distinct (source placement,
        bytes, destination placement): a few calls where the pairs are hundreds of thousands.
        Also returns its blocking seconds (``comm_s``) as one ``solver.Term`` per mesh axis; they
        sum to the grid's."""
        full = _numel(shape) * _itemsize(dtype)
        full = full if isinstance(full, sympy.Basic) else float(full)
        mesh, times = self.mesh.shape, self.microbatches
        blocking, waiting = np.zeros((len(srcs), len(dsts))), np.zeros((len(srcs), len(dsts)))
        measured = np.zeros(blocking.shape, dtype=bool)
        sent, terms = [], []
        for a in range(len(mesh)):
            rows, row_keys = _classes([(s[a], full * _others_fraction(s, a, mesh)) for s in srcs])
            cols, col_keys = _classes([d[a] for d in dsts])
            reduced = np.array([_reduced(queued, s) for s, _ in row_keys])
            table = np.array([[self._axis_move(a, s, d, nbytes, r) for d in col_keys]
                              for (s, nbytes), r in zip(row_keys, reduced, strict=True)])
            terms.append(Term(rows, cols, np.where(reduced[:, None], 0.0, table[..., 0]) * self.comm_scale * times))
            table, reduced = table[np.ix_(rows, cols)], reduced[rows][:, None]   # [source, destination, (seconds, bytes, measured)]
            blocking = blocking + np.where(reduced, 0.0, table[..., 0])
            waiting = waiting + np.where(reduced, table[..., 0], 0.0)
            sent.append(table[..., 1] * np.where(reduced, 1, times))
            measured |= table[..., 2].astype(bool)
        summed = np.array([queued and self._summed_by_job(s) for s in srcs])
        if summed.any():
            joint = summed[:, None] & np.array([self._summed_by_job(d, into=True) for d in dsts])[None, :]
            seconds, on_profile = self._job_all_reduce(full)
            waiting, measured = np.where(joint, seconds, waiting), np.where(joint, on_profile, measured)
        largest = np.maximum(np.array([shard_fraction(s, mesh) for s in srcs])[:, None],
                             np.array([shard_fraction(d, mesh) for d in dsts])[None, :])
        buffers = np.where(blocking != 0, _collective_buffers(full, largest), 0.0)
        return Cost(comm_s=blocking * self.comm_scale * times, overlap_s=waiting, comm_bytes=tuple(sent),  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields
                    transient_bytes=buffers, measured=measured), terms  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields

    def _axis_move(self, a: int, s: Placement, d: Placement, nbytes: float, queued: bool = False,
                   batched: bool = False, own: CollectiveKind | None = None) -> tuple[float, float, bool]:
        """One mesh axis of a redistribution, ``nbytes`` being the tensor's bytes on the ranks of
        one group of that axis: (seconds, bytes each rank sends, over a profiled link), run as
        DTensor runs it, or as collective ``own`` (an op's kernel's). An all-to-all's ``N`` is
        one rank's buffer (``cost_models.comm``), as the profile fits it: 1/n of ``nbytes``. A
        ``batched`` one pays the share of the latency its bytes take of a bucket; a ``queued``
        one (gradient sync) too, at the in-step factor. A bucket holds at most the model's
        parameters (``bucket_bytes``): a small model's ZeRO gathers are one collective, each
        paying a full latency, as its gradient buckets are (priced as a share of 25 MiB, they
        cost gpt-tiny's a fiftieth of one, and the solver mixed ZeRO-1 parameters into 'ddp':
        predicted 11% under it on 4 processes, measured 1.6x it)."""
        n = self.mesh.shape[a]
        kind = axis_collective(s, d)
        if n == 1 or kind is None:
            local = isinstance(s, Replicate) and isinstance(d, Partial) and n > 1 and not (queued or batched)
            return (self._local_copies(None, s, d, nbytes, n) if local else 0.0), 0.0, False
        kind = own or kind
        link = self._link(kind, a)
        each = nbytes / n if kind in ALL_TO_ALLS else nbytes   # N, as collective_time reads it
        if queued or batched:
            time = self._in_bucket(kind, each, n, link, nbytes, self.sync_scale if queued else 1.0)
        else:
            time = collective_time(kind, each, n, link) + self._local_copies(kind, s, d, nbytes, n)
        return (time, each * (n - 1) / n * (2 if kind == "all_reduce" else 1), link is not self.links[a])

    def _summed_by_job(self, placements: Placements, into: bool = False) -> bool:
        """Is a gradient placed ``placements`` (a partial sum on every axis; ``into``: replicated on
        every axis, what it is summed into) summed by one all-reduce of the whole job? The runtime
        sums a bucket reduced over every axis of a mesh that is the whole job in one collective
        (``autopar.core.collectives.spans_job``), not one per axis; a pipeline stage's mesh is not
        the job (``MeshSpec.job_size``)."""
        wanted = Replicate if into else Partial
        return (sum(n > 1 for n in self.mesh.shape) > 1 and self.mesh.processes == self.mesh.size
                and all(isinstance(p, wanted) for p in placements))

    def _job_all_reduce(self, nbytes: float) -> tuple[float, bool]:
        """A queued gradient all-reduce of ``nbytes`` over every rank (``_summed_by_job``): (seconds,
        over a profiled link), its latency a bucket's share at the in-step factor. Its link is the
        profile's for groups of the whole mesh, else the slowest of the axes' (a ring crossing
        nodes is bound by the inter-node one)."""
        n = self.mesh.size
        measured = self.profile.link("all_reduce", n) if self.profile is not None else None
        link = measured or min(self.links, key=lambda k: (k.bandwidth, -k.latency))
        return self._in_bucket("all_reduce", nbytes, n, link, nbytes, self.sync_scale), measured is not None

    def _in_bucket(self, kind: str, each: float, n: int, link: Link, nbytes: float, scale: float) -> float:
        """Seconds of collective ``kind`` (``each``: its ``N``) run in a bucket: its bytes at the link's
        bandwidth, and the share of the bucket's latency its ``nbytes`` take (at in-step factor
        ``scale``). Sizes may be symbolic."""
        time = collective_time(kind, each, n, link)
        latency = time - collective_time(kind, each, n, Link(link.bandwidth, 0.0))
        return time - latency + latency * scale * minimum(1.0, nbytes / self.bucket_bytes)

    def _local_copies(self, kind: str | None, s: Placement, d: Placement, nbytes: float, n: int) -> float:
        """Seconds of the memory work a blocking move does on its rank beside the collective the
        profile timed (gathered or scattered along the first dim, in buffers the allocator
        reuses): the relayout DTensor makes for a split along another dim (the gathered tensor
        concatenated, the scattered one packed), and the page faults of each buffer above
        ``FRESH_BUFFER_BYTES`` (the collective's result, the relayout's); or, with no collective
        (``kind`` None), the pass that makes a replica a partial sum. Gradient buckets and
        ZeRO gathers run in buffers of their own, and the roofline (no profile) knows no such
        work: 0 for them."""
        if self.profile is None:
            return 0.0
        relayout_s, fresh_s = (self.profile.overheads.get(k, 0.0) / 2**20 for k in PER_MIB_OVERHEADS)
        if kind is None:   # a replica made a partial sum: each rank's share, the value divided by n
            return nbytes * relayout_s + _above_reuse(nbytes) * fresh_s
        # DTensor's all-to-all on gloo gathers the whole tensor before it chunks it
        result = nbytes / n if kind in ("reduce_scatter", "all_to_all_single") else nbytes
        seconds = _above_reuse(result) * fresh_s
        split = s if kind == "all_gather" else d if kind == "reduce_scatter" else None
        if isinstance(split, Shard) and split.dim != 0:   # the relayout: the whole tensor copied anew
            seconds = seconds + nbytes * relayout_s + _above_reuse(nbytes) * fresh_s
        return seconds

    def _earlier_reduce_scatters(self, queued_s):
        """The ZeRO-3 reduce-scatters of the k - 1 microbatches before the last, blocking as far as
        their backward does not hide them (a float, or an array of queued seconds)."""
        return queued_s * (self.microbatches - 1) * (1.0 - self.overlap_efficiency)

    def _link(self, kind: str, axis: int) -> Link:
        """The profile's fitted link for this collective and group size, else the preset's."""
        measured = self.profile.link(kind, self.mesh.shape[axis]) if self.profile is not None else None
        return measured or self.links[axis]

    # ------------------------------------------------------------ nodes
    def node(self, nc: NodeChoices, s: Strategy) -> Cost:
        val = tensor_val(nc.node)
        if nc.kind == "param":
            return self._param(nc, s, val)
        if nc.kind in ("input", "buffer"):
            return Cost(state_bytes=_bytes(val) * shard_fraction(s.out, self.mesh.shape))
        if nc.kind in ("output", "alias") or val is None or nc.node.name in self.space.folded:
            return Cost()   # a folded op runs once, at the first step: nothing a step (its result is small)
        load = self._load(nc, s)
        compute = self._compute(nc, s, val)
        inside = self._inside(nc, s, compute.compute_s)
        by_parts = self.saved is not None and self.saved(nc.node).by_parts
        if by_parts:   # its collectives' buffers are among the temporaries its ``working`` hook counts
            inside = replace(inside, transient_bytes=0.0)
        compute = (compute + inside).busier(load)
        recomputed = nc.node in self.block_of
        if recomputed:   # its forward runs again in the backward, with the collectives it runs inside itself
            again = compute.compute_s / self.microbatches - compute.backward_s
            rerun = self._inside(nc, s, again * self.microbatches, grad=False).busier(load)
            compute = replace(compute, compute_s=compute.compute_s + again * self.microbatches,
                              timed_s=compute.timed_s * (1 + again * self.microbatches / (compute.compute_s or 1.0)),
                              backward_s=compute.backward_s + again) + replace(rerun, transient_bytes=0.0)
        out_bytes = _bytes(val) * shard_fraction(s.out, self.mesh.shape)
        if self._grad(nc.node):
            compute = compute + Cost(output_grad_bytes=out_bytes)
        if nc.node.target in VIEW_OPS:   # aliases: no data moved, nothing kept
            return compute
        kept, internal = self._kept(nc, s, val)
        kept, internal = kept + internal * (load - 1.0), internal * load
        # Working memory: the output (its gradient, in the backward), the op's internal tensors
        # (their gradients: none held at once where the backward frees them part by part) and
        # its own temporaries; input gradients are tracked by the schedule.
        entry = entry_for(nc.node)
        internal = 0.0 if by_parts else internal
        if entry is not None and entry.working is not None:
            internal = internal + entry.working(nc.node, s, self.mesh.shape) * load
        if recomputed:
            inputs = sum(b for k, b in enumerate(self.input_bytes(nc, s)) if k in self._block_inputs.get(nc.node, ()))
            return compute + Cost(saved_bytes=inputs, recomputed_bytes=kept, transient_bytes=out_bytes + internal)
        return compute + Cost(saved_bytes=kept, transient_bytes=out_bytes + internal)

    def node_signature(self, nc: NodeChoices) -> tuple:
        """Everything ``node`` reads of a node besides the strategy: nodes with equal signatures
        (the same op in identical layers) cost the same under each strategy they both have.
        Whether it is recomputed, and which block inputs it keeps, set apart identical layers
        of which only the first are recomputed (``Planner._lighter``)."""
        node = nc.node
        saved = self.saved(node) if self.saved is not None and nc.kind == "op" else NOTHING
        counted = self._counted.get(node, frozenset()) & saved.inputs
        target = node.target if nc.kind == "op" else None   # a placeholder's is its name, one a layer
        return (nc.kind, nc.trains, target, _signature(tensor_val(node)),
                node in self.block_of, self._block_inputs.get(node, frozenset()),
                tuple(_signature(tensor_val(i)) for i in nc.inputs),
                tuple(repr(a.meta.get("val")) for a in node.all_input_nodes if tensor_val(a) is None),
                self.saved.grad.get(node, False) if self.saved is not None else None, saved, counted,
                tuple(_signature(tensor_val(_storage_root(nc.inputs[k]))) for k in sorted(counted)))

    def input_bytes(self, nc: NodeChoices, s: Strategy, floating_only: bool = False) -> list[float]:
        """Local bytes of each of the node's tensor inputs under strategy ``s``."""
        return [_bytes(tensor_val(i)) * shard_fraction(p, self.mesh.shape) for i, p in zip(nc.inputs, s.ins, strict=True)
                if not floating_only or tensor_val(i).dtype.is_floating_point]

    def _accumulates(self, s: Strategy) -> bool:
        """Does a parameter's gradient accumulate whole over the step's microbatches (ZeRO-1)?"""
        return s.accumulated and s.storage != s.out and self.microbatches > 1

    def offloads(self, s: Strategy) -> bool:
        """Does a parameter stored and used as ``s`` keep its state in host memory (``offload``)?"""
        return self.offload and s.storage is not None and s.storage != s.out

    def _param(self, nc: NodeChoices, s: Strategy, val: torch.Tensor) -> Cost:
        """A parameter's storage, gradient, optimizer states and update, and its gathers. A frozen
        one (``NodeChoices.trains`` false) holds its shard alone: no gradient, no states, no update,
        and nothing goes back to its storage (``edge``: no gradient flows into it)."""
        local = _bytes(val) * shard_fraction(s.storage, self.mesh.shape)
        whole = _bytes(val) * shard_fraction(s.out, self.mesh.shape)
        opt = self.optimizer
        # reduce-scatters of its gradient a step
        reductions = 0 if not nc.trains else 1 if self._accumulates(s) else self.microbatches
        overhead = self.param_overhead() if nc.trains else 0.0   # measured by the profile's micro-benchmarks
        if self.offloads(s) and self.hw.host_bandwidth > 0:
            # the shard copied to the device for each gather (once a step if kept, again for a
            # recomputed block's backward), each reduced gradient back; the update on the host
            gathers = 1 if s.kept else self.microbatches * (2 if nc.node in self.block_of else 1)
            copies = (gathers + reductions) * (local / self.hw.host_bandwidth + self.hw.op_overhead_s)
            update = (opt.update_bytes * local / self.hw.host_memory_bandwidth + self.hw.op_overhead_s
                      + overhead) if nc.trains else 0.0
            cost = Cost(compute_s=update, timed_s=overhead, comm_s=copies, transient_bytes=local,
                        comm_bytes=(0.0,) * self.mesh.ndim)
        elif nc.trains:
            update = compute_time(0, opt.update_bytes * local, self.hw, val.dtype) + overhead
            cost = Cost(compute_s=update, timed_s=overhead, state_bytes=local * (1 + opt.states), grad_bytes=local,
                        transient_bytes=local * opt.temp, comm_bytes=(0.0,) * self.mesh.ndim)
        else:
            cost = Cost(state_bytes=local, comm_bytes=(0.0,) * self.mesh.ndim)
        if self._accumulates(s) and nc.trains:   # ZeRO-1: the microbatches' gradients summed whole on the device
            cost = replace(cost, grad_bytes=whole)
        if s.storage != s.out and s.kept:
            # ZeRO-1/2: gathered once a step (the first forward after the optimizer changed the
            # shard) and kept whole; each forward unpacks it into the copies its ops keep
            gather = self.redistribute(val.shape, val.dtype, s.storage, s.out, batched=True, once=True)
            return cost + gather + Cost(state_bytes=whole, saved_bytes=whole)
        if s.storage != s.out:  # ZeRO-3: gathered on use; the gathered copy is kept until backward
            gather = self.redistribute(val.shape, val.dtype, s.storage, s.out, batched=True)
            if nc.node in self.block_of:   # gathered inside a recomputed block: again for its backward
                return cost + gather + gather + Cost(recomputed_bytes=whole)
            cost = cost + gather + Cost(saved_bytes=whole)
        return cost

    def _compute(self, nc: NodeChoices, s: Strategy, val: torch.Tensor) -> Cost:
        timed = self.measured_time(nc, s)
        if timed is not None:
            scale = self.profile.calibration.get("ops", 1.0) if self.calibrated(nc, s) else 1.0
            seconds = timed.total_s * scale * self.microbatches
            return Cost(compute_s=seconds, timed_s=seconds, backward_s=timed.bwd_s * scale)
        if nc.node.target in VIEW_OPS:
            return Cost()
        split = 1
        for a, n in enumerate(self.mesh.shape):
            if is_split(s.out[a]) or any(is_split(i[a]) for i in s.ins):
                split *= n
        moved = self._working_bytes(nc, s)
        entry = entry_for(nc.node)
        share = entry.flop_share(nc.node, s, self.mesh.shape) if entry is not None and entry.flop_share else 1.0
        flops = self.flops(nc.node) / split * share
        if self.efficiency is not None and not (flops == 0 and moved == 0):
            shapes = [largest_shard_shape(tensor_val(i).shape, p, self.mesh.shape) for i, p in zip(nc.inputs, s.ins, strict=True)]
            fwd, bwd = op_seconds(nc.node, shapes, flops, moved, self.efficiency, self.hw, val.dtype)
        else:
            fwd = compute_time(flops, moved, self.hw, val.dtype)
            bwd = compute_time(BACKWARD_FACTOR * flops, BACKWARD_FACTOR * moved, self.hw, val.dtype)
        if not self._grad(nc.node):
            bwd = 0.0
        return Cost(compute_s=(fwd + bwd) * self.microbatches, backward_s=bwd)

    def _inside(self, nc: NodeChoices, s: Strategy, compute_s: float, grad: bool | None = None) -> Cost:
        """The collectives an op runs inside itself (``autopar.core.ops``: a loss over a split batch
        made whole sums its local losses, a training batch norm split by batch its statistics, ring
        attention its key/value blocks). Those in flight while the op computes (``hidden_by``, a
        share of its ``compute_s``) are hidden by that compute as far as this host overlaps an
        asynchronous collective with compute (``overlap_efficiency``, measured): a ring step's
        exposed time is what its transfer takes beyond the block computed meanwhile. Moving a
        block a step, such a collective holds no whole tensor: the blocks it holds are the op's
        working memory (``@working``). The others run one after another (Ulysses' eight
        all-to-alls, the experts' dispatch and combine): the op holds one's buffers at a time, the
        largest's. ``grad=False``: the forward's alone (what a recomputed forward runs again)."""
        entry = entry_for(nc.node)
        if entry is None or entry.collectives is None:
            return Cost()
        grad = self._grad(nc.node) if grad is None else grad
        inside = entry.collectives(nc.node, s, self.mesh.shape, grad, self.space.loss_with_gradients)
        blocking, hideable, share, buffers = Cost(), Cost(), 0.0, 0.0
        for c in inside:
            moved = self.redistribute(c.shape, c.dtype, c.src, c.dst, kind=c.kind, in_step=c.in_step)
            if c.hidden_by:
                hideable, share = hideable + replace(moved, transient_bytes=0.0), max(share, c.hidden_by)
            else:
                blocking, buffers = blocking + replace(moved, transient_bytes=0.0), maximum(buffers, moved.transient_bytes)
        hidden = self.overlap_efficiency * minimum(hideable.comm_s, share * compute_s)
        return replace(blocking, transient_bytes=buffers) + replace(hideable, comm_s=hideable.comm_s - hidden)

    def _load(self, nc: NodeChoices, s: Strategy) -> float:
        """The share of the mean work this op's busiest rank does (``OpEntry.imbalance``): 1 but
        for experts split by expert under a skewed router."""
        entry = entry_for(nc.node)
        return 1.0 if entry is None or entry.imbalance is None else entry.imbalance(s, self.skew_on)

    def skew_on(self, axis: int) -> float:
        """The router's skew priced on experts split by expert over mesh ``axis`` (``expert_skew``:
        one factor, or one per axis size: 1 for a size it does not name)."""
        skew = self.expert_skew
        return float(skew) if isinstance(skew, (int, float)) else float(skew.get(self.mesh.shape[axis], 1.0))

    def _working_bytes(self, nc: NodeChoices, s: Strategy) -> float:
        """Local bytes an op's forward reads and writes: its inputs and its output."""
        return sum(self.input_bytes(nc, s)) + _bytes(tensor_val(nc.node)) * shard_fraction(s.out, self.mesh.shape)

    def calibrated(self, nc: NodeChoices, s: Strategy) -> bool:
        """Whether calibration's in-step "ops" factor scales this op's measured time
        (``Profile.in_cache``)."""
        return self.profile is not None and self.profile.in_cache(self._working_bytes(nc, s))

    def measured_time(self, nc: NodeChoices, s: Strategy) -> OpTime | None:
        """The profile's forward and backward seconds of this op call, as measured alone."""
        if self.profile is None or not self.profile.ops:
            return None
        from cost_models.profile_ops import op_call  # profiling is optional: import on use
        call = op_call(nc, s, self.mesh.shape, self.saved.grad)
        return self.profile.ops.get(call.key) if call is not None else None

    def _grad(self, node: fx.Node) -> bool:
        return self.saved is not None and self.saved.grad.get(node, False)

    def move_overhead(self, src: NodeChoices, s: Strategy, dst: NodeChoices, d: Strategy, i: int) -> float:
        """The generated code's wrapping cost of the edge into input ``i`` of ``dst``, beyond its
        collectives (ops themselves run as the profile timed them): a placement change
        (``runtime.move``) where the placement or the gradient's differs (see ``moves``); a
        parameter read through ``runtime.param_shard`` where the op does not read it as stored
        (one read as stored is its plain local shard)."""
        if dst.kind == "output" or tensor_val(src.node) is None:
            return 0.0
        return self._wrapping(src, s.out, s.storage, d.ins[i], grad_placement(d.ins[i], d.ins, d.out))

    def _wrapping(self, src: NodeChoices, out: Placements, storage: Placements | None, inp: Placements,
                  grad: Placements) -> float:
        if src.kind == "param":
            return runtime_overhead(self.profile, {"param_read": self.microbatches}) if inp != (storage or out) else 0.0
        moved = moves(out, inp, grad, self._grad_flows(src))
        return runtime_overhead(self.profile, {"move": self.microbatches}) if moved else 0.0

    def param_overhead(self) -> float:
        """The runtime's cost per parameter tensor, beyond its bytes: its gradient hook and its
        optimizer update as a DTensor. A plan that splits any parameter keeps every one a DTensor
        (torch's foreach optimizers cannot mix DTensors and plain tensors), so each parameter,
        priced alone, pays that, its replicated ones too; a plan that splits none and reads each
        as stored keeps them plain, as DDP does (``runtime.replicated``), and
        ``schedule.step_costs`` takes ``plain_saving`` off each (``schedule.parameter_saving``). Priced by its own storage, a replicated parameter cost the
        plain price in any plan: the solver mixed in a few ZeRO-1 parameters for gpt-tiny on 4
        processes, predicted 11% under 'ddp', measured 1.6x it."""
        return runtime_overhead(self.profile, {"optimizer_per_param": 1, "grad_hook": 1})

    def plain_saving(self) -> float:
        """How much less a parameter's optimizer update costs as a plain tensor than as a DTensor."""
        return max(0.0, runtime_overhead(self.profile, {"optimizer_per_param": 1})
                   - runtime_overhead(self.profile, {"optimizer_per_plain_param": 1}))

    def step_overhead(self) -> float:
        """The runtime's fixed cost of one training step (a forward and backward per microbatch)."""
        return runtime_overhead(self.profile, {"step": self.microbatches})

    def _kept(self, nc: NodeChoices, s: Strategy, val: torch.Tensor) -> tuple[float, float]:
        """Bytes of the activations this op keeps for its backward, at the strategy's placements,
        and of those that are internal (neither an input nor the output). An input kept by
        several ops is one tensor: only its first keeper counts it."""
        saved: Saved = self.saved(nc.node) if self.saved is not None else NOTHING
        mesh = self.mesh.shape
        total = _bytes(val) * shard_fraction(s.out, mesh) if saved.output else 0.0
        for k in saved.inputs & self._counted.get(nc.node, frozenset()):
            total += _bytes(tensor_val(_storage_root(nc.inputs[k]))) * shard_fraction(s.ins[k], mesh)
        # internal tensors are per row of the split input (attention's row statistics follow the
        # queries), unless the op says otherwise (a MoE layer's dispatched rows follow its tokens
        # and, split within its experts, their intermediate values the experts: ``Kept.share``)
        share = (saved.share(s.ins, mesh) if saved.share is not None
                 else min((shard_fraction(p, mesh) for p in s.ins), default=1.0))
        internal = saved.extra_bytes * share
        return total + internal, internal

    def _first_keepers(self) -> dict[fx.Node, frozenset[int]]:
        """For each op, the inputs it is the first to keep (parameters and buffers excluded:
        their memory is the parameter's own)."""
        if self.saved is None:
            return {}
        own = {nc.node for nc in self.space.nodes if nc.kind in ("param", "buffer")}
        claimed: set[fx.Node] = set()
        counted: dict[fx.Node, frozenset[int]] = {}
        for nc in self.space.nodes:
            if nc.kind != "op":
                continue
            mine = set()
            for k in sorted(self.saved(nc.node).inputs):
                root = _storage_root(nc.inputs[k])
                if root not in own and root not in claimed:
                    claimed.add(root)
                    mine.add(k)
            counted[nc.node] = frozenset(mine)
        return counted

    def _first_block_readers(self) -> dict[fx.Node, frozenset[int]]:
        """For each op in a recomputed block, the inputs from outside the block (activations, not
        parameters, buffers or folded values: those are held once, for every block) it is the
        first of its block to read: the checkpoint keeps those."""
        own = {nc.node for nc in self.space.nodes if nc.kind in ("param", "buffer") or nc.node.name in self.space.folded}
        claimed: set[tuple[int, fx.Node]] = set()
        readers: dict[fx.Node, frozenset[int]] = {}
        for nc in self.space.nodes:
            block = self.block_of.get(nc.node)
            if block is None or nc.kind != "op":
                continue
            mine = set()
            for k, inp in enumerate(nc.inputs):
                root = _storage_root(inp)
                outside = self.block_of.get(root) != block and root not in own
                if outside and (block, root) not in claimed and tensor_val(root) is not None:
                    claimed.add((block, root))
                    mine.add(k)
            readers[nc.node] = frozenset(mine)
        return readers

    def flops(self, node: fx.Node) -> float:
        """Forward FLOPs of the whole (unsharded) op, counted by PyTorch's FlopCounterMode once per
        node and once per process for each signature (``_counted_flops``): identical layers, and
        every plan of the same model, share the count."""
        if node not in self._node_flops:
            flops, failure = _counted_flops(node)
            if failure is not None and (str(node.target), failure) not in self._flop_failures:
                msg = (f"cannot count the FLOPs of {node.target} ({node.name}: {failure}); "
                       "it is costed as memory-bound (0 FLOPs): run `autopar profile` to measure it")
                self._flop_failures.add((str(node.target), failure))   # said once per op and cause
                self.space.warnings.append(msg)
                log.warning("autopar: %s", msg)
            self._node_flops[node] = flops
        return self._node_flops[node]

    # ------------------------------------------------------------ edges
    def edge(self, src: NodeChoices, s: Strategy, dst: NodeChoices, d: Strategy, i: int) -> Cost:
        """Forward redistribution of ``src``'s output into input ``i`` of ``dst``, plus the backward
        redistribution of that input's gradient into ``src``'s gradient placement (a parameter's is
        its synchronisation, queued asynchronously: ``overlap_s``): ``edge_grid`` of this pair."""
        return self._grid(src, [s], dst, [d], i)[0, 0]

    def _joined(self, src: NodeChoices, val: torch.Tensor, grad: Placements) -> Cost:
        """A parameter several ops read (a tied embedding) sums their gradients: one arriving
        replicated on an axis (``_arrival``) joins the others' partial sums there, divided by the
        axis size (DTensor's accumulation; gpt2-125m's tied embedding read replicated and by a
        batch-split LM head, on 2x2: two passes over 147 MiB, 1.4 s of a step). Priced for every
        replicated axis, whether or not another read is partial there: the reads are priced apart."""
        joined = tuple(Partial() if isinstance(g, Replicate) else g for g in grad)
        if len(src.node.users) < 2 or not self._grad_flows(src) or joined == tuple(grad):
            return Cost()
        return self.redistribute(val.shape, val.dtype, grad, joined)

    def _gathered_alone(self, src: NodeChoices, out: Placements, storage: Placements | None, kept: bool,
                        inp: Placements, grad: Placements) -> float:
        """A ZeRO parameter's gather is priced (``_param``) as one in a group of them, paying its
        share of the group's latency; a read that does not fit a group's gather
        (``placements.gathered_in_group``) has the generated code gather the parameter alone: it
        adds the rest of the latency, shared among the parameter's readers (seconds, blocking)."""
        if storage in (None, out):
            return 0.0
        if gathered_in_group(storage, out, inp, grad, src.trains):
            return 0.0   # grouped (a parameter that trains has a gradient: ``_grad_flows``)
        val = tensor_val(src.node)
        times = 2 if not kept and src.node in self.block_of else 1   # gathered again for a recomputed block's backward
        alone = self.redistribute(val.shape, val.dtype, storage, out, once=kept).comm_s
        grouped = self.redistribute(val.shape, val.dtype, storage, out, batched=True, once=kept).comm_s
        return times * (alone - grouped) / max(1, len(src.node.users))

    def _synced_dtype(self, src: NodeChoices) -> torch.dtype:
        """The dtype a gradient synchronisation (``_queued``) moves: the parameters' gradients it is
        summed with (an op computed from parameters, a bf16 cast of one, passes its partial
        gradient down to them: ``autopar.core.gradients.partial_passes``), narrowed to bf16 where
        ``reduce_precision`` says so."""
        dtype = tensor_val(src.node).dtype if src.kind == "param" else self._from_params[src.node]
        return reduce_dtype(self.reduce_precision, dtype)

    def _local_gradient(self, val: torch.Tensor, out: Placements) -> float:
        """Bytes of a parameter's gradient as it is synchronised (placed ``out``, in
        ``reduce_precision``). Held once more while it is: a ZeRO parameter's, packed with its
        group's for their reduce-scatter (``codegen.zero3``); a replicated one's, as the sum its
        bucket's all-reduce returns in a buffer of its own (``codegen.grad_sync``), ``grad`` once
        the backward ends."""
        return _numel(val.shape) * _itemsize(reduce_dtype(self.reduce_precision, val.dtype)) * shard_fraction(out, self.mesh.shape)

    def _returned(self, val: torch.Tensor, out: Placements) -> Cost:
        """An output returned to the caller at the end of the forward (a language model's logits
        beside its loss): gathered whole on every rank (``gather_outputs``), or this rank's part.
        ``train_step`` keeps only the loss from there on: the rest is working memory of the
        forward's end, not held through the backward."""
        if not self.gather_outputs or evenly_split(out, val.shape, self.mesh.shape):   # gathered only where read
            return Cost(transient_bytes=_bytes(val) * shard_fraction(out, self.mesh.shape))
        replicated = (Replicate(),) * self.mesh.ndim
        return self.redistribute(val.shape, val.dtype, out, replicated) + Cost(transient_bytes=_bytes(val))

    def edge_grid(self, src: NodeChoices, dst: NodeChoices, i: int) -> "EdgeGrid":
        """``edge`` for every pair of strategies, priced as grids over their distinct layouts."""
        return self._grid(src, src.strategies, dst, dst.strategies, i)

    def _grid(self, src: NodeChoices, sources: Sequence[Strategy], dst: NodeChoices, consumers: Sequence[Strategy],
              i: int) -> "EdgeGrid":
        """The edge from ``src`` into input ``i`` of ``dst`` (see ``edge``) for every pair of
        ``sources`` and ``consumers`` strategies: each source's output and storage layout is a row
        class, each consumer's input and gradient layout a column class, priced once."""
        val = tensor_val(src.node)
        rows, src_reps = _classes([(s.out, s.storage, self._accumulates(s), s.kept) for s in sources])
        cols, dst_reps = _classes([(d.ins[i], grad_placement(d.ins[i], d.ins, d.out)) for d in consumers])
        if val is None or (src.node.name in self.space.folded and dst.kind != "output"):
            return EdgeGrid(rows, cols, Cost(), ())   # a folded value is moved once, with it
        if dst.kind == "output":
            return EdgeGrid(rows, cols, *self._returned_grid(val, [out for out, *_ in src_reps], len(dst_reps)))
        grid, blocking = self.redistribute_grid(val.shape, val.dtype, [out for out, *_ in src_reps],
                                                [inp for inp, _ in dst_reps])
        again = 2.0 if dst.node in self.block_of else 1.0   # moved inside a recomputed block: again for its backward
        if again != 1.0:
            grid = replace(grid, comm_s=grid.comm_s * again, comm_bytes=tuple(b * again for b in grid.comm_bytes))
            blocking = [Term(t.rows, t.cols, np.asarray(t.core) * again) for t in blocking]
        if self._grad_flows(src):
            back, terms = self._gradient_grid(src, val, src_reps, dst_reps)
            grid, blocking = grid + back, blocking + terms
        every = (np.arange(len(src_reps)), np.arange(len(dst_reps)))
        if src.kind == "param":   # gathered alone, gradients joined
            alone = np.array([[self._gathered_alone(src, out, storage, kept, inp, grad)
                               + self._joined(src, val, _arrival(grad, grad_target(out, storage))).comm_s
                               for inp, grad in dst_reps] for out, storage, _, kept in src_reps])
            grid = replace(grid, comm_s=grid.comm_s + alone)  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields
            blocking.append(Term(*every, alone))
        if runtime_overhead(self.profile, {"move": 1, "param_read": 1}):
            wrapping = again * np.array([[self._wrapping(src, out, storage, inp, grad) for inp, grad in dst_reps]
                                         for out, storage, *_ in src_reps])
            grid = replace(grid, compute_s=grid.compute_s + wrapping, timed_s=grid.timed_s + wrapping)  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields
            blocking.append(Term(*every, wrapping))
        return EdgeGrid(rows, cols, grid, tuple(blocking))

    def _returned_grid(self, val: torch.Tensor, outs: list[Placements], columns: int) -> tuple[Cost, tuple[Term, ...]]:
        """``_returned`` of each of ``outs`` (rows) as a grid of ``columns`` equal columns, with its
        blocking terms."""
        if not self.gather_outputs or all(evenly_split(out, val.shape, self.mesh.shape) for out in outs):
            held = [self._returned(val, out).transient_bytes for out in outs]
            return Cost(transient_bytes=np.repeat(np.array(held)[:, None], columns, 1)), ()  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields
        grid, blocking = self.redistribute_grid(val.shape, val.dtype, outs, [(Replicate(),) * self.mesh.ndim] * columns)
        lazy = np.array([evenly_split(out, val.shape, self.mesh.shape) for out in outs])[:, None]
        local = np.array([self._returned(val, out).transient_bytes for out in outs])[:, None]
        return _rows_dropped(grid, blocking, lazy, np.where(lazy, local, _bytes(val)))

    def _gradient_grid(self, src: NodeChoices, val: torch.Tensor, src_reps: list, dst_reps: list
                       ) -> tuple[Cost, list[Term]]:
        """The backward of an edge's grid: each consumer's gradient (column) redistributed to where
        ``src`` keeps it (row); a queued sync's ZeRO reduce-scatters of the earlier microbatches,
        its packed gradient, and an all-reduced parameter gradient's sum, held beside it."""
        queued = self._queued(src)
        back, terms = self.redistribute_grid(val.shape, self._synced_dtype(src) if queued else val.dtype,
                                             [g for _, g in dst_reps],
                                             [grad_target(out, storage) for out, storage, *_ in src_reps], queued=queued)
        back, terms = _transposed(back), [t.transposed() for t in terms]
        if queued and self.microbatches > 1:   # ZeRO-2/3 rows reduce-scatter every microbatch
            zero3 = np.array([storage not in (None, out) and not whole for out, storage, whole, _ in src_reps])[:, None]
            earlier = np.where(zero3, self._earlier_reduce_scatters(back.overlap_s), 0.0)
            back = replace(back, comm_s=back.comm_s + earlier)  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields
            terms.insert(0, Term(np.arange(len(src_reps)), np.arange(len(dst_reps)), earlier))
        if queued:
            packed = np.array([self._local_gradient(val, out) if storage not in (None, out) else 0.0
                               for out, storage, *_ in src_reps])[:, None]
            back = replace(back, transient_bytes=back.transient_bytes + packed)  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields
        if src.kind == "param":
            summed = np.array([self._local_gradient(val, out) if storage in (None, out) else 0.0
                               for out, storage, *_ in src_reps])[:, None]
            back = replace(back, synced_bytes=np.where(back.overlap_s != 0, summed, 0.0))  # type: ignore[arg-type]  # a grid of costs: arrays in Cost's fields
        return back, terms

    def _computed_from_parameters(self) -> dict[fx.Node, torch.dtype]:
        """Ops whose gradient may stay partial down to the parameters (``core.gradients``), as
        position embeddings' may, with the dtype of those parameters (the widest). Run replicated,
        their gradient is summed with the parameters', in gradient sync's buckets: the edge out of
        such an op into one that splits the batch is priced as that queued sync, not as a
        blocking all-reduce in the backward. Not knowing the plan, the values with no gradient
        they may read are those that do not depend on the batch (positions, folded masks)."""
        kind = {nc.node: nc.kind for nc in self.space.nodes}
        data: set[fx.Node] = set()   # what depends on the batch
        for nc in self.space.nodes:
            if nc.kind == "input" or any(i in data for i in nc.node.all_input_nodes):
                data.add(nc.node)
        ops = [nc.node for nc in self.space.nodes if nc.kind == "op"]
        found: dict[fx.Node, torch.dtype] = {}
        for node in computed_from_parameters(ops, lambda n: kind.get(n) == "param", self._grad, lambda n: n not in data):
            dtypes = [found.get(i) or tensor_val(i).dtype for i in node.all_input_nodes
                      if kind.get(i) == "param" or i in found]
            found[node] = max(dtypes, key=_itemsize, default=tensor_val(node).dtype)
        return found

    def _queued(self, src: NodeChoices) -> bool:
        """Is the gradient redistribution out of ``src`` a queued gradient synchronisation? A
        parameter's, and that of an op computed from parameters alone (``_computed_from_parameters``)."""
        return src.kind == "param" or src.node in self._from_params

    def _grad_flows(self, src: NodeChoices) -> bool:
        """Does a gradient flow back into ``src``'s output? Not into integers, inputs, buffers and
        what derives from them only."""
        return self.saved is None or self.saved.grad.get(src.node, False)

    def edge_signature(self, src: NodeChoices, dst: NodeChoices) -> tuple:
        """What ``edge_grid`` reads of an edge's ends besides their strategies and the value's
        shape: edges with equal signatures share one grid (``schedule.PricedSpace``)."""
        flows = self._grad_flows(src)
        return (src.kind, src.trains, dst.kind, src.node.name in self.space.folded, dst.node in self.block_of, flows,
                self._synced_dtype(src) if flows and self._queued(src) else None,
                src.node in self.block_of, len(src.node.users))   # a parameter's lone gather and joined gradient


def recomputed_blocks(space: StrategySpace, recompute: str | Mapping[str, RecomputeMode]) -> dict[fx.Node, int]:
    """The region number of every node recomputed in the backward under ``recompute`` (and of
    every parameter first read in one): each repeated block under "full", each attention core
    under "selective" (``autopar.core.blocks``), nothing under "none"; or as a ``Plan.recompute``
    (block path -> mode) says, block by block."""
    if isinstance(recompute, str) and recompute not in RECOMPUTE:
        raise AutoparError(f"recompute is one of {', '.join(RECOMPUTE)} (or 'auto' when planning), got {recompute!r}")
    if recompute in ("none", {}) or not space.nodes:
        return {}
    graph = space.nodes[0].node.graph
    modes = recompute if not isinstance(recompute, str) else recompute_modes(graph, recompute)
    return block_of(graph, recomputed_regions(graph, modes))


def _classes(keys: Sequence) -> tuple[np.ndarray, list]:
    """Each key's class number, and the distinct keys in order of first appearance."""
    index: dict = {}
    for key in keys:
        index.setdefault(key, len(index))
    return np.array([index[key] for key in keys], dtype=np.intp), list(index)


def _collective_buffers(full: float, largest_fraction: float | np.ndarray) -> float | np.ndarray:
    """Bytes a redistribution holds while it runs (a float, or an array of fractions): the result
    and the backend's staging copy of it, each the larger of the source and destination shards."""
    return 2 * full * largest_fraction


def _others_fraction(placements: Placements, axis: int, mesh_shape: Sequence[int]) -> float:
    """Fraction of a tensor one group along ``axis`` holds: the shards of the other axes only."""
    return shard_fraction(tuple(p if a != axis else Replicate() for a, p in enumerate(placements)), mesh_shape)


def _arrival(grad: Placements, target: Placements) -> Placements:
    """Where a parameter read's gradient ``grad`` reaches the parameter (placed ``target``): the
    read's redistribution, differentiated, moves it there but for its partial sums, which
    gradient sync reduces (``_reduced``)."""
    return tuple(g if isinstance(g, Partial) else t for g, t in zip(grad, target, strict=True))


def _reduced(queued: bool, src: Placement) -> bool:
    """Is one mesh axis of a queued gradient synchronisation queued? Its reductions are (summed in
    gradient sync's buckets and ZeRO's groups); a gradient's other moves run in the backward as
    its read's redistribution is differentiated, blocking it (gpt2-125m's tied embedding read by
    vocabulary on 2x2: its 147 MiB gradient gathered twice, 2 s of a step)."""
    return queued and isinstance(src, Partial)


def _above_reuse(nbytes):
    """Bytes of a buffer beyond what the allocator reuses (``FRESH_BUFFER_BYTES``); sizes may be symbolic."""
    return nbytes - minimum(nbytes, FRESH_BUFFER_BYTES)


def _transposed(c: Cost) -> Cost:
    """A grid ``Cost`` (``redistribute_grid``) with sources and destinations swapped."""
    t = lambda x: x.T if isinstance(x, np.ndarray) else x
    return Cost(**{n: t(getattr(c, n)) for n in _SUMMED}, comm_bytes=tuple(map(t, c.comm_bytes)), measured=t(c.measured))


def _scalar(x):
    """A grid's entry as a float (a sympy expression where the shape is symbolic)."""
    return x if isinstance(x, sympy.Basic) else float(x)


def _at(x, r: int, c: int):
    return x[r, c] if isinstance(x, np.ndarray) else x


@dataclass(frozen=True)
class EdgeGrid:
    """An edge's cost for every pair of strategies, factored: it depends only on the source's
    output and storage layouts (its row class) and on the input's layout and gradient layout
    (its column class), far fewer than the strategies on 2-D and 3-D meshes."""
    rows: np.ndarray    # per source strategy: its class
    cols: np.ndarray    # per destination strategy: its class
    classes: Cost       # a grid Cost (``CostModel.redistribute_grid``): [row class, column class] arrays
    blocking: tuple[Term, ...]   # ``classes.comm_s`` (+ moves) as a sum over mesh axes and directions

    def __getitem__(self, pair: tuple[int, int]) -> Cost:
        """The cost with source strategy ``pair[0]`` and destination strategy ``pair[1]``."""
        r, c, g = self.rows[pair[0]], self.cols[pair[1]], self.classes
        measured = _at(g.measured, r, c)
        return Cost(**{n: _scalar(_at(getattr(g, n), r, c)) for n in _SUMMED},
                    comm_bytes=tuple(_scalar(_at(b, r, c)) for b in g.comm_bytes),
                    measured=measured if isinstance(measured, frozenset) else frozenset({"comm"} if measured else ()))

    def matrix(self, what: Callable[[Cost], float]) -> np.ndarray:
        """``what`` of every pair, as a [source strategy, destination strategy] array. ``what``
        must be arithmetic on the fields (it is applied to the whole grid at once)."""
        core = np.broadcast_to(np.asarray(what(self.classes), dtype=float), (self.rows.max() + 1, self.cols.max() + 1))
        return core[np.ix_(self.rows, self.cols)]

    def blocking_terms(self) -> list[Term]:
        """The blocking seconds (``matrix(lambda c: c.comm_s)``) as a sum of terms over
        strategies, each with a few classes: the ILP pairs those instead of the strategies."""
        return [Term(np.asarray(t.rows)[self.rows], np.asarray(t.cols)[self.cols], t.core) for t in self.blocking]


def _signature(val: torch.Tensor | None) -> tuple | None:
    return None if val is None else (tuple(val.shape), val.dtype)


def _storage_root(node: fx.Node) -> fx.Node:
    """The node whose output a view aliases (a kept view keeps its base's storage alive)."""
    while node.op == "call_function" and node.target in VIEW_OPS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _dim(size):
    """One dimension as an int; a symbolic one (a ``SymInt`` of a capture with dynamic shapes, or
    a sympy expression: ``autopar.planning.symbolic``) as a sympy expression."""
    if type(size) is int:   # the common case first: the planner prices millions of moves
        return size
    if isinstance(size, torch.SymInt):
        return size.node.expr
    if isinstance(size, sympy.Basic):
        return size
    return int(size)


def _numel(shape: Sequence[int]):
    n = 1
    for s in shape:
        n *= _dim(s)
    return n


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _bytes(val):
    """Bytes of a tensor: a float, or a sympy expression when its shape is symbolic."""
    if val is None:
        return 0.0
    n = _numel(val.shape) * _itemsize(val.dtype)
    return n if isinstance(n, sympy.Basic) else float(n)

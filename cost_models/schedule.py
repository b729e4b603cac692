"""The training step as a schedule: forward in graph order, backward in reverse, then the
optimizer. Places each node's costs at the moments they happen, to find

* the peak memory: parameters and optimizer states throughout; activations kept from their
  op's forward to its backward; the gradient of each activation from the backward of its last
  user to its own backward (the backward's mirror of forward liveness); a parameter's gradient
  from the backward of its first user (in forward order: the last one the backward reaches) to
  the optimizer step; each node's working memory while it runs; at the backward's end, the sums
  of the gradients all-reduced in buckets beside the gradients, and the last bucket's flattened
  input (``simulate`` only: the ILP's rows leave them out, and the planner re-solves when that
  moment exceeds the budget);
* the exposed communication: gradient synchronisations are queued, in the order the backward
  completes them, on one communication channel that runs under the rest of the backward.

``simulate`` does this exactly for one plan; ``memory_rows`` and ``exposed_rows`` give the ILP
the same quantities at a few cut points of the backward (``solver.Row``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch.fx as fx
from torch.distributed.tensor import Replicate

from autopar.core.execution import BUCKET_BYTES, VIEW_OPS
from autopar.core.placements import grad_placement, read_as_stored
from autopar.core.strategies import NodeChoices, Strategy, StrategySpace
from cost_models.estimate import Cost, CostModel, EdgeGrid
from solver import Row


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    compute_s: float
    comm_s: float        # blocking communication
    overlap_s: float     # gradient synchronisation queued during the backward
    exposed_s: float     # the part of overlap_s no backward compute hid
    peak_bytes: float
    peak_at: str         # "forward", "backward" or "optimizer step", and the node
    peak_position: int   # the cut (see Timeline.memory_rows) that holds the peak
    at_peak: dict[str, float]   # bytes live at the peak by kind


class _Peak:
    """Memory over a simulated step: what is held now (``check`` adds the moment's working bytes)
    and the highest total seen, with where it was and what filled it."""

    def __init__(self, state: float) -> None:
        self.state, self.saved, self.recomputed, self.grads = state, 0.0, 0.0, 0.0
        self.best: tuple[float, str, dict[str, float], int] = (
            state, "forward (start)", {"state": state, "activations": 0.0, "recomputed": 0.0, "gradients": 0.0,
                                       "working": 0.0}, 0)

    def check(self, work: float, where: str, position: int) -> None:
        total = self.state + self.saved + self.recomputed + self.grads + work
        if total > self.best[0]:
            self.best = (total, where, {"state": self.state, "activations": self.saved, "recomputed": self.recomputed,
                                        "gradients": self.grads, "working": work}, position)


class Timeline:
    """Where each node of a strategy space sits in the step."""

    def __init__(self, space: StrategySpace, overlap_efficiency: float = 1.0,
                 block_of: dict[fx.Node, int] | None = None, accumulating: bool = False) -> None:
        """``overlap_efficiency``: the share of backward compute time that really hides queued
        communication (1: separate engines, as on GPUs; near 0: collectives that need the same
        CPU cores as compute). Measured by ``autopar profile``. ``block_of``: the recomputed block
        of each node in one (``CostModel.block_of``): its ``recomputed_bytes`` live from the start
        of that block's backward (when the block's forward runs again) to the node's own backward.
        ``accumulating``: the step runs several microbatches, so every parameter's gradient is
        live all along (the earlier microbatches' sum), not only from its backward on."""
        self.space = space
        self.overlap = overlap_efficiency
        n = len(space.nodes)
        # An op's activations are kept from its position; a parameter's gathered copy and its
        # gradient belong to the position of its first real user.
        self.position = list(range(n))
        for i, nc in enumerate(space.nodes):
            if nc.kind == "param":
                self.position[i] = self._first_user(nc.node, n)
        self.names = [nc.node.name for nc in space.nodes]
        self.block = [(block_of or {}).get(nc.node) for nc in space.nodes]
        self.accumulating = accumulating
        self.last_user = [max((space.index[u] for u in nc.node.users if u in space.index), default=i)
                          for i, nc in enumerate(space.nodes)]

    def _first_user(self, node: fx.Node, default: int) -> int:
        """Position of the first op computing with ``node`` (looking through views and aliases)."""
        best, todo = default, [node]
        while todo:
            for user in todo.pop().users:
                idx = self.space.index.get(user)
                if idx is not None and self.space.nodes[idx].kind == "op" and user.target not in VIEW_OPS:
                    best = min(best, idx)
                elif user.op == "call_function":
                    todo.append(user)
        return best

    # ------------------------------------------------------------------ one plan
    def simulate(self, nodes: Sequence[Cost], queued: Sequence[tuple[int, float]], step_overhead_s: float = 0.0
                 ) -> StepPrediction:
        """``nodes[i]``: node i's cost with its incoming edges' blocking parts; ``queued``:
        (node index, seconds) of gradient synchronisations, queued when node i's gradient is done."""
        kinds = [nc.kind for nc in self.space.nodes]
        order = sorted(range(len(nodes)), key=lambda i: (self.position[i], i))
        mem = _Peak(sum(c.state_bytes for c in nodes))
        mem.grads = sum(c.grad_bytes for c in nodes) if self.accumulating else 0.0
        for i in order:
            mem.saved += nodes[i].saved_bytes
            if kinds[i] in ("op", "output"):   # the output's: gathering what the step returns
                mem.check(nodes[i].transient_bytes, f"forward: {self.names[i]}", self.position[i])
        t, chan = self._backward(nodes, queued, kinds, order, mem)
        # The backward's end: the last bucket launched. Every gradient all-reduced in a bucket is
        # held twice (the local one and the sum), and that bucket's flattened input once more.
        synced = sum(c.synced_bytes for c in nodes)
        mem.check(synced + min(synced, BUCKET_BYTES), "backward: gradient buckets", 0)
        mem.check(max((nodes[i].transient_bytes for i in order if kinds[i] == "param"), default=0.0), "optimizer step", 0)
        exposed = max(0.0, chan - t)
        compute = sum(c.compute_s for c in nodes)
        comm = sum(c.comm_s for c in nodes)
        overlap = sum(s for _, s in queued)
        peak, where, breakdown, position = mem.best
        return StepPrediction(step_s=compute + comm + exposed + step_overhead_s, compute_s=compute, comm_s=comm,
                              overlap_s=overlap, exposed_s=exposed, peak_bytes=peak, peak_at=where, at_peak=breakdown,
                              peak_position=position)

    def _backward(self, nodes: Sequence[Cost], queued: Sequence[tuple[int, float]], kinds: Sequence[str],
                  order: Sequence[int], mem: _Peak) -> tuple[float, float]:
        """Walk the backward in reverse forward order, tracking memory in ``mem``; the backward's
        compute time and when the gradient channel (``queued``'s syncs, in order) ends."""
        at: dict[int, list[float]] = {}
        for i, seconds in queued:
            at.setdefault(i, []).append(seconds)
        born: dict[int, float] = {}   # backward position -> activation gradients it creates
        rebuilt: dict[int, float] = {}   # per recomputed block: what running its forward again rebuilds
        for i, c in enumerate(nodes):
            born[self.last_user[i]] = born.get(self.last_user[i], 0.0) + c.output_grad_bytes
            if self.block[i] is not None:
                rebuilt[self.block[i]] = rebuilt.get(self.block[i], 0.0) + c.recomputed_bytes
        t = chan = frontier = 0.0
        current = None
        for i in reversed(order):
            if self.block[i] is not None and self.block[i] != current:   # a recomputed block's backward begins
                current = self.block[i]
                mem.recomputed = rebuilt[current]
            if kinds[i] == "param" and not self.accumulating:
                mem.grads += nodes[i].grad_bytes
            elif kinds[i] == "op":
                frontier += born.get(i, 0.0)
                mem.check(frontier + nodes[i].transient_bytes, f"backward: {self.names[i]}", self.position[i])
                frontier -= nodes[i].output_grad_bytes
            mem.saved -= nodes[i].saved_bytes
            mem.recomputed -= nodes[i].recomputed_bytes
            t += nodes[i].backward_s * self.overlap
            for seconds in at.get(i, ()):
                chan = max(t, chan) + seconds
        return t, chan

    # ------------------------------------------------------------------ ILP rows
    def cuts(self, count: int) -> list[int]:
        """Cut points of the backward: after the forward (n), a few inside, before the optimizer (0)."""
        n = len(self.space.nodes)
        return sorted({round(n * k / count) for k in range(count + 1)})

    def memory_rows(self, owner: Sequence[int], node_costs: dict[int, list[Cost]], cuts: Sequence[int]) -> tuple[Row, ...]:
        """Per cut c (the backward of the node at position c): activations kept by nodes up to c
        (and, inside a recomputed block, what its nodes up to c rebuilt), gradients of
        activations made before c and used at or after c, and gradients of parameters whose
        first user is at or after c, on top of the state. Any forward moment at c holds no more
        than this."""
        rows = []
        for c in cuts:
            block = self.block[c] if c < len(self.block) else None
            terms = []
            for i, costs in node_costs.items():
                param = self.space.nodes[i].kind == "param"
                live_grad = self.position[i] < c <= self.last_user[i]
                rebuilt = block is not None and self.block[i] == block and self.position[i] <= c
                values = [(x.saved_bytes if self.position[i] <= c else 0.0)
                          + (x.recomputed_bytes if rebuilt else 0.0)
                          + (x.grad_bytes if param and (self.accumulating or self.position[i] >= c) else 0.0)
                          + (x.output_grad_bytes if live_grad else 0.0) for x in costs]
                if any(values):
                    terms.append((owner[i], tuple(values)))
            rows.append(Row(nodes=tuple(terms)))
        return tuple(rows)

    def exposed_rows(self, owner: Sequence[int], node_costs: dict[int, list[Cost]],
                     queued_edges: Sequence[tuple[int, int, tuple[tuple[float, ...], ...]]], cuts: Sequence[int]
                     ) -> tuple[Row, ...]:
        """Per cut c: gradient synchronisation queued after c minus the backward compute after c
        (a lower bound of the exposed time; exact with every position a cut). ``queued_edges``:
        (parameter index, consumer index, seconds matrix [parameter choice][consumer choice]).
        Each matrix enters as its best additive split between the two nodes: pairing them would
        give the ILP a pair variable per parameter use, which huge models cannot afford; the
        plan's own prediction (``simulate``) prices the exact pairs."""
        split = [(i, j, *_additive(m)) for i, j, m in queued_edges]
        rows = []
        for c in cuts:
            terms: dict[int, list[float]] = {}
            for i, j, a, b in split:
                if self.position[i] < c:
                    _accumulate(terms, owner[i], a)
                    _accumulate(terms, owner[j], b)
            if not terms:
                continue
            for i, costs in node_costs.items():
                if self.position[i] < c and any(x.backward_s for x in costs):
                    _accumulate(terms, owner[i], [-x.backward_s * self.overlap for x in costs])
            rows.append(Row(nodes=tuple((k, tuple(v)) for k, v in terms.items())))
        return tuple(rows)


def step_costs(space: StrategySpace, model: CostModel, chosen: Sequence[Strategy]
               ) -> tuple[list[Cost], list[tuple[int, float]]]:
    """What ``Timeline.simulate`` takes for one plan: each node's cost with its incoming edges
    (``StrategySpace.edges``), and the queued gradient synchronisations."""
    return _assemble(space, lambda i: model.node(space.nodes[i], chosen[i]),
                     lambda i, j, k: model.edge(space.nodes[i], chosen[i], space.nodes[j], chosen[j], k),
                     parameter_saving(space, chosen, model.plain_saving()))


def _listed(nc: NodeChoices, listed: dict[int, int], numbers: dict[tuple[Strategy, ...], int]) -> int:
    """A node's strategies as a number that equal lists share: identical layers' parameters and
    ops may have lists of their own, equal, whose costs are the same. Each list is hashed once
    (a tuple does not keep its hash)."""
    number = listed.get(id(nc.strategies))
    if number is None:
        number = listed[id(nc.strategies)] = numbers.setdefault(tuple(nc.strategies), len(numbers))
    return number


class PricedSpace:
    """Every node's cost under each of its strategies and every edge's under each pair, priced once
    (nodes and edges of identical layers share theirs) so that many plans of one space cost nothing more."""

    def __init__(self, space: StrategySpace, model: CostModel) -> None:
        self.space = space
        self.saving = model.plain_saving()   # a parameter's, stored plain (``parameter_saving``)
        self.nodes: list[list[Cost]] = []             # per node, per strategy
        self.largest_input: list[np.ndarray] = []     # per node, per strategy: its largest floating input's bytes
        shared: dict[tuple, tuple[list[Cost], np.ndarray]] = {}
        listed: dict[int, int] = {}                    # each strategy list's number (``_listed``)
        numbers: dict[tuple[Strategy, ...], int] = {}
        for nc in space.nodes:
            key = (_listed(nc, listed, numbers), model.node_signature(nc))
            if key not in shared:
                # an output left where the plan puts it (``gather_outputs=False``) is no collective's input
                moved = nc.kind != "output" or model.gather_outputs
                shared[key] = ([model.node(nc, s) for s in nc.strategies],
                               np.array([max(model.input_bytes(nc, s, floating_only=True), default=0.0) if moved else 0.0
                                         for s in nc.strategies], dtype=float))
            self.nodes.append(shared[key][0])
            self.largest_input.append(shared[key][1])
        grids: dict[tuple, EdgeGrid] = {}
        self.edges: dict[tuple[int, int, int], EdgeGrid] = {}
        for i, j, k in space.edges():
            src, nc = space.nodes[i], space.nodes[j]
            val = nc.inputs[k].meta.get("val")
            pair = (_listed(src, listed, numbers), _listed(nc, listed, numbers), k, tuple(val.shape), val.dtype,
                    model.edge_signature(src, nc))
            if pair not in grids:
                grids[pair] = model.edge_grid(src, nc, k)
            self.edges[(i, j, k)] = grids[pair]

    def step_costs(self, strategy: Sequence[int]) -> tuple[list[Cost], list[tuple[int, float]]]:
        """``step_costs`` of the plan giving node i its strategy number ``strategy[i]``."""
        chosen = [nc.strategies[x] for nc, x in zip(self.space.nodes, strategy, strict=True)]
        return _assemble(self.space, lambda i: self.nodes[i][strategy[i]],
                         lambda i, j, k: self.edges[(i, j, k)][strategy[i], strategy[j]],
                         parameter_saving(self.space, chosen, self.saving))


def parameter_saving(space: StrategySpace, chosen: Sequence[Strategy], saving: float) -> float:
    """What each parameter's update saves in this plan (``CostModel.param_overhead``): ``saving``
    where the runtime keeps parameters plain tensors, as DDP does (``codegen.module``): every one
    stored replicated and read as stored (``placements.read_as_stored``, each op's gradient placed
    as ``grad_placement`` says: codegen's partial passes are not seen); else nothing."""
    params = [i for i, nc in enumerate(space.nodes) if nc.kind == "param"]
    if not all(isinstance(p, Replicate) for i in params for p in chosen[i].storage):
        return 0.0
    uses: dict[int, list] = {i: [] for i in params}
    for i, j, k in space.edges():
        if i in uses:
            d = chosen[j]
            uses[i].append((d.ins[k], grad_placement(d.ins[k], d.ins, d.out)))
    plain = all(not u or read_as_stored(chosen[i].storage, chosen[i].out, u, space.nodes[i].trains) is not None
                for i, u in uses.items())
    return saving if plain else 0.0


def _assemble(space: StrategySpace, node: Callable[[int], Cost], edge: Callable[[int, int, int], Cost],
              saving: float) -> tuple[list[Cost], list[tuple[int, float]]]:
    incoming: dict[int, Cost] = {}
    queued = []
    for i, j, k in space.edges():
        c = edge(i, j, k)
        incoming[j] = incoming.get(j, Cost()) + c
        if c.overlap_s:
            queued.append((i, c.overlap_s))
    costs = [node(idx) + incoming.get(idx, Cost()) for idx in range(len(space.nodes))]
    for idx, nc in enumerate(space.nodes):
        if nc.kind == "param" and saving:
            costs[idx] = replace(costs[idx], compute_s=costs[idx].compute_s - saving,
                                 timed_s=max(0.0, costs[idx].timed_s - saving))
    return costs, queued


def _additive(m: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """``a[s] + b[d]`` closest to ``m[s][d]`` in least squares (row and column means)."""
    rows, cols = len(m), len(m[0])
    mean = sum(map(sum, m)) / (rows * cols)
    a = [sum(r) / cols - mean / 2 for r in m]
    b = [sum(m[s][d] for s in range(rows)) / rows - mean / 2 for d in range(cols)]
    return a, b


def _accumulate(terms: dict[int, list[float]], node: int, values: Sequence[float]) -> None:
    if node in terms:
        terms[node] = [x + y for x, y in zip(terms[node], values, strict=True)]
    else:
        terms[node] = list(values)

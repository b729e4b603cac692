"""``PipelinedModule``: a pipeline plan run by ``torch.distributed.pipelining``.

Each rank holds the stages of the plan its pipeline rank runs (``Plan.pipeline``; several under
interleaved schedules), as generated functions (``codegen.stages``) over its sub-mesh of the other
axes, where they shard, gather and synchronise as any plan does. Each stage becomes a
``PipelineStage`` told the local shapes it receives and sends (no shape inference at run time),
driven by the plan's schedule class. Parameters of the stages a rank does not hold are dropped
from its module; a parameter two stages read (tied embeddings) is held by both, and their
gradients summed after the backward over the ranks holding it, as Megatron sums its embedding
group's.

Zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``) run in
their order, with the whole backward in the input-gradient step and an empty weight step
(``_weights_done``; priced so by ``autopar.planning.pipeline``).

``train_step`` runs the step through the schedule: every microbatch's loss weighted by its share
of the batch's loss (``autopar.core.loss_weights``: the schedule's ``loss_fn`` multiplies by it;
``scale_grads=False``), so that loss and gradients equal one device's on the whole batch. Gradient
sync runs in each stage's last backward only (the schedule says which), as DDP under pipelining.
``forward`` (evaluation) runs the microbatches through the stages with point-to-point sends and
gives every rank the outputs.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules as torch_schedules
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.utils import _pytree as pytree

import codegen.runtime as runtime
from autopar.core import collectives
from autopar.core.capture import CapturedGraph, needs_grad, tensor_val
from autopar.core.errors import AutoparError, InputMismatchError, LossWeightError, MeshError
from autopar.core.launched import Pending, handed_over, settle
from autopar.core.loss_weights import loss_weighting
from autopar.core.microbatch import batch_size, split
from autopar.core.placements import shard_shape_at
from autopar.core.plan import Plan, rank_of_stage
from codegen.generate import GeneratedCode, generate
from codegen.grad_sync import DEFAULT_BUCKET_BYTES
from codegen.modes import by_mode
from codegen.module import ShardedModule, compile_source, grad_sync_of
from codegen.stages import StageCode
from codegen.zero3 import GatheredParams


class PipelinedModule(ShardedModule):
    """The original submodules (parameters under their names, only this rank's stages' kept) run
    as a pipeline. ``train_step`` trains; calling the module evaluates."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan: Plan, captured: CapturedGraph,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """``captured``: the model at one microbatch's shape (what the stages run)."""
        nn.Module.__init__(self)
        self._adopt(model)
        pipeline = plan.pipeline
        names = mesh.mesh_dim_names
        if names is None or names != plan.mesh.axis_names:
            raise MeshError(f"a pipeline plan runs on a mesh with named axes {plan.mesh.axis_names} "
                            f"(got {names}): build it with init_device_mesh(..., mesh_dim_names=...)")
        self.mesh, self.plan, self._bucket_bytes = mesh, plan, bucket_bytes
        self._device = torch.device(mesh.device_type)
        others = tuple(n for n in names if n != pipeline.axis)
        self._stage_mesh = mesh[others] if len(others) > 1 else mesh[others[0]]
        self._pp_group = mesh.get_group(pipeline.axis)
        pp_rank = mesh.get_local_rank(pipeline.axis)
        ranks = mesh.size(names.index(pipeline.axis))
        self._held = [s for s in range(pipeline.num_stages)
                      if rank_of_stage(pipeline.schedule, s, ranks, pipeline.virtual_stages) == pp_rank]
        self._captured = captured
        self._weighting = loss_weighting(captured)
        train = generate(captured, plan, strict=runtime.STRICT, group_bytes=bucket_bytes, spans_job=False,
                         outputs="loss")
        evaluate = generate(captured, plan, strict=runtime.STRICT, group_bytes=bucket_bytes, spans_job=False,
                            outputs="full")
        self.code = evaluate.source
        self._train, self._eval = compile_source(train.source), compile_source(evaluate.source)
        self._sizes = train.sizes.values(self._stage_mesh)
        held = {f for s in self._held for f in train.stages[s].state}
        within = plan.within_stage()
        direct = self._shard_parameters(within, captured, self._stage_mesh, train, keep=held)
        self._replicate_buffers_and_constants(captured, self._stage_mesh, keep=held)
        # a parameter two stages of this rank read (tied embeddings under a V-shaped schedule) is
        # synchronised by the first: its backward of the last microbatch is the rank's last
        self._syncs = {}
        claimed: set[str] = set()
        for s in self._held:
            own = train.stages[s].state - claimed
            claimed |= own
            self._syncs[s] = grad_sync_of(self._stage_mesh, _only(train, own), direct, bucket_bytes,
                                          plan.reduce_precision)
            self._syncs[s].sync = False   # on only in the stage's last backward of a step (``_Stage``)
        per_stage = {s: GatheredParams(self, self._stage_mesh, train.gathered, self._syncs[s], self._device,
                                       [k for k, g in enumerate(train.gathered) if set(g.fqns) <= train.stages[s].state])
                     for s in self._held}
        self._autopar_gather = _Groups(  # type: ignore[assignment]  # gathers as GatheredParams does, stage by stage
            {k: gathered for gathered in per_stage.values() for k in gathered.groups})
        self._tied = _tie_groups(mesh, pipeline, train.stages)
        self._code = train
        self._constants: list[tuple[int, Any]] = []   # the model's non-tensor inputs, by position
        self._loss_counts: list[float | torch.Tensor] = []   # the target count of each microbatch's loss, in turn
        self._expect_inputs(captured.in_spec)
        self._out_spec = captured.out_spec
        self._stages = [self._stage(s, train.stages[s], within) for s in self._held]
        self._schedule = self._make_schedule()

    # ------------------------------------------------------------------ building
    def _stage(self, s: int, code: StageCode, within: Plan) -> PipelineStage:
        last = s == self.plan.pipeline.num_stages - 1
        module = _StageModule(self, self._train[code.name], last, self._weighting.index)
        return _Stage(module, self._syncs[s], self.plan.pipeline.num_microbatches, s, self.plan.pipeline.num_stages,
                      self._device,
                      input_args=self._metas(code.inputs, within, first=s == 0),
                      output_args=(self._loss_meta(),) if last else self._metas(code.outputs, within),
                      group=self._pp_group, dw_builder=_weights_done)

    def _metas(self, names: Sequence[str], within: Plan, first: bool = False) -> tuple[torch.Tensor, ...]:
        """Empty tensors shaped as this rank's part of the values ``names`` (the model's inputs,
        whole, for the first stage), requiring a gradient where the value has one."""
        nodes = {n.name: n for n in self._captured.graph.nodes}
        grads = needs_grad(self._captured.graph, self._captured.trained_params())
        placed = {n.name: n.out for n in within.nodes}
        coords = self._stage_mesh.get_coordinate()
        out = []
        for name in names:
            val = tensor_val(nodes[name])
            if val is None:
                continue
            shape = list(val.shape) if first else shard_shape_at(val.shape, placed[name], coords, self._stage_mesh.shape)
            out.append(torch.empty(shape, dtype=val.dtype, device=self._device).requires_grad_(
                bool(grads.get(nodes[name])) and val.dtype.is_floating_point))
        return tuple(out)

    def _loss_meta(self) -> torch.Tensor:
        return torch.empty((), device=self._device)

    def _make_schedule(self) -> Any:
        pipeline = self.plan.pipeline
        cls = getattr(torch_schedules, pipeline.schedule)
        inputs = [n for n in self._captured.graph.nodes if n.name in self._captured.user_inputs]
        rows = batch_size(tuple(tensor_val(n) for n in inputs), {})
        spec = tuple(TensorChunkSpec(0) if tensor_val(n) is not None and tensor_val(n).dim() > 0
                     and tensor_val(n).shape[0] == rows else _Replicate() for n in inputs
                     if tensor_val(n) is not None)
        stages = self._stages if issubclass(cls, torch_schedules.PipelineScheduleMulti) else self._stages[0]
        schedule = cls(stages, pipeline.num_microbatches, loss_fn=_weighted, scale_grads=False)
        schedule._args_chunk_spec = spec   # (not every schedule's constructor takes it)
        return schedule

    # ------------------------------------------------------------------ running
    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one step over the global batch, through the schedule; leaves
        the gradients ready for ``optimizer.step()`` and returns the batch's loss on every rank
        (sent from the last stage as the step ends, waited for where first read)."""
        settle()
        flat = self._flat(args, kwargs)
        rows = batch_size(args, kwargs)
        n = self.plan.pipeline.num_microbatches
        if rows != self.plan.batch_size:
            raise InputMismatchError(f"this pipeline runs batches of {self.plan.batch_size} rows in {n} microbatches; "
                                     f"got {rows} rows. Compile for this batch size")
        weighting = self._weighting
        if weighting.index is None:
            raise LossWeightError(f"train_step needs the loss: {weighting.how}")
        parts = [self._flat(a, k) for a, k in split(args, kwargs, self.plan.microbatch_size)]
        counts = weighting.counts([(part, rows // n) for part in parts]) if weighting.count is not None else None
        weights = weighting.weights(counts, n)
        self._loss_counts = list(counts) if counts is not None and self._code.counts_loss else []
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        self._constants = [(i, v) for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)]
        target = torch.tensor(weights, dtype=torch.float32, device=self._device)
        losses: list[torch.Tensor] = []
        last = self.plan.pipeline.num_stages - 1 in self._held
        self._schedule.step(*(tensors if 0 in self._held else ()), target=target if last else None,
                            losses=losses if last else None, return_outputs=False)
        for tied, group in self._tied:
            for fqn in tied:
                runtime.sum_grad_over(self.get_parameter(fqn), group)
        loss = torch.stack([l.detach() for l in losses]).sum() if last else torch.zeros((), device=self._device)
        if self._code.loss_summed_over and last:
            loss = collectives.all_reduce(loss.reshape(1), self._stage_mesh, self._code.loss_summed_over).reshape(())
        # launched, read when the caller reads it (a functional collective): the step does not wait
        sent = funcol.broadcast(loss, self._stage_rank(self.plan.pipeline.num_stages - 1), self._pp_group)
        return handed_over([sent])[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's unsharded state dict on every rank: each pipeline rank's stages',
        gathered over the pipeline axis."""
        mine = ShardedModule.full_state_dict(self)
        every: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(self._pp_group)
        dist.all_gather_object(every, mine, group=self._pp_group)
        out: dict[str, torch.Tensor] = {}
        for part in every:
            out.update(part)
        return out

    def _stage_rank(self, stage: int) -> int:
        pipeline = self.plan.pipeline
        return rank_of_stage(pipeline.schedule, stage, dist.get_world_size(self._pp_group), pipeline.virtual_stages)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's outputs for each microbatch of the batch, run through the stages in order
        (no backward), concatenated along the batch (the loss: weighted as ``train_step`` weighs
        it), on every rank."""
        self._refuse_eval_mode()
        parts = split(args, kwargs, self.plan.microbatch_size)
        n = len(parts)
        if n != self.plan.pipeline.num_microbatches or batch_size(args, kwargs) != self.plan.batch_size:
            raise InputMismatchError(f"this pipeline runs batches of {self.plan.batch_size} rows; got "
                                     f"{batch_size(args, kwargs)}. Compile for this batch size")
        flats = [self._flat(a, k) for a, k in parts]
        counts = self._weighting.counts([(f, batch_size(*p)) for f, p in zip(flats, parts, strict=True)]) \
            if self._weighting.count is not None else None
        outputs = []
        with torch.no_grad():
            for i, flat in enumerate(flats):
                outputs.append(self._evaluate(flat, counts[i] if counts is not None and self._code.counts_loss else None))
        weights = self._weighting.weights(counts, n) if self._weighting.index is not None else [1.0] * n
        merged = [_merge([o[j] for o in outputs], weights, j == self._weighting.index) for j in range(len(outputs[0]))]
        return pytree.tree_unflatten(merged, self._out_spec)

    def _refuse_eval_mode(self) -> None:
        """A pipeline's stages run the model as captured in training mode: in eval mode, where that
        capture has ops eval would run otherwise (``codegen.modes.by_mode``), refused by name, never
        run as in training."""
        differ = by_mode(self._captured.graph) if not self.training else []
        if differ:
            raise AutoparError(
                f"a pipelined module evaluates only as in training mode, and {self.plan.model_name} in eval mode "
                f"runs {len(differ)} op(s) otherwise (dropout or batch norm: {', '.join(differ[:3])}"
                f"{', ...' if len(differ) > 3 else ''}). Evaluate with the model in training mode under "
                "torch.no_grad() if that is what you want, or evaluate on a plan without a pipeline "
                "(pipeline=False).")

    def _evaluate(self, flat: list[Any], loss_count: float | torch.Tensor | None) -> list[Any]:
        """One microbatch through every stage: each rank runs its stages, receiving from the stage
        before and sending to the next; the last stage's outputs go to every rank of the pipeline."""
        pipeline = self.plan.pipeline
        values: tuple = tuple(flat)
        for s in range(pipeline.num_stages):
            rank = self._stage_rank(s)
            mine = s in self._held
            if mine:
                if s > 0 and self._stage_rank(s - 1) != rank:   # else the stage before ran here: its values
                    values = self._receive(s)
                fn = self._eval[self._code.stages[s].name]
                values = fn(self, self._stage_mesh, self._device, self._sizes, *values, loss_count=loss_count)
                if s + 1 < pipeline.num_stages and self._stage_rank(s + 1) != rank:
                    for v in values:
                        dist.send(v.contiguous(), dist.get_global_rank(self._pp_group, self._stage_rank(s + 1)),
                                  group=self._pp_group)
        # collectives still on their way are waited for: pickling one would send this rank's summand
        box = [[_waited(v) for v in values] if pipeline.num_stages - 1 in self._held else None]
        dist.broadcast_object_list(box, dist.get_global_rank(self._pp_group, self._stage_rank(pipeline.num_stages - 1)),
                                   group=self._pp_group)
        return box[0]

    def _receive(self, s: int) -> tuple:
        metas = self._stages[self._held.index(s)].submod.inputs
        out = []
        for meta in metas:
            buf = torch.empty_like(meta, requires_grad=False)
            dist.recv(buf, dist.get_global_rank(self._pp_group, self._stage_rank(s - 1)), group=self._pp_group)
            out.append(buf)
        return tuple(out)


def _waited(value: Any) -> Any:
    """``value`` with its collective waited for: a plain tensor, which pickles."""
    return value.wait() if isinstance(value, (AsyncCollectiveTensor, Pending)) else value


def _merge(parts: Sequence[Any], weights: Sequence[float], is_loss: bool) -> Any:
    """One output over the microbatches: the loss weighted by each one's share, batch-shaped
    tensors concatenated, anything else as the first microbatch gave it."""
    first = parts[0]
    if is_loss:
        return sum(p * w for p, w in zip(parts, weights, strict=True))
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return torch.cat(list(parts))
    return first


class _Groups:
    """The ZeRO groups of the stages this rank holds, each gathered by its stage's ``GatheredParams``."""

    def __init__(self, by_group: dict[int, GatheredParams]) -> None:
        self.by_group = by_group

    def gather(self, k: int) -> tuple[torch.Tensor, ...]:
        return self.by_group[k].gather(k)


class _StageModule(nn.Module):
    """What a ``PipelineStage`` runs: one generated stage function on this rank's values. The
    last stage returns the loss alone (each forward reading the next microbatch's target count
    where the loss divides by it); the first binds the model's non-tensor inputs."""

    def __init__(self, owner: PipelinedModule, fn: Any, last: bool, loss_index: int | None) -> None:
        super().__init__()
        self.__dict__["owner"] = owner   # not a submodule: the stage's parameters live on the owner
        self.fn, self.last, self.loss_index = fn, last, loss_index
        self.inputs: tuple[torch.Tensor, ...] = ()

    def forward(self, *values: torch.Tensor) -> Any:
        owner = self.owner
        if self.fn.__name__ == "stage_0":
            values = tuple(_with_constants(values, owner._constants))
        count = owner._loss_counts.pop(0) if self.last and owner._loss_counts else None
        out = self.fn(owner, owner._stage_mesh, owner._device, owner._sizes, *values, loss_count=count)
        return out[self.loss_index] if self.last else out


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose gradient sync runs in its last backward of the step only: the
    ``microbatches``-th it runs (the schedules' own ``last_backward`` marks the weight step of
    zero-bubble schedules, which runs nothing here: ``_weights_done``)."""

    def __init__(self, submodule: _StageModule, grad_sync: Any, microbatches: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(submodule, *args, **kwargs)
        submodule.inputs = kwargs["input_args"]
        self._grad_sync = grad_sync
        self._microbatches = microbatches
        self._backwards = 0   # run so far, over every step

    def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        self._backwards += 1
        self._grad_sync.sync = self._backwards % self._microbatches == 0
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:   # another stage's backward reaching a parameter it shares with this one accumulates
            self._grad_sync.sync = False


def _weights_done() -> Any:
    """Zero-bubble schedules' weight step: nothing left to run. Generated code computes the
    weights' gradients in the same backward as the inputs' (gradient buckets and ZeRO groups
    synchronise as that pass produces them), so their input step runs the whole backward."""
    return lambda: None


def _weighted(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function: a microbatch's loss times its share of the batch's."""
    return (loss * weight.to(loss.dtype)).sum()


def _with_constants(values: Sequence[Any], constants: Sequence[tuple[int, Any]]) -> list[Any]:
    """The first stage's arguments: the tensors the schedule passes, with the non-tensor inputs
    put back at their positions."""
    out: list[Any] = []
    tensors = iter(values)
    at = dict(constants)
    while True:
        i = len(out)   # out holds one value per position so far
        if i in at:
            out.append(at[i])
            continue
        value = next(tensors, None)
        if value is None:
            return out
        out.append(value)


def _only(code: GeneratedCode, state: frozenset[str]) -> GeneratedCode:
    """``code`` with only the directly read parameters in ``state`` (a stage's)."""
    return replace(code, direct={f: g for f, g in code.direct.items() if f in state})


def _tie_groups(mesh: DeviceMesh, pipeline: Any, stages: Sequence[StageCode]) -> list[tuple[list[str], Any]]:
    """Parameters read by stages on different pipeline ranks (tied embeddings), with the process
    group of the ranks holding them at this rank's place in the other axes. Every rank creates
    every group (``new_group`` is collective), in the same order."""
    names = mesh.mesh_dim_names
    axis = names.index(pipeline.axis)
    ranks_of_pp = mesh.mesh.movedim(axis, 0)   # (pipeline rank, other axes...) -> global rank
    per_fqn: dict[str, set[int]] = {}
    for s, code in enumerate(stages):
        for f in code.state:
            per_fqn.setdefault(f, set()).add(rank_of_stage(pipeline.schedule, s, mesh.size(axis), pipeline.virtual_stages))
    shared: dict[tuple[int, ...], list[str]] = {}
    for f, holders in sorted(per_fqn.items()):
        if len(holders) > 1:
            shared.setdefault(tuple(sorted(holders)), []).append(f)
    out = []
    me = dist.get_rank()
    for pp_ranks, fqns in sorted(shared.items()):
        for place in itertools.product(*(range(n) for n in ranks_of_pp.shape[1:])):
            members = [int(ranks_of_pp[(r,) + place]) for r in pp_ranks]
            group = dist.new_group(members)
            if me in members:
                out.append((fqns, group))
    return out

"""``ShardedModule``: the original module's parameters, sharded as planned (same names), with the
generated forward. Every rank calls it with the same global inputs and gets the same outputs."""
from __future__ import annotations

import linecache
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils import _pytree as pytree

import codegen.runtime as runtime
from autopar.core import collectives
from autopar.core.buffers import refuse_split_steps, whole_batch_state
from autopar.core.capture import CapturedGraph
from autopar.core.context_parallel import balance
from autopar.core.errors import AutoparError, InputMismatchError, LossWeightError
from autopar.core.launched import handed_over, prepare_reads, settle
from autopar.core.loss_weights import loss_weighting
from autopar.core.microbatch import batch_size, split
from autopar.core.ops import Kernels
from autopar.core.placements import ShardBlocks
from autopar.core.plan import Plan
from autopar.core.stacked_params import stacked_value, unstacked
from autopar.core.together import one_process
from codegen.generate import GeneratedCode, OutputMode, generate
from codegen.grad_sync import DEFAULT_BUCKET_BYTES, Carried, GradSync
from codegen.modes import as_named
from codegen.recompute import recompute
from codegen.shapes import Forward, ForwardPerShape, flat_tensors, tensor_layout
from codegen.zero3 import GatheredParams, gather_params, stored_as

_counter = [0]


#: What generated code reads besides its arguments: the runtime's helpers and, as ``kernels.<name>``,
#: the ops' kernels (``autopar.core.ops.KERNELS``, each declared beside its op's rule). Capture
#: keeps graph values from shadowing these (``autopar.core.execution.GENERATED_NAMES``).
GENERATED_GLOBALS = {
    "torch": torch, "aten": torch.ops.aten, "R": Replicate(), "S": Shard, "SB": ShardBlocks, "P": Partial(),
    "Partial": Partial, "redistribute": runtime.redistribute, "move": runtime.move, "move_balanced": runtime.move_balanced,
    "balance": balance, "full_balanced": collectives.full_balanced, "param_shard": runtime.param_shard,
    "shard_of": runtime.shard_of, "held": runtime.held, "on_device": runtime.on_device, "expect": runtime.expect,
    "uneven_reshape": runtime.uneven_reshape, "full": collectives.full, "kept_sharded": collectives.kept_sharded,
    "gather_params": gather_params, "recompute": recompute, "once": runtime.once, "kernels": Kernels(),
}


def compile_source(source: str) -> dict[str, Any]:
    """Compile generated source into its functions (``forward``, or a pipeline's ``stage_k``);
    register it with linecache so tracebacks show its lines."""
    _counter[0] += 1
    filename = f"<autopar generated forward {_counter[0]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(GENERATED_GLOBALS)
    exec(compile(source, filename, "exec"), namespace)
    return namespace


class ShardedModule(nn.Module):
    """Holds the original submodules (so parameter names are unchanged) with DTensor parameters
    (plain ones, as DDP's, when the plan replicates every parameter)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan: Plan, captured: CapturedGraph,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        super().__init__()
        self._adopt(model)
        self.mesh = mesh
        self.plan = plan
        self._bucket_bytes = bucket_bytes
        # before the parameters are sharded: the forwards of other input shapes capture a copy
        self._forwards = ForwardPerShape(model, captured, self._make_forward, self._outputs)
        self.code = self._forwards.first.code.source
        self._expect_inputs(captured.in_spec)
        self._device = torch.device(mesh.device_type)
        if not one_process():   # a loss read before its backward, split outputs gathered: on groups of their own
            prepare_reads(mesh)
        self._shard_state(plan, captured, mesh, self._forwards.first.code, bucket_bytes)

    def _adopt(self, model: nn.Module) -> None:
        """Take ``model``'s submodules, parameters and buffers under their own names."""
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)

    @property
    def _outputs(self) -> OutputMode:
        """How ``forward`` returns outputs: as the plan says (``gather_outputs``)."""
        return "full" if self.plan.gather_outputs else "sharded"

    def _make_forward(self, captured: CapturedGraph, outputs: OutputMode, names: dict | None = None) -> Forward:
        """The forward of ``captured`` (``names``: captured in the other training mode, each node's
        counterpart in the planned graph, ``codegen.modes``)."""
        plan = self.plan if names is None else as_named(self.plan, captured, names)
        generated = generate(captured, plan, strict=runtime.STRICT, group_bytes=self._bucket_bytes,
                             spans_job=collectives.spans_job(self.mesh, range(self.mesh.ndim)), outputs=outputs)
        return Forward(generated, compile_source(generated.source)["forward"], generated.sizes.values(self.mesh),
                       loss_weighting(captured), captured.out_spec, whole_batch_state(captured))

    def _shard_state(self, plan: Plan, captured: CapturedGraph, mesh: DeviceMesh, code: GeneratedCode,
                     bucket_bytes: int) -> None:
        """Parameters sharded (``_shard_parameters``), their gradient sync and ZeRO groups set up,
        buffers and constants replicated."""
        direct = self._shard_parameters(plan, captured, mesh, code)
        self._grad_sync = grad_sync_of(mesh, code, direct, bucket_bytes, plan.reduce_precision)
        self._autopar_gather = GatheredParams(self, mesh, code.gathered, self._grad_sync, self._device)
        self._replicate_buffers_and_constants(captured, mesh)

    def _shard_parameters(self, plan: Plan, captured: CapturedGraph, mesh: DeviceMesh, code: GeneratedCode,
                          keep: set[str] | None = None) -> dict[str, nn.Parameter]:
        """Parameters become DTensors of their planned storage (plain tensors when every one is
        replicated and read as it is: the optimizer then skips DTensor's dispatch, as under DDP).
        A parameter reached under several names (tied embeddings: export reads it through one of
        them) stays one parameter, stored as planned for the name the graph uses. Those the
        forward reads as their shard (``code.direct``) are returned by FQN: ``GradSync`` gives them
        their gradients; those gathered in groups (``code.gathered``) get theirs from their group,
        the others from a hook. Frozen ones (``CapturedGraph.trains``) stay frozen: no gradient,
        nothing to synchronise. ``keep``: the FQNs this rank holds (a pipeline stage's); the
        others are dropped from the module."""
        self._stack_parameters(captured.stacked, keep)
        direct_grads = code.direct
        gathered = {f: g for g in code.gathered for f in g.fqns}
        used = {captured.param_of[n.name] for n in captured.graph.nodes if n.name in captured.param_of and n.users}
        # data parallelism (every parameter replicated, read as it is): plain parameters, as DDP's
        plain = (all(isinstance(x, Replicate) for node in plan.parameters.values() for x in node.storage)
                 and used <= set(direct_grads))
        sharded: dict[int, nn.Parameter | None] = {}
        direct: dict[str, nn.Parameter] = {}
        self._autopar_trains: list[tuple[str, nn.Parameter, bool]] = []   # (FQN, parameter, trains as planned)
        for fqn, node in sorted(plan.parameters.items(), key=lambda kv: kv[0] not in used):
            owner, _, leaf = fqn.rpartition(".")
            mod = self.get_submodule(owner)
            p = getattr(mod, leaf)
            if id(p) not in sharded and keep is not None and fqn not in keep:
                sharded[id(p)] = None
            elif id(p) not in sharded:
                storage = (stored_as(node.storage, gathered[fqn], mesh.shape) if fqn in gathered
                           else list(node.storage))
                shard = (runtime.replicated(p.detach(), mesh) if plain
                         else runtime.distribute(p.detach(), mesh, storage))
                if node.offloaded:   # its gradient and optimizer states follow it to host memory
                    shard = runtime.to_host(shard)
                trains = captured.trains(fqn)
                sharded[id(p)] = nn.Parameter(shard, requires_grad=trains)
                self._autopar_trains.append((fqn, sharded[id(p)], trains))
                if trains and fqn in direct_grads:
                    direct[fqn] = sharded[id(p)]
                elif trains and fqn not in gathered and not plain:   # plain: read directly, or not at all
                    runtime.sync_grad_to(sharded[id(p)], plan.reduce_precision)
            setattr(mod, leaf, sharded[id(p)])
        return direct

    def _stack_parameters(self, stacked: dict[str, tuple[str, ...]], keep: set[str] | None) -> None:
        """Each parameter the graph reads stacked (``autopar.core.stacked_params``) registered
        stacked in its parts' place (those in ``keep``, where given); the parts dropped from the
        module (``full_state_dict`` gives them back)."""
        self._autopar_stacked = stacked
        for fqn, parts in stacked.items():
            owner, _, leaf = fqn.rpartition(".")
            trains = self.get_parameter(parts[0]).requires_grad
            held = keep is None or fqn in keep
            self.get_submodule(owner).register_parameter(
                leaf, nn.Parameter(stacked_value(self, parts), requires_grad=trains) if held else None)
            for part in parts:
                path, _, name = part.rpartition(".")
                setattr(self.get_submodule(path), name, None)

    def _refuse_refrozen(self) -> None:
        """The plan syncs (and prices) the gradients of the parameters trainable when the model was
        captured: one frozen or unfrozen since would train wrong (a gradient never synchronised,
        or one awaited that never comes), so it is refused by name."""
        changed = [(fqn, p.requires_grad) for fqn, p, trains in self._autopar_trains if p.requires_grad != trains]
        if changed:
            said = ", ".join(f"{fqn} ({'unfrozen' if now else 'frozen'})" for fqn, now in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise AutoparError(
                f"{len(changed)} parameter(s) changed requires_grad after autopar.compile: {said}{more}. The plan "
                "synchronises the gradients of the parameters trainable when it was made. Freeze or unfreeze them "
                "on the model before compiling it (and plan again), or set requires_grad back.")

    def _replicate_buffers_and_constants(self, captured: CapturedGraph, mesh: DeviceMesh,
                                         keep: set[str] | None = None) -> None:
        """Buffers (those in ``keep``; the others dropped) and lifted constants, replicated."""
        replicate = [Replicate()] * mesh.ndim
        for fqn in captured.buffer_of.values():
            owner, _, leaf = fqn.rpartition(".")
            mod = self.get_submodule(owner)
            setattr(mod, leaf, runtime.distribute(getattr(mod, leaf), mesh, replicate)
                    if keep is None or fqn in keep else None)
        self._autopar_constants = {
            name: runtime.distribute(t, mesh, replicate).to_local() if isinstance(t, torch.Tensor)
            else t for name, t in captured.program.constants.items()
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict (``autopar.full_state_dict``)."""
        whole = {k: runtime.whole(v, self._device) if isinstance(v, DTensor) else v for k, v in self.state_dict().items()}
        return unstacked(whole, self._autopar_stacked)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's outputs for the whole batch given (one forward, whatever ``plan.microbatches``)."""
        forward, flat = self._forward_of(args, kwargs, self._outputs)
        counts = forward.loss.counts([(flat, batch_size(args, kwargs))]) if forward.code.counts_loss else None
        settle()
        flat_out = handed_over(self._run(forward, flat, counts[0] if counts else None))
        return pytree.tree_unflatten(list(flat_out), forward.out_spec)

    def _run(self, forward: Forward, flat: list[Any], loss_count: float | torch.Tensor | None) -> tuple:
        """One generated forward on these flattened inputs: its flat outputs. ``loss_count``: the
        targets its mean cross-entropy averages (``autopar.core.loss_weights``), known to every rank."""
        return forward.run(self, self.mesh, self._device, forward.sizes, *runtime.rank_inputs(flat),
                           loss_count=loss_count if forward.code.counts_loss else None)

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one training step over the global batch given, leaving the
        gradients ready for ``optimizer.step()``; returns the batch's loss (detached).

        The batch runs in microbatches of ``plan.microbatch_size`` rows (gradient accumulation;
        a batch of another size makes as many as it needs, the last one smaller): gradients
        are synchronised once, in the last backward, and each microbatch's loss counts by its
        share of what the batch's loss averages (``autopar.core.loss_weights``), so loss and
        gradients equal one device's on the whole batch. Each rank's summand of the loss is summed
        over ranks in a gradient bucket's all-reduce (``GradSync.carry``) and read after the last
        backward. The other outputs are not gathered (whatever ``gather_outputs``): nothing reads
        them (``OutputMode`` "loss")."""
        settle()
        parts = split(args, kwargs, self.plan.microbatch_size)
        forwards = [(*self._forward_of(a, k, "loss"), batch_size(a, k)) for a, k in parts]
        if len(parts) > 1:
            refuse_split_steps(self.plan.model_name, forwards[0][0].whole_batch,
                               f"a batch of {batch_size(args, kwargs)} rows runs as {len(parts)} microbatches of "
                               f"the planned {self.plan.microbatch_size}",
                               f"Pass batches of at most {self.plan.microbatch_size} rows, or compile the model for "
                               "this batch size.")
        weighting = forwards[0][0].loss
        if weighting.index is None:
            raise LossWeightError(f"train_step needs the loss: {weighting.how}; call the module and backward yourself")
        counts = (weighting.counts([(flat, rows) for _, flat, rows in forwards])
                  if len(parts) > 1 or forwards[0][0].code.counts_loss else None)
        weights = weighting.weights(counts, len(parts)) if len(parts) > 1 else [1.0]
        losses: list[torch.Tensor | Carried] = []
        try:
            for i, ((forward, flat, _), weight) in enumerate(zip(forwards, weights, strict=True)):
                self._grad_sync.sync = i == len(forwards) - 1
                loss = self._run(forward, flat, counts[i] if counts else None)[weighting.index]   # logits dropped
                summed = forward.code.loss_summed_over   # a summand: summed with the gradients
                losses.append(self._grad_sync.carry(loss, summed) if summed else loss.detach())
                torch.autograd.backward(loss, _filled_like(loss, weight))   # the seed reads no value
        finally:
            self._grad_sync.sync = True
        return sum(_value(loss) * weight for loss, weight in zip(losses, weights, strict=True))

    def _forward_of(self, args: tuple, kwargs: dict, outputs: OutputMode) -> tuple[Forward, list[Any]]:
        """The generated forward for these inputs' shapes returning ``outputs`` so, and the inputs
        flattened."""
        flat = self._flat(args, kwargs)
        return self._forwards.get(flat, args, kwargs, outputs, self.training), flat

    def _expect_inputs(self, spec: pytree.TreeSpec) -> None:
        """Inputs are to be structured as ``spec`` says (the example inputs')."""
        self._in_spec, self._in_layout = spec, tensor_layout(spec)

    def _flat(self, args: tuple, kwargs: dict) -> list[Any]:
        """The inputs flattened, refused if structured unlike the example inputs (or, where grad
        is enabled, if parameters were frozen or unfrozen since the plan: ``_refuse_refrozen``)."""
        if torch.is_grad_enabled():
            self._refuse_refrozen()
        flat = flat_tensors(args, kwargs, self._in_layout)
        if flat is not None:
            return flat
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise InputMismatchError(
                "inputs have another structure than the example inputs the module was compiled with "
                f"(got {spec}, expected {self._in_spec}); recompile for new input structures"
            )
        return flat


def grad_sync_of(mesh: DeviceMesh, code: GeneratedCode, direct: dict[str, nn.Parameter], bucket_bytes: int,
                 reduce_precision: str) -> GradSync:
    """Gradient sync of the parameters ``code`` reads as their shard (``direct``, by FQN): the
    backward produces their gradients in about the reverse order the forward first reads them."""
    ready_order = [(direct[f], code.direct[f]) for f in reversed(code.direct) if f in direct]
    return GradSync(mesh, ready_order, bucket_bytes, reduce_precision)


def _value(loss: torch.Tensor | Carried) -> torch.Tensor:
    """A loss's value, whole on every rank."""
    if isinstance(loss, Carried):
        return loss.value()
    return runtime.whole(loss) if isinstance(loss, DTensor) else loss


def _filled_like(t: torch.Tensor, value: float) -> torch.Tensor:
    """A tensor of ``t``'s shape, dtype and placement filled with ``value``, made from its
    metadata only: ``t`` may be a collective's result still on its way."""
    if isinstance(t, DTensor):
        local = torch.full(t._local_tensor.shape, value, dtype=t.dtype, device=t.device)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return torch.full(t.shape, value, dtype=t.dtype, device=t.device)


def full_state_dict(pmodel: ShardedModule) -> dict[str, torch.Tensor]:
    """The unsharded state dict: same keys and shapes as the original model's, on every rank."""
    return pmodel.full_state_dict()

"""Capture: the unmodified model -> ``CapturedGraph`` (a ``torch.export`` program plus the maps
from graph placeholders to parameter, buffer, constant and user-input names).

Export is non-strict (Python runs normally, ATen ops are recorded), which handles HuggingFace
models that ``torch.fx.symbolic_trace`` cannot. It works on ``meta`` models, so huge models are
captured without allocating their weights.
"""
from __future__ import annotations

import inspect
import os
import re
import traceback
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.fx.config
from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind
from torch.fx._lazy_graph_module import _use_lazy_graph_module  # private; torch is pinned (setup.py)
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from autopar.core import lean_loss
from autopar.core.errors import BufferWriteError, CaptureError, InputMismatchError, PlanningTimeout
from autopar.core.execution import GENERATED_NAMES, IDENTITY_OPS, private_write
from autopar.core.expert_lists import fold_expert_lists
from autopar.core.expert_parallel import experts_as_one_op
from autopar.core.moe_modules import folded_once
from autopar.core.precision import ComputeIn, Precision, check_precision
from autopar.core.stacked_params import stack_parameters


@dataclass
class CapturedGraph:
    """What capture hands to the planner and the code generator.

    ``graph`` nodes carry ``meta["val"]`` (FakeTensor: global shape and dtype) and
    ``meta["nn_module_stack"]`` (the module path, used to name layers in reports).
    """

    program: ExportedProgram
    param_of: dict[str, str]          # placeholder name -> parameter FQN
    buffer_of: dict[str, str]         # placeholder name -> buffer FQN
    constant_of: dict[str, str]       # placeholder name -> lifted constant name
    user_inputs: list[str]            # placeholder names of user inputs, in flattened (args, kwargs) order
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    model_name: str
    fingerprint: str                  # identifies model structure + input shapes, for plan files
    precision: Precision = "fp32"     # policy the graph computes under (``autopar.core.precision``)
    warnings: list[str] = field(default_factory=list)
    frozen: frozenset[str] = frozenset()   # FQNs of the parameters that do not train (``frozen_parameters``)
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)   # a stacked parameter's FQN -> its parts' (``stack_parameters``)

    @property
    def graph(self) -> fx.Graph:
        return self.program.graph_module.graph

    def trains(self, fqn: str) -> bool:
        """Does parameter ``fqn`` train? The one notion of trainable that planning and code
        generation share: it was not frozen (``requires_grad``) when the model was captured."""
        return fqn not in self.frozen and not any(part in self.frozen for part in self.stacked.get(fqn, ()))

    def trained_params(self) -> set[fx.Node]:
        """The placeholders of the parameters that train: where gradients start (``needs_grad``)."""
        return {n for n in self.graph.nodes if n.name in self.param_of and self.trains(self.param_of[n.name])}


def check_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Fail early, with the signature, when the example inputs cannot be passed to forward."""
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise InputMismatchError(
            f"example inputs do not match {type(model).__name__}.forward{inspect.signature(model.forward)}: {e}. "
            "Pass example_inputs as a tuple of positional args and example_kwargs as a dict."
        ) from None


def _without_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """The keyword arguments to export with: ``use_cache=False`` added where ``forward`` takes
    ``use_cache`` and the caller left it unset (Hugging Face decoders return a key/value cache by
    default, for generation; training keeps none, and the cache is no tensor a plan could place).
    ``_drop_added_input`` then takes it out of the captured inputs: the caller passes nothing."""
    signature = inspect.signature(model.forward)
    if ("use_cache" not in signature.parameters or "use_cache" in signature.bind(*args, **kwargs).arguments
            or getattr(getattr(model, "config", None), "use_cache", None) is False):
        return kwargs
    return {**kwargs, "use_cache": False}


def _drop_added_input(program: ExportedProgram, key: str) -> pytree.TreeSpec:
    """Remove keyword input ``key`` (a constant autopar added: ``_without_cache``) from the captured
    program's inputs; returns the inputs' structure without it, as the caller passes them."""
    in_spec = program.call_spec.in_spec
    args, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    index = kwargs.pop(key)
    user = [spec for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    spec = user[index]
    node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
    program.graph.erase_node(node)
    program.graph_signature.input_specs.remove(spec)
    program.graph_module.recompile()
    return pytree.tree_structure((args, kwargs))


def _with_added(dynamic_shapes: Any, added: dict) -> Any:
    """``dynamic_shapes`` by argument name with the arguments autopar added (static) too."""
    return {**dynamic_shapes, **dict.fromkeys(added)} if isinstance(dynamic_shapes, dict) else dynamic_shapes


def _notes(model: torch.nn.Module, added: dict, checkpoints: int) -> list[str]:
    """What capture did that the user did not ask for, said in the plan (``Plan.warnings``); the
    model's own activation checkpointing (``checkpoints``: its ``torch.utils.checkpoint`` calls
    traced), which the plan ignores, also as a Python warning."""
    name = type(model).__name__
    notes = [f"autopar called {name}.forward with {k}={v!r}, which the inputs left unset: training keeps no "
             f"key/value cache (pass {k} with the inputs to choose otherwise)" for k, v in added.items()]
    hf = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    if model.training and (hf or checkpoints):   # traced through: the ops inside run once, as captured
        how = ("gradient checkpointing on (gradient_checkpointing_enable())" if hf
               else f"{checkpoints} torch.utils.checkpoint call(s) in its forward")
        ignored = (f"{name} has {how}: autopar ignores it and plans recomputation itself (the recompute= option: "
                   "'auto' recomputes where memory needs it, 'full' every repeated block)")
        warnings.warn(ignored, stacklevel=3)
        notes.append(ignored)
    return notes


@contextmanager
def _counting_checkpoints(calls: list[str]) -> Iterator[None]:
    """Record the model's ``torch.utils.checkpoint`` calls while it is traced (export inlines the
    ops inside them, so the graph no longer shows them): one entry per call, in ``calls``."""
    import torch.utils.checkpoint as ckpt

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append("non-reentrant")
        return generator(*args, **kwargs)

    class Reentrant:
        @staticmethod
        def apply(*args: Any) -> Any:
            calls.append("reentrant")
            return function.apply(*args)

    generator, function = ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction
    # both looked up by name when checkpoint() runs
    ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = counted, Reentrant  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = generator, function  # type: ignore[misc]


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch: the model line that failed to trace."""
    own = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)   # not code made at run time (<string>)
              if "/torch/" not in f.filename and not f.filename.startswith((own, "<"))]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} ({f.line})"




def _capture_hint(message: str, dtype: torch.dtype = torch.float32, line: str = "") -> str | None:
    """What to do about export's error ``message`` (its first line), where its cause is known;
    ``dtype``: the precision policy's compute dtype the model was traced under; ``line``: the
    model's source line that failed to trace."""
    if dtype != torch.float32 and re.search(r"dtype|BFloat16|Half", message):
        return (f"under a precision policy computing in {dtype} autopar casts the parameters and floating inputs "
                "to it (FSDP2's MixedPrecisionPolicy), not the buffers nor the tensors the model makes: this op "
                f"mixes {dtype} with float32. Cast that operand to the activations' dtype where the model uses it "
                "(as Hugging Face models cast their buffers), or plan with precision='fp32'.")
    unknown = re.search(r"Found <class '([\w.]+)'> in output", message)
    if unknown and "Cache" in unknown.group(1):
        return ("the model returns a key/value cache, for generation; training keeps none: pass use_cache=False "
                "with the inputs, or leave use_cache out (autopar then passes False).")
    if unknown:
        return (f"the model returns a {unknown.group(1)}, which autopar cannot carry: return tensors, "
                "or tuples, lists and dicts of them (or register the type with torch.utils._pytree).")
    if "higher order operator" in message.lower():   # torch.cond and the like: untraced, and no sharded form
        return ("torch.cond (or another control-flow operator) is the cause; autopar cannot shard it: compute both "
                "branches and pick one with torch.where.")
    dependent = "data-dependent" in message.lower() or "data dependent" in message.lower()
    if dependent and re.match(r"\s*for\s", line):
        return ("a Python loop over a tensor whose length depends on its values is the cause (as a mixture of "
                "experts looping over the experts a batch hits): loop over a length known from shapes instead, "
                "e.g. every expert with range(num_experts) (autopar runs a loop over a list of experts as one op)")
    if dependent and re.match(r"\s*if\s.*(numel\(\)|shape\[0\]|size\(0\)|len\().*(==|<=|<|>)\s*[01]\b", line):
        return ("a branch on how many rows a value-dependent selection picked is the cause (as a mixture of experts "
                "skipping an expert that no token chose): drop the branch; an expert run on no rows adds nothing, "
                "and autopar runs a loop over a list of experts as one op")
    if dependent:
        return ("Python control flow on tensor values is the cause: compute both outcomes and pick one with "
                "torch.where, or make the condition depend on shapes only.")
    return None


def _capture_error(model: torch.nn.Module, e: Exception, dtype: torch.dtype = torch.float32) -> CaptureError:
    """Export's error ``e`` said for the user: where in the model, why, what to do. A known cause
    comes first, export's words after it, and without export's traceback (raised ``from None``);
    an unknown one keeps it (its ``__cause__``). ``dtype``: as ``_capture_hint`` takes it."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    frame = _user_frame(e)
    where = f"torch.export could not capture {type(model).__name__}{frame}"
    hint = _capture_hint(first, dtype, frame.rpartition(" (")[2])
    if hint is None:
        error = CaptureError(f"{where}: {type(e).__name__}: {first}. Check that the model runs eagerly on these "
                             "inputs (model(*args, **kwargs)); the line named above is where tracing failed.")
        error.__cause__ = e
        return error
    error = CaptureError(f"{where}: {hint} ({type(e).__name__}: {first.split('. ')[0]})")
    error.__suppress_context__ = True
    return error


def _inline_grad_regions(program: ExportedProgram) -> None:
    """Inline the ``torch.no_grad()`` / ``torch.enable_grad()`` regions export records as
    ``wrap_with_set_grad_enabled`` higher-order ops on submodules (HF's rotary embeddings run
    under ``no_grad``): their ops join the graph, to be planned and generated like any other,
    and each value a ``no_grad`` region returns is detached, so no gradient flows through it,
    as when the model runs. Nested regions are inlined in turn."""
    gm = program.graph_module
    graph = gm.graph
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    while regions := [n for n in graph.nodes if n.op == "call_function" and n.target is hop]:
        for node in regions:
            enabled, attr, *operands = node.args
            body = getattr(gm, attr.target)
            for inner in body.graph.nodes:   # a nested region's submodule, reached from the parent
                if inner.op == "get_attr":
                    inner.target = f"{attr.target}.{inner.target}"
            placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
            with graph.inserting_before(node):
                outs = graph.graph_copy(body.graph, dict(zip(placeholders, operands, strict=True)))
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            for item in list(node.users):   # getitem(region, i): region output i
                value = outs[item.args[1]]
                if enabled:
                    item.replace_all_uses_with(value)
                    graph.erase_node(item)
                else:
                    item.target, item.args = torch.ops.aten.detach.default, (value,)
            graph.erase_node(node)
            if not attr.users:
                graph.erase_node(attr)
    gm.delete_all_unused_submodules()
    gm.recompile()


def _out_of_place_private_writes(program: ExportedProgram) -> None:
    """Run out of place the in-place writes no other value sees (``execution.private_write``),
    so that they split like any other op, instead of keeping what they write replicated."""
    gm = program.graph_module
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in gm.graph.nodes:   # in order: a write to a rewritten write's output is private in turn
        functional = private_write(node, position)
        if functional is not None:
            node.target, changed = functional, True
    if changed:
        gm.recompile()


def _drop_idle_dropouts(program: ExportedProgram) -> None:
    """A dropout of probability 0 (or not training) returns its input itself and draws nothing
    (ATen's ``dropout``): replaced by its input, so that it is not priced as a pass over it and a
    copy (a Hugging Face model's eager attention calls one on every score matrix, gpt-oss's
    among them)."""
    gm = program.graph_module
    idle = [n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default
            and (float(n.args[1]) == 0.0 or not n.args[2])]
    for node in idle:
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
    if idle:
        gm.recompile()


def _lean_losses(program: ExportedProgram) -> None:
    """Each cross-entropy the lean loss computes made one (``autopar.core.lean_loss``: the
    logits' fp32 copy, log-probabilities and their gradients never held whole)."""
    if lean_loss.lean_losses(program.graph_module.graph):
        program.graph_module.recompile()


#: What to do about each higher-order op that has no generated form (others: write the model without it).
_HIGHER_ORDER_ADVICE = {
    "cond": "torch.cond: compute both branches and pick one with torch.where",
    "wrap_with_autocast": "torch.autocast: run the model without it; plan with precision='bf16' to compute in bf16",
}


def _refuse_higher_order_ops(program: ExportedProgram, model_name: str) -> None:
    """Higher-order ops other than grad-mode regions (autocast regions, torch.cond, checkpoint
    wrappers) have no generated form yet: say which, and what to write instead, rather than fail in
    generated code. (``torch.cond`` is not rewritten as ``torch.where`` here: that would run the
    branch the model skips, whose ops may fail or give NaN gradients on values it was never meant for.)"""
    found = sorted({getattr(n.target, "__name__", str(n.target)) for n in program.graph.nodes
                    if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)})
    if found:
        advice = "; ".join(_HIGHER_ORDER_ADVICE.get(op, f"{op}: write the model without it") for op in found)
        raise CaptureError(f"{model_name} contains higher-order ops autopar cannot shard yet ({', '.join(found)}). "
                           f"What to do: {advice}.")


def _simulated_state_error(model: torch.nn.Module) -> CaptureError | None:
    """Why export failed where the model was built under ``LocalTensorMode`` (inside
    ``run_on_local_tensor_mesh``): a tensor per simulated rank in its state, which export traces
    only in the simplest models (a GPT stopped on a bare ``StopIteration``); None where it was not."""
    simulated = next((name for name, t in model.state_dict(keep_vars=True).items() if isinstance(t, LocalTensor)), None)
    if simulated is None:
        return None
    return CaptureError(
        f"torch.export could not capture {type(model).__name__}, built with every rank simulated (its {simulated} "
        "is a LocalTensor: the model was made inside LocalTensorMode, e.g. in the function run_on_local_tensor_mesh "
        "runs). Build the model outside it, as for one device, and pass it in; autopar shards it over the simulated "
        "ranks.")


def frozen_parameters(model: torch.nn.Module) -> frozenset[str]:
    """The FQNs (every name of a tied one) of ``model``'s parameters with ``requires_grad=False``,
    as users freeze them (a frozen embedding, a fine-tuned model's base weights under LoRA
    adapters, Whisper's sinusoidal positions): they get no gradient, no gradient sync and no
    optimizer state, as on one device."""
    return frozenset(name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)


def fingerprint(program: ExportedProgram, model_name: str, frozen: frozenset[str] = frozenset()) -> str:
    """A stable id of the graph (ops and shapes) and of the parameters frozen in it, so a plan is
    never applied to another model, nor to the same one trained otherwise (a plan prices and syncs
    only trainable parameters' gradients). No frozen parameter adds nothing to the id."""
    import hashlib

    h = hashlib.sha256(model_name.encode())
    if frozen:
        h.update(("frozen:" + ",".join(sorted(frozen)) + ";").encode())
    for n in program.graph.nodes:
        if n.target in IDENTITY_OPS:
            continue
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        h.update(f"{n.op}:{n.target}:{shape};".encode())
    return h.hexdigest()[:16]


def as_args(example_inputs: Any) -> tuple:
    """Example inputs as the positional-argument tuple ``capture`` takes (a lone tensor is one argument)."""
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def _rename(program: ExportedProgram, node: fx.Node, name: str) -> None:
    """Rename a graph value and the signature's references to it."""
    old = node.name
    node._rename(name)
    if node.op == "placeholder":
        node.target = node.name
    sig = program.graph_signature
    for spec in (*sig.input_specs, *sig.output_specs):
        if hasattr(spec.arg, "name") and spec.arg.name == old:
            spec.arg.name = node.name


def _inner_stack(stack: dict[str, tuple[str, Any]]) -> dict[str, tuple[str, Any]]:
    """A module stack of ``ComputeIn(model)``'s capture as ``model``'s capture has it."""
    inner = {}
    for key, (path, kind) in stack.items():
        if key.startswith("L__self__model"):
            inner["L__self__" + key.removeprefix("L__self__model").removeprefix(".")] = (path.removeprefix("model").removeprefix("."), kind)
    return inner


def _free_generated_names(program: ExportedProgram) -> None:
    """Rename graph values named as something generated code uses itself (a ``torch.full`` node
    is ``full``, also the runtime's gather of an output)."""
    for node in list(program.graph.nodes):
        if node.name in GENERATED_NAMES:
            _rename(program, node, f"{node.name}_value")


def _unwrap(program: ExportedProgram, model: torch.nn.Module) -> None:
    """Make a capture of ``ComputeIn(model)`` read as one of ``model``: state names without the
    wrapper's ``model.`` prefix, user inputs named as ``model.forward`` names them (not ``args_0``),
    and each parameter's cast right before its first use, its metadata check dropped (so the
    graph's order, which generated code and the memory timeline follow, keeps one layer's copy
    alive, not every layer's)."""
    graph = program.graph
    order = {n: i for i, n in enumerate(graph.nodes)}   # moving a cast up leaves the others' order
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    positional = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for spec in program.graph_signature.input_specs:
        node = placeholders.get(getattr(spec.arg, "name", None))
        if spec.target is not None and spec.target.startswith("model."):
            spec.target = spec.target.removeprefix("model.")
        if node is None:
            continue
        if spec.kind == InputKind.USER_INPUT:
            index = re.fullmatch(r"args_(\d+)", node.name)
            if index and int(index.group(1)) < len(positional) and positional[int(index.group(1))] not in placeholders:
                _rename(program, node, positional[int(index.group(1))])
        elif re.match(r"[pbc]_model_", node.name):
            _rename(program, node, node.name[0] + node.name[len("p_model"):])
        if spec.kind == InputKind.PARAMETER:
            _cast_at_first_use(graph, node, order)
    root = {"L__self__": ("", f"{type(model).__module__}.{type(model).__qualname__}")}
    for node in graph.nodes:
        if "nn_module_stack" in node.meta:
            node.meta["nn_module_stack"] = _inner_stack(node.meta["nn_module_stack"]) or root
    for node in graph.nodes:   # a parameter's cast belongs to the layer that uses it
        if node.target is torch.ops.aten.to.dtype and node.args[0].op == "placeholder" and node.users:
            node.meta["nn_module_stack"] = next(iter(node.users)).meta.get("nn_module_stack", root)
    for state in (program.state_dict, program.constants):
        for key in [k for k in state if k.startswith("model.")]:
            state[key.removeprefix("model.")] = state.pop(key)


def _cast_at_first_use(graph: torch.fx.Graph, param: torch.fx.Node, order: dict[torch.fx.Node, int]) -> None:
    """Move each cast of ``param`` right before its first user, and drop the metadata checks
    export puts before each cast: a read that would pin the parameter's use (ZeRO-3: its gather)
    to the top of the graph, with no value to give."""
    for cast in [u for u in param.users if u.target is torch.ops.aten.to.dtype]:
        first = min(cast.users, key=order.__getitem__, default=None)
        if first is not None:
            first.prepend(cast)
    for check in [u for u in param.users if u.target is torch.ops.aten._assert_tensor_metadata.default]:
        graph.erase_node(check)


@contextmanager
def _lean_tracing() -> Iterator[None]:
    """Export without what autopar never reads: the Python stack of every node (a traceback taken
    per op) and the Python code of every intermediate graph module (generated anew after each of
    export's passes; a lazy module generates it when first run). Halves the capture of Llama-2 70B
    (7,377 nodes: 12 s -> 7 s); the graph is the same."""
    config = torch.fx.config
    emit = getattr(config, "do_not_emit_stack_traces", None)   # None: torch 2.11 (the lent GPUs') lacks it
    if emit is not None:
        config.do_not_emit_stack_traces = True
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        if emit is not None:
            config.do_not_emit_stack_traces = emit


def _refuse_value_dependent_sizes(program: ExportedProgram, model_name: str, why_not: list[str]) -> None:
    """A size that depends on tensor values (export's unbacked symbols: ``torch.where(cond)``,
    ``nonzero``, boolean-mask indexing) cannot be planned: every cost and placement rests on
    sizes known before the run. Name the first op that makes one, its module, and ``why_not``
    (``fold_expert_lists``) it is no hand-written mixture of experts autopar runs as one op."""
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or not free_unbacked_symbols(val):
            continue
        module = readable_name(node) or "its own forward"
        raise CaptureError(
            f"{model_name}: {node.target} in {module} makes a tensor whose size depends on "
            "tensor values (as torch.where(condition), nonzero or boolean-mask indexing do, e.g. a mixture of "
            "experts that picks each expert's tokens in a loop); autopar plans sizes known before the run. "
            "Keep shapes fixed: weight by a mask instead of selecting rows. A mixture of experts is planned where "
            "its experts are transformers' fused ones or a list of MLPs of linears, each picking its "
            "tokens by the router's top-k ids and adding its weighted rows back" + (f"; here, {why_not[0]}" if why_not else "") + ".")


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None,
            dynamic_shapes: Any = None, precision: Precision = "fp32") -> CapturedGraph:
    """Export ``model`` on its example inputs; ``dynamic_shapes`` (as ``torch.export`` takes it)
    makes dims symbolic (``autopar.planning.symbolic``); ``precision`` other than fp32 records the
    policy's casts in the graph (``autopar.core.precision``)."""
    kwargs = kwargs or {}
    if not isinstance(args, tuple):
        args = (args,)
    check_inputs(model, args, kwargs)
    traced = model if check_precision(precision) == "fp32" else ComputeIn(model, precision)
    exported = _without_cache(model, args, kwargs)
    added = {k: v for k, v in exported.items() if k not in kwargs}
    if added and dynamic_shapes is not None:   # shaped as the inputs given: the added one has none
        dynamic_shapes = _with_added(dynamic_shapes, added)
    checkpoints: list[str] = []
    with _counting_checkpoints(checkpoints):
        program, once = _export(model, traced, args, exported, dynamic_shapes)
    in_spec = program.call_spec.in_spec
    for key in added:
        in_spec = _drop_added_input(program, key)
    if traced is not model:
        _unwrap(program, model)
    _inline_grad_regions(program)
    _out_of_place_private_writes(program)
    _drop_idle_dropouts(program)
    _refuse_higher_order_ops(program, type(model).__name__)
    _lean_losses(program)
    folded, why_not = fold_expert_lists(program, model)
    folded = once + folded
    _refuse_value_dependent_sizes(program, type(model).__name__, why_not)
    frozen = frozen_parameters(model)
    stacked = stack_parameters(program, frozen)
    _free_generated_names(program)
    param_of, buffer_of, constant_of, user_inputs = _inputs_by_kind(program.graph_signature)
    notes = _notes(model, added, len(checkpoints)) + folded
    name = type(model).__name__
    _refuse_buffer_writes(program.graph_signature, name)
    return CapturedGraph(
        program=program,
        param_of=param_of,
        buffer_of=buffer_of,
        constant_of=constant_of,
        user_inputs=user_inputs,
        in_spec=in_spec,
        out_spec=program.call_spec.out_spec,
        model_name=name,
        fingerprint=fingerprint(program, name, frozen),
        precision=precision,
        warnings=notes,
        frozen=frozen,
        stacked=stacked,
    )


def _export(model: torch.nn.Module, traced: torch.nn.Module, args: tuple, kwargs: dict,
            dynamic_shapes: Any) -> tuple[torch.export.ExportedProgram, list[str]]:
    """``torch.export.export(traced, ...)`` (non-strict, lean: ``_lean_tracing``; transformers'
    experts as one op each: ``experts_as_one_op``; repeated hand-written MoE modules folded once:
    ``folded_once``, whose notes come second), its failures raised as ``_capture_error`` says
    about ``model``."""
    precision = traced.precision if isinstance(traced, ComputeIn) else "fp32"
    once: AbstractContextManager[list[str]] = (folded_once(model, args, kwargs, precision) if dynamic_shapes is None
                                               else nullcontext([]))
    try:
        # Export traces with its own fake tensors; a LocalTensorMode (one-process SPMD simulation)
        # around the caller must not see that tracing.
        with maybe_disable_local_tensor_mode(), _lean_tracing(), experts_as_one_op(), once as notes:
            return torch.export.export(traced, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False), notes
    except PlanningTimeout:   # the planning call's time limit (``Clock.stops_capture``), not the model
        raise
    except Exception as e:  # export raises many types; all mean "not traceable"
        simulated = _simulated_state_error(model)
        if simulated is not None:
            raise simulated from e
        dtype = traced.dtype if isinstance(traced, ComputeIn) else torch.float32
        raise _capture_error(model, e, dtype)  # noqa: B904 - _capture_error chains export's error or not


def _inputs_by_kind(sig: ExportGraphSignature) -> tuple[dict[str, str], dict[str, str], dict[str, str], list[str]]:
    """The graph's placeholders by what they are: (parameter, buffer and constant placeholder ->
    its name in the model, the user inputs' placeholders in order)."""
    param_of, buffer_of, constant_of, user_inputs = {}, {}, {}, []
    for spec in sig.input_specs:
        name = spec.arg.name if hasattr(spec.arg, "name") else None
        if spec.kind == InputKind.PARAMETER:
            param_of[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            buffer_of[name] = spec.target
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constant_of[name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
    return param_of, buffer_of, constant_of, user_inputs


def _refuse_buffer_writes(sig: ExportGraphSignature, name: str) -> None:
    """Export keeps in-place writes to buffers in its graph, which autopar runs as they are; a
    write it turned into an output of a functional graph would be lost."""
    if sig.buffers_to_mutate:
        raise BufferWriteError(
            f"torch.export captured {name}'s writes to buffers {sorted(sig.buffers_to_mutate.values())} as outputs "
            "of a functional graph, which autopar does not write back. Report the model: autopar captures writes "
            "as the in-place ops torch.export.export(strict=False) records.")


def readable_name(node: fx.Node) -> str:
    """Layer path of a node, e.g. ``transformer.h.0.attn``, from export's module stack."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return re.sub(r"L\['self'\]\.?|\['(\w+)'\]", lambda m: m.group(1) or "", path).replace("_modules.", "")


def flat_tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued argument nodes in argument order (duplicates kept: ``x * x`` has two)."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in leaves if isinstance(a, fx.Node) and _is_tensor_like(a)]


def needs_grad(graph: fx.Graph, params: set[fx.Node]) -> dict[fx.Node, bool]:
    """Whether each node's output gets a gradient: it depends on a floating-point parameter through
    ops other than ``detach`` (which ends a ``torch.no_grad`` region: ``_inline_grad_regions``)."""
    out: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        val = tensor_val(node)
        floating = val is not None and val.dtype.is_floating_point
        if node.op == "placeholder":
            out[node] = floating and node in params
        else:
            out[node] = (floating and node.target is not torch.ops.aten.detach.default
                         and any(out.get(i, False) for i in flat_tensor_inputs(node)))
    return out


def _is_tensor_like(n: fx.Node) -> bool:
    return tensor_val(n) is not None


_RANDOM = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)


def is_random(node: fx.Node) -> bool:
    """An op drawing random numbers (dropout's mask): its value differs from call to call."""
    return isinstance(node.target, torch._ops.OpOverload) and any(t in node.target.tags for t in _RANDOM)


def is_size(node: fx.Node) -> bool:
    """A size read off a tensor's shape (a capture with symbolic sizes, ``autopar.planning.symbolic``):
    fixed for a generated forward, which is specialised on its inputs' shapes."""
    return isinstance(node.meta.get("val"), (int, torch.SymInt))


def tensor_val(node: fx.Node) -> torch.Tensor | None:
    """A node's (first) tensor output as export recorded it (global shape and dtype), or None."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val if isinstance(val, torch.Tensor) else None


def value_bytes(graph: fx.Graph, name: str) -> int:
    """The bytes of node ``name``'s (first) tensor output, whole (global shape)."""
    val = tensor_val(next(n for n in graph.nodes if n.name == name))
    return val.numel() * val.element_size()


def output_shape(node: fx.Node) -> tuple[int, ...] | None:
    """Global shape of a node's (first) tensor output."""
    val = tensor_val(node)
    return tuple(val.shape) if val is not None else None

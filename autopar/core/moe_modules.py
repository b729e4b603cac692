"""Repeated hand-written MoE modules exported once, so that a model of many exports quickly.

Exported in the whole model, each hand-written MoE layer's loop over its experts
(``autopar.core.expert_lists``) costs export time in proportion to its experts: a value-dependent
size per expert (4.8 s a layer of 64 experts on this 2-core host; DeepSeek-V2-Lite's 27 such
layers, 140 s). Most models repeat one such module in every block. So capture exports one of them
alone (its inputs' shapes found by running the model on fake tensors up to its first call),
folds its loop into ``moe_experts`` there, and while the whole model is exported every module
alike (same class, parameter shapes and settings) runs that folded graph on its own parameters
(``folded_once``): the loop is traced once, not once per layer. A module that cannot be folded,
or is called with other shapes, runs its own forward, as it would anyway.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from autopar.core.expert_lists import fold_expert_lists
from autopar.core.precision import ComputeIn, Precision

_STATE = (InputKind.PARAMETER, InputKind.BUFFER)
log = logging.getLogger("autopar")


@dataclass(frozen=True)
class Folded:
    """One MoE module's exported graph with its loop folded, and how to call it."""

    graph: fx.GraphModule
    state: tuple[str, ...]          # the module's parameter and buffer names, in placeholder order
    in_spec: pytree.TreeSpec        # its (args, kwargs)
    out_spec: pytree.TreeSpec
    shapes: tuple[tuple[int, ...], ...]   # of its tensor inputs, as exported


def _alike_entries(entries: nn.ModuleList) -> bool:
    """Entries of one type and parameter shapes, each with at least two parameters (an expert MLP)."""
    shapes = {(type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())) for m in entries}
    return len(entries) > 1 and len(shapes) == 1 and len(next(iter(shapes))[1]) >= 2


def _key(module: nn.Module) -> tuple:
    """What modules alike share: class, parameter and buffer shapes, plain settings."""
    state = [(n, tuple(t.shape), t.dtype) for n, t in [*module.named_parameters(), *module.named_buffers()]]
    settings = sorted((k, repr(v)) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str)))
    return type(module), tuple(state), tuple(settings)


def repeated_moe_modules(model: nn.Module) -> list[list[nn.Module]]:
    """Groups of two or more modules alike, each holding a ``ModuleList`` of alike experts."""
    groups: dict[tuple, list[nn.Module]] = {}
    for module in model.modules():
        if any(isinstance(c, nn.ModuleList) and _alike_entries(c) for c in module.children()):
            groups.setdefault(_key(module), []).append(module)
    return [g for g in groups.values() if len(g) > 1]


class _Reached(Exception):
    """Raised by a pre-hook to stop the model's forward once a module's inputs are known."""


def first_inputs(model: nn.Module, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``module``'s (args, kwargs), as fake tensors, at its first call in ``model(*args, **kwargs)``
    run on fake tensors up to it; None where the run ends before it."""
    found: list[tuple[tuple, dict]] = []

    def reached(_: nn.Module, a: tuple, kw: dict) -> None:
        found.append((a, kw))
        raise _Reached

    handle = module.register_forward_pre_hook(reached, with_kwargs=True)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            model(*fake_args, **fake_kwargs)
    except _Reached:
        pass
    finally:
        handle.remove()
    return found[0] if found else None


def _shapes(flat: list) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(x.shape) for x in flat if isinstance(x, torch.Tensor))


def folded(module: nn.Module, inputs: tuple[tuple, dict], precision: Precision = "fp32"
           ) -> tuple[Folded, list[str]] | None:
    """``module`` exported alone on ``inputs`` (under ``precision``'s casts, as the whole model is)
    with its loop over experts folded (``fold_expert_lists``), and the notes the fold made; None
    where it does not fold or takes other than tensors (an export that fails raises)."""
    traced = module if precision == "fp32" else ComputeIn(module, precision)
    program = torch.export.export(traced, inputs[0], inputs[1], strict=False)
    notes, _ = fold_expert_lists(program, traced)
    wrapped = "" if traced is module else "model."   # (ComputeIn's child)
    notes = [note.removeprefix(wrapped) for note in notes]
    specs = program.graph_signature.input_specs
    if not notes or any(s.kind not in (*_STATE, InputKind.USER_INPUT) for s in specs) or \
            any(node.op == "get_attr" for node in program.graph.nodes):
        return None
    flat, in_spec = pytree.tree_flatten(inputs)
    if len([s for s in specs if s.kind == InputKind.USER_INPUT]) != len(flat) or \
            not all(isinstance(x, torch.Tensor) for x in flat):
        return None
    state = tuple(str(s.target).removeprefix(wrapped) for s in specs if s.kind in _STATE)
    if wrapped:
        _read_as_cast(program.graph_module, [s.arg.name for s in specs if s.kind in (InputKind.PARAMETER,
                                                                                    InputKind.USER_INPUT)])
    return Folded(program.graph_module, state, in_spec, program.call_spec.out_spec, _shapes(flat)), notes


def _read_as_cast(graph: fx.GraphModule, names: list[str]) -> None:
    """Drop the precision policy's casts of the placeholders ``names`` (and their metadata checks):
    inside the whole model's capture each module's parameters and inputs come already cast."""
    for node in [n for n in graph.graph.nodes if n.op == "placeholder" and n.name in names]:
        for user in list(node.users):
            if user.target is torch.ops.aten._assert_tensor_metadata.default:
                graph.graph.erase_node(user)
            elif user.target is torch.ops.aten.to.dtype:
                user.replace_all_uses_with(node)
                graph.graph.erase_node(user)
    graph.recompile()


def _run(graph: Folded, module: nn.Module, original: Any, *args: Any, **kwargs: Any) -> Any:
    """``module``'s forward as ``graph`` computes it on its own parameters and buffers (its own
    forward where the inputs are laid out or shaped otherwise)."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec != graph.in_spec or _shapes(flat) != graph.shapes or not all(isinstance(x, torch.Tensor) for x in flat):
        return original(module, *args, **kwargs)
    out = fx.Interpreter(graph.graph).run(*(_current(module, name) for name in graph.state), *flat)
    return pytree.tree_unflatten(list(out), graph.out_spec)


def _current(module: nn.Module, name: str) -> torch.Tensor:
    """``module``'s parameter or buffer ``name`` as it is now (under a precision policy's
    ``functional_call``, the cast value in its place)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(module.get_submodule(owner), leaf)


def _paths(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def _folded_first(model: nn.Module, module: nn.Module, args: tuple, kwargs: dict,
                  precision: Precision) -> tuple[Folded, list[str]] | None:
    """``folded`` on ``module``'s inputs in ``model``; None where any step fails (the model is then
    exported as it is, each loop in place: slower, never wrong)."""
    traced = model if precision == "fp32" else ComputeIn(model, precision)
    try:
        inputs = first_inputs(traced, module, args, kwargs)
        return folded(module, inputs, precision) if inputs is not None else None
    except Exception as e:  # noqa: BLE001 - an optimisation only
        log.debug("a repeated MoE module is exported in place: %s", e)
        return None


@contextmanager
def folded_once(model: nn.Module, args: tuple, kwargs: dict, precision: Precision = "fp32") -> Iterator[list[str]]:
    """While open, each group of ``repeated_moe_modules`` of ``model`` that exports and folds runs
    the folded graph of its first (``folded``, under ``precision``); yields the fold's notes, one
    per module, named by its path. The modules' own forwards are back after."""
    notes: list[str] = []
    patched: list[nn.Module] = []
    paths = _paths(model)
    try:
        for group in repeated_moe_modules(model):
            found = _folded_first(model, group[0], args, kwargs, precision)
            if found is None:
                continue
            for module in group:
                module.forward = functools.partial(_run, found[0], module, type(module).forward)
                patched.append(module)
                notes += [f"{paths[id(module)]}.{note}" for note in found[1]]
        yield notes
    finally:
        for module in patched:
            del module.forward

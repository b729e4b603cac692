"""Parameters the graph stacks every step, stored stacked: one parameter in their place.

A hand-written list of experts runs as ``moe_experts`` on its weights stacked in the graph
(``autopar.core.expert_lists``): ``stack([experts.0.w1.weight, experts.1.w1.weight, ...])``. Left
so, each expert's weight is a parameter of its own, stored as the plan says for it, and split by
expert every rank would hold every expert (the stack sliced to its own each step, the gradients
gathered back whole). Here each such stack becomes one parameter placeholder
(``experts.w1_weight``, [E, ...]) that the plan stores as it stores transformers' fused experts:
split by expert, a rank holds its experts alone, their gradients and optimizer states too.

The compiled module holds the stacked parameter in the parts' place (``ShardedModule``), and
``full_state_dict`` gives the parts back under their own names. A stack is kept as it is where its
parts do not all train alike, are read elsewhere too, or are not one list's entries (names that
differ in one component).
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default)


def stacked_name(parts: list[str], taken: set[str]) -> str | None:
    """The name of the stack of ``parts`` (FQNs differing in one component, the list's index):
    the list's path then the role, joined by ``_`` (``experts.0.w1.weight`` ... ->
    ``experts.w1_weight``); None where they differ otherwise or the name is ``taken``."""
    split = [p.split(".") for p in parts]
    if len({len(s) for s in split}) != 1:
        return None
    differ = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
    if len(differ) != 1 or differ[0] == len(split[0]) - 1:
        return None
    i = differ[0]
    name = ".".join(split[0][:i] + ["_".join(split[0][i + 1:])])
    return None if name in taken else name


def _part(node: fx.Node, param_of: dict[str, str]) -> tuple[fx.Node, fx.Node | None] | None:
    """(the parameter placeholder, its cast or None) an input of a stack reads, where it is read
    there alone; else None."""
    cast = node if node.op == "call_function" and node.target in _CASTS else None
    param = node.args[0] if cast is not None else node
    if not isinstance(param, fx.Node) or param.name not in param_of or len(param.users) != 1:
        return None
    if cast is not None and len(cast.users) != 1:
        return None
    return param, cast


def _stackable(stack: fx.Node, param_of: dict[str, str], frozen: frozenset[str],
               taken: set[str]) -> tuple[str, list[tuple[fx.Node, fx.Node | None]]] | None:
    """(the stacked parameter's name, its parts) where ``stack`` joins parameters read nowhere else,
    on dim 0, with one cast or none alike, all training or all frozen; else None."""
    if stack.target is not aten.stack.default or (len(stack.args) > 1 and stack.args[1] != 0):
        return None
    parts = [_part(n, param_of) for n in stack.args[0]]
    if any(p is None for p in parts) or len(parts) < 2:
        return None
    found = [p for p in parts if p is not None]
    names = [param_of[p.name] for p, _ in found]
    casts = {(c.target, c.args[1:], tuple(sorted(c.kwargs.items()))) if c is not None else None for _, c in found}
    shapes = {(tuple(p.meta["val"].shape), p.meta["val"].dtype) for p, _ in found}
    if len(casts) != 1 or len(shapes) != 1 or len({n in frozen for n in names}) != 1:
        return None
    name = stacked_name(names, taken)
    return (name, found) if name is not None else None


def _placeholder_name(fqn: str) -> str:
    return "p_" + fqn.replace(".", "_")


def _replace(program: ExportedProgram, stack: fx.Node, name: str, parts: list[tuple[fx.Node, fx.Node | None]]) -> None:
    """One parameter placeholder ``name`` (in the first part's place) for ``stack`` and its parts."""
    graph = program.graph
    first = parts[0][0]
    with graph.inserting_before(first):
        placeholder = graph.placeholder(_placeholder_name(name))
    placeholder.meta.update({k: v for k, v in first.meta.items() if k != "val"})
    placeholder.meta["val"] = _stacked_val([p for p, _ in parts])
    value: fx.Node = placeholder
    cast = parts[0][1]
    if cast is not None:
        with graph.inserting_before(stack):
            value = graph.call_function(cast.target, (placeholder, *cast.args[1:]), dict(cast.kwargs))
        value.meta.update(cast.meta)
        value.meta["val"] = stack.meta["val"]
    stack.replace_all_uses_with(value)
    graph.erase_node(stack)
    for param, c in parts:
        if c is not None:
            graph.erase_node(c)
        graph.erase_node(param)
    specs = program.graph_signature.input_specs
    gone = {p.name for p, _ in parts}
    at = next(i for i, s in enumerate(specs) if getattr(s.arg, "name", None) == first.name)
    kept = [s for s in specs if getattr(s.arg, "name", None) not in gone]
    kept.insert(at, InputSpec(InputKind.PARAMETER, TensorArgument(placeholder.name), name, None))
    specs[:] = kept


def _stacked_val(params: list[fx.Node]) -> torch.Tensor:
    """The stacked parameter's fake value (the stack's own may be of a cast)."""
    vals = [p.meta["val"] for p in params]
    mode = detect_fake_mode(vals)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.stack(vals)


def stack_parameters(program: ExportedProgram, frozen: frozenset[str]) -> dict[str, tuple[str, ...]]:
    """Each stack of parameters in ``program`` (``_stackable``) made one parameter: {its name: the
    parts' FQNs, in order}."""
    param_of = dict(program.graph_signature.inputs_to_parameters)
    taken = set(param_of.values())
    stacked: dict[str, tuple[str, ...]] = {}
    for stack in list(program.graph.nodes):
        found = _stackable(stack, param_of, frozen, taken)
        if found is None:
            continue
        name, parts = found
        stacked[name] = tuple(param_of[p.name] for p, _ in parts)
        taken.add(name)
        _replace(program, stack, name, parts)
    if stacked:
        program.graph_module.recompile()
    return stacked


def stacked_value(model: torch.nn.Module, parts: tuple[str, ...]) -> torch.Tensor:
    """The stacked parameter's value: ``parts`` of ``model`` stacked (detached)."""
    return torch.stack([model.get_parameter(p).detach() for p in parts])


def unstacked(state: dict[str, torch.Tensor], stacked: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """``state`` (whole tensors) with each stacked parameter given back as its parts, under their
    names, in its place: the model's own state dict."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in stacked:
            out.update({part: piece.clone() for part, piece in zip(stacked[key], value.unbind(0), strict=True)})
        else:
            out[key] = value
    return out

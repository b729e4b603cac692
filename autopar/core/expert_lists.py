"""A hand-written mixture of experts, found in the exported graph and run as ``moe_experts``.

Hand-written MoE layers (Hugging Face's Mixtral before transformers 5, and most written by hand)
keep their experts in a ``ModuleList`` of MLPs of linears (with biases or none): gated (SwiGLU:
``down(silu(gate x) * up x)``) or plain (``down(gelu(up x))``, as GShard's and DeepSpeed-MoE's
FFNs; SiLU, GELU or ReLU). Each expert picks its tokens with ``torch.where`` / ``nonzero`` over
the router's top-k ids, runs on those rows, weights them by their router weights and adds them
back with ``index_add_`` (or an indexed add). Exported, each expert's row count is an unbacked symbol, a size
no plan can rest on.

Capture finds each such layer (``expert_lists``): the value-dependent ops that one router's ids
[T, k] feed, the first [T, H] value that all of them reach (the layer's output), and the ops
between that output and the layer's inputs (the tokens [T, H], the ids, the router weights [T, k]
and the experts' weights). It checks on random values that those ops compute what ``moe_experts``
computes from the same inputs with the experts' weights stacked (gate and up [E, 2I, H], or up
[E, I, H]; down [E, H, I]) and their activation, some expert receiving no token (``_agrees``), and only then puts that one op in their
place (``_rewrite``). The layer is then planned, priced and split as transformers' fused experts
are. The weights are stacked in the graph from the model's own parameters; capture then makes
each stack one parameter (``autopar.core.stacked_params``), so that split by expert a rank holds
its experts alone.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from autopar.core.expert_parallel import moe_experts

aten = torch.ops.aten
MOE = torch.ops.autopar.moe_experts.default
#: Elements of random inputs and weights the check may make; above, a layer on ``meta`` is taken unchecked.
CHECK_ELEMENTS = 1 << 28
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.type_as.default)


@dataclass(frozen=True)
class ExpertList:
    """One hand-written MoE layer of the graph: its inputs, its output and the ops between."""

    output: fx.Node                   # the layer's [T, H] result
    hidden: fx.Node                   # the tokens [T, H] the experts read
    ids: fx.Node                      # the router's expert ids [T, k]
    weights: fx.Node                  # the router's weights [T, k]
    experts: tuple[tuple[fx.Node, ...], ...]   # each expert's weights by role, then their biases (``_mlp_roles``)
    activation: str                   # of ``expert_parallel.ACTIVATIONS``
    gated: bool                       # (gate, up, down), else (up, down)
    biased: bool                      # each linear with its bias
    inner: frozenset[fx.Node]         # the ops between the inputs and the output
    doomed: frozenset[fx.Node]        # those and the size checks on the experts' rows: replaced
    name: str                         # the experts' module path


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _unbacked(node: fx.Node) -> bool:
    return bool(free_unbacked_symbols(node.meta.get("val")))


def seeds(graph: fx.Graph) -> list[fx.Node]:
    """The ops that make a value-dependent size from inputs of known size (``where``, ``nonzero``)."""
    return [n for n in graph.nodes if n.op == "call_function" and _unbacked(n)
            and not any(_unbacked(i) for i in n.all_input_nodes)]


def _routing_ids(seed: fx.Node) -> fx.Node | None:
    """The integer [T, k] value ``seed`` is computed from through integer ops only, first in the
    chain (the router's expert ids, not a mask derived from them)."""
    todo, seen, found = list(seed.all_input_nodes), set(), []
    while todo:
        node = todo.pop()
        val = _val(node)
        if node in seen or val is None or val.dtype.is_floating_point:
            continue
        seen.add(node)
        if val.dim() == 2 and val.dtype != torch.bool:
            found.append(node)
        todo.extend(node.all_input_nodes)
    first = [n for n in found if not _ancestors(n, seen.__contains__) & set(found)]
    return first[0] if len(first) == 1 else None


def _first_reached_by_all(graph: fx.Graph, group: list[fx.Node]) -> fx.Node | None:
    """The first floating 2-D value of known size that every op of ``group`` reaches."""
    reach: dict[fx.Node, int] = {s: 1 << i for i, s in enumerate(group)}
    full = (1 << len(group)) - 1
    for node in graph.nodes:
        bits = reach.get(node, 0)
        for i in node.all_input_nodes:
            bits |= reach.get(i, 0)
        if not bits:
            continue
        reach[node] = bits
        val = _val(node)
        if bits == full and val is not None and not _unbacked(node) and val.dim() == 2 \
                and val.dtype.is_floating_point:
            return node
    return None


def _ancestors(node: fx.Node, within: Callable[[fx.Node], bool] = lambda _: True) -> set[fx.Node]:
    """The values ``node`` is computed from, through those ``within`` admits."""
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen and within(n):
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


@dataclass
class _Walk:
    """What the walk back from a layer's output found: its inputs and the ops in between."""

    hidden: set[fx.Node]
    weights: set[fx.Node]
    params: set[fx.Node]
    inner: set[fx.Node]


def _walk_back(output: fx.Node, ids: fx.Node, params: Mapping[str, str]) -> _Walk | str:
    """The ops from ``output`` back to the layer's inputs: ``ids``, parameters, a floating [T, k]
    value (the router's weights) and a floating [T, H] value the router also reads (the tokens)."""
    routed_from = _ancestors(ids)
    (t, k), h = _val(ids).shape, _val(output).shape[-1]
    walk = _Walk(set(), set(), set(), set())
    todo = [output]
    while todo:
        node = todo.pop()
        if node is ids or node in walk.inner or node in walk.hidden or node in walk.weights or node in walk.params:
            continue
        val = _val(node)
        shape = tuple(val.shape) if val is not None and not _unbacked(node) else None
        floating = val is not None and val.dtype.is_floating_point
        if floating and shape == (t, k) and node is not output:
            walk.weights.add(node)
        elif floating and shape == (t, h) and node in routed_from:
            walk.hidden.add(node)
        elif node.op == "placeholder":
            if node.name not in params:
                return f"it reads {node.name}, which is neither a parameter nor the router's output"
            walk.params.add(node)
        elif node.op != "call_function":
            return f"it reads {node.name} ({node.op})"
        else:
            walk.inner.add(node)
            todo.extend(node.all_input_nodes)
    if len(walk.hidden) != 1 or len(walk.weights) != 1:
        return (f"its rows come from {len(walk.hidden)} values of [{t}, {h}] the router reads (one expected) and "
                f"are weighted by {len(walk.weights)} values of [{t}, {k}] (one expected)")
    return walk


def _param_name(node: object, params: Mapping[str, str]) -> str | None:
    """The name of the parameter a linear reads as ``node`` (through casts), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    return params.get(node.name) if isinstance(node, fx.Node) else None


def _list_split(names: list[str]) -> tuple[str, list[int]] | None:
    """(list path, each name's index in it): the first index position in the dotted ``names`` at
    which all share the path before it and at least two differ (``experts.3.w1.weight``, or
    ``experts.3.0.weight`` in a ``Sequential``)."""
    parts = [name.split(".") for name in names]
    for pos in range(1, min(map(len, parts))):
        if all(p[pos].isdigit() for p in parts) and len({tuple(p[:pos]) for p in parts}) == 1 \
                and len({p[pos] for p in parts}) > 1:
            return ".".join(parts[0][:pos]), [int(p[pos]) for p in parts]
    return None


#: The activation ops an expert may apply, by their name in ``expert_parallel.ACTIVATIONS``.
_ACTIVATION_OF = {aten.silu.default: "silu", aten.relu.default: "relu", aten.gelu.default: "gelu"}


def _activation(node: fx.Node) -> str | None:
    """The name of the activation a user of linear ``node`` applies, or None."""
    for user in node.users:
        name = _ACTIVATION_OF.get(user.target)
        if name == "gelu" and user.kwargs.get("approximate", "none") == "tanh":
            return "gelu_tanh"
        if name is not None:
            return name
    return None


def _mlp_roles(linears: list[fx.Node], inner: set[fx.Node]) -> tuple[tuple[fx.Node, ...], str] | None:
    """One expert's weights by role, then their biases where every linear has one, and its
    activation, from its linears (among the layer's ops ``inner``): gated, three (gate, up, down:
    down reads the product of the others, gate's output goes through the activation); plain, two
    (up, down: down reads the activation of up's output)."""
    downs = [lin for lin in linears if _ancestors(lin.args[0], inner.__contains__) & set(linears)]
    firsts = [lin for lin in linears if lin not in downs]
    acts = [lin for lin in firsts if _activation(lin) is not None]
    if len(downs) != 1 or len(acts) != 1 or len(firsts) not in (1, 2):
        return None
    up = next(lin for lin in firsts if lin is not acts[0]) if len(firsts) == 2 else acts[0]
    ordered = (acts[0], up, downs[0]) if len(firsts) == 2 else (up, downs[0])
    biases = [lin.args[2] if len(lin.args) > 2 else None for lin in ordered]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    kept = tuple(b for b in biases if b is not None)
    return tuple(lin.args[1] for lin in ordered) + kept, _activation(acts[0]) or ""


def _experts(walk: _Walk, params: Mapping[str, str]) -> tuple[str, tuple, str] | str:
    """The experts' list path, each expert's weights by role (``_mlp_roles``) in expert order, and
    their activation."""
    linears = [n for n in walk.inner if n.target is aten.linear.default]
    weights = [_param_name(n.args[1], params) for n in linears]
    biases = [_param_name(n.args[2], params) if len(n.args) > 2 and n.args[2] is not None else "" for n in linears]
    if any(w is None for w in weights) or any(b is None for b in biases):
        return "one of its linears reads a weight or bias that is not a parameter"
    split = _list_split([w for w in weights if w is not None])
    if split is None:
        return f"its linears' weights ({', '.join(sorted(filter(None, weights))[:4])}, ...) are not one list of experts"
    path, index = split
    by_expert: dict[int, list[fx.Node]] = {}
    for lin, e, bias in zip(linears, index, biases, strict=True):
        if bias and not bias.startswith(f"{path}.{e}."):
            return f"{lin.name} reads a bias ({bias}) that is not its expert's"
        by_expert.setdefault(e, []).append(lin)
    if sorted(by_expert) != list(range(len(by_expert))):
        return f"its linears belong to experts {sorted(by_expert)} of {path}, not to experts 0..E-1"
    roles = [_mlp_roles(by_expert[e], walk.inner) for e in range(len(by_expert))]
    if any(r is None for r in roles) or len({(len(r[0]), r[1]) for r in roles if r is not None}) != 1:
        return ("its experts are not all one kind of MLP, gated (down(act(gate(x)) * up(x))) or plain "
                "(down(act(up(x)))), with SiLU, GELU or ReLU, every linear with a bias or none")
    return path, tuple(r[0] for r in roles if r is not None), roles[0][1] if roles[0] else ""


def _descendants(group: Iterable[fx.Node], stop: fx.Node) -> set[fx.Node]:
    """Every value computed from ``group``, not counting what is computed from ``stop``."""
    seen: set[fx.Node] = set()
    todo = list(group)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            if n is not stop:
                todo.extend(n.users)
    return seen


def _layer(graph: fx.Graph, ids: fx.Node, group: list[fx.Node], params: Mapping[str, str]) -> ExpertList | str:
    """The hand-written MoE layer whose experts pick their tokens with ``group``, routed by ``ids``."""
    output = _first_reached_by_all(graph, group)
    if output is None:
        return "no [tokens, hidden] value is computed from all its experts' rows"
    walk = _walk_back(output, ids, params)
    if isinstance(walk, str):
        return walk
    if not set(group) <= walk.inner:
        return "some of its experts' rows do not reach its output"
    found = _experts(walk, params)
    if isinstance(found, str):
        return found
    hidden, weights = walk.hidden.pop(), walk.weights.pop()
    if _val(hidden).dtype != _val(output).dtype:
        return f"its output is {_val(output).dtype} where its tokens are {_val(hidden).dtype}"
    doomed = walk.inner | _descendants(group, output)
    stray = [n for n in doomed - {output} if any(u not in doomed for u in n.users)]
    if stray:
        return f"{stray[0].name}, computed inside it, is also used outside it"
    roles = len(found[1][0])
    gated, biased = roles in (3, 6), roles in (4, 6)   # (gate, up, down) or (up, down), biases after
    return ExpertList(output, hidden, ids, weights, found[1], found[2], gated, biased, frozenset(walk.inner),
                      frozenset(doomed), found[0])


def expert_lists(graph: fx.Graph, params: Mapping[str, str]) -> tuple[list[ExpertList], list[str]]:
    """The hand-written MoE layers of ``graph`` (``params``: parameter placeholder -> name), and
    why each other group of value-dependent ops is not one."""
    groups: dict[fx.Node | None, list[fx.Node]] = {}
    for seed in seeds(graph):
        groups.setdefault(_routing_ids(seed), []).append(seed)
    layers, why_not = [], []
    for ids, group in groups.items():
        found = "no integer [tokens, k] value (the router's ids) is its input" if ids is None else \
            _layer(graph, ids, group, params)
        if isinstance(found, str):
            why_not.append(f"{group[0].name}: {found}")
        else:
            layers.append(found)
    return layers, why_not


# ----------------------------------------------------------------------------
# Checked on random routing, then replaced
# ----------------------------------------------------------------------------


def _param_inputs(graph: fx.Graph, layer: ExpertList) -> list[fx.Node]:
    """The parameters the layer's ops read."""
    roots = (layer.hidden, layer.ids, layer.weights)
    return [n for n in graph.nodes if n.op == "placeholder" and n not in roots and any(u in layer.inner for u in n.users)]


def _extracted(graph: fx.Graph, layer: ExpertList, device: torch.device) -> fx.GraphModule:
    """The layer's ops as a module of (tokens, ids, router weights, its parameters) returning
    (its output, each expert's weights by role as its linears read them); the
    tensors its ops make, made on ``device`` (not ``meta``, where the model was captured)."""
    inputs = [layer.hidden, layer.ids, layer.weights, *_param_inputs(graph, layer)]
    small = fx.Graph()
    env = {n: small.placeholder(n.name) for n in inputs}
    for node in graph.nodes:
        if node in layer.inner:
            env[node] = small.node_copy(node, env.__getitem__)
            if isinstance(node.kwargs.get("device"), torch.device):
                env[node].kwargs = {**node.kwargs, "device": device}
    small.output((env[layer.output], *[env[w] for expert in layer.experts for w in expert]))
    return fx.GraphModule(torch.nn.Module(), small)


def _routing(t: int, k: int, experts: int, spare: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k ids [t, k] (distinct in a row, the last ``spare`` experts never chosen) and weights."""
    ids = torch.rand(t, experts - spare, generator=gen).argsort(dim=1)[:, :k]
    return ids, torch.rand(t, k, generator=gen).softmax(dim=1)


def _stacked(weights: list, layer: ExpertList, stack: Callable, cat: Callable) -> tuple:
    """(gate_up, down) of the experts' ``weights`` (flat, expert by expert, as ``layer.experts``
    holds them), then, biased, their biases: stacked by ``stack`` and, gated, the gate and up
    joined by ``cat`` (on their rows)."""
    roles = 3 if layer.gated else 2
    per = roles * (2 if layer.biased else 1)
    by_role = [stack(weights[i::per]) for i in range(per)]

    def joined(parts: list) -> object:
        return cat([parts[0], parts[1]], 1) if layer.gated else parts[0]
    biases = (joined(by_role[roles:]), by_role[-1]) if layer.biased else ()
    return (joined(by_role[:roles]), by_role[roles - 1], *biases)


def _agrees(graph: fx.Graph, layer: ExpertList, value: Callable[[fx.Node], torch.Tensor]) -> str | None:
    """None where the layer's ops compute what ``moe_experts`` does on random tokens and routing
    (first with an expert that receives no token); else how far apart. ``value``: a parameter's."""
    params = [value(p) for p in _param_inputs(graph, layer)]
    module = _extracted(graph, layer, params[0].device)
    (t, k), h, n = _val(layer.ids).shape, _val(layer.hidden).shape[-1], len(layer.experts)
    gen = torch.Generator().manual_seed(0)
    for spare in (min(1, n - k), 0):
        ids, weights = _routing(t, k, n, spare, gen)
        hidden = torch.randn(t, h, generator=gen)
        args = [hidden.to(params[0].device, _val(layer.hidden).dtype), ids.to(params[0].device, _val(layer.ids).dtype),
                weights.to(params[0].device, _val(layer.weights).dtype)]
        with torch.no_grad():
            out, *w = module(*args, *params)
            gate_up, down, *biases = _stacked(w, layer, torch.stack, torch.cat)
            fused = moe_experts(args[0], args[1], args[2], gate_up, down, layer.activation, *biases)
        tol = 1e-4 if out.dtype in (torch.float32, torch.float64) else 3e-2
        error = ((fused.double() - out.double()).abs().max() / out.double().abs().max().clamp_min(1e-30)).item()
        if fused.shape != out.shape or not error <= tol:
            return f"on random routing its result and the stacked experts' differ by {error:.2g} (relative)"
    return None


def _call(graph: fx.Graph, before: fx.Node, target: torch._ops.OpOverload, *args: object) -> fx.Node:
    """``target(*args)`` inserted before ``before``, with its fake value and ``before``'s module path."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    vals = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], args)
    mode = detect_fake_mode(pytree.tree_leaves(vals))
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*vals)
    if "nn_module_stack" in before.meta:
        node.meta["nn_module_stack"] = dict(before.meta["nn_module_stack"])
    return node


def rewrite(graph: fx.Graph, layer: ExpertList) -> fx.Node:
    """``moe_experts`` on the experts' weights stacked, in the layer's place; its ops erased."""
    out = layer.output
    stacked = _stacked([w for expert in layer.experts for w in expert], layer,
                       lambda ws: _call(graph, out, aten.stack.default, ws),
                       lambda ws, dim: _call(graph, out, aten.cat.default, ws, dim))
    activation = () if layer.activation == "silu" and not layer.biased else (layer.activation,)   # (its default)
    moe = _call(graph, out, MOE, layer.hidden, layer.ids, layer.weights, *stacked[:2], *activation, *stacked[2:])
    out.replace_all_uses_with(moe)
    for node in reversed(list(graph.nodes)):   # each node's users before it
        if node in layer.doomed and not node.users:
            graph.erase_node(node)
    return moe


def _parameter_values(program: ExportedProgram, model: torch.nn.Module) -> Callable[[fx.Node], torch.Tensor]:
    """A parameter placeholder's value: the model's own, or random of its shape where it is on ``meta``."""
    names = program.graph_signature.inputs_to_parameters

    def value(node: fx.Node) -> torch.Tensor:
        param = model.get_parameter(names[node.name])
        if _has_values(param):
            return param.detach()
        return torch.randn(param.shape, dtype=param.dtype) / max(1, param.shape[-1]) ** 0.5
    return value


def _has_values(param: torch.Tensor) -> bool:
    """Not on ``meta`` nor fake (a copy of the model captured again for new input shapes)."""
    return param.device.type != "meta" and not is_fake(param)


def _checkable(layer: ExpertList) -> bool:
    """Small enough to check with random weights where the model's are on ``meta``."""
    (t, _), h = _val(layer.ids).shape, _val(layer.hidden).shape[-1]
    weights = sum(_val(w).numel() for expert in layer.experts for w in expert)
    return weights + 4 * t * h <= CHECK_ELEMENTS


def fold_expert_lists(program: ExportedProgram, model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Each hand-written MoE layer of ``program`` replaced by ``moe_experts`` where checked to
    compute the same: (a note for each, why each other value-dependent size is not such a layer)."""
    graph = program.graph
    layers, why_not = expert_lists(graph, program.graph_signature.inputs_to_parameters)
    value, notes = _parameter_values(program, model), []
    real = all(_has_values(p) for p in model.parameters())
    for layer in layers:
        checked = real or _checkable(layer)
        # (random values on the CPU, whatever default device a caller set, e.g. ``meta``)
        with maybe_disable_local_tensor_mode(), unset_fake_temporarily(), torch.device("cpu"):
            problem = _agrees(graph, layer, value) if checked else None
        if problem is not None:
            why_not.append(f"{layer.name}: {problem}")
            continue
        rewrite(graph, layer)
        kind = f"{'gated' if layer.gated else 'plain'} {layer.activation} MLPs{' with biases' if layer.biased else ''}"
        notes.append(f"{layer.name}: a hand-written list of {len(layer.experts)} experts ({kind}) picking "
                     "their tokens by value runs as one op (moe_experts) on their weights stacked" +
                     ("" if checked else "; not checked here (its weights have no values and are too large to draw), it is when compiled on real ones"))
    if notes:
        program.graph_module.recompile()
    return notes, why_not

"""How a model's loss averages, so that microbatch losses add up to the whole batch's exactly.

A loss that is a mean over a batch is not the mean of its microbatches' means when they average
different counts: a language model's cross-entropy averages the targets that are not
``ignore_index`` (padding), and microbatches hold different numbers of them. ``loss_weighting``
reads the captured graph once: which output is the loss (the first floating scalar) and what it
averages:

* ``cross_entropy``/``nll_loss`` with ``reduction="mean"``: the targets that are not
  ``ignore_index``, counted from the microbatch's inputs by the graph's own ops that compute the
  target (labels shifted, flattened; they read no parameter), run on plain tensors;
* ``mean`` of a tensor: its elements, in proportion to the microbatch's rows;
* ``sum`` (or a ``reduction="sum"`` loss): nothing (microbatch losses add).

``train_step`` backpropagates each microbatch's loss times its count over the batch's total.
The same count spares a batch split over ranks a collective in its forward: generated code
divides each rank's summed cross-entropy by the count the module passes (``loss_count``), taken
from the inputs every rank holds whole, instead of summing every rank's count first (a blocking
all-reduce in the middle of the step, where every rank waits for the slowest).
A loss of another form (a mean of means, a loss scaled by a learned parameter) is refused for
more than one microbatch rather than weighted wrongly.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.export.graph_signature import OutputKind

from autopar.core.capture import CapturedGraph
from autopar.core.errors import LossWeightError
from autopar.core.lean_loss import CROSS_ENTROPY, LEAN

aten = torch.ops.aten
# (the lean loss, ``autopar::cross_entropy``, takes aten's arguments in their places)
_CROSS_ENTROPY = {CROSS_ENTROPY, LEAN, aten.nll_loss.default, aten.nll_loss_nd.default}
_MEAN_OVER_ALL = {aten.mean.default}
_SUM_OVER_ALL = {aten.sum.default}
# Ops a loss passes through unchanged in what it averages (a dtype cast, an alias).
_PASS = {aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default, aten.detach.default}
#: ops that keep each of a tensor's values once, only laid out anew
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
             aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default}
_MEAN, _SUM = 1, 2   # torch's reduction enum (``torch.nn._reduction``)


@dataclass(frozen=True)
class LossWeighting:
    """The loss's place among the flattened outputs (None: there is none) and what its value
    averages over a microbatch (``count``: from the microbatch's flattened user inputs and rows;
    None: a sum, nothing to weigh); ``how`` says which, or why it cannot be weighed (``exact``).
    ``counted``: the cross-entropy node whose targets ``count`` counts (None: the loss is no
    mean cross-entropy)."""

    index: int | None
    count: Callable[[Sequence[Any], int], float | torch.Tensor] | None
    how: str
    exact: bool = True
    counted: str | None = None

    def counts(self, microbatches: Sequence[tuple[Sequence[Any], int]]) -> list[float | torch.Tensor] | None:
        """What each microbatch's loss averages; ``microbatches``: (flat inputs, rows). None: a sum."""
        return None if self.count is None else [self.count(flat, rows) for flat, rows in microbatches]

    def weights(self, counts: Sequence[float | torch.Tensor] | None, parts: int) -> list[float]:
        """Each of ``parts`` microbatches' share of the batch's loss, from their ``counts`` (read on
        the host: the shares scale each microbatch's backward seed)."""
        if not self.exact:
            raise LossWeightError(f"the batch cannot run as {parts} microbatches exactly: {self.how}. "
                                  "Plan with microbatches=1")
        if counts is None:
            return [1.0] * parts
        counts = [float(c) for c in counts]
        total = sum(counts)
        if total == 0:   # every target ignored: the whole batch's mean is nan as each microbatch's
            return [1.0 / len(counts)] * len(counts)
        return [c / total for c in counts]


def loss_weighting(captured: CapturedGraph) -> LossWeighting:
    """The weighting of the captured graph's loss (not ``exact``: no scalar output, or a loss of
    an unrecognised form, saying so)."""
    specs = captured.program.graph_signature.output_specs
    output = next(n for n in captured.graph.nodes if n.op == "output")
    user_outputs = [o for o, s in zip(output.args[0], specs, strict=True) if s.kind == OutputKind.USER_OUTPUT]
    constants = {name: captured.program.constants[target] for name, target in captured.constant_of.items()
                 if isinstance(captured.program.constants.get(target), torch.Tensor)}
    user_inputs = captured.user_inputs
    index = next((i for i, o in enumerate(user_outputs) if isinstance(o, fx.Node) and _is_scalar_loss(o)), None)
    if index is None:
        return LossWeighting(None, None, "the model returns no loss (a floating-point scalar tensor)", exact=False)
    node = user_outputs[index]
    while node.target in _PASS:
        node = node.args[0]
    if node.target in _SUM_OVER_ALL:
        return LossWeighting(index, None, "a sum: microbatch losses add")
    if node.target in _MEAN_OVER_ALL:
        return LossWeighting(index, lambda _flat, rows: float(rows), "a mean: weighted by rows")
    if node.target in _CROSS_ENTROPY:
        args = list(node.args) + [None] * 6
        weight, reduction, ignore = args[2], args[3] if args[3] is not None else _MEAN, args[4]
        ignore = -100 if ignore is None else ignore
        if reduction == _SUM:
            return LossWeighting(index, None, "a summed cross-entropy: microbatch losses add")
        if reduction == _MEAN and weight is None:
            count = _target_counter(node.args[1], user_inputs, constants, ignore)
            if isinstance(count, str):
                return LossWeighting(index, None, count, exact=False)
            return LossWeighting(index, count, f"a mean cross-entropy: weighted by targets other than {ignore}",
                                 counted=node.name)
    return LossWeighting(index, None, f"its loss ({node.name}: {node.target}) is not a mean or sum autopar can "
                         "weigh per microbatch", exact=False)


def loss_with_gradients(captured: CapturedGraph) -> str | None:
    """The mean cross-entropy whose sum over ranks ``train_step`` adds to a gradient bucket's
    all-reduce (``codegen.grad_sync.GradSync.carry``): the counted loss (``loss_weighting``) where
    it reaches the output alone (each rank's summand stays one up to there). It runs no collective
    of its own: the cost model prices none, generated code returns this rank's summand."""
    counted = loss_weighting(captured).counted
    if counted and reaches_output_alone(next(n for n in captured.graph.nodes if n.name == counted)):
        return counted
    return None


def reaches_output_alone(node: fx.Node) -> bool:
    """Does ``node``'s value reach the graph's output only through ops that leave it what it was
    (``_PASS``), used nowhere else? Then a rank's summand of it stays a summand up to the output."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op == "output":
            return list(user.args[0]).count(node) == 1
        if user.target not in _PASS:
            return False
        node = user
    return False


def _is_scalar_loss(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point


def _reshaped_input(node: fx.Node, user_inputs: Sequence[str]) -> int | None:
    """The position among the user inputs of the input ``node`` only reshapes (its values, each
    once), or None."""
    while node.op == "call_function" and node.target in _RESHAPES:
        node = node.args[0]
    return user_inputs.index(node.name) if node.op == "placeholder" and node.name in user_inputs else None


def _target_counter(target: fx.Node, user_inputs: Sequence[str], constants: dict[str, torch.Tensor],
                    ignore: int) -> Callable[[Sequence[Any], int], torch.Tensor] | str:
    """Counts the targets other than ``ignore``: the ops that compute ``target`` from the user
    inputs, copied into a graph of their own and run on a microbatch's inputs. The count stays a
    tensor on the inputs' device (the loss divides by it there): read on the host, it cost every
    step a wait for the device and ``torch.compile`` a graph break."""
    direct = _reshaped_input(target, user_inputs)
    if direct is not None:   # the targets as passed, reshaped: counted on the input itself
        def count_input(flat: Sequence[Any], _rows: int) -> torch.Tensor:
            return (flat[direct] != ignore).sum()
        return count_input
    seen: set[fx.Node] = set()
    todo = [target]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name not in user_inputs and n.name not in constants:
            return f"its loss's target depends on a parameter or buffer ({n.name})"
        todo.extend(n.all_input_nodes)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in (n for n in target.graph.nodes if n in seen):   # graph order is topological
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[target])
    module = fx.GraphModule(torch.nn.Module(), sub)
    inputs = [n.name for n in sub.nodes if n.op == "placeholder"]
    position = {name: i for i, name in enumerate(user_inputs)}

    def count(flat: Sequence[Any], _rows: int) -> torch.Tensor:
        values = [constants[name] if name in constants else flat[position[name]] for name in inputs]
        with torch.no_grad():
            return (module.forward(*values) != ignore).sum()   # no nn.Module call: nothing hooks it

    return count

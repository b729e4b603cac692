"""One generated forward per input shape, as ``torch.compile`` recompiles: a training loop feeds a
smaller last batch, or another sequence length, and generated code holds local shapes.

At compile time the module keeps a copy of the model whose parameters are fake tensors (shapes
only, no memory). A call with inputs of a new shape captures that copy at those shapes, checks
that the graph is the one planned (same nodes in the same order; only shapes differ) and
generates code for it with the plan's placements, which hold at any size (an uneven split is
exact; a rank may hold an empty part; a flattened value sliced beside the flattened rows of an
uneven split is cut in whole rows too, ``codegen.generate.row_units``). The forward is cached by the inputs' shapes, and by
whether it gathers its outputs whole: ``train_step`` reads only the loss, so its forward leaves the
other outputs (the logits) as they lie, where ``forward`` gathers them if the plan says so. And by
the module's training mode: in the mode the model was not compiled in, the copy is captured in
that mode and runs the plan's placements by counterpart (``codegen.modes``).
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autopar.core.capture import CapturedGraph, capture
from autopar.core.errors import InputMismatchError
from autopar.core.loss_weights import LossWeighting
from codegen.generate import GeneratedCode, OutputMode
from codegen.modes import counterparts


@dataclass(frozen=True)
class Forward:
    """A generated forward, compiled, with this rank's sizes of its uneven splits and how its loss
    weighs against other microbatches' (``autopar.core.loss_weights``)."""

    code: GeneratedCode
    run: Callable[..., Any]
    sizes: Any
    loss: LossWeighting
    out_spec: pytree.TreeSpec         # how its flat outputs nest (the model's outputs in its mode)
    whole_batch: list[str]            # why its step must not run in parts of the batch (``autopar.core.buffers``)


def tensor_layout(spec: pytree.TreeSpec) -> tuple[int, tuple[str, ...]] | None:
    """Where ``spec`` (of ``(args, kwargs)``) holds only tensors, positional and by keyword, as a
    language model's batch does: (how many positional, the keywords in order); else None."""
    args, kwargs = spec.children()
    if args.type is not tuple or kwargs.type is not dict or not all(
            c.is_leaf() for c in args.children() + kwargs.children()):
        return None
    return args.num_children, tuple(kwargs.context)


def flat_tensors(args: tuple, kwargs: dict, layout: tuple[int, tuple[str, ...]] | None) -> list[Any] | None:
    """``(args, kwargs)`` flattened as ``pytree.tree_flatten`` would, where they are tensors laid out
    as ``layout`` says (``tensor_layout``); else None. A step's inputs, flattened without pytree's
    generic walk (some 60 us a step, its code cold after the backward)."""
    if layout is None or len(args) != layout[0] or tuple(kwargs) != layout[1]:
        return None
    flat = [*args, *kwargs.values()]
    return flat if all(isinstance(v, torch.Tensor) for v in flat) else None


def signature(values: Sequence[Any]) -> tuple:
    """What a generated forward is specialised on: each input's shape and dtype (a non-tensor's value)."""
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", repr(v)) for v in values)


def _structure(captured: CapturedGraph) -> list[tuple[str, str, str]]:
    return [(n.name, n.op, str(n.target)) for n in captured.graph.nodes]


class ForwardPerShape:
    """The generated forwards of one plan, one per input signature, training mode and way of
    returning outputs (``codegen.generate.OutputMode``), generated on first use by ``make`` (which
    holds the plan; ``make(captured, outputs, names)``, ``names``: for a capture in the mode the
    plan was not made in, each node's counterpart in the planned graph, ``codegen.modes``)."""

    def __init__(self, model: nn.Module, captured: CapturedGraph,
                 make: Callable[[CapturedGraph, OutputMode, dict | None], Forward], outputs: OutputMode) -> None:
        self._mode = FakeTensorMode(allow_non_fake_inputs=True)
        memo: dict[int, Any] = {}
        for t in itertools.chain(model.parameters(), model.buffers()):
            fake = self._mode.from_tensor(t)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
        self._model = copy.deepcopy(model, memo)   # the structure only: parameters are shapes
        self._planned, self._training = captured.graph, model.training
        self._structure = {model.training: _structure(captured)}
        self._precision = captured.precision
        self._make = make
        placeholders = {n.name: n for n in captured.graph.nodes if n.op == "placeholder"}
        key = (signature([placeholders[name].meta.get("val") for name in captured.user_inputs]), model.training)
        self._captured: dict[tuple, tuple[CapturedGraph, dict | None]] = {key: (captured, None)}
        self.first = make(captured, outputs, None)
        self._forwards = {(key, outputs): self.first}

    def get(self, flat: Sequence[Any], args: tuple, kwargs: dict, outputs: OutputMode, training: bool) -> Forward:
        key = (signature(flat), training)
        if (key, outputs) not in self._forwards:
            if key not in self._captured:
                self._captured[key] = self._capture(args, kwargs, training)
            captured, names = self._captured[key]
            forward = self._make(captured, outputs, names)
            if forward.code.direct != self.first.code.direct or forward.code.gathered != self.first.code.gathered:
                mode = "" if training == self._training else f" (or the module in {('eval', 'train')[training]} mode)"
                raise InputMismatchError(f"inputs of a new shape{mode} change how the plan reads its parameters; "
                                         "compile again")
            self._forwards[key, outputs] = forward
        return self._forwards[key, outputs]

    def _capture(self, args: tuple, kwargs: dict, training: bool) -> tuple[CapturedGraph, dict | None]:
        """The copy captured on these inputs in this mode, and its nodes' counterparts where the
        mode is not the planned one."""
        fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, self._mode.from_tensor, (args, kwargs))
        self._model.train(training)
        captured = capture(self._model, fake_args, fake_kwargs, precision=self._precision)
        planned = self._structure.setdefault(training, _structure(captured))
        if _structure(captured) != planned:
            changed = next((a, b) for a, b in zip(_structure(captured) + [None], planned + [None], strict=False) if a != b)
            raise InputMismatchError(
                f"inputs of shapes {[tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]} "
                f"change the model's graph (first difference: {changed[0]} where the plan has {changed[1]}): its "
                "control flow depends on the shapes. Compile the model again for these inputs (autopar.compile).")
        return captured, (None if training == self._training else counterparts(self._planned, captured.graph))

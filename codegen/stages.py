"""Pipeline stages in generated code: the sharded forward's lines cut into one function per stage.

A pipeline plan (``Plan.pipeline``) cuts the model at block boundaries: stage ``k`` starts at the
first op of its first repeated block (``stage_starts``). The code generator emits the whole forward
as for any plan, each stage reading its own parameters, buffers and constants (a parameter used by
two stages, tied embeddings, is read by both), then ``split_stages`` cuts the body at those ops.
Each stage becomes ``stage_k(self, mesh, device, sizes, <what it receives>)`` returning what the
stages after it read: the values it computed and those it passes on (the labels the last stage's
loss reads, Llama's rotary tables). The first stage takes the model's inputs; the last returns the
model's outputs. What crosses a boundary is this rank's part of a tensor, placed as the plan
placed it: the pipeline sends it to the same position of the next stage's sub-mesh.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from autopar.core.blocks import repeated_blocks
from autopar.core.errors import AutoparError
from autopar.core.plan import PipelinePlan
from codegen.recompute import statement_names

#: Arguments every generated function takes besides its values.
COMMON_ARGUMENTS = ("self", "mesh", "device", "sizes", "loss_count")


@dataclass(frozen=True)
class StageCode:
    """One stage's generated function: ``name``; ``inputs`` its arguments after the common ones
    (the model's inputs for the first stage, what it receives for the others); ``outputs`` what
    it returns to the next stage (empty for the last, which returns the model's outputs);
    ``state`` the parameters and buffers (FQNs) it reads."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    state: frozenset[str]


def stage_starts(graph: fx.Graph, pipeline: PipelinePlan) -> list[str]:
    """The first op of each stage after the first: the first op of its first block."""
    blocks = repeated_blocks(graph)
    starts = []
    for stage in pipeline.stages[1:]:
        first = stage.blocks[0]
        if not 0 < first < len(blocks):
            raise AutoparError(f"the pipeline plan starts a stage at block {first}; the model has {len(blocks)} "
                               "repeated blocks: the plan is for another model, re-plan")
        starts.append(blocks[first].nodes[0])
    return starts


def node_stages(graph: fx.Graph, starts: Sequence[str]) -> dict[str, set[int]]:
    """The stages each node runs in: an op its stage, a placeholder (parameter, input) every
    stage that reads it."""
    stage, out = 0, {}
    for node in graph.nodes:
        if node.name in starts:
            stage += 1
        if node.op == "call_function" or node.op == "output":
            out[node.name] = {stage}
    for node in graph.nodes:
        if node.op == "placeholder":
            out[node.name] = set().union(*(out.get(u.name, set()) for u in node.users))
    return out


def split_stages(body: Sequence[str], cuts: Sequence[int], first_inputs: Sequence[str], kept: set[str]
                 ) -> list[tuple[list[str], StageCode, bool]]:
    """``body`` (the forward's statements) cut before each line of ``cuts``: per stage, its
    statements (those passing values on end with their ``return``), its ``StageCode`` (without
    ``state``, which the emitter knows) and whether it reads a value computed once (``kept``: each
    stage reads those itself). ``first_inputs``: the model's inputs (the first stage's arguments)."""
    bounds = [0, *cuts, len(body)]
    parts = [list(body[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    reads: list[list[str]] = []   # per stage: names read before it assigns them
    stores: list[set[str]] = []
    for lines in parts:
        read: list[str] = []
        stored: set[str] = set()
        for line in lines:
            loads, assigned, _ = statement_names(line)
            read += [n for n in loads if n not in stored and n not in read]
            stored.update(assigned)
        reads.append(read)
        stores.append(stored)
    defined = [set(first_inputs) | stores[0]]   # per stage: what exists when it ends
    for k in range(1, len(parts)):
        defined.append(defined[-1] | stores[k])
    # what each stage passes on: values from it or before that it or a later stage reads first
    passed: list[list[str]] = [[] for _ in parts]
    for k in range(len(parts) - 1, 0, -1):
        needed = [n for n in reads[k] if n in defined[k - 1] and n not in kept]
        needed += [n for n in passed[k] if n not in stores[k]]
        passed[k - 1] = list(dict.fromkeys(needed))
    out = []
    for k, lines in enumerate(parts):
        last = k == len(parts) - 1
        if not last:
            lines.append(f"    return ({', '.join(passed[k])}{',' if len(passed[k]) == 1 else ''})  # to stage {k + 1}")
        code = StageCode(f"stage_{k}", tuple(first_inputs) if k == 0 else tuple(passed[k - 1]),
                         () if last else tuple(passed[k]), frozenset())
        out.append((lines, code, bool(kept & set(reads[k]))))
    return out


def stage_signature(code: StageCode) -> str:
    args = ", ".join(code.inputs)
    return f"def {code.name}(self, mesh, device, sizes{', ' if args else ''}{args}, *, loss_count=None):"

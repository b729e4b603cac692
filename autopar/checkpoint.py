"""Checkpoints of a compiled module and its optimizer: ``autopar.save`` and ``autopar.load``.

Built on ``torch.distributed.checkpoint`` (DCP): every rank writes its shards of each tensor under
the model's own parameter names, and a load reads what each rank of the loading module holds, so a
checkpoint loads into another plan, another mesh shape or a pipeline (resharded as it is read).
``autopar.full_state_dict`` gives the whole state for a single-device model (``save_pretrained``).

Why not DCP on ``pmodel.state_dict()`` and ``optimizer.state_dict()``: an optimizer's own state
dict keys its states by parameter position (which differ between a pipeline's ranks), and a fresh
optimizer's holds none. DCP loads in place only the entries of the dict it is given: loaded into a
fresh optimizer's state dict, nothing of the saved state is read, silently, and Adam restarts from
zero moments. torch's ``get_optimizer_state_dict`` keys states by parameter name and creates them
first (a step with zero gradients and learning rate), so that there is something to load into;
``set_optimizer_state_dict`` puts them back. ``load`` checks that every saved state of the
parameters a rank holds has a place to go, so that nothing is dropped silently; ``save`` refuses
an optimizer that has taken no step, which torch would give states by a step of its own (one
more step counted, Adam's bias correction off by it from then on).
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._pytree import tree_map_only

from autopar.core.errors import CheckpointError

__all__ = ["save", "load"]

MODEL, OPTIMIZER, RNG = "model", "optim", "rng"
_STATE = f"{OPTIMIZER}.state."


def save(pmodel: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Write ``pmodel``'s parameters and buffers, ``optimizer``'s state (None: the model's alone)
    and the random generator's (dropout draws from it) to the directory ``path``. Collective: every
    rank calls it, with the same path (on a file system every host sees)."""
    state = {MODEL: get_model_state_dict(pmodel), RNG: _rng_state()}
    if optimizer is not None:
        _check_steps_only(pmodel, optimizer)
        if not optimizer.state:   # torch would create its states by a step of its own, counted by Adam
            raise CheckpointError("the optimizer has taken no step: it has no state to save yet (a fresh one "
                                  "needs none); save with optimizer=None")
        state[OPTIMIZER] = get_optimizer_state_dict(pmodel, optimizer)
    dcp.save(_in_chunks(state)[0], checkpoint_id=path)


def load(pmodel: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Read what ``save`` wrote to ``path`` into ``pmodel`` and ``optimizer`` (None: the model
    alone), and restore the random generator: training goes on as if never stopped. ``pmodel`` may
    run another plan, on a mesh of another shape, or a pipeline. Collective, as ``save``; refused
    (``CheckpointError``) before anything is changed where it cannot load as asked."""
    where = os.fspath(path)
    saved = _saved(where)
    state = {MODEL: get_model_state_dict(pmodel),
             RNG: {k: v for k, v in _rng_state().items() if f"{RNG}.{k}" in saved}}
    _check_entries(_flat(state), saved, where)
    if optimizer is not None:
        _check_steps_only(pmodel, optimizer)
        if not any(k.startswith(_STATE) for k in saved):
            raise CheckpointError(f"the checkpoint at {where!r} holds no optimizer state: it was saved with "
                                  "autopar.save(pmodel, None, path); load it with optimizer=None")
        state[OPTIMIZER] = get_optimizer_state_dict(pmodel, optimizer)   # creates the states to load into
        _check_optimizer_entries(_flat({OPTIMIZER: state[OPTIMIZER]}), saved, pmodel, where)
    chunked, back = _in_chunks(state)
    dcp.load(chunked, checkpoint_id=path)
    state = tree_map_only(DTensor, lambda t: t.redistribute(t.device_mesh, back[id(t)]) if id(t) in back else t,
                          chunked)
    set_model_state_dict(pmodel, state[MODEL])
    if optimizer is not None:
        set_optimizer_state_dict(pmodel, optimizer, state[OPTIMIZER])
    _set_rng_state(state[RNG])


def _in_chunks(state: dict[str, Any]) -> tuple[dict[str, Any], dict[int, list[Placement]]]:
    """``state`` with each DTensor split in blocks (``autopar.core.placements.ShardBlocks``: an
    expert's gate and up rows split within it, a rank's pieces of the blocks not one chunk, which
    DCP cannot record) redistributed to a plain split of that dim; and, by the id of each value
    so made, the placements to put it back in (after a load)."""
    back: dict[int, list[Placement]] = {}

    def chunked(t: DTensor) -> DTensor:
        plain = [Shard(p.dim) if isinstance(p, _StridedShard) and not any(
            isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim for q in t.placements[a + 1:]) else p
            for a, p in enumerate(t.placements)]
        if plain == list(t.placements):
            return t
        out = t.redistribute(t.device_mesh, plain)
        back[id(out)] = list(t.placements)
        return out

    return tree_map_only(DTensor, chunked, state), back


def _check_steps_only(pmodel: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer steps the compiled module's parameters (``autopar.compile`` replaces the
    model's: an optimizer built before it steps tensors the module no longer reads)."""
    mine = {id(p) for p in pmodel.parameters()}
    if any(id(p) not in mine for group in optimizer.param_groups for p in group["params"]):
        raise CheckpointError("the optimizer steps parameters that are not the module's: build it from "
                              "pmodel.parameters() after autopar.compile")


def _saved(path: str) -> dict[str, Any]:
    """The checkpoint's entries at ``path``: flattened key -> its metadata (a tensor's size)."""
    try:
        return dict(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"no checkpoint at {path!r}: write one with autopar.save") from None


def _check_entries(want: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """Every entry to load is in the checkpoint, each tensor of the shape saved (else it is
    another model's: DCP would fail later, with a less clear message)."""
    missing = sorted(k for k in want if k not in saved)
    if missing:
        raise CheckpointError(f"the checkpoint at {where!r} lacks {len(missing)} entries this module loads, "
                              f"e.g. {missing[:3]}: is it another model's?")
    for key, value in want.items():
        size = getattr(saved[key], "size", None)
        if isinstance(value, torch.Tensor) and size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(f"{key!r} is {tuple(size)} in the checkpoint at {where!r}, "
                                  f"{tuple(value.shape)} here: is it another model's?")


def _check_optimizer_entries(want: dict[str, Any], saved: dict[str, Any], pmodel: nn.Module, where: str) -> None:
    """As ``_check_entries``, and every saved state of a parameter this rank holds has a place to
    go: DCP reads only the entries it is given, and would skip the others silently."""
    _check_entries(want, saved, where)
    held = {name for name, _ in pmodel.named_parameters(remove_duplicate=False)}
    dropped = sorted(k for k in saved if k.startswith(_STATE) and k not in want
                     and k[len(_STATE):].rpartition(".")[0] in held)
    if dropped:
        raise CheckpointError(f"the optimizer has no state to load {dropped[:3]} into (it holds gradients but "
                              "has taken no step): call optimizer.zero_grad() before autopar.load")


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``state``'s tensors and values by DCP's flattened key ("optim.state.<name>.exp_avg"): nested
    dicts joined by dots, the optimizer's param groups by position."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                out.update(_flat(v, f"{prefix}{key}.{i}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _rng_state() -> dict[str, torch.Tensor]:
    """The random generators dropout draws from (every rank's alike: ``autopar.compile`` shares
    rank 0's): the CPU's, and this rank's GPU's where CUDA runs."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(rng: dict[str, torch.Tensor]) -> None:
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])

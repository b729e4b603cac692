"""The ``autopar`` command line (also ``python -m autopar``).

``autopar demo``
    Plan the demo GPT for a local CPU mesh, train it on that mesh (one gloo process per
    device) and, side by side, on a single device; print the plan report, both loss curves and
    the generated code.
``autopar plan --model NAME --mesh 8x8``
    Plan a zoo model (or ``pkg.module:factory``) for a mesh that need not exist: the model is
    built on the ``meta`` device, so a 175B model plans on a laptop. Prints the report and can
    save the plan as JSON.
``autopar compare --model NAME --mesh 2x2 [--measure]``
    Plan a model under the auto plan, every hand plan and forced variants and print them side by
    side, sorted by predicted step time; ``--measure`` also trains each on a local gloo mesh,
    beside torch's DDP, FSDP2 and tensor parallel (``autopar.compare``).
``autopar profile --model NAME --mesh 2x2``
    Measure this machine for a zoo model (or ``pkg.module:factory``) on a local mesh: the
    model's ops at every candidate strategy's local shapes, the collectives per mesh axis and the
    runtime's overheads. The profile is cached (keyed by a hardware fingerprint) and used by every
    later plan for a mesh of that size on this host.
``autopar models``
    List the model zoo.

Progress goes to stderr: a line per step, and during long work (planning, measuring this host) a
status line saying what runs, for how long and what is left of the time limit, where stderr is a
terminal (``autopar.core.progress``); ``-q`` silences both, ``-v`` adds every planning stage with its
seconds (the ``autopar`` logger at DEBUG). Reports, tables and code go to stdout. Bad input (any
``AutoparError``) prints ``error: <message>`` to stderr and exits with status 2, like a
command-line usage error.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import Field
from typing import Any, Callable, Literal, Sequence, get_args, get_origin, get_type_hints

from autopar.core.errors import AutoparError, MeshError
from autopar.core.plan import Plan
from autopar.core.precision import Precision
from autopar.core.progress import ENV as PROGRESS_ENV
from autopar.planning.options import AS_FIELD, Flag, PlanOptions, field_doc, option_flags

__all__ = ["main", "parse_mesh", "build_parser"]

DEMO_SEED = 1234
DEMO_LR = 1e-3
# Per-step losses of the sharded and the single-device model must agree this closely (fp32;
# the sharded model sums in another order, so they are not bit-identical).
DEMO_TOLERANCE = 1e-4
# The demo's batch shape: big enough that sharding pays off in the CPU cost model (gpt-tiny's
# zoo default, 8 x 32, is planned as plain replication: too little work per collective).
DEMO_BATCH, DEMO_SEQ = 32, 64
# Every rank of the demo holds the model (and rank 0 a second copy) in host memory.
DEMO_MAX_PARAMS = 50_000_000


#: Set by ``-q``: no progress lines (errors and warnings still print).
_quiet = False


def _progress(msg: str) -> None:
    """A progress line to stderr (above the status line, where one shows), unless ``-q``."""
    if not _quiet:
        from autopar.core.progress import say

        say(msg)


# --------------------------------------------------------------------------------------- parsing


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x2"`` -> ``(2, 2)``, ``"8"`` -> ``(8,)``, ``"2x4x8"`` -> ``(2, 4, 8)``."""
    parts = re.split(r"[xX*,]", text.strip()) if text and text.strip() else []
    if not parts or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise MeshError(
            f"bad mesh {text!r}: expected positive device counts per mesh axis separated by 'x', "
            "e.g. '4' (1-D), '2x2' or '8x8' (2-D), '2x4x8' (3-D)"
        )
    return tuple(int(p) for p in parts)


def _parse_axis_names(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise MeshError(f"bad --axis-names {text!r}: expected comma-separated names, e.g. 'dp,tp'")
    return names


def _mesh_spec(mesh: str, axis_names: str | None, hardware: str):
    from autopar.core.mesh import MeshSpec

    shape = parse_mesh(mesh)
    names = _parse_axis_names(axis_names)
    if names is not None and len(names) != len(shape):
        raise MeshError(f"--axis-names {axis_names!r} names {len(names)} axes but mesh {mesh!r} has {len(shape)}")
    return MeshSpec(shape, names, hardware)


def _check_positive(**values: int | float | None) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise AutoparError(f"--{name.replace('_', '-')} must be positive, got {value}")


def _fmt_count(n: int | None) -> str:
    if not n:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _limit(seconds: float | None) -> str:
    return "none" if seconds is None else f"{seconds:g} s"


# --------------------------------------------------------------------------------------- models


def cmd_models(args: argparse.Namespace) -> int:
    from autopar.models.zoo import get_model, list_models

    rows = []
    for name in list_models():
        e = get_model(name)
        rows.append((name, _fmt_count(e.num_params), f"{e.default_batch}x{e.default_seq}", e.description))
    w = [max(len(r[i]) for r in rows + [("model", "params", "batch x seq", "")]) for i in range(3)]
    print(f"{'model'.ljust(w[0])}  {'params'.rjust(w[1])}  {'batch x seq'.ljust(w[2])}  description")
    for name, params, shape, desc in rows:
        print(f"{name.ljust(w[0])}  {params.rjust(w[1])}  {shape.ljust(w[2])}  {desc}")
    print("\nAlso: --model pkg.module:factory (a function returning an nn.Module or a ZooEntry).")
    return 0


# --------------------------------------------------------------------------------------- plan


def cmd_plan(args: argparse.Namespace) -> int:
    import autopar
    from autopar.core.units import fmt

    spec, options, entry = _planning_inputs(args)
    model, example_args, example_kwargs = _built(entry, args, _plan_device(entry, options))
    plan_call = autopar.plan   # the planner's modules load here, not in the time the plan reports
    _say_planning(spec, options, args)
    plan = plan_call(model, spec, example_args, example_kwargs, options=options)
    _progress(f"planned in {fmt(plan.planning_s, 's')} (the report's planning time)")
    print(plan.report(top=None if args.all_nodes else args.top))
    if args.scaling:
        from autopar.planning.symbolic import symbolic_plan_costs

        print()
        print(symbolic_plan_costs(model, plan, example_args, example_kwargs, optimizer=args.optimizer).describe())
    _save(plan, args.json, args.html)
    return 0


def _planning_inputs(args: argparse.Namespace) -> tuple[Any, PlanOptions, Any]:
    """The mesh, options and zoo entry of ``autopar plan``'s (and ``compare``'s) flags, checked
    before the slow capture."""
    from autopar.core.hardware import get_hardware
    from autopar.models.zoo import get_model

    spec = _mesh_spec(args.mesh, args.axis_names, args.hardware)
    get_hardware(args.hardware)  # unknown hardware: fail before the (slow) capture
    _check_positive(batch=args.batch, seq=args.seq, memory_budget_gib=args.memory_budget,
                    time_limit=args.time_limit)
    return spec, _plan_options(args), get_model(args.model)


def _plan_device(entry: Any, options: PlanOptions) -> str:
    """Where ``autopar plan`` builds the model: ``meta``, or the CPU where its router is to be run
    (``--expert-skew measured``: its freshly initialised weights), if its fp32 weights take at most
    half of this host's memory."""
    if options.expert_skew != "measured":
        return "meta"
    if 4 * entry.num_params > os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2:
        raise AutoparError(f"--expert-skew measured runs {entry.name}'s router on its weights, and its "
                           f"{_fmt_count(entry.num_params)} parameters do not fit in half of this host's memory: "
                           "give the skew as a number")
    return "cpu"


def _built(entry: Any, args: argparse.Namespace, device: str) -> tuple[Any, Any, Any]:
    """(model, example args, example kwargs) of ``entry`` on ``device``: ``meta`` to plan for a
    mesh that need not exist, ``cpu`` where the plans are then run here."""
    import torch

    t0 = time.perf_counter()
    _progress(f"building {entry.name} ({_fmt_count(entry.num_params)} parameters) on the {device} device...")
    if device == "cpu":
        torch.manual_seed(DEMO_SEED)
    with torch.device(device):
        model = entry.build()
    example_args, example_kwargs = entry.example(args.batch, args.seq, device=device)
    _progress(f"built in {time.perf_counter() - t0:.1f} s")
    return model, example_args, example_kwargs


def _say_planning(spec: Any, options: PlanOptions, args: argparse.Namespace) -> None:
    _progress(f"planning for {spec.describe()} in {options.precision}"
              f"{'' if args.precision else ' (the default for ' + args.hardware + '; --precision to choose)'}, "
              f"time limit {_limit(options.time_limit)}...")


def _save(plan: Plan, json_path: str | None, html_path: str | None) -> None:
    """``--json``: the plan; ``--html``: its report as a page of charts (a pipeline's schedule
    replayed for its Gantt chart)."""
    if json_path:
        plan.to_json(json_path)
        _progress(f"plan saved to {json_path} (load it with autopar.Plan.from_json and pass it to autopar.compile(plan=...))")
    if html_path:
        from autopar.planning.pipeline import schedule_timeline

        plan.to_html(html_path, schedule_timeline(plan))
        _progress(f"report saved to {html_path} (one self-contained HTML file)")


# -------------------------------------------------------------------------------------- compare


def cmd_compare(args: argparse.Namespace) -> int:
    """``autopar compare``: the auto plan, every hand plan and the ``--variant``s side by side;
    ``--measure``: also trained on a local gloo mesh beside torch's wrappers."""
    from autopar.compare import TORCH_WRAPPERS, measure, plan_strategies

    if args.hardware is None:
        args.hardware = "cpu" if args.measure else "h100-80gb"
    if args.measure and args.hardware != "cpu":
        raise AutoparError(f"--measure trains on this host's CPU, so its figures compare with predictions for "
                           f"--hardware cpu (the default with --measure), not {args.hardware!r}")
    _check_positive(rounds=args.rounds, steps=args.steps)
    spec, options, entry = _planning_inputs(args)
    variants = {f"auto, {text.strip()}": _variant_options(args, text) for text in args.variant}
    if args.measure and options.profile == "auto":
        _measure_first_profile(entry, spec, entry.example(args.batch, args.seq, device="cpu"), _progress, {},
                               not _quiet)
    # run here (--measure): built on the CPU, as the ranks build it, so that the plans' fingerprints match
    model, example_args, example_kwargs = _built(entry, args, "cpu" if args.measure else "meta")
    _say_planning(spec, options, args)
    comparison = plan_strategies(model, spec, example_args, example_kwargs, options=options, variants=variants,
                                 name=entry.name, say=_progress)
    if args.measure:
        _progress(f"measuring on {spec.size} gloo processes (forkserver): every strategy built on each, then "
                  f"{args.rounds} rounds of {args.warmup} + {args.steps} steps of each, in turns...")
        measure(comparison, args.model, args.batch, args.seq, rounds=args.rounds, warmup=args.warmup,
                steps=args.steps, torch_wrappers=() if args.no_torch else TORCH_WRAPPERS, progress=not _quiet)
    print(comparison.table())
    if args.html:
        comparison.to_html(args.html)
        _progress(f"comparison saved to {args.html} (one self-contained HTML file)")
    return 0


def _variant_options(args: argparse.Namespace, text: str) -> PlanOptions:
    """The options of ``--variant TEXT``: ``autopar plan``'s option flags in ``TEXT`` over the
    command's own."""
    import shlex

    parser = argparse.ArgumentParser(prog="--variant", add_help=False, exit_on_error=False)
    _option_flags(parser)
    try:
        values, extra = parser.parse_known_args(shlex.split(text), namespace=copy.copy(args))
    except (argparse.ArgumentError, ValueError) as e:
        raise AutoparError(f"bad --variant {text!r}: {e}") from None
    if extra or not text.strip():
        raise AutoparError(f"bad --variant {text!r}: {'unknown ' + ' '.join(extra) if extra else 'empty'}; it takes "
                           "`autopar plan`'s planning options, e.g. --variant='--recompute full' or "
                           "--variant='--pipeline Schedule1F1B --microbatches 4'")
    return _plan_options(values)


def _compare_parser(sub: Any) -> argparse.ArgumentParser:
    """``autopar compare``."""
    cmp = sub.add_parser("compare", help="plan a model under several strategies and print them side by side",
                         description="Plan a zoo model (or pkg.module:factory) as `autopar plan` does, under every "
                                     "hand plan (DDP, FSDP, ZeRO, Megatron, pipelines) and under forced variants; "
                                     "print one table sorted by predicted step time. --measure also trains each on "
                                     "local gloo processes beside torch's DDP, FSDP2 and tensor parallel.")
    _model_flags(cmp, hardware=None)
    cmp.add_argument("--variant", action="append", default=[], metavar="OPTIONS",
                     help="also the auto plan under these planning options (autopar plan's flags, quoted), e.g. "
                          "--variant='--recompute full'; repeat for more")
    cmp.add_argument("--html", metavar="FILE", default=None, help="also save the table as an HTML page")
    cmp.add_argument("--measure", action="store_true",
                     help="train every strategy that fits on a local CPU mesh of gloo processes, in turns in one "
                          "launch, and add the measured step time and peak memory (implies --hardware cpu)")
    cmp.add_argument("--rounds", type=int, default=2, help="--measure: rounds of turns (default 2)")
    cmp.add_argument("--warmup", type=int, default=1, help="--measure: untimed steps of each turn (default 1)")
    cmp.add_argument("--steps", type=int, default=2, help="--measure: timed steps of each turn (default 2)")
    cmp.add_argument("--no-torch", action="store_true", help="--measure: leave out torch's own DDP, FSDP2 and TP")
    _option_flags(cmp.add_argument_group("planning options", "the fields of autopar.PlanOptions, for every strategy"))
    cmp.set_defaults(func=cmd_compare)
    return cmp


# ----------------------------------------------------------------------------------------- diff


def cmd_diff(args: argparse.Namespace) -> int:
    """``autopar diff a.json b.json``: what changed between two saved plans."""
    from autopar.core.diff import plan_diff

    a, b = Plan.from_json(args.first), Plan.from_json(args.second)   # (a missing file: PlanFileError, exit 2)
    lines = plan_diff(a, b)
    print("\n".join(lines) if lines else "no change: the two plans place every node alike and predict the same step")
    return 0


def _diff_parser(sub: Any) -> argparse.ArgumentParser:
    """``autopar diff``."""
    diff = sub.add_parser("diff", help="what changed between two saved plans (autopar plan --json)")
    diff.add_argument("first", help="a plan's JSON file")
    diff.add_argument("second", help="another plan's JSON file")
    diff.set_defaults(func=cmd_diff)
    return diff


def _plan_options(args: argparse.Namespace) -> PlanOptions:
    """The ``PlanOptions`` of ``autopar plan``'s flags (validated there, before the slow capture);
    without ``--precision``, the hardware's default (``default_precision``)."""
    values = {}
    for f, flag in option_flags():
        value = getattr(args, f.name)
        values[f.name] = flag.to_option(value) if flag.to_option is not None and value is not None else value
    if values["precision"] is None:
        values["precision"] = default_precision(args.hardware)
    return PlanOptions(**values)


def default_precision(hardware: str) -> str:
    """What a training run on ``hardware`` computes in: bf16 on accelerators (as FSDP2 and
    torchtitan train), fp32 on the CPU."""
    return "fp32" if hardware == "cpu" else "bf16"


# --------------------------------------------------------------------------------------- profile


def cmd_profile(args: argparse.Namespace) -> int:
    from autopar.models.zoo import get_model
    from autopar.profiling.profile_comm import print_progress
    from autopar.profiling.profiler import profile_model

    spec = _mesh_spec(args.mesh, args.axis_names, "cpu")
    _check_positive(batch=args.batch, seq=args.seq)
    entry = get_model(args.model)
    model = entry.build()
    example_args, example_kwargs = entry.example(args.batch, args.seq)
    t0 = time.perf_counter()
    profile, path = profile_model(model, spec, example_args, example_kwargs, path=args.out, precision=args.precision,
                                  progress=None if _quiet else print_progress)
    print(f"profile of {profile.fingerprint['device_name']} ({spec.size} processes x {profile.fingerprint['threads']} "
          f"thread): {len(profile.ops)} op calls, {len(profile.collectives)} collective fits, "
          f"{len(profile.overheads)} overheads; {time.perf_counter() - t0:.1f} s")
    for key, link in sorted(profile.collectives.items()):
        print(f"  {key:<18} latency {link.latency * 1e6:8.1f} us   bandwidth {link.bandwidth / 1e9:6.3f} GB/s")
    for key, seconds in sorted(profile.overheads.items()):
        print(f"  {key:<18} {seconds * 1e6:8.1f} us")
    print(f"saved to {path}; `autopar plan --hardware cpu --mesh {args.mesh}` and autopar.plan() now use it")
    return 0


# --------------------------------------------------------------------------------------- demo


def _vocab_size(model: Any) -> int | None:
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) and vocab > 0 else None


# The demo cycles through this many fixed random batches: few enough that the model visibly
# fits them within a few steps (the loss falls), more than one so that inputs change between steps.
DEMO_DISTINCT_BATCHES = 2


def _demo_batches(example: tuple[tuple, dict], vocab: int | None, steps: int, seed: int) -> list[tuple[tuple, dict]]:
    """Batches for ``steps`` steps, shaped like ``example`` (token ids below ``vocab``), cycling through
    ``DEMO_DISTINCT_BATCHES`` fixed random ones; the same on every rank."""
    import torch
    from torch.utils import _pytree as pytree

    batches = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed + 1 + step % DEMO_DISTINCT_BATCHES)

        def fresh(t: Any, gen: torch.Generator = gen) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if t.dtype.is_floating_point:
                return torch.randn(t.shape, generator=gen, dtype=t.dtype)
            high = vocab if vocab is not None else int(t.max()) + 1
            return torch.randint(0, max(high, 1), t.shape, generator=gen, dtype=t.dtype)

        batches.append(pytree.tree_map(fresh, example))
    return batches


def _scalar(loss: Any) -> float:
    from torch.distributed.tensor import DTensor

    return float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().item())


def _train(model: Any, batches: list[tuple[tuple, dict]]) -> tuple[list[float], list[float]]:
    """AdamW steps on ``batches``: (loss per step, seconds per step)."""
    import torch

    from autopar.profiling.measure import forward_backward

    opt = torch.optim.AdamW(model.parameters(), lr=DEMO_LR)
    losses, seconds = [], []
    for args, kwargs in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(model, (args, kwargs))
        opt.step()
        losses.append(_scalar(loss))
        seconds.append(time.perf_counter() - t0)
    return losses, seconds


def _demo_worker(mesh: Any, model_name: str, batch: int | None, seq: int | None, steps: int, seed: int,
                 plan_json: str, verbose: bool) -> dict[str, Any] | None:
    """One rank of ``autopar demo`` (module-level: it is pickled into every gloo process).

    Every rank builds the same model (same seed), compiles it with the plan made by the parent
    and trains it on the same global batches; rank 0 also trains an unsharded copy.
    """
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.models.zoo import get_model
    from autopar.profiling import peers

    rank = dist.get_rank()
    say = _progress if (verbose and rank == 0) else (lambda msg: None)
    if not verbose:   # compile's summary of the plan, which the demo reports
        logging.getLogger("autopar").setLevel(logging.WARNING)
    entry = get_model(model_name)
    torch.manual_seed(seed)
    model = entry.build()
    # Copy BEFORE compiling: autopar.compile takes over the model's submodules (their
    # parameters become DTensors holding this rank's shard).
    reference = copy.deepcopy(model) if rank == 0 else None
    example = entry.example(batch, seq, device="cpu")
    batches = _demo_batches(example, _vocab_size(model), steps, seed)

    t0 = time.perf_counter()
    plan = autopar.Plan.from_json(plan_json)
    pmodel = autopar.compile(model, mesh, *example, plan=plan)
    say(f"  rank 0: compiled in {time.perf_counter() - t0:.1f} s (capture + code generation + sharding the weights)")
    t0 = time.perf_counter()
    losses, step_s = _train(pmodel, batches)
    say(f"  rank 0: trained {steps} sharded steps in {time.perf_counter() - t0:.2f} s")
    torch.manual_seed(seed)
    ddp, _ = peers.ddp(entry.build(), example)
    _, ddp_step_s = _train(ddp, [peers.rank_batch(b, dist.get_world_size(), rank) for b in batches])
    say(f"  rank 0: trained {steps} steps of torch DDP (each rank its part of the batch)")
    if rank != 0:
        return None
    t0 = time.perf_counter()
    reference_losses, _ = _train(reference, batches)
    say(f"  rank 0: trained {steps} single-device steps in {time.perf_counter() - t0:.2f} s")
    return {"losses": losses, "reference_losses": reference_losses, "code": pmodel.code, "step_s": step_s,
            "ddp_step_s": ddp_step_s}


def run_demo(model_name: str = "gpt-tiny", mesh: str = "2x2", steps: int = 5, batch: int | None = None,
             seq: int | None = None, seed: int = DEMO_SEED, verbose: bool = True,
             timeout_s: float = 300) -> dict[str, Any]:
    """Plan ``model_name`` for a local CPU mesh, then train it sharded (gloo) and on one device.

    Returns ``{"plan", "losses", "reference_losses", "max_abs_diff", "code", "timings", "batch", "seq",
    "step_s"}`` (``batch``/``seq`` default to the zoo entry's; ``step_s``: rank 0's seconds per sharded step).
    The plan is made once, here, and handed to every rank:
    ranks that planned independently would repeat the work and could, in principle, disagree.
    """
    import torch

    import autopar
    from autopar.core.mesh import MeshSpec
    from autopar.core.report import step_with_band
    from autopar.core.units import fmt
    from autopar.models.zoo import get_model
    from autopar.profiling.launch import run_on_gloo_mesh

    say = _progress if verbose else (lambda msg: None)
    _check_positive(steps=steps, batch=batch, seq=seq)
    shape = parse_mesh(mesh)
    spec = MeshSpec(shape, None, "cpu")
    entry = get_model(model_name)
    if entry.num_params is not None and entry.num_params > DEMO_MAX_PARAMS:
        raise AutoparError(
            f"{entry.name} has {_fmt_count(entry.num_params)} parameters; the demo trains it on local CPU "
            f"processes (and once more on one device), so it takes models up to {_fmt_count(DEMO_MAX_PARAMS)}. "
            f"Plan big models without running them: autopar plan --model {entry.name} --mesh 8x8"
        )
    timings: dict[str, float] = {}

    batch = entry.default_batch if batch is None else batch
    seq = entry.default_seq if seq is None else seq
    _measure_first_profile(entry, spec, entry.example(batch, seq, device="cpu"), say, timings, verbose)
    say(f"planning {entry.name} ({_fmt_count(entry.num_params)} parameters, batch {batch} x seq {seq}) "
        f"for a local mesh of {spec.describe()}...")
    # On the CPU, not the meta device: the captured graph (and so the plan's fingerprint) must be
    # exactly what the ranks capture from their CPU models.
    torch.manual_seed(seed)
    plan = autopar.plan(entry.build(), spec, *entry.example(batch, seq, device="cpu"), progress=verbose)
    timings["plan"] = plan.planning_s
    figure = "predicted step" if plan.predicted.basis != "roofline" else \
        "uncalibrated roofline estimate (not a prediction)"
    say(f"planned in {fmt(plan.planning_s, 's')}; {figure} {step_with_band(plan.predicted)}")

    say(f"starting {spec.size} gloo processes (forkserver), mesh {shape} with axes {spec.axis_names}; "
        f"each compiles the plan and trains {steps} steps...")
    t0 = time.perf_counter()
    results = run_on_gloo_mesh(
        _demo_worker, shape, entry.name, batch, seq, steps, seed, plan.to_json(), verbose,
        axis_names=spec.axis_names, timeout_s=timeout_s, start_method="forkserver",
    )
    timings["distributed run"] = time.perf_counter() - t0
    say(f"distributed run done in {timings['distributed run']:.1f} s")
    r0 = results[0]
    diffs = [abs(a - b) for a, b in zip(r0["losses"], r0["reference_losses"], strict=True)]
    return {"plan": plan, "losses": r0["losses"], "reference_losses": r0["reference_losses"],
            "max_abs_diff": max(diffs), "code": r0["code"], "timings": timings, "batch": batch, "seq": seq,
            "step_s": r0["step_s"], "ddp_step_s": r0["ddp_step_s"]}


def _measure_first_profile(entry: Any, spec: Any, example: tuple[tuple, dict], say: Callable[[str], None],
                           timings: dict[str, float], shown: bool = True) -> None:
    """Measure what the cached profile of this host for ``spec`` lacks to price the demo's model
    (its ops at every candidate strategy's local shapes, the mesh's collectives, the runtime's
    overheads; ``autopar profile`` without calibration) on local gloo processes, so that the demo
    predicts its step from measured costs, not the CPU roofline (5.2 ms predicted against 58 ms
    measured on 2x2). Off with ``AUTOPAR_MEASURE_FIRST_PROFILE=0``; then the demo says its figure
    is no prediction."""
    from autopar.core.progress import working
    from autopar.profiling.missing_ops import first_profile_allowed
    from autopar.profiling.profiler import profile_model
    from cost_models.profile import find_profile

    if not first_profile_allowed():
        return
    cached = find_profile(spec)
    say(f"{'completing the' if cached is not None else 'no'} profile of this host for {spec.size} processes: measuring "
        f"the model's ops{'' if cached is not None else ', the collectives and runtime overheads'} on {spec.size} gloo "
        "processes (once; cached for later runs)...")
    t0 = time.perf_counter()
    with working(f"measuring this host on {spec.size} gloo processes", progress=shown):
        profile, path = profile_model(entry.build(), spec, *example, progress=None, calibrate=False)
    timings["profile"] = time.perf_counter() - t0
    say(f"profiled in {timings['profile']:.1f} s: {len(profile.ops)} op calls, {len(profile.collectives)} collective "
        f"fits, {len(profile.overheads)} overheads in {path}")


def _typical_step(seconds: list[float]) -> float:
    """The median step after the first (which builds optimizer states and warms caches)."""
    later = sorted(seconds[1:] or seconds)
    return later[len(later) // 2]


def cmd_demo(args: argparse.Namespace) -> int:
    from autopar.core.report import fmt, step_with_band

    t0 = time.perf_counter()
    result = run_demo(args.model, args.mesh, args.steps, args.batch, args.seq, verbose=not args.quiet)
    batch, seq = result["batch"], result["seq"]
    plan = result["plan"]
    print()
    print(plan.report(top=args.top))
    print()
    print(f"Training: {args.steps} AdamW steps (lr {DEMO_LR:g}) cycling through {DEMO_DISTINCT_BATCHES} fixed random "
          f"batches of {batch} x {seq} tokens, sharded on {plan.mesh.size} gloo processes vs. one device:")
    rows = [(str(i), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.2e}")
            for i, (a, b) in enumerate(zip(result["losses"], result["reference_losses"], strict=True))]
    headers = ("step", "autopar loss", "single-device loss", "abs diff")
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  " + " | ".join(h.rjust(w[i]) for i, h in enumerate(headers)))
    print("  " + "-+-".join("-" * x for x in w))
    for r in rows:
        print("  " + " | ".join(c.rjust(w[i]) for i, c in enumerate(r)))
    max_diff = result["max_abs_diff"]
    ok = max_diff <= DEMO_TOLERANCE
    print(f"max abs diff: {max_diff:.2e} ({'OK' if ok else 'MISMATCH'}: tolerance {DEMO_TOLERANCE:g})")
    step, ddp_step = _typical_step(result["step_s"]), _typical_step(result["ddp_step_s"])
    if plan.predicted.basis != "roofline":
        said = f"predicted {step_with_band(plan.predicted)} from {plan.predicted.cost_source}"
    else:
        said = (f"no prediction: nothing measured on this host, the plan's {fmt(plan.predicted.step_time_s, 's')} is an "
                f"uncalibrated roofline; run `autopar profile --mesh {'x'.join(map(str, plan.mesh.shape))}` once, or "
                "leave AUTOPAR_MEASURE_FIRST_PROFILE unset, to plan with measured costs")
    print(f"measured time per sharded step: {fmt(step, 's')} (median after the first step; {said})")
    print(f"torch DDP on the same {plan.mesh.size} processes and batch: {fmt(ddp_step, 's')} per step "
          f"(autopar / DDP = {step / ddp_step:.2f})")
    print()

    code = result["code"]
    lines = code.splitlines()
    if args.code_out:
        with open(args.code_out, "w") as f:
            f.write(code)
    n = len(lines) if args.code_lines <= 0 else min(args.code_lines, len(lines))
    print(f"Generated code (pmodel.code), {'all' if n == len(lines) else f'first {n} of'} {len(lines)} lines:")
    print("\n".join("    " + line for line in lines[:n]))
    if n < len(lines):
        where = f"saved in full to {args.code_out}" if args.code_out else \
            "see all of it with --code-lines 0, save it with --code-out FILE, or read pmodel.code in Python"
        print(f"    ... ({len(lines) - n} more lines; {where})")
    elif args.code_out:
        print(f"(saved to {args.code_out})")
    print()
    print(f"demo finished in {time.perf_counter() - t0:.1f} s")
    if not ok:
        print(f"error: sharded and single-device losses differ by {max_diff:.2e} > {DEMO_TOLERANCE:g}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------------- main


def _importable_from_here() -> None:
    """Let ``--model pkg.module:factory`` name a module of the current directory, as under
    ``python -m autopar``: the ``autopar`` console script's ``sys.path`` lacks it. Appended, so an
    installed package of the same name still wins; gloo ranks inherit it (spawn and forkserver
    pass ``sys.path`` on)."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def _talk_flags(parser: argparse.ArgumentParser, default: Any = False) -> None:
    """``-v`` and ``-q``, before the command or after it (a command's own take ``default``
    ``SUPPRESS``: not given there, they leave the main parser's value)."""
    talk = parser.add_mutually_exclusive_group()
    talk.add_argument("-v", "--verbose", action="store_true", default=default,
                      help="also log every stage of the work with its seconds: each capture, problem built, hand "
                           "plan costed, solve and pipeline layout (the autopar logger at DEBUG)")
    talk.add_argument("-q", "--quiet", action="store_true", default=default,
                      help="no progress on stderr: neither the progress lines nor the status line that long work "
                           f"shows on a terminal (as {PROGRESS_ENV}=0); errors and warnings still print")


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` parser: ``-v``/``-q`` and the commands ``demo``, ``plan``, ``compare``, ``profile``,
    ``models``, ``diff``."""
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="autopar: an auto-parallelizing compiler for PyTorch training.",
        epilog="Examples: autopar demo | autopar plan --model gpt-13b --mesh 8x8 --hardware h100-80gb | autopar models",
    )
    _talk_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in (_demo_parser, _plan_parser, _compare_parser, _profile_parser, _models_parser, _diff_parser):
        command = add(sub)
        _talk_flags(command, argparse.SUPPRESS)
    return parser


def _demo_parser(sub: Any) -> argparse.ArgumentParser:
    """``autopar demo``."""
    demo = sub.add_parser("demo", help="train a tiny GPT on a local CPU mesh and compare with one device",
                          description="Plan a zoo model for a local CPU mesh, train it sharded on gloo processes and "
                                      "on a single device with the same batches, and compare the losses.")
    demo.add_argument("--mesh", default="2x2", help="local mesh shape, e.g. 2, 2x2 (default 2x2)")
    demo.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    demo.add_argument("--model", default="gpt-tiny", help="zoo model (default gpt-tiny; see `autopar models`)")
    demo.add_argument("--batch", type=int, default=DEMO_BATCH,
                      help=f"global batch size (default {DEMO_BATCH})")
    demo.add_argument("--seq", type=int, default=DEMO_SEQ, help=f"sequence length (default {DEMO_SEQ})")
    demo.add_argument("--top", type=int, default=12, help="nodes listed in the report (default 12)")
    demo.add_argument("--code-lines", type=int, default=40,
                      help="lines of generated code to print (default 40; 0 prints all)")
    demo.add_argument("--code-out", metavar="FILE", default=None, help="save the generated code to FILE")
    demo.set_defaults(func=cmd_demo)
    return demo


def _plan_parser(sub: Any) -> argparse.ArgumentParser:
    """``autopar plan``: what to plan, what to print, and a flag per ``PlanOptions`` field."""
    plan = sub.add_parser("plan", help="plan a model for a mesh that need not exist (built on the meta device)",
                          description="Plan a zoo model (or pkg.module:factory) for a device mesh; nothing is "
                                      "allocated or run, so any cluster size can be planned here.")
    _model_flags(plan, hardware="h100-80gb")
    plan.add_argument("--top", type=int, default=12, help="nodes listed in the report (default 12)")
    plan.add_argument("--json", metavar="FILE", default=None, help="save the plan as JSON (autopar.Plan.from_json)")
    plan.add_argument("--html", metavar="FILE", default=None,
                      help="save the report as one self-contained HTML page of charts (Plan.to_html)")
    plan.add_argument("--all-nodes", action="store_true",
                      help="list every node's predicted compute, communication, memory and their source")
    plan.add_argument("--scaling", action="store_true",
                      help="also print step time and memory as formulas of batch size B and sequence length S")
    _option_flags(plan.add_argument_group("planning options", "the fields of autopar.PlanOptions"))
    plan.set_defaults(func=cmd_plan)
    return plan


def _model_flags(parser: argparse.ArgumentParser, hardware: str | None) -> None:
    """What ``plan`` and ``compare`` plan: the model, its batch shape, the mesh and its hardware."""
    parser.add_argument("--model", required=True, help="zoo model name (see `autopar models`) or pkg.module:factory")
    parser.add_argument("--mesh", required=True, help="mesh shape, e.g. 8, 8x8, 2x4x8")
    parser.add_argument("--hardware", default=hardware,
                        help="hardware preset (cpu, a100-40gb, a100-80gb, h100-80gb, h200) or a JSON file "
                             f"(default {hardware or 'h100-80gb, cpu with --measure'})")
    parser.add_argument("--axis-names", default=None, help="mesh axis names, e.g. dp,tp (default: dp,tp for 2-D)")
    parser.add_argument("--batch", type=int, default=None, help="global batch size (default: the model's)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")


def _option_flags(parser: Any) -> None:
    """A flag per ``PlanOptions`` field."""
    for f, flag in option_flags():
        _add_option_flag(parser, f, flag)


def _add_option_flag(parser: Any, f: Field, flag: Flag) -> None:
    """The flag of ``PlanOptions`` field ``f``: its name, type, choices and default from the field
    (``flag`` overriding them), its help the field's doc; a switch where the field is True by default."""
    default = f.default if flag.default is AS_FIELD else flag.default
    text = field_doc(f).replace("``", "`") + (f" {flag.note}" if flag.note else "")
    if isinstance(default, bool):
        parser.add_argument(flag.flag_name(f), dest=f.name, action="store_false",
                            help=_escape(f"{text} (on by default; this flag turns it off)"))
        return
    hint = get_type_hints(PlanOptions)[f.name]
    choices = flag.choices or (get_args(hint) if get_origin(hint) is Literal else None)
    kind = flag.type or (float if isinstance(default, float) else None)
    shown = flag.default_text or (format(default, "g") if isinstance(default, float) else default)
    name = flag.flag_name(f)
    metavar = flag.metavar or (None if choices else name.removeprefix("--").replace("-", "_").upper())
    parser.add_argument(name, dest=f.name, type=kind, choices=choices, default=default, metavar=metavar,
                        help=_escape(f"{text} (default: {shown})"))


def _escape(help_text: str) -> str:
    """``help_text`` as argparse reads it (which formats ``%``)."""
    return help_text.replace("%", "%%")


def _profile_parser(sub: Any) -> argparse.ArgumentParser:
    """``autopar profile``."""
    prof = sub.add_parser("profile", help="measure this machine's op, collective and runtime costs for a model",
                          description="Time a model's ops (zoo or pkg.module:factory) at every candidate "
                                      "strategy's local shapes, the collectives of each mesh axis and the runtime "
                                      "overheads, on a local gloo mesh (all ranks at once, as in training); cache "
                                      "the profile for planning.")
    prof.add_argument("--model", default="gpt-tiny", help="zoo model or pkg.module:factory (default gpt-tiny)")
    prof.add_argument("--mesh", default="2x2", help="local mesh shape (default 2x2)")
    prof.add_argument("--axis-names", default=None, help="mesh axis names")
    prof.add_argument("--batch", type=int, default=None, help="global batch size (default: the model's)")
    prof.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    prof.add_argument("--precision", choices=get_args(Precision), default="fp32",
                      help="time the ops in this compute dtype (default fp32)")
    prof.add_argument("--out", default=None, help="profile file (default: the cache, ~/.cache/autopar/profiles)")
    prof.set_defaults(func=cmd_profile)
    return prof


def _models_parser(sub: Any) -> argparse.ArgumentParser:
    """``autopar models``."""
    models = sub.add_parser("models", help="list the model zoo")
    models.set_defaults(func=cmd_models)
    return models


@contextmanager
def _talking(verbose: bool, quiet: bool) -> Iterator[None]:
    """``-v``: every stage logged (``progress.verbose``); ``-q``: no progress lines, no status line
    (for this process and the gloo processes it starts, through the environment), no summary.
    Undone when the command ends: ``main`` called from Python (a test) leaves nothing changed."""
    global _quiet
    from autopar.core import progress

    loggers = [logging.getLogger(name) for name in ("autopar", "cost_models", "codegen", "solver")]
    saved = _quiet, os.environ.get(progress.ENV), [lg.level for lg in loggers]
    _quiet = quiet
    if verbose:
        progress.verbose()
    if quiet:
        os.environ[progress.ENV] = "0"
        logging.getLogger("autopar").setLevel(logging.WARNING)
    try:
        yield
    finally:
        _quiet, env, levels = saved
        if env is None:
            os.environ.pop(progress.ENV, None)
        else:
            os.environ[progress.ENV] = env
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns 0 on success (1 if the demo's losses disagree).

    Bad input raises ``SystemExit(2)`` after printing ``error: <message>`` (as argparse does for
    usage errors), so a console script exits with status 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _importable_from_here()
    if args.verbose and args.quiet:
        parser.error("-v and -q cannot go together")
    try:
        with _talking(args.verbose, args.quiet):
            return args.func(args)
    except AutoparError as e:
        # (a DistributedRunError's message carries the failing rank's traceback)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

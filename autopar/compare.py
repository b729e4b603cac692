"""One model on one mesh under several strategies, side by side (``autopar compare``).

``plan_strategies`` plans the model as ``autopar.plan`` does (the auto plan), under every hand
plan (``autopar.planning.baselines.candidates``: DDP, FSDP, ZeRO, Megatron, their mixes and
pipelines) and under variants the user forces (``PlanOptions`` of their own, e.g. full
recomputation); each is priced by the same cost model. ``measure`` then trains each on a local
gloo mesh, beside torch's own DDP, FSDP2 and tensor parallel (``autopar.profiling.peers``) where
torch can run the model, all in one launch and timed in turns (``time_in_turns``: separate
launches vary by up to 10% on a shared host, turns let the slow spells fall on every strategy),
and fills in the measured step and peak memory. ``Comparison.table`` prints the result,
``Comparison.to_html`` writes it as a page.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from autopar.core.errors import AutoparError
from autopar.core.mesh import MeshSpec
from autopar.core.plan import Plan
from autopar.core.report import step_with_band
from autopar.core.units import fmt
from autopar.planning.options import PlanOptions
from autopar.profiling.peers import NAMES

__all__ = ["Comparison", "Strategy", "plan_strategies", "measure", "TORCH_WRAPPERS"]

Kind = Literal["auto", "hand plan", "variant", "torch"]
#: torch's own wrappers, as ``autopar.profiling.peers`` builds them.
TORCH_WRAPPERS = NAMES
#: A local mesh above this many processes is not measured here (one process per device).
MAX_LOCAL_PROCESSES = 16
SEED = 1234
LR = 1e-3


@dataclass
class Strategy:
    """One row of a comparison: a plan (or torch's wrapper) and what it costs."""

    name: str
    kind: Kind
    plan: Plan | None = None
    why_not: str = ""                       # why it was not planned or not run ("" where it was)
    same_as: str = ""                       # the strategy whose plan this is (auto keeping a hand plan)
    measured_step_s: float | None = None    # median over rounds of each round's median step, slowest rank
    measured_peak_bytes: float | None = None  # tensor bytes live at a step's peak, highest rank

    @property
    def fits(self) -> bool | None:
        """Does the plan fit the memory budget (None: no plan, torch's wrappers)?"""
        return None if self.plan is None else self.plan.feasible

    def verdict(self) -> str:
        """"yes", or "no: " and why not; "-" for torch's wrappers that ran."""
        if self.plan is None:
            return f"no: {self.why_not}" if self.why_not else "-"
        if not self.plan.feasible:
            p = self.plan.predicted
            return (f"no: needs {fmt(p.peak_memory_bytes, 'B')} per device, {fmt(self.plan.shortfall_bytes, 'B')} "
                    f"over the budget of {fmt(self.plan.memory_budget, 'B')}")
        return "yes" + (f" (not run: {self.why_not})" if self.why_not else "")


@dataclass
class Comparison:
    """The strategies planned (and measured) for one model on one mesh."""

    model_name: str
    mesh: MeshSpec
    strategies: list[Strategy] = field(default_factory=list)
    measured: str = ""   # how the measured figures were taken ("" where nothing was measured)

    def sorted(self) -> list[Strategy]:
        """By predicted step time; then those without a prediction (torch's wrappers, plans that
        failed) by measured step time."""
        def key(s: Strategy) -> tuple[int, float]:
            if s.plan is not None:
                return 0, s.plan.predicted.step_time_s
            return 1, s.measured_step_s if s.measured_step_s is not None else float("inf")
        return sorted(self.strategies, key=key)

    def headers(self) -> list[str]:
        measured = ["measured step", "measured peak"] if self.measured else []
        return ["strategy", "predicted step", "predicted peak", *measured, "fits"]

    def rows(self) -> list[list[str]]:
        """The table's cells, in ``sorted`` order."""
        out = []
        for s in self.sorted():
            p = s.plan.predicted if s.plan is not None else None
            row = [s.name + (f" (= {s.same_as})" if s.same_as else ""),
                   step_with_band(p) if p is not None else "-", fmt(p.peak_memory_bytes, "B") if p is not None else "-"]
            if self.measured:
                row += [fmt(s.measured_step_s, "s") if s.measured_step_s is not None else "-",
                        fmt(s.measured_peak_bytes, "B") if s.measured_peak_bytes is not None else "-"]
            out.append([*row, s.verdict()])
        return out

    def title(self) -> str:
        return f"{self.model_name} on {self.mesh.describe()}"

    def table(self) -> str:
        """The comparison as text: a title, the table, how it was measured."""
        headers, rows = self.headers(), self.rows()
        w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        lines = [f"{self.title()}: predicted per training step, fastest first", "",
                 "  ".join(h.ljust(w[i]) for i, h in enumerate(headers)).rstrip(),
                 "  ".join("-" * x for x in w)]
        lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
        if self.measured:
            lines += ["", f"measured: {self.measured}"]
        return "\n".join(lines)

    def to_html(self, path: str | None = None) -> str:
        """The comparison as one self-contained HTML page (the table and a bar chart of the
        predicted and measured steps); written to ``path`` if given."""
        from autopar.core.report_html import bar_chart, page, section, table

        ordered = self.sorted()
        parts = [f"<h1>autopar compare: {self.title()}</h1>",
                 section("Strategies", "Sorted by predicted step time (torch's wrappers, which have no prediction, "
                         "last). " + (f"Measured: {self.measured}." if self.measured else "Not measured."),
                         table(self.headers(), self.rows())),
                 section("Predicted step time", "Per training step, on the worst device.",
                         bar_chart([(s.name, {"predicted": s.plan.predicted.step_time_s}) for s in ordered
                                    if s.plan is not None], "s", "predicted step time"))]
        timed = [(s.name, {"measured": s.measured_step_s}) for s in ordered if s.measured_step_s is not None]
        if timed:
            parts.append(section("Measured step time", self.measured, bar_chart(timed, "s", "measured step time")))
        text = page(f"autopar compare: {self.title()}", parts)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text


def plan_strategies(model: Any, mesh: MeshSpec, example_args: Any, example_kwargs: dict | None = None, *,
                    options: PlanOptions | None = None, variants: Mapping[str, PlanOptions] | None = None,
                    name: str | None = None, say: Callable[[str], None] = lambda msg: None) -> Comparison:
    """Plan ``model`` on ``mesh`` as ``autopar.plan`` does ("auto"), under every hand plan (with
    the same ``options``) and under each of ``variants`` (label -> its own options). A strategy
    that cannot be planned is kept, with why. ``name``: the model's, for the title (default: the
    plan's, its class name); ``say``: progress lines."""
    import autopar
    from autopar.planning.baselines import candidates

    options = options or PlanOptions()
    out = Comparison(name or type(model).__name__, mesh)
    t0 = time.perf_counter()
    out.strategies.append(_planned("auto", "auto", lambda: autopar.plan(model, mesh, example_args, example_kwargs,
                                                                         options=options)))
    auto = out.strategies[0].plan
    if auto is not None and name is None:
        out.model_name = auto.model_name
    say(f"auto plan in {time.perf_counter() - t0:.1f} s; costing every hand plan...")
    t0 = time.perf_counter()
    kept = auto.solver.get("kept_hand_plan") if auto is not None else None
    for hand, plan in candidates(model, mesh, example_args, example_kwargs, options=options).items():
        out.strategies.append(Strategy(hand, "hand plan", plan))
        if hand == kept:
            out.strategies[0].same_as = hand
    say(f"{len(out.strategies) - 1} hand plans in {time.perf_counter() - t0:.1f} s")
    for label, forced in (variants or {}).items():
        t0 = time.perf_counter()
        out.strategies.append(_planned(label, "variant", partial(autopar.plan, model, mesh, example_args,
                                                                 example_kwargs, options=forced)))
        say(f"{label} in {time.perf_counter() - t0:.1f} s")
    return out


def _planned(name: str, kind: Kind, make: Callable[[], Plan]) -> Strategy:
    """A strategy planned by ``make``; one it cannot plan (no plan fits, a bad option) says why."""
    try:
        return Strategy(name, kind, make())
    except AutoparError as e:
        return Strategy(name, kind, None, why_not=str(e).splitlines()[0])


def measure(comparison: Comparison, model_name: str, batch: int | None, seq: int | None, *, rounds: int = 2,
            warmup: int = 1, steps: int = 2, torch_wrappers: Collection[str] = TORCH_WRAPPERS,
            timeout_s: float = 600, progress: bool = True) -> Comparison:
    """Train every strategy of ``comparison`` that fits on a local gloo mesh of its shape (one
    process per device; ``model_name``: a zoo name or ``pkg.module:factory``, built on every rank),
    beside those of torch's wrappers named in ``torch_wrappers`` that torch can run it with, all in
    one launch, in turns: ``rounds`` rounds of ``warmup`` + ``steps`` AdamW steps of each. Fills in
    the measured columns (in place) and returns ``comparison``."""
    from autopar.profiling.launch import run_on_gloo_mesh

    spec = comparison.mesh
    if spec.size > MAX_LOCAL_PROCESSES:
        raise AutoparError(f"--measure runs one process per device on this host: a mesh of {spec.size} is more "
                           f"than {MAX_LOCAL_PROCESSES}; compare without --measure, or on a smaller mesh")
    if min(rounds, steps) < 1 or warmup < 0:
        raise AutoparError(f"measuring needs rounds >= 1, steps >= 1 and warmup >= 0 (got {rounds}, {steps}, {warmup})")
    plans = _to_run(comparison)
    _check_host_memory(plans, spec)
    wrappers = {k: why for k, why in _torch_wrappers(spec, model_name).items() if k in torch_wrappers}
    t0 = time.perf_counter()
    ranks = run_on_gloo_mesh(_measure_worker, spec.shape, model_name, batch, seq,
                             {k: p.to_json() for k, p in plans.items()}, [k for k, v in wrappers.items() if not v],
                             (rounds, warmup, steps), progress, axis_names=spec.axis_names, timeout_s=timeout_s,
                             start_method="forkserver")
    for name, why in wrappers.items():
        comparison.strategies.append(Strategy(name, "torch", why_not=why))
    _fill(comparison, ranks)
    comparison.measured = (f"{rounds} rounds of {warmup} warm-up + {steps} timed AdamW steps of each strategy, in "
                           f"turns, on {spec.size} local gloo processes ({time.perf_counter() - t0:.0f} s in all); "
                           "step: median over rounds of the slowest rank's median step; peak: the highest rank's "
                           "tensor bytes")
    return comparison


def _to_run(comparison: Comparison) -> dict[str, Plan]:
    """The plans to train: each that fits, once (auto where it is a hand plan is that plan's run)."""
    out = {}
    for s in comparison.strategies:
        if s.plan is None or s.same_as:
            continue
        if not s.plan.feasible:
            s.why_not = "does not fit"
            continue
        out[s.name] = s.plan
    return out


def _check_host_memory(plans: Mapping[str, Plan], spec: MeshSpec) -> None:
    """Every strategy lives on every rank for the whole launch: their predicted peaks, twice over
    (torch's wrappers beside them), must fit in half of this host's memory."""
    need = 2 * spec.size * sum(p.predicted.peak_memory_bytes for p in plans.values())
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have / 2:
        raise AutoparError(f"measuring {len(plans)} strategies at once on {spec.size} processes would hold about "
                           f"{fmt(need, 'B')} of this host's {fmt(have, 'B')}; compare fewer (--pipeline none, a "
                           "smaller --batch) or without --measure")


def _torch_wrappers(spec: MeshSpec, model_name: str) -> dict[str, str]:
    """torch's wrappers for this mesh -> "" (run) or why torch cannot run the model so."""
    if spec.size == 1:
        return {"torch eager": ""}
    out = {"torch DDP": "", "torch FSDP2": ""}
    if len(spec.shape) == 2:
        import torch

        from autopar.models.zoo import get_model
        from autopar.profiling import peers

        with torch.device("meta"):
            model = get_model(model_name).build()
        out["torch TP x FSDP2"] = "" if peers.tensor_parallel_plan(model) is not None else \
            f"torch's tensor parallel API cannot split {type(model).__name__} unchanged (it needs separate q/k/v and " \
            "gate/up nn.Linear layers)"
    return out


def _fill(comparison: Comparison, ranks: list[dict[str, Any]]) -> None:
    """The measured columns from every rank's timings (``_measure_worker``)."""
    from autopar.profiling.measure import slowest_rank_steps

    first = ranks[0]
    by_name = {s.name: s for s in comparison.strategies}
    for name, why in first["errors"].items():
        by_name[name].why_not = f"failed: {why}"
    for name in first["rounds"]:
        per_round = [statistics.median(slowest_rank_steps([rank["rounds"][name][r] for rank in ranks]))
                     for r in range(len(first["rounds"][name]))]
        s = by_name[name]
        s.measured_step_s = statistics.median(per_round)
        s.measured_peak_bytes = max(rank["peak"][name] for rank in ranks)
    for s in comparison.strategies:
        if s.same_as and s.same_as in by_name:
            s.measured_step_s, s.measured_peak_bytes = by_name[s.same_as].measured_step_s, \
                by_name[s.same_as].measured_peak_bytes


def _measure_worker(mesh: Any, model_name: str, batch: int | None, seq: int | None, plans: dict[str, str],
                    wrappers: list[str], schedule: tuple[int, int, int], progress: bool) -> dict[str, Any]:
    """On every rank: build every strategy (autopar's plans compiled, torch's wrappers), time them
    in turns, then one more step of each for its peak memory."""
    from autopar.core import progress as talk
    from autopar.core.together import first_rank
    from autopar.profiling.measure import peak_step_bytes, time_in_turns

    rounds, warmup, steps = schedule
    say = talk.say if progress and first_rank() else (lambda msg: None)
    logging.getLogger("autopar").setLevel(logging.WARNING)   # compile's summary of each plan: the table says it
    # DTensor's hint at each two-axis all-gather, kineto's two lines at each profiler start and stop
    # (the peak memory step) would bury the progress lines
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    runs, errors = _build_runs(mesh, model_name, batch, seq, plans, wrappers, say)
    countdown = talk.Countdown(len(runs) * (rounds * (warmup + steps) + 1))
    per_round, taken = len(runs) * (warmup + steps), dict.fromkeys(runs, 0)

    def tick(name: str) -> None:
        countdown.tick()
        taken[name] += 1
        r, k = divmod(taken[name] - 1, warmup + steps)
        talk.note(f"round {r + 1} of {rounds}: {name}, step {k + 1} of {warmup + steps} ({countdown.text()})")
        if countdown.done % per_round == 0:
            say(f"  round {countdown.done // per_round} of {rounds} timed: {countdown.text()}")

    with talk.working(f"timing {len(runs)} strategies in turns", progress=progress):
        times = time_in_turns(runs, rounds=rounds, warmup=warmup, steps=steps, on_step=tick)
        peak = {}
        for name, (module, optimizer, rank_batch) in runs.items():
            peak[name] = peak_step_bytes(module, rank_batch, optimizer)[0]
            countdown.tick()
            talk.note(f"peak memory of {name} ({countdown.text()})")
    say(f"  peak memory of each measured: {countdown.text()}")
    return {"rounds": times, "peak": peak, "errors": errors}


def _build_runs(mesh: Any, model_name: str, batch: int | None, seq: int | None, plans: dict[str, str],
                wrappers: list[str], say: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every strategy built on this rank: name -> (module, AdamW, this rank's batch), each from
    the same seed; and name -> why, for those that failed to build (on every rank alike:
    ``together``)."""
    import torch

    import autopar
    from autopar.core import progress as talk
    from autopar.core.together import together
    from autopar.models.zoo import get_model
    from autopar.profiling import peers

    entry = get_model(model_name)
    example = entry.example(batch, seq)

    def build() -> Any:
        torch.manual_seed(SEED)
        return entry.build()

    def compiled(text: str) -> tuple[Any, Any]:
        return autopar.compile(build(), mesh, *example, plan=autopar.Plan.from_json(text)), example

    def wrapped(name: str) -> tuple[Any, Any]:
        return peers.wrap(name, build(), example, mesh)

    makers: dict[str, Callable[[], tuple[Any, Any]]] = {**{name: partial(compiled, text) for name, text in plans.items()},
                                                        **{name: partial(wrapped, name) for name in wrappers}}
    runs, errors = {}, {}
    built = talk.Countdown(len(makers), "built")
    for name, make in makers.items():
        say(f"  building {name} ({built.text()})")
        built.tick()
        try:
            with talk.working(f"building {name}"):
                module, rank_batch = together(f"building {name}", make)
        except Exception as e:  # noqa: BLE001 - any failure to build: that strategy's row says it, the rest run
            errors[name] = str(e).splitlines()[0] if str(e) else type(e).__name__
            continue
        # foreach: torch's default picks its per-tensor loop for DTensor parameters and on the CPU
        runs[name] = (module, torch.optim.AdamW(module.parameters(), lr=LR, foreach=True), rank_batch)
    return runs, errors

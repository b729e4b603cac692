"""The planner: the auto plan of a captured graph, chosen against the hand plans.

``plan_captured`` costs the standard strategies (``baselines``), warm-starts the ILP from the best
one that fits (``problem.solve_planning``), and keeps that hand plan unless the solver's plan is
predicted faster by ``PlanOptions.min_gain``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from autopar.core.blocks import RecomputeMode, recompute_modes, repeated_blocks
from autopar.core.buffers import refuse_split_steps, whole_batch_state
from autopar.core.capture import CapturedGraph
from autopar.core.errors import AutoparError, InfeasibleError, PlanningTimeout
from autopar.core.hardware import get_hardware
from autopar.core.mesh import MeshSpec
from autopar.core.microbatch import captured_rows, fewest_at_least, microbatch_rows
from autopar.core.ops import moe
from autopar.core.ops.attention import BALANCED_RING
from autopar.core.plan import HandPlanSummary, Plan
from autopar.core.seq_layout import BalancedLayoutError, plan_layout
from autopar.core.strategies import Strategy, StrategySpace
from autopar.core.units import fmt
from autopar.planning.baselines import hand_plans as standard_plans
from autopar.planning.clock import Clock, Deadline, Once
from autopar.planning.context import ContextChoice, context_choice
from autopar.planning.options import PlanOptions
from autopar.planning.pipeline import (
    PipelineChoice,
    pipeline_choice,
    pipeline_degrees,
    pipeline_layouts,
    pipeline_search,
    sub_mesh,
)
from autopar.planning.problem import Planning, prepare, solve_planning
from cost_models.comm import crosses_nodes


def plan_captured(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions = PlanOptions(), *,
                  clock: Clock | None = None, forced: dict[str, Strategy] | None = None,
                  recapture: Callable[[int], CapturedGraph] | None = None) -> Plan:
    """Choose one strategy per node (``options``: see ``PlanOptions``). ``forced`` pins named nodes
    to a strategy and skips the hand plans (tests, calibration). ``recapture(k)``: the model
    captured at one of ``k`` microbatches of the batch, for gradient accumulation (None: the
    batch is planned whole, ``microbatches`` must be 1 or "auto").

    Memory knobs, cheapest first: ``microbatches="auto"`` plans the whole batch when some plan can
    fit it, else the fewest microbatches (a divisor of the batch) that fit: the least memory a
    plan needs on the whole batch, less what does not shrink with the batch (state, parameter
    gradients), says how many at least. ``recompute="auto"``: where the whole batch cannot fit
    without recomputation, full recomputation of the repeated blocks (a third more compute) is
    priced beside it, each in the fewest microbatches that fit, and the faster plan kept (fewer,
    larger microbatches need less sharding: Llama-2 70B at 512 x 4096 on 16x8 H100 runs 64
    microbatches without recomputation, 16 with it, predicted 2.7x faster); the two share the time
    limit, recomputation first. Where the model has attention cores (attention not computed by
    SDPA), selective recomputation takes the place of none there. Otherwise each mode (none,
    selective, full) is tried only when no plan fits with the lighter ones. ``offload="auto"``: where no plan fits the device (the state alone, or after every count
    and mode was tried) and the hardware has host memory apart, the search runs again with the
    ZeRO-2/3 parameters' states in host memory (``CostModel.offload``).

    ``pipeline``: a ``PipelineChoice`` makes the plan a pipeline (``autopar.planning.pipeline``);
    "auto" weighs one over a factor of the mesh's first axis where that axis crosses nodes (where
    Megatron puts its stages: within a node, tensor and data parallelism's collectives run on the
    fast links; ``pipeline.pipeline_degrees``), in the time the plan without leaves
    (``SPMD_SHARE``), and keeps it where predicted faster by ``min_gain``; its plan's mesh then
    cuts the first axis in two (``mesh.split_first_axis``: ``compile`` re-forms a live mesh so).

    ``clock``: the call's ``Clock`` where it began before (``autopar.plan``'s capture counts; it
    shows the call's status line), else one of its own, shown where ``options.progress`` says;
    ``options.time_limit`` bounds the whole call on it (``autopar.planning.clock``). The plan's
    ``timings`` add up to the call's wall time; ``solver["time_limit"]`` says what the limit cut
    short, where it did (another run may then give another plan)."""
    moe.check_axis(options.expert_parallel, mesh)
    whole_batch = whole_batch_state(captured)
    if whole_batch:   # batch statistics, buffer writes: never in parts of the batch
        refuse_split_steps(captured.model_name, whole_batch, _in_parts(options),
                           'Plan it with microbatches=1 and pipeline=False (or "auto", which then plans the whole '
                           "batch); where that does not fit, give it more memory or a smaller batch.")
        recapture = None
    shown = Clock(options.time_limit, deterministic=options.deterministic).shown("planning", options.progress) if clock is None else nullcontext(clock)
    with shown as clock:
        again = Once(recapture, clock, "capture") if recapture is not None else None
        plan = _runs_in_order(captured, options, lambda o: _planned(captured, mesh, o, clock.deadline(), forced,
                                                                    again, Problems()), forced)
    return timed(plan, clock)


def timed(plan: Plan, clock: Clock) -> Plan:
    """``plan`` with the call's ``timings`` and what its time limit cut short, as of now: called
    again by ``autopar.plan`` once its status line is gone and its capture freed, so that they
    cover the whole call."""
    plan.timings = clock.breakdown()
    if clock.limit is not None:
        plan.solver["time_limit"] = {"limit_s": clock.limit, "wall_s": clock.wall(), "charged_s": clock.spent,
                                     "reproducible": clock.reproducible, "cut_short": list(clock.cut_short)}
    return plan


def _runs_in_order(captured: CapturedGraph, options: PlanOptions, planned: Callable[[PlanOptions], Plan],
                   forced: dict[str, Strategy] | None = None) -> Plan:
    """``planned(options)``, planned again with every ring contiguous where its balanced rings
    cannot hold the balanced order (``seq_layout``: a parameter split beside the sequence, a
    dimension another axis splits too...); refused, saying why, where the options force it, or
    ``forced`` pins a node to a balanced ring."""
    plan = planned(options)
    try:
        plan_layout(captured, plan)
        return plan
    except BalancedLayoutError as e:
        pinned = any(BALANCED_RING in s.names for s in (forced or {}).values())
        if pinned or _balance_forced(options):
            raise
        try:
            plan = planned(_contiguous(options))
        except PlanningTimeout as late:   # the first search spent the time
            raise PlanningTimeout(f"the plan found ran its causal rings balanced, which it cannot ({e}), and "
                                  f"planning them contiguous ran out of time ({late}): plan with context_parallel="
                                  "{'load_balance': 'contiguous'} or a larger time_limit") from None
        plan.warnings.append(f"the plan's causal rings run contiguous: the balanced layout was refused ({e})")
        return plan


def _balance_forced(options: PlanOptions) -> bool:
    """Do the options force causal rings into the balanced layout?"""
    setting = context_choice(options.context_parallel)
    return isinstance(setting, ContextChoice) and setting.load_balance == "balanced"


def _contiguous(options: PlanOptions) -> PlanOptions:
    """The options with every causal ring contiguous. Options that force the balanced layout are
    kept (refused where it cannot run), and so are those with no context parallelism (False)."""
    setting = context_choice(options.context_parallel)
    if setting is False or _balance_forced(options):
        return options
    contiguous = (replace(setting, load_balance="contiguous") if isinstance(setting, ContextChoice)
                  else ContextChoice(None, load_balance="contiguous"))
    return replace(options, context_parallel=contiguous)


def _in_parts(options: PlanOptions) -> str | None:
    """How the options make a step run its forward on parts of the batch, if they do."""
    if isinstance(options.microbatches, int) and options.microbatches > 1:
        return f"microbatches={options.microbatches} runs it in {options.microbatches} parts"
    if isinstance(pipeline_choice(options.pipeline), PipelineChoice):
        return "a pipeline runs it in microbatches"
    return None


def _planned(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions, deadline: Deadline,
             forced: dict[str, Strategy] | None, recapture: Once | None, problems: Problems) -> Plan:
    """``plan_captured``'s search, by ``deadline`` (a pipeline stage's plan is one too), each
    planning problem built once in the call (``problems``)."""
    choice = pipeline_choice(options.pipeline)
    if isinstance(choice, PipelineChoice):   # a stage holds no balanced ring (``seq_layout``)
        return pipeline_search(captured, mesh, _contiguous(options), choice, recapture, deadline,
                               _stage_plan(recapture, problems))
    if choice != "auto" or forced or not _pipeline_worth_weighing(captured, mesh, recapture):
        return _spmd_plan(captured, mesh, options, deadline, forced, recapture, problems)
    return _with_or_without_pipeline(captured, mesh, options, deadline, recapture, problems)


def _with_or_without_pipeline(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions, deadline: Deadline,
                              recapture: Once, problems: Problems) -> Plan:
    """"auto" pipelines: the plan without a pipeline first, in ``SPMD_SHARE`` of the time (the
    search that needs it most), then the pipeline in what is left where that is at least
    ``MIN_PIPELINE_SHARE`` of the limit; the faster by ``min_gain`` is kept."""
    try:
        best: Plan | None = _spmd_plan(captured, mesh, options, deadline.share(SPMD_SHARE), None, recapture, problems)
    except (InfeasibleError, PlanningTimeout) as e:   # a pipeline may fit where nothing else does
        best, failed = None, e
    left = deadline.left()
    if best is not None and deadline.limited and left < MIN_PIPELINE_SHARE * options.time_limit:
        piped, why = None, (f"not weighed: {fmt(max(left, 0.0), 's')} of the time limit was left (a stage plan "
                            "takes more; raise time_limit)")
        deadline.clock.note("the pipeline plans (not weighed)")
    else:
        try:
            piped = pipeline_search(captured, mesh, _contiguous(options), PipelineChoice(axis="auto"), recapture,
                                    deadline, _stage_plan(recapture, problems))
        except AutoparError as e:
            piped, why = None, str(e)
    if best is None:
        if piped is None or not piped.feasible:
            raise failed
        piped.solver["pipeline"] = f"kept: no plan without a pipeline was found ({failed})"
        return piped
    if piped is None:
        best.solver["pipeline"] = f"none: {why}"
        return best
    return _faster(best, piped, options.min_gain)


def _faster(best: Plan, piped: Plan, min_gain: float) -> Plan:
    """The pipeline plan where it fits and is predicted faster than ``best`` by ``min_gain`` (or
    ``best`` does not fit), else ``best``; each says why."""
    if "hand_plans" in best.solver:   # what the plan was weighed against, pipeline or not
        piped.solver["hand_plans"] = best.solver["hand_plans"]
    faster = piped.predicted.step_time_s < (1 - min_gain) * best.predicted.step_time_s
    if piped.feasible and (faster or not best.feasible):
        piped.solver["pipeline"] = (f"kept: {fmt(piped.predicted.step_time_s, 's')} a step, the plan without "
                                    f"{fmt(best.predicted.step_time_s, 's')}" + ("" if best.feasible else " (not fitting)"))
        return piped
    best.solver["pipeline"] = (f"not kept: the best pipeline ({piped.pipeline.schedule}, {piped.pipeline.num_stages} "
                               f"stages) is predicted {fmt(piped.predicted.step_time_s, 's')} a step"
                               + ("" if piped.feasible else ", over the budget"))
    return best


def priced_workloads(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions,
                     recapture: Callable[[int], CapturedGraph] | None) -> list[tuple[CapturedGraph, MeshSpec]]:
    """The (graph, mesh) pairs whose op calls ``plan_captured`` prices with these options, known
    before it runs: the batch on ``mesh``, a forced microbatch count's capture, and each pipeline
    layout's microbatch on its stage's sub-mesh (``pipeline_layouts``). What a profile must hold
    for the plan to be costed on measured times (``missing_ops``, ``profile_model``); microbatch
    counts the search picks by memory ("auto") are not known ahead and are priced as they come."""
    out = [(captured, mesh)]
    if isinstance(options.microbatches, int) and options.microbatches > 1 and recapture is not None:
        out.append((recapture(options.microbatches), mesh))
    choice = pipeline_choice(options.pipeline)
    if choice == "auto" and _pipeline_worth_weighing(captured, mesh, recapture):
        choice = PipelineChoice(axis="auto")
    if isinstance(choice, PipelineChoice) and recapture is not None:
        for shaped, axis, counts in pipeline_layouts(captured, mesh, choice):
            out += [(captured if m == 1 else recapture(m), sub_mesh(shaped, axis)) for m in counts]
    return out


def memoized(recapture: Callable[[int], CapturedGraph] | None) -> Callable[[int], CapturedGraph] | None:
    """``recapture`` capturing each microbatch count once (the pipeline search and the plan
    without share them)."""
    if recapture is None:
        return None
    done: dict[int, CapturedGraph] = {}

    def capture(k: int) -> CapturedGraph:
        if k not in done:
            done[k] = recapture(k)
        return done[k]
    return capture


def _pipeline_worth_weighing(captured: CapturedGraph, mesh: MeshSpec, recapture: Callable | None) -> bool:
    """Does "auto" weigh a pipeline: the first axis spans nodes, the model has blocks to cut?"""
    if mesh.ndim < 2 or mesh.shape[0] < 2 or recapture is None:
        return False
    hw = get_hardware(mesh.hardware)
    if not crosses_nodes(hw, mesh.shape, 0):
        return False
    return bool(pipeline_degrees(mesh.shape[0], len(repeated_blocks(captured.graph))))


def _stage_plan(recapture: Once | None, problems: Problems
                ) -> Callable[[CapturedGraph, MeshSpec, PlanOptions, Deadline], Plan]:
    """The planner itself, for one pipeline stage's sub-mesh, by a deadline on the call's clock
    (the problems of the layouts' attempts, each recomputation mode of one layout, built once)."""
    def plan(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions, deadline: Deadline) -> Plan:
        return _planned(captured, mesh, options, deadline, None, recapture, problems)
    return plan


class Problems:
    """The planning problems of one ``plan_captured`` call, each built once, and the strategy
    space of each captured graph on each mesh, built once for all its problems. The searches ask
    for the same problems again: a pipeline layout's stage plan for each recomputation mode, the
    whole batch's for the memory bounds and then for its plan; and problems of one graph differ
    only in their costs (recomputation, offload, the budget), not in their strategies."""

    def __init__(self) -> None:
        self.built: dict[tuple, Planning] = {}
        self.spaces: dict[tuple, tuple[CapturedGraph, StrategySpace]] = {}

    @staticmethod
    def key(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions, k: int,
            recompute: RecomputeMode | dict[str, RecomputeMode],
            offload: bool, forced: dict[str, Strategy] | None = None) -> tuple:
        """What ``prepare`` reads: the graph (``captured`` at ``k`` microbatches), mesh, count,
        recomputation, offload, forced nodes and the options that price the problem."""
        profile = options.profile if isinstance(options.profile, (str, Path, type(None))) else id(options.profile)
        return (id(captured), mesh, k, recompute if isinstance(recompute, str) else tuple(sorted(recompute.items())),
                offload, id(forced) if forced else None, options.device_budget(mesh.hardware), profile,
                options.optimizer, options.gather_outputs, options.reduce_precision, options.share_layers,
                context_choice(options.context_parallel))

    def get(self, key: tuple) -> Planning | None:
        return self.built.get(key)

    def put(self, key: tuple, planning: Planning) -> Planning:
        self.built[key] = planning
        return planning

    def space(self, captured: CapturedGraph, mesh: MeshSpec) -> StrategySpace | None:
        """The strategy space of ``captured`` on ``mesh`` where a problem built it before (None:
        build it; it is kept from the problem that does, ``keep_space``)."""
        held = self.spaces.get((id(captured), mesh))
        return held[1] if held is not None else None

    def keep_space(self, planning: Planning, mesh: MeshSpec) -> None:
        self.spaces.setdefault((id(planning.captured), mesh), (planning.captured, planning.space))


def _spmd_plan(captured: CapturedGraph, mesh: MeshSpec, options: PlanOptions, deadline: Deadline,
               forced: dict[str, Strategy] | None, recapture: Once | None, problems: Problems) -> Plan:
    """The plan without pipeline (``plan_captured``'s memory knobs)."""
    rows = captured_rows(captured)
    if options.microbatches != "auto":
        microbatch_rows(rows, options.microbatches)   # refuses a count that does not divide the batch
        if options.microbatches > 1 and recapture is None:
            raise AutoparError("microbatches > 1 needs the model to capture one microbatch: plan with autopar.plan "
                               "or autopar.compile")
    search = _Search(captured, mesh, options, deadline.clock, forced, recapture, rows, problems, deadline,
                     offload=options.offload == "optimizer")
    if search.may_offload() and search.state_exceeds_budget():
        search.offload = True
        search.offload_why = "what no plan avoids holding on the device (parameters, gradients, optimizer states) exceeds the budget"
    try:
        best: Plan | None = _best_mode(search, deadline)
    except InfeasibleError as e:
        if search.offload_why:
            raise InfeasibleError(f"{e} That is with the ZeRO-sharded parameters' states offloaded to host memory: "
                                  f"{search.offload_why}.", min_memory_bytes=e.min_memory_bytes) from None
        if not search.may_offload():
            raise
        best, failed = None, e
    if search.may_offload() and (best is None or not best.feasible):
        search.offload, search.offload_why = True, "no plan fits the device otherwise"
        try:
            offloaded: Plan | None = _best_mode(search, deadline)
        except PlanningTimeout:
            if best is None:
                raise
            offloaded = None
            deadline.clock.note("the plans offloading optimizer states (not weighed)")
        except InfeasibleError as e:
            if best is None:
                raise InfeasibleError(f"{failed} With optimizer states offloaded to host memory too: {e}",
                                      min_memory_bytes=min(failed.min_memory_bytes, e.min_memory_bytes)) from None
            offloaded = None
        if offloaded is not None and (best is None or offloaded.shortfall_bytes < best.shortfall_bytes):
            best = offloaded
    if best.offloaded and search.offload_why:
        best.solver["offload"] = (f"the states of {len(best.offloaded)} parameters are offloaded to host memory: "
                                  f"{search.offload_why}")
    return best


def _best_mode(search: _Search, deadline: Deadline) -> Plan:
    """The best plan over the recomputation modes the options allow (see ``plan_captured``): the
    fastest that fits, else the least bad; raises ``InfeasibleError`` where no mode has a plan."""
    options = search.options
    # selective recomputation, where the model has attention cores, costs a few percent of compute
    # for most of the activations of long sequences (Korthikanti et al.)
    selective: tuple[RecomputeMode, ...] = ("selective",) if recompute_modes(search.captured.graph, "selective") else ()
    modes: tuple[RecomputeMode, ...]
    if options.recompute != "auto":
        modes, compete = (options.recompute,), False
    elif search.needs_microbatches("none"):
        # the batch must be cut anyway: fewer, larger microbatches may pay for recomputation. It
        # goes first: at the scale where both need microbatches it usually wins, and the second
        # mode gets what the first leaves of the time limit.
        modes, compete = ("full", *(selective or ("none",))), True
    else:
        modes, compete = ("none", *selective, "full"), False
    plans: list[Plan] = []
    errors: list[tuple[str, InfeasibleError]] = []
    timeouts: list[PlanningTimeout] = []   # modes whose search found no plan in the time left
    for n, mode in enumerate(modes):
        if plans or errors or timeouts:
            if plans and plans[-1].feasible and not compete:
                break
            if deadline.passed():
                deadline.clock.note(f"recomputation {', '.join(modes[n:])} (not weighed)")
                break
        # competing modes share the time left (recomputation, first, the larger part, all of it
        # where the second could not build and solve its problem in the rest); otherwise the next
        # mode is only a fallback
        until = deadline
        if compete and not n and deadline.affords(search.new_problem_s(captured=False) / (1 - FIRST_MODE_SHARE)):
            until = deadline.share(FIRST_MODE_SHARE)
        try:
            plans.append(search.fit(mode, until))
        except InfeasibleError as e:
            errors.append((mode, e))
        except PlanningTimeout as e:
            timeouts.append(e)
    fitting = [p for p in plans if p.feasible]
    if fitting or plans:
        best = min(fitting, key=lambda p: p.predicted.step_time_s) if fitting else plans[0]   # else the least bad
        if len(plans) > 1:
            best.solver["recompute"] = "; ".join(
                f"{p.recompute_mode}: {fmt(p.predicted.step_time_s, 's')} in {p.microbatches} microbatch(es)"
                + ("" if p.feasible else " (over the budget)") for p in plans) + f"; kept {best.recompute_mode}"
        return best
    if timeouts:
        raise timeouts[0]
    errors.sort(key=lambda e: e[0] != "none")   # the plain case first, then what recomputation needs
    first = errors[0][1]
    also = "".join(f" With {mode} recomputation of the repeated blocks too, a plan needs {fmt(e.min_memory_bytes, 'B')}."
                   for mode, e in errors[1:])
    raise InfeasibleError(f"{first}{also}", min_memory_bytes=min(e.min_memory_bytes for _, e in errors)) from None


@dataclass
class _Search:
    """The plans of one capture under each memory knob: ``fit(mode)`` for one recomputation mode."""

    captured: CapturedGraph
    mesh: MeshSpec
    options: PlanOptions
    clock: Clock                                                        # the call's: timings, estimates
    forced: dict[str, Strategy] | None
    recapture: Once | None
    rows: int
    problems: Problems                                                  # the call's, each built once
    within: Deadline                                                    # the whole search's
    offload: bool = False                                               # ZeRO-2/3 states in host memory
    offload_why: str = ""                                               # why "auto" offloads
    deadline: Deadline | None = None                                    # of the fit under way
    planned: bool = False                                               # has a fitting plan in hand

    def may_offload(self) -> bool:
        """May "auto" still turn offload on: not yet on, and the device has host memory apart?"""
        return self.options.offload == "auto" and not self.offload and get_hardware(self.mesh.hardware).host_bandwidth > 0

    def state_exceeds_budget(self) -> bool:
        """Does what no plan avoids (the state, what every moment holds) exceed the budget, so that
        neither microbatches nor recomputation can help? Asked of the first problem the search
        plans anyway: the whole batch's, or the microbatch the options fix (a pipeline stage's: a
        problem of the whole batch there would be built for this question alone)."""
        first = self.options.recompute if self.options.recompute != "auto" else "none"
        base = self._whole(first) if self.options.microbatches == "auto" else \
            self._prepare(self.options.microbatches, first)
        return base.bounds().quietest() > base.budget

    def needs_microbatches(self, recompute: RecomputeMode) -> bool:
        """Does every plan of the whole batch under ``recompute`` exceed the budget (where the
        batch can be cut)?"""
        if self.options.microbatches != "auto" or self.recapture is None or self.rows == 1:
            return False
        whole = self._whole(recompute)
        return whole.bounds().least() > whole.budget

    def fit(self, recompute: RecomputeMode, deadline: Deadline) -> Plan:
        """The auto plan under ``recompute``, by ``deadline``, in the fewest microbatches that fit
        (or as many as the options say); raises ``InfeasibleError`` when no count does."""
        self.deadline = deadline
        if self.options.microbatches != "auto":
            return self._plan(self._prepare(self.options.microbatches, recompute))
        whole = self._whole(recompute)
        if self.recapture is None or self.rows == 1:
            started = self.clock.spent
            return self._lighter(self._plan(whole), 1, recompute, self.clock.spent - started)
        least, floor = whole.bounds().least(), whole.bounds().quietest()
        if least <= whole.budget:   # some plan may fit the whole batch; if the solver's does not, microbatches
            plan = self._whole_batch_fitting(whole, recompute)
            if plan is not None:
                return plan
        elif floor >= whole.budget:
            return self._whole_batch_or_why(whole, floor)
        return self._in_microbatches(whole, recompute, least, floor)

    def _whole_batch_fitting(self, whole: Planning, recompute: RecomputeMode) -> Plan | None:
        """The plan of the whole batch, if it fits (with as little recomputation as fits); None
        where it does not or there is none."""
        try:
            started = self.clock.spent
            plan = self._plan(whole)
            if plan.feasible:
                return self._lighter(plan, 1, recompute, self.clock.spent - started)
        except InfeasibleError:
            pass
        return None

    def _whole_batch_or_why(self, whole: Planning, floor: float) -> Plan:
        """The plan of the whole batch where microbatches cannot help: what does not shrink with
        the batch alone exceeds the budget (its error says so)."""
        try:
            return self._plan(whole)
        except InfeasibleError as e:
            raise InfeasibleError(f"{e} Microbatches would not help: what does not shrink with the batch "
                                  f"(parameters, their gradients and optimizer states) needs at least "
                                  f"{fmt(floor, 'B')}.", min_memory_bytes=e.min_memory_bytes) from None

    def _in_microbatches(self, whole: Planning, recompute: RecomputeMode, least: float, floor: float) -> Plan:
        """The plan in the fewest microbatches that fit, trying counts from a guess upward.

        What shrinks with the microbatch (activations, their gradients, working memory) must fit
        beside what does not. The least-memory bound gives each node its leanest choice at once,
        which no plan affords: the first count aims it at a fraction of the room (``BOUND_SLACK``);
        a count whose plan does not fit says by how much it missed, and the next count is scaled by
        that. The search ends at the first count that fits (its plan, made faster in fewer
        microbatches or with less recomputation where that still fits), at the deadline (the last
        count's plan, over the budget, as the least bad; ``PlanningTimeout`` where the last count
        had none), or at one row per microbatch (the last plan, or ``InfeasibleError``).
        """
        k = fewest_at_least(self.rows, max(2.0, BOUND_SLACK * _shrink_needed(least, floor, whole.budget)))
        fewest = fewest_at_least(self.rows, max(2.0, _shrink_needed(least, floor, whole.budget)))   # if the bound fit
        last: Plan | InfeasibleError | None = None   # the last count's plan (not fitting) or error
        while True:
            started = self.clock.spent
            try:
                last = self._plan_count(k, recompute)
            except PlanningTimeout:
                if isinstance(last, Plan):   # out of time planning k: the last count's plan is the least bad
                    return last
                raise
            if isinstance(last, Plan) and last.feasible:
                return self._fitted(last, k, fewest, recompute, least, started)
            if k == self.rows:   # one row per microbatch, and still nothing fits
                return self._least_bad(last, k)
            if self.deadline.passed():   # no time to try more
                self.clock.note(f"more than {k} microbatches (not tried)")
                return self._least_bad(last, k)
            k = fewest_at_least(self.rows, k * max(_more_microbatches(last, floor, whole.budget), 1.5))

    def _plan_count(self, k: int, recompute: RecomputeMode) -> Plan | InfeasibleError:
        """The plan in ``k`` microbatches, or why there is none (``PlanningTimeout`` where the
        deadline stops it)."""
        try:
            return self._plan(self._prepare(k, recompute))
        except InfeasibleError as e:
            return e

    def _fitted(self, plan: Plan, k: int, fewest: int, recompute: RecomputeMode, least: float, started: float) -> Plan:
        """``plan`` (``k`` microbatches, the first count that fits) made faster in fewer microbatches
        (down to ``fewest``) or with less recomputation where either still fits, saying why
        microbatches were needed (the whole batch needs ``least`` bytes)."""
        plan = self._fewer(plan, k, fewest, recompute, self.clock.spent - started)
        plan = self._lighter(plan, plan.microbatches, recompute, self.clock.spent - started)
        plan.solver["microbatches"] = (f"the whole batch needs at least {fmt(least, 'B')} per device; "
                                       f"{plan.microbatches} microbatches of {self.rows // plan.microbatches} "
                                       "rows fit")
        return plan

    def _least_bad(self, last: Plan | InfeasibleError, k: int) -> Plan:
        """The last count's plan (over the budget), or the error of the last count where it had none."""
        if isinstance(last, Plan):
            return last
        raise InfeasibleError(f"{last} Microbatches were tried up to {k} (of {self.rows // k} rows each).",
                              min_memory_bytes=last.min_memory_bytes) from None

    def _fewer(self, plan: Plan, k: int, fewest: int, recompute: RecomputeMode, attempt_s: float) -> Plan:
        """``plan`` (``k`` microbatches, fitting), or a faster one in fewer microbatches (about
        half as many each time, down to ``fewest``, where the bound itself fits): larger
        microbatches run more efficiently, as long as the plan need not shard harder to fit them."""
        def counts() -> Iterator[Planning]:
            count = k
            while (smaller := fewest_at_least(self.rows, max(fewest, count / 2))) < count:
                yield self._prepare(smaller, recompute)
                count = smaller
        return self._while_faster(plan, counts(), attempt_s)

    def _lighter(self, plan: Plan, k: int, recompute: RecomputeMode, attempt_s: float) -> Plan:
        """``plan`` (``k`` microbatches, every block recomputed), or a faster one that recomputes
        only the first half of those blocks, then the first quarter, ...: a block not recomputed
        runs its forward once. The first blocks are kept recomputed: their activations wait
        longest for their backward. Only where the options leave recomputation to the planner."""
        total = len(plan.recompute)
        if recompute != "full" or self.options.recompute != "auto" or not plan.feasible:
            return plan

        def halves() -> Iterator[Planning]:
            blocks = total
            while blocks > 1:
                blocks //= 2
                yield self._prepare(k, recompute_modes(self.captured.graph, "full", blocks))
        plan = self._while_faster(plan, halves(), attempt_s)
        if len(plan.recompute) < total:
            plan.solver["recompute_blocks"] = (f"{len(plan.recompute)} of {total} blocks recomputed: the first ones, "
                                               "enough to fit (each block left out runs its forward once)")
        return plan

    def _while_faster(self, plan: Plan, problems: Iterator[Planning], attempt_s: float) -> Plan:
        """``plan`` (fitting), or the plan of the last of ``problems`` (each prepared on demand)
        while each fits and is faster than the one before, and one more attempt (the last took
        ``attempt_s``) fits in the time left. A plan is in hand: a problem that cannot fit or
        finds no plan in time ends the search."""
        while True:
            if not self.deadline.affords(attempt_s):
                self.clock.note(f"plans beyond {plan.microbatches} microbatch(es), {len(plan.recompute)} blocks "
                                "recomputed (not tried)")
                return plan
            started = self.clock.spent
            try:
                problem = next(problems, None)
                if problem is None:
                    return plan
                other = self._plan(problem)
            except (InfeasibleError, PlanningTimeout):
                return plan
            attempt_s = self.clock.spent - started
            if not other.feasible or other.predicted.step_time_s >= plan.predicted.step_time_s:
                return plan
            plan = other

    def _whole(self, recompute: RecomputeMode) -> Planning:
        return self._prepare(1, recompute)

    def _prepare(self, k: int, recompute: RecomputeMode | dict[str, RecomputeMode]) -> Planning:
        """The planning problem of one of ``k`` microbatches (the captured batch itself for k = 1),
        from the call's ``problems`` where built before, else begun only where the search's
        deadline affords what it needs (``_affords_build``; else ``PlanningTimeout``): what is
        built past the search's share is taken from what follows it (the pipeline's time)."""
        key = self.problems.key(self.captured, self.mesh, self.options, k, recompute, self.offload, self.forced)
        if (planning := self.problems.get(key)) is not None:
            return planning
        captured = self.captured if k == 1 else None
        if captured is None and self.recapture is not None and k in self.recapture.done:
            captured = self.recapture.done[k]
        by = self._affords_build(k, captured is not None)
        if captured is None:
            captured = self.recapture(k, by)   # recomputation modes share it
        space = self.problems.space(captured, self.mesh) if not self.forced else None
        planning = prepare(captured, self.mesh, self.options, forced=self.forced, microbatches=k,
                           whole=self.captured if k > 1 else None, recompute=recompute, offload=self.offload,
                           space=space, clock=self.clock)   # charged there ("prepare": the estimate of the next)
        self.clock.add(planning.timings)
        if not self.forced:
            self.problems.keep_space(planning, self.mesh)
        return self.problems.put(key, planning)

    def new_problem_s(self, captured: bool, solve: bool = True) -> float:
        """Seconds a new problem likely takes: its capture (unless ``captured``), its build and
        (``solve``) a solve as long as that build, each kind as long as it last took."""
        build = self.clock.estimate("prepare")
        return (build * (1 + (SOLVE_PER_BUILD if solve else 0.0))
                + (0.0 if captured else self.clock.estimate("capture")))

    def _affords_build(self, k: int, captured: bool) -> Deadline:
        """The deadline a new problem of ``k`` microbatches is built by, where it affords its
        capture (unless ``captured``) and build, each as long as the last of its kind took (else
        ``PlanningTimeout``): the call's while the search has no plan that fits (what the call
        needs first); once it has one, the search's own, with a solve as long as the build too
        (``SOLVE_PER_BUILD``): a problem built with no time left to solve it is time taken from
        what follows. GPT-3 175B on 128x8 under load captured and built 6 microbatches' problem
        in 18 s, had 0.25 s to solve it, and the pipeline was then not weighed for want of time."""
        needed = self.new_problem_s(captured, solve=self.planned)
        within = self.within if self.planned else self.clock.deadline()
        if not within.affords(needed):
            raise PlanningTimeout(f"no time was left to build and solve the problem of {k} microbatch(es) "
                                  f"(about {needed:.1f} s)")
        return within

    def _plan(self, planning: Planning) -> Plan:
        before = dict(planning.timings)
        try:
            plan = _plan(planning, self.options, self.forced, self.deadline)
            self.planned = self.planned or plan.feasible
            return plan
        finally:
            self.clock.add({k: v - before.get(k, 0.0) for k, v in planning.timings.items()})


#: Seconds of solving a new planning problem must leave room for, per second its build took: the
#: build and HiGHS's first LP grow together (GPT-3 175B on 128x8: a 2.5-4 s build, a 4 s first LP).
SOLVE_PER_BUILD = 1.0
#: Share of the time left that the plan without a pipeline may use where "auto" weighs one too.
#: At the scale where pipelines are weighed both searches need time: one stage plan of Llama-2 70B
#: on 16x8 takes a microbatch's capture (6 s) and an ILP build (9 s) before it solves, and GPT-3
#: 175B at 1536 x 2048 on 128x8 A100 gets 21.0 s a step from the plan without in 60% of 60 s, 19.4 s
#: from a pipeline of 32 stages.
SPMD_SHARE = 0.5
#: The least share of the time limit left after it for which the pipeline is weighed at all.
MIN_PIPELINE_SHARE = 0.25


#: Share of the time left that recomputation, priced first where both modes compete, may use: its
#: plan usually wins, and its solve is the one worth the time (Llama-2 70B on 16x8: 24.9 s a step
#: with 6 s of solving, 33.7 s with 3 s).
FIRST_MODE_SHARE = 0.6


#: How many times the least-memory bound the first microbatch count leaves room for. At the edge
#: of the budget only heavily sharded plans fit and the solver struggles to find them: GPT-3 175B
#: at 1536 x 2048 on 128x8 A100 in 4 microbatches (the bound at half the room) ended 0.2 GiB over
#: the budget at a predicted 10% MFU; at 2.5x it plans in 6 microbatches at 24%
#: (benchmarks/realistic_plans.py).
BOUND_SLACK = 2.5


def _more_microbatches(last: Plan | InfeasibleError, floor: float, budget: float) -> float:
    """By how much to multiply the microbatch count after a count whose plan did not fit
    (``last``) or that had none: the shrink its peak needs, twice that of its least memory."""
    if isinstance(last, InfeasibleError):
        return _shrink_needed(last.min_memory_bytes, floor, budget) * 2
    at_peak = last.predicted.memory_breakdown
    return _shrink_needed(last.predicted.peak_memory_bytes, at_peak.get("state", 0.0) + at_peak.get("gradients", 0.0),
                          budget)


def _shrink_needed(needed: float, fixed: float, budget: float) -> float:
    """By how much what shrinks with the microbatch must shrink for ``needed`` bytes to fit in 90%
    of ``budget`` beside ``fixed`` bytes that do not shrink."""
    return (needed - fixed) / max(0.9 * budget - fixed, 1.0)


def _plan(planning: Planning, options: PlanOptions, forced: dict[str, Strategy] | None,
          deadline: Deadline) -> Plan:
    """The auto plan of one planning problem: the solver's, or the best hand plan it does not beat
    (kept unsolved where no time was left to solve). Where no plan can fit the budget, the solver
    says so at once: no hand plan is worth costing."""
    hopeless = planning.budget is not None and planning.bounds().least() > planning.budget
    hands = (standard_plans(planning, deadline=deadline, cost_unfit=False)
             if options.hand_plans and not forced and not hopeless else {})
    fitting = [h for h in hands.values() if not isinstance(h, InfeasibleError) and h[0].feasible]
    best = min(fitting, key=lambda h: h[0].predicted.step_time_s, default=None)
    try:
        plan, _ = solve_planning(planning, deadline=deadline, warm_start=best[1] if best else None)
    except PlanningTimeout:
        if best is None:
            raise
        deadline.clock.note(f"the auto solve (not begun: keeping the hand plan {best[0].name!r})")
        plan = replace(best[0], name="auto", solver={"status": "not solved: no time was left",
                                                     "kept_hand_plan": best[0].name})
    else:
        if best is not None and (not plan.feasible or
                                 plan.predicted.step_time_s > (1 - options.min_gain) * best[0].predicted.step_time_s):
            plan = _renamed(best[0], "auto", plan, options.min_gain)
    if hands:
        plan.solver["warm_start"] = best[0].name if best else None
        plan.solver["hand_plans"] = {name: _summary(h) for name, h in hands.items()}
    return plan


def _summary(hand: tuple[Plan, tuple[int, ...]] | InfeasibleError) -> HandPlanSummary:
    """A hand plan as the auto plan lists it: its predicted step and peak, or the least memory any
    plan of its family needs where none fits."""
    if isinstance(hand, InfeasibleError):
        return {"feasible": False, "least_memory_bytes": hand.min_memory_bytes}
    plan = hand[0]
    return {"step_time_s": plan.predicted.step_time_s, "peak_memory_bytes": plan.predicted.peak_memory_bytes,
            "feasible": plan.feasible}


def _renamed(hand: Plan, name: str, solved: Plan, min_gain: float) -> Plan:
    """The hand plan, kept as the auto plan because the solver's plan does not fit the budget or
    is not predicted faster by ``min_gain`` under the exact schedule."""
    gain = 1 - solved.predicted.step_time_s / hand.predicted.step_time_s
    than = (f"as fast as {hand.name!r}" if abs(gain) < 5e-4 else
            f"{abs(gain):.1%} {'faster' if gain > 0 else 'slower'} than {hand.name!r}")
    why = (f"exceeds the memory budget by {fmt(solved.shortfall_bytes, 'B')}" if not solved.feasible else
           f"({fmt(solved.predicted.step_time_s, 's')}) was predicted {than} ({fmt(hand.predicted.step_time_s, 's')}) "
           f"under the exact schedule, not the {min_gain:.0%} (min_gain) worth leaving a standard plan for")
    note = f"the solver's plan {why}: keeping the hand plan {hand.name!r}"
    return replace(hand, name=name, warnings=[*hand.warnings, note], solver={**solved.solver, "kept_hand_plan": hand.name})

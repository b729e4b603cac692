"""``PlanOptions``: everything that steers planning, declared once. ``autopar.plan``,
``autopar.compile``, ``autopar.planning.baselines.candidates`` and the ``autopar plan`` command
all take these fields by name (``plan(model, mesh, x, memory_budget=...)``) or as one object
(``options=PlanOptions(...)``). Each field carries its doc and how the command line takes it
(``Flag``): ``autopar plan``'s flags and their help are built from them."""
from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

from autopar.core.blocks import RECOMPUTE, RecomputeMode
from autopar.core.errors import AutoparError
from autopar.core.hardware import get_hardware
from autopar.core.microbatch import check_microbatches
from autopar.core.precision import Precision, check_precision
from autopar.planning.context import ContextChoice, context_choice, context_from_text
from autopar.planning.pipeline import PipelineChoice, pipeline_choice
from cost_models.estimate import OPTIMIZERS, get_optimizer
from cost_models.profile import Profile

#: Seconds planning may take (capture, hand plans and the auto plan together) by default.
DEFAULT_TIME_LIMIT_S = 60.0
#: The solver's plan replaces the best fitting hand plan only when predicted at least this much
#: faster: a smaller gain is inside the cost model's own error (``benchmarks/cost_accuracy.py``),
#: and there the standard plan is the safer choice (measured: auto plans predicted 4% faster than
#: DDP ran 11-13% slower on the CPU mesh).
MIN_GAIN = 0.05
#: ``PlanOptions.offload``'s values.
Offload = Literal["auto", "none", "optimizer"]
OFFLOAD: tuple[Offload, ...] = get_args(Offload)
#: ``PlanOptions.recompute``'s values: a mode of ``Plan.recompute``, or "auto".
Recompute = Literal["auto", RecomputeMode]
#: ``PlanOptions.expert_parallel``'s values: "auto", False, or a dict forcing the experts' layout:
#: ``{"axis": name}`` (by expert), ``{"within": name}`` (within each expert), or both.
ExpertParallel = Literal["auto", False] | dict[str, str]
#: ``PlanOptions.microbatches``' values: a count, or "auto".
Microbatches = int | Literal["auto"]


#: ``Flag.default`` where the command line's default is the field's.
AS_FIELD: Any = object()


@dataclass(frozen=True)
class Flag:
    """How ``autopar plan`` takes a ``PlanOptions`` field (``autopar.cli``); its help is the
    field's doc, then ``note``, then its default."""

    name: str = ""                                  # default: "--" and the field's name, dashed
    type: Callable[[str], Any] | None = None        # the text's conversion (default: a float field's float)
    to_option: Callable[[Any], Any] | None = None   # the converted value (not None) -> the field's value
    choices: tuple = ()                             # default: the values of a Literal field
    default: Any = AS_FIELD                         # where the command line's differs from the field's
    default_text: str = ""                          # the help's default, where the value alone does not say it
    metavar: str | None = None
    note: str = ""                                  # what the command line changes: a unit, a spelling

    def flag_name(self, f: Field) -> str:
        """The flag: ``name``, else ``--`` and the field's name (``--no-`` for a switch that
        turns off a field True by default)."""
        return self.name or ("--no-" if f.default is True else "--") + f.name.replace("_", "-")


#: A field on the command line under its own name (``Flag``'s defaults).
ON_COMMAND_LINE = Flag()


def _option(default: Any, doc: str, flag: Flag | None = ON_COMMAND_LINE) -> Any:
    """A ``PlanOptions`` field: its default, its doc (shown by ``help(PlanOptions)`` and as its
    command-line help) and how ``autopar plan`` takes it (None: not on the command line)."""
    return field(default=default, metadata={"doc": doc, "flag": flag})


def _gib_to_bytes(gib: float) -> float:
    return gib * 2**30


def _profile_from_text(text: str) -> str | None:
    """``--profile``: auto, a profile file, or none (None: the roofline presets only)."""
    return None if text == "none" else text


def _count(text: str) -> int:
    """``--microbatches``: a count (the options refuse one below 1)."""
    try:
        return int(text)
    except ValueError:
        raise AutoparError(f"--microbatches is 'auto' or a count, got {text!r}") from None


def _microbatches_from_text(text: str) -> Microbatches:
    """``--microbatches``: auto, or a count."""
    return "auto" if text == "auto" else _count(text)


def _expert_parallel_from_text(text: str) -> ExpertParallel:
    """``--expert-parallel``: auto, none, or the mesh axis to split the experts over by expert
    (``AXIS``), within each expert (``within:AXIS``), or both (``AXIS,within:AXIS``)."""
    if text in ("auto", "none"):
        return "auto" if text == "auto" else False
    parts = [t.strip() for t in text.split(",")]
    return {("within" if t.startswith("within:") else "axis"): t.removeprefix("within:") for t in parts}


def check_expert_parallel(value: Any) -> None:
    """Refuse an ``expert_parallel`` that is not "auto", False or a dict naming the mesh axis to
    split the experts over by expert (``axis``), within each expert (``within``), or both."""
    if value == "auto" or value is False:
        return
    if not (isinstance(value, dict) and value and set(value) <= {"axis", "within"}
            and all(isinstance(v, str) for v in value.values()) and len(set(value.values())) == len(value)):
        raise AutoparError(f"expert_parallel is 'auto', False, or {{'axis': name}} naming the mesh axis to split "
                           "the experts over by expert, {'within': name} the axis to split each expert within, or "
                           f"both (two different axes); got {value!r}")


#: ``PlanOptions.expert_skew``: one factor, "measured" on the example batch, or per expert-axis
#: size (what "measured" becomes once measured: ``autopar.core.routing``).
ExpertSkew = float | Literal["measured"] | dict[int, float]


def _skew_from_text(text: str) -> ExpertSkew:
    """``--expert-skew``: a factor, or measured."""
    if text == "measured":
        return "measured"
    try:
        return float(text)
    except ValueError:
        raise AutoparError(f"--expert-skew is a factor (>= 1.0) or 'measured', got {text!r}") from None


def check_expert_skew(value: Any) -> None:
    """Refuse an ``expert_skew`` that is not a factor >= 1, "measured", or such factors by axis size."""
    factors = value.values() if isinstance(value, dict) else [value]
    if value == "measured" or (all(isinstance(f, (int, float)) and not isinstance(f, bool) and f >= 1.0 for f in factors)
                               and (not isinstance(value, dict) or all(isinstance(n, int) for n in value))):
        return
    raise AutoparError(f"expert_skew is the busiest rank's routed rows over the mean (>= 1.0), 'measured', or such "
                       f"factors by expert-axis size; got {value!r}")


def _pipeline_from_text(text: str) -> str | bool | dict:
    """``--pipeline``: auto, none, or SCHEDULE[:AXIS[:MICROBATCHES[:STAGES_PER_RANK]]]."""
    if text in ("auto", "none"):
        return text
    parts = text.split(":")
    keys = ("axis", "microbatches", "virtual_stages")
    if len(parts) > 1 + len(keys):
        raise AutoparError(f"--pipeline takes at most SCHEDULE:AXIS:MICROBATCHES:STAGES_PER_RANK, got {text!r} "
                           f"({len(parts)} fields); drop the extra ones")
    fields: dict = {"schedule": parts[0]}
    for key, value in zip(keys, parts[1:], strict=False):
        fields[key] = value if key == "axis" or value == "auto" else _count(value)
    return fields


@dataclass(frozen=True)
class PlanOptions:
    """How to plan; every field is documented on its own below (``help(PlanOptions)``)."""

    memory_budget: float | None = _option(
        None, "Bytes per device a plan may hold (None: the hardware's memory).",
        Flag(name="--memory-budget-gib", type=float, to_option=_gib_to_bytes, default_text="the hardware's memory",
             note="Given in GiB here."))
    time_limit: float | None = _option(
        DEFAULT_TIME_LIMIT_S,
        "Seconds for planning (``autopar.plan``'s capture of the model included), after which the best plan "
        "found is returned with its optimality gap (None: solve to optimality).")
    deterministic: bool = _option(
        False, "Spend ``time_limit`` as seconds charged by the size of the search's work "
        "(``autopar.planning.work``), not as wall-clock seconds: the same call gives the same plan on any host "
        "and at any load (unless the wall clock runs out first, which the plan says). On the host the rates "
        "were fitted on it ends after about half to two thirds of the limit, so large models (Llama-2 70B, "
        "GPT-3 175B at 60 s) get a less searched plan: raise ``time_limit`` with it.")
    profile: Profile | str | Path | None = _option(
        "auto",
        "Measured costs of this host (``autopar profile``): \"auto\" uses the cached one when it matches the "
        "mesh, a path or ``Profile`` that one, None the roofline presets only (the plan's "
        "``predicted.cost_source`` says which were used).",
        Flag(to_option=_profile_from_text, note="Here: auto, a profile JSON file, or none."))
    optimizer: str = _option(
        "adamw", f"The optimizer whose states count in memory (one of {', '.join(OPTIMIZERS)}).",
        Flag(choices=tuple(OPTIMIZERS)))
    share_layers: bool = _option(
        True, "Let identical inner layers share decisions (``autopar.planning.shrink``), not every layer choose "
        "on its own (slower to solve).")
    hand_plans: bool = _option(
        True, "Cost the standard strategies (DDP, FSDP, Megatron TP...: ``autopar.planning.baselines``) first "
        "and warm-start from the best that fits; the plan's ``solver[\"hand_plans\"]`` lists them.")
    min_gain: float = _option(
        MIN_GAIN, "The solver's plan is returned only if predicted at least this fraction faster than the best "
        "fitting hand plan (else that hand plan, saying so).")
    gather_outputs: bool = _option(
        True, "The compiled module returns every output whole on every rank, as the single-device model does: "
        "an evenly split output (the logits) is gathered when first read, by every rank alike, and not priced "
        "in the step; an uneven or partial one is gathered in the forward, priced (``autopar.core.launched``). "
        "False returns them as DTensors placed as the plan leaves them (``.full_tensor()`` gathers one).",
        Flag(name="--sharded-outputs"))
    measure_missing_ops: bool = _option(
        True, "When ``compile`` plans on a live mesh with a profile of this host, first time the model's op "
        "calls (at every candidate strategy's local shapes) that the profile lacks, on every rank at once, and "
        "add them to it (saved to its file; a ``Profile`` object is only updated in memory), so a model the "
        "profile was not taken for is planned on measured costs, not the roofline "
        "(``autopar.profiling.missing_ops``); with ``profile=\"auto\"`` and no profile of this host cached, it "
        "first measures one (the mesh's collectives and the runtime's overheads: ``measure_host``; "
        "``AUTOPAR_MEASURE_FIRST_PROFILE=0`` turns that off); False plans on the profile as it is (or the "
        "roofline, which the plan then says). ``autopar.plan`` measures nothing (its mesh need not exist).",
        None)
    precision: Precision = _option(
        "fp32", "The compute dtype: \"fp32\", or \"bf16\" to compute in bf16 with fp32 parameters, gradients "
        "and optimizer states (``autopar.core.precision``).",
        Flag(default=None, default_text="bf16 on GPU presets, fp32 on cpu"))
    reduce_precision: Precision = _option(
        "fp32", "The dtype gradients are summed over ranks in (FSDP2's ``reduce_dtype``): \"fp32\" (each "
        "gradient in its own dtype), or \"bf16\" for half the bytes of fp32 gradients: each rank's gradient and "
        "the sum rounded to bf16 (the gradient handed to the optimizer is fp32).")
    microbatches: Microbatches = _option(
        "auto", "Gradient accumulation: the global batch (the example inputs' rows) run as this many equal "
        "microbatches a step (``ShardedModule.train_step``; a count that divides the batch), or \"auto\": the "
        "whole batch if a plan fits it, else the fewest microbatches that fit.",
        Flag(to_option=_microbatches_from_text))
    recompute: Recompute = _option(
        "auto", "Activation recomputation of the repeated blocks (transformer layers): \"none\", \"selective\" "
        "(each block's attention core, from the query-key product to the probability-value product, runs again "
        "in the backward: its attention-matrix-sized activations are not kept; blocks computing attention with "
        "SDPA have none, their kernel keeps no attention matrix), \"full\" (each block keeps only its input and "
        "runs its forward again in the backward), or \"auto\": where the whole batch needs microbatches, full "
        "and the lighter mode (selective where the model has attention cores, else none) priced and the faster "
        "plan kept, else the modes tried lightest first, each only where nothing fits with the ones before.")
    offload: Offload = _option(
        "auto", "\"optimizer\" keeps the shard, gradient and optimizer states of every parameter the plan "
        "stores split and gathers to use (ZeRO-2/3) in host memory, the optimizer stepping them there (FSDP2's "
        "``CPUOffloadPolicy``, ZeRO-Offload); \"auto\" does so only where no plan fits the device without it "
        "and the hardware has host memory of its own (``Hardware.host_bandwidth``); \"none\" never.")
    pipeline: bool | str | PipelineChoice | dict = _option(
        "auto", "Pipeline parallelism over a mesh axis (``autopar.planning.pipeline``): \"auto\" lets the "
        "planner weigh stages over the first axis of a mesh of two or more against the plans without (kept "
        "where predicted faster by ``min_gain``), False never; a ``PipelineChoice`` (or a dict of its fields, "
        "or a schedule's class name) makes the plan a pipeline with the axis, schedule, microbatches and stages "
        "per rank it names (its \"auto\" fields chosen by the planner).",
        Flag(to_option=_pipeline_from_text, metavar="auto|none|SCHEDULE[:AXIS[:MICROBATCHES[:STAGES]]]",
             note="Here: auto, none, or a torch.distributed.pipelining schedule class (Schedule1F1B, "
                  "ScheduleInterleaved1F1B, ...) with the axis carrying the stages, the microbatches and the "
                  "stages per rank."))
    context_parallel: Literal["auto", False] | ContextChoice | dict = _option(
        "auto", "Context parallelism: attention split by sequence over a mesh axis, keys and values passed "
        "around a ring (\"ring\") or regrouped by heads with all-to-alls (\"ulysses\"), the rest of the model "
        "split by sequence with it (``autopar.core.context_parallel``). \"auto\" lets the search weigh it "
        "where the model has attention that can be split so (self-attention, causal or unmasked, no dropout); "
        "False never; a ``ContextChoice`` (or a dict ``{\"axis\": AXIS, \"kind\": \"ring\" | \"ulysses\"}``) "
        "makes every attention that can be split so use that kind on that mesh axis, and is refused, saying "
        "why, where none can (``autopar.planning.context``).",
        Flag(to_option=context_from_text, metavar="auto|none|KIND:AXIS",
             note="Here: auto, none, or ring:AXIS / ulysses:AXIS (a mesh axis name)."))
    expert_parallel: ExpertParallel = _option(
        "auto", "Expert parallelism for mixture-of-experts layers (``autopar.core.ops.moe``): each rank of a "
        "mesh axis holds E/n of a layer's experts and tokens go to their experts' ranks and back by all-to-all. "
        "\"auto\" lets the planner weigh it against the other strategies of each layer, False never uses it, "
        "``{\"axis\": name}`` splits every such layer's experts over that axis, ``{\"within\": name}`` splits "
        "each expert's intermediate dimension over that axis (expert tensor parallelism: a partial sum), both "
        "keys do both, and a dict allows nothing else (``Plan.expert_parallel`` says what was chosen).",
        Flag(to_option=_expert_parallel_from_text, metavar="auto|none|AXIS|within:AXIS|AXIS,within:AXIS",
             note="Here: auto, none, the mesh axis to split the experts over, within:AXIS to split each "
                  "expert within, or both."))
    expert_skew: ExpertSkew = _option(
        1.0, "The router's token imbalance, priced where experts are split by expert: the busiest rank of the "
        "expert axis receives this many times the mean of the rows routed (1.0: uniform routing). Its "
        "experts' GEMMs, all-to-alls and dispatched rows are priced that much larger: give a value from a "
        "training run (the most rows any rank of the axis received over the mean), or \"measured\": the "
        "router run once on the model's own weights and the example inputs, per expert-axis size "
        "(``autopar.core.routing``; not for a model on meta).",
        Flag(to_option=_skew_from_text, type=str, metavar="X|measured"))
    progress: bool = _option(
        True, "While planning, a status line on stderr says what runs, for how long and what is left of "
        "``time_limit`` (rank 0, where stderr is a terminal, unless the environment sets "
        "``AUTOPAR_PROGRESS=0``: ``autopar.core.progress``); False draws none.",
        None)

    def __post_init__(self) -> None:
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise AutoparError(f"memory_budget is bytes per device (> 0) or None, got {self.memory_budget!r}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise AutoparError(f"time_limit is seconds (> 0) or None for no limit, got {self.time_limit!r}")
        if not 0 <= self.min_gain < 1:
            raise AutoparError(f"min_gain is a fraction of the best hand plan's step time in [0, 1), got {self.min_gain!r}")
        get_optimizer(self.optimizer)   # an unknown name raises, listing the known ones
        check_precision(self.precision)
        check_precision(self.reduce_precision)
        check_microbatches(self.microbatches)
        if self.recompute not in ("auto", *RECOMPUTE):
            raise AutoparError(f"recompute is 'auto', {', '.join(map(repr, RECOMPUTE))}, got {self.recompute!r}")
        if self.offload not in OFFLOAD:
            raise AutoparError(f"offload is {', '.join(map(repr, OFFLOAD))}, got {self.offload!r}")
        pipeline_choice(self.pipeline)
        context_choice(self.context_parallel)
        check_expert_parallel(self.expert_parallel)
        check_expert_skew(self.expert_skew)

    def device_budget(self, hardware: str) -> float:
        """Bytes per device a plan may hold: ``memory_budget``, else the memory of ``hardware``'s preset."""
        return float(self.memory_budget) if self.memory_budget is not None else float(get_hardware(hardware).memory_bytes)

    @classmethod
    def of(cls, options: PlanOptions | None = None, **values: Any) -> PlanOptions:
        """``options`` (default: all defaults) with ``values`` replaced; an unknown name is refused."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise AutoparError(f"unknown planning option(s) {', '.join(unknown)}; the options are {', '.join(names)}")
        return replace(options or cls(), **values)


def option_flags() -> list[tuple[Field, Flag]]:
    """The ``PlanOptions`` fields ``autopar plan`` takes, each with its ``Flag``, in field order."""
    return [(f, f.metadata["flag"]) for f in fields(PlanOptions) if f.metadata["flag"] is not None]


def field_doc(f: Field) -> str:
    """A ``PlanOptions`` field's doc."""
    return f.metadata["doc"]


def _with_field_docs(doc: str) -> str:
    """``doc`` followed by each field, its default and its doc: what ``help(PlanOptions)`` shows."""
    items = [f"{f.name} (default {f.default!r})\n" + textwrap.fill(field_doc(f), 92, initial_indent="    ",
                                                                   subsequent_indent="    ")
             for f in fields(PlanOptions)]
    return doc + "\n\n" + "\n\n".join(items) + "\n"


PlanOptions.__doc__ = _with_field_docs(PlanOptions.__doc__ or "")

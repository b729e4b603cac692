"""``PlanOptions``: everything that steers planning, declared once. ``autopar.plan``,
``autopar.compile``, ``autopar.planning.baselines.candidates`` and the ``autopar plan`` command
all take these fields by name (``plan(model, mesh, x, memory_budget=...)``) or as one object
(``options=PlanOptions(...)``)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from autopar.core.blocks import RECOMPUTE
from autopar.core.errors import AutoparError
from autopar.core.hardware import get_hardware
from autopar.core.microbatch import check_microbatches
from autopar.core.precision import check_precision
from autopar.planning.pipeline import PipelineChoice, pipeline_choice
from cost_models.estimate import get_optimizer
from cost_models.profile import Profile

#: Seconds planning may take (capture, hand plans and the auto plan together) by default.
DEFAULT_TIME_LIMIT_S = 60.0
#: The solver's plan replaces the best fitting hand plan only when predicted at least this much
#: faster: a smaller gain is inside the cost model's own error (``benchmarks/cost_accuracy.py``),
#: and there the standard plan is the safer choice (measured: auto plans predicted 4% faster than
#: DDP ran 11-13% slower on the CPU mesh).
MIN_GAIN = 0.05
#: ``PlanOptions.offload``'s values.
OFFLOAD = ("auto", "none", "optimizer")


@dataclass(frozen=True)
class PlanOptions:
    """How to plan.

    ``memory_budget``: bytes per device (None: the hardware's memory). ``time_limit``: seconds for
    planning (``autopar.plan``'s capture of the model included), after which the best plan found
    is returned with its optimality gap (None: solve to optimality). ``profile``: measured costs of this host (``autopar profile``); ``"auto"`` uses
    the cached one when it matches the mesh, a path or ``Profile`` that one, None the roofline
    presets only (the plan's ``predicted.cost_source`` says which were used). ``optimizer``:
    "adamw", "adam", "sgd" or "sgd-momentum" (its states count in memory). ``share_layers``: let
    identical inner layers share decisions (``autopar.planning.shrink``). ``hand_plans``: cost the
    standard strategies first (``autopar.planning.baselines``) and warm-start from the best that
    fits; the plan's ``solver["hand_plans"]`` lists them. ``min_gain``: the solver's plan is
    returned only if predicted at least this fraction faster than the best fitting hand plan
    (else that hand plan, saying so). ``gather_outputs``: the compiled module returns every output
    whole on every rank, as the single-device model does (priced: a gather per split output,
    launched in the forward, waited for where read: ``codegen.outputs``); False returns them as
    DTensors placed as the plan leaves them (``.full_tensor()`` gathers one): no gather of batch x
    sequence x vocabulary logits, and no plan bent to make that gather small. ``measure_missing_ops``: when
    ``compile`` plans on a live mesh with a profile of this host, first time the model's op calls
    (at every candidate strategy's local shapes) that the profile lacks, on every rank at once,
    and add them to it (saved to its file; a ``Profile`` object is only updated in memory), so a
    model the profile was not taken for is planned on measured costs, not the roofline
    (``autopar.profiling.missing_ops``); with ``profile="auto"`` and no profile of this host
    cached, it first measures one (the mesh's collectives and the runtime's overheads:
    ``measure_host``; ``AUTOPAR_MEASURE_FIRST_PROFILE=0`` turns that off); False plans on the
    profile as it is (or the roofline, which the plan then says). ``autopar.plan`` measures
    nothing (its mesh need not exist). ``precision``: "fp32", or "bf16" to compute in
    bf16 with fp32 parameters, gradients and optimizer states (``autopar.core.precision``).
    ``reduce_precision``: the dtype gradients are summed over ranks in (FSDP2's ``reduce_dtype``):
    "fp32" (each gradient in its own dtype), or "bf16" for half the bytes of fp32 gradients: each
    rank's gradient and the sum rounded to bf16 (the gradient handed to the optimizer is fp32).
    ``microbatches``: gradient accumulation, the global batch (the example inputs' rows) run as
    this many equal microbatches a step (``ShardedModule.train_step``; a count that divides the
    batch), or "auto": the whole batch if a plan fits it, else the fewest microbatches that fit.
    ``recompute``: activation recomputation of the repeated blocks (transformer layers): "none",
    "selective" (each block's attention core, from the query-key product to the probability-value
    product, runs again in the backward: its attention-matrix-sized activations are not kept;
    blocks computing attention with SDPA have none, their kernel keeps no attention matrix),
    "full" (each block keeps only its input and runs its forward again in the backward), or
    "auto": where the whole batch needs microbatches, full and the lighter mode (selective where
    the model has attention cores, else none) priced and the faster plan kept, else the modes
    tried lightest first, each only where nothing fits with the ones before. ``offload``: "optimizer" keeps the shard, gradient
    and optimizer states of every parameter the plan stores split and gathers to use (ZeRO-2/3) in
    host memory, the optimizer stepping them there (FSDP2's ``CPUOffloadPolicy``, ZeRO-Offload);
    "auto" does so only where no plan fits the device without it and the hardware has host memory
    of its own (``Hardware.host_bandwidth``); "none" never. ``pipeline``: pipeline parallelism
    over a mesh axis (``autopar.planning.pipeline``): "auto" lets the planner weigh stages over the
    first axis of a mesh of two or more against the plans without (kept where predicted faster by
    ``min_gain``), False never; a ``PipelineChoice`` (or a dict of its fields, or a schedule's
    class name) makes the plan a pipeline with the axis, schedule, microbatches and stages per
    rank it names (its "auto" fields chosen by the planner). ``progress``: while planning, a status
    line on stderr says what runs, for how long and what is left of ``time_limit`` (rank 0, where
    stderr is a terminal, unless the environment sets ``AUTOPAR_PROGRESS=0``:
    ``autopar.core.progress``); False draws none.
    """

    memory_budget: float | None = None
    time_limit: float | None = DEFAULT_TIME_LIMIT_S
    profile: Profile | str | Path | None = "auto"
    optimizer: str = "adamw"
    share_layers: bool = True
    hand_plans: bool = True
    min_gain: float = MIN_GAIN
    gather_outputs: bool = True
    measure_missing_ops: bool = True
    precision: str = "fp32"
    reduce_precision: str = "fp32"
    microbatches: int | Literal["auto"] = "auto"
    recompute: str = "auto"
    offload: str = "auto"
    pipeline: bool | str | PipelineChoice | dict = "auto"
    progress: bool = True

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

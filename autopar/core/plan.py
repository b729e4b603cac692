"""``Plan``: the placement chosen for every node, with predicted costs; the contract between the
planner and the code generator, and what users read, save and reload.

Plans are JSON (versioned; never pickle) and round-trip exactly. A plan names the model
fingerprint and mesh it was made for, so it is never applied to another.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypedDict

from typing_extensions import NotRequired

from autopar.core.blocks import RecomputeMode
from autopar.core.errors import PlanFileError
from autopar.core.mesh import MeshSpec
from autopar.core.placements import Placements, parse_placement, placements_str
from autopar.core.precision import Precision
from autopar.core.report import format_report

if TYPE_CHECKING:
    from autopar.core.report_html import Interval

PLAN_FORMAT_VERSION = 11   # 5: precision; 6: microbatches, recompute; 7: reduce_precision; 8: offloaded, accumulated; 9: pipeline, sync_s;
                          # 10: pipeline.microbatch_fingerprint; 11: the parameters of each pipeline stage


@dataclass(frozen=True)
class NodePlan:
    """One graph node's chosen strategy and what it is predicted to cost per device."""

    name: str                         # graph node name (unique)
    op: str                           # ATen op, "parameter", "input", "buffer" or "output"
    layer: str                        # module path, e.g. "transformer.h.0.attn"
    strategy: str                     # rule names per axis, e.g. "batch x column"
    out: Placements                   # output placement per mesh axis
    ins: tuple[Placements, ...]       # placement each tensor input is redistributed to
    storage: Placements | None        # parameters: how they are stored (differs from out under ZeRO-3)
    fqn: str | None                   # parameter/buffer name
    compute_s: float                  # forward+backward compute time of this node
    comm_s: float                     # communication time charged to this node (incoming resharding, gradient sync)
    memory_bytes: float               # bytes this node holds per device (state + kept activations + gradients)
    saved_bytes: float = 0.0          # of which activations kept for the backward
    sync_s: float = 0.0               # of comm_s, gradient synchronisation queued during the backward (once a step)
    kept: bool = False                # parameters: ZeRO-1/2, the gathered copy kept from step to step
    accumulated: bool = False         # parameters: ZeRO-1, the gradient accumulated whole, reduce-scattered once a step
    offloaded: bool = False           # parameters: shard, gradient and optimizer states in host memory
    source: str = "roofline"          # where compute/comm figures came from: "measured", "roofline" or both

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out"] = placements_str(self.out)
        d["ins"] = [placements_str(p) for p in self.ins]
        d["storage"] = placements_str(self.storage) if self.storage is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodePlan":
        return cls(**{**d, "out": _parse(d["out"]), "ins": tuple(_parse(p) for p in d["ins"]),
                      "storage": _parse(d["storage"]) if d["storage"] is not None else None})


def _parse(text: str) -> Placements:
    inner = text.strip()[1:-1]
    return tuple(parse_placement(t.strip()) for t in inner.split(",") if t.strip())


#: Pipeline schedules whose ranks hold two stages in a V (rank r: stages r and 2 p - 1 - r).
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def rank_of_stage(schedule: str, stage: int, ranks: int, per_rank: int) -> int:
    """The pipeline rank holding ``stage``: stages go round the ranks in loops (interleaved and
    looped schedules), or in a V (rank r holds stages r and 2 ranks - 1 - r)."""
    if per_rank == 2 and schedule in V_SHAPED:
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks



@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the run of the model's repeated blocks it computes (the first stage also
    what comes before them, the embedding; the last what comes after, the head and the loss), its
    module paths for people, the parameters it holds, its predicted seconds per microbatch and its
    rank's peak memory per device."""

    blocks: tuple[int, int]           # [start, stop) of the repeated blocks (``autopar.core.blocks``)
    modules: tuple[str, ...]          # the module paths it runs, in order
    forward_s: float
    backward_s: float
    peak_memory_bytes: float
    parameters: tuple[str, ...] = ()  # names of the parameters it holds (a tied one: every stage reading it)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StagePlan":
        return cls(**{**d, "blocks": tuple(d["blocks"]), "modules": tuple(d["modules"]),
                      "parameters": tuple(d["parameters"])})


@dataclass(frozen=True)
class PipelinePlan:
    """Pipeline parallelism over one mesh axis: its ranks hold consecutive stages (several each
    under interleaved schedules), run by a ``torch.distributed.pipelining`` schedule (``schedule``,
    its class name) over ``num_microbatches`` microbatches a step. Every node's placement on
    ``axis`` is replicated: within a stage, the other axes carry the plan's SPMD placements."""

    axis: str
    schedule: str
    num_microbatches: int
    virtual_stages: int               # stages per rank
    stages: tuple[StagePlan, ...]
    bubble_fraction: float = 0.0      # predicted idle share of the busiest rank's step
    microbatch_fingerprint: str = ""  # of the model captured at one microbatch: what the stages run

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def ranks(self) -> int:
        """Ranks of the pipeline axis."""
        return self.num_stages // self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The pipeline rank holding ``stage``."""
        return rank_of_stage(self.schedule, stage, self.ranks, self.virtual_stages)

    def peak_rank(self) -> int:
        """The pipeline rank whose peak is the plan's (the first of the highest)."""
        peaks = {self.rank_of(s): stage.peak_memory_bytes for s, stage in enumerate(self.stages)}
        return max(sorted(peaks), key=peaks.__getitem__)

    def held_by(self, rank: int) -> set[str]:
        """The parameters pipeline rank ``rank`` holds (those of its stages)."""
        return {f for s, stage in enumerate(self.stages) if self.rank_of(s) == rank for f in stage.parameters}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PipelinePlan":
        return cls(**{**d, "stages": tuple(StagePlan.from_dict(s) for s in d["stages"])})


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of one training step (forward, backward, optimizer) on the worst device."""

    step_time_s: float
    peak_memory_bytes: float
    comm_bytes: dict[str, float]      # bytes sent per device, per mesh axis name
    compute_s: float
    comm_s: float                     # blocking communication
    memory_breakdown: dict[str, float]  # bytes live at the peak: state, activations, gradients, working
    overlapped_comm_s: float = 0.0    # gradient synchronisation queued during the backward
    exposed_comm_s: float = 0.0       # the part of it no backward compute hides (included in step_time_s)
    peak_at: str = ""                 # the moment of the peak, e.g. "backward: linear_8"
    cost_source: str = ""             # which costs were measured (profile) and which from the roofline
    basis: str = "roofline"           # what the step time rests on: a key of report.BASES
    band_low: float = 0.0             # the step, as validation runs of this basis found it, is between
    band_high: float = 0.0            # band_low and band_high times the prediction (0: no band known)
    model_flops: float = 0.0          # FLOPs of a step's forward and backward, all devices (3x the forward's)
    hardware_flops: float = 0.0       # the same with the forwards recomputed in the backward
    peak_flops: float = 0.0           # the devices' summed peak FLOP/s in the compute dtype

    @property
    def profiled(self) -> bool:
        """Were these costs priced with a measured profile (``cost_source`` names one)?"""
        return self.cost_source.startswith("profile ")

    @property
    def band_s(self) -> tuple[float, float] | None:
        """(low, high) seconds of the step, from the spread of validation runs on this basis; None
        where none is known (an uncalibrated roofline: a lower bound, not a prediction)."""
        if self.band_high <= 0:
            return None
        return self.step_time_s * self.band_low, self.step_time_s * self.band_high

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs over the devices' peak times the step (0: unknown)."""
        return self.model_flops / (self.peak_flops * self.step_time_s) if self.peak_flops * self.step_time_s else 0.0

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: as ``mfu``, counting the recomputed forwards."""
        return self.hardware_flops / (self.peak_flops * self.step_time_s) if self.peak_flops * self.step_time_s else 0.0


class HandPlanSummary(TypedDict, total=False):
    """A hand plan as ``SearchLog.hand_plans`` lists it: its prediction, or where no plan of its
    family fits, the least memory one needs (not costed)."""

    feasible: bool
    step_time_s: float
    peak_memory_bytes: float
    least_memory_bytes: float | None


class TimeLimitLog(TypedDict):
    """What ``time_limit`` did to the search (``SearchLog.time_limit``)."""

    limit_s: float | None     # the limit (None: none)
    wall_s: float             # the planning call's seconds
    charged_s: float          # what its work was charged (``autopar.planning.work``): the search's time
    reproducible: bool        # the search ended by its charged time, not the wall clock's hard stop
    cut_short: list[str]      # what the limit stopped or skipped


class SearchLog(TypedDict, total=False):
    """How a plan was found (``Plan.solver``): a JSON object, each key set by the step of the
    search that decided it; absent where that step did not run."""

    status: str               # the solver's: "optimal" (within its gap), "feasible" (a limit hit) or "not solved: ..."
    gap: float | None         # the proven relative optimality gap (None: unknown)
    variables: int            # the ILP's size
    constraints: int
    objective_s: float        # the solver's objective: the predicted step it minimised
    problem: str              # the problem solved: nodes, decisions, shared blocks (``Grouping.describe``)
    warm_start: str | None    # the hand plan the solver started from
    hand_plans: dict[str, HandPlanSummary]   # every hand plan costed, by name
    kept_hand_plan: str       # the hand plan returned because the solver's did not beat it by ``min_gain``
    time_limit: TimeLimitLog
    microbatches: str         # why the batch runs in microbatches
    recompute: str            # each recomputation mode priced, and the one kept
    recompute_blocks: str     # how many blocks are recomputed, and why those
    offload: str              # which parameters' states are in host memory, and why
    pipeline: str             # whether a pipeline was kept, and why
    pipelines: dict[str, str]  # each pipeline layout tried: its step and peak, or why there is none


@dataclass(frozen=True)
class ContextParallel:
    """Where a plan splits attention by sequence (context parallelism): the mesh axis, how
    ("ring" or "ulysses"; joined by "+" where its attentions differ), how the sequence is laid
    out over the axis's ranks ("contiguous": rank r holds the r-th block; "balanced": the
    head-tail halves r and 2n-1-r, equal causal work) and the attention nodes so split."""

    axis: str
    kind: str
    load_balance: str
    nodes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "nodes": list(self.nodes)}


class ExpertParallelPlan(TypedDict):
    """How a plan splits mixture-of-experts layers' experts (``Plan.expert_parallel``): by expert
    (``axis``), within each expert (``within``), or both."""

    axis: NotRequired[str]              # the mesh axis whose ranks each hold a slice of the experts
    experts_per_rank: NotRequired[int]  # E/n
    within: NotRequired[str]            # the mesh axis splitting each expert's intermediate dimension
    layers: int               # MoE layers split so
    of: int                   # MoE layers in all
    skew: NotRequired[float]  # the busiest rank's routed rows over the mean, priced (``PlanOptions.expert_skew``); absent: 1


@dataclass
class Plan:
    """The planner's answer: each node's chosen strategy (``nodes``) with its predicted costs, the
    predicted step (``predicted``), and how it was found (``solver``, ``timings``, ``warnings``).
    Made by ``autopar.plan`` (or a hand plan of ``autopar.planning.baselines``), read by the code
    generator and by people (``report()``), saved and reloaded as JSON (``to_json``/``from_json``)."""

    mesh: MeshSpec
    model_name: str
    fingerprint: str
    nodes: list[NodePlan]
    predicted: Prediction
    memory_budget: float
    solver: SearchLog = field(default_factory=SearchLog)   # how the plan was found
    timings: dict[str, float] = field(default_factory=dict)  # seconds per planning stage
    warnings: list[str] = field(default_factory=list)
    feasible: bool = True                 # predicted peak within the memory budget
    shortfall_bytes: float = 0.0          # how far the predicted peak is above the budget
    name: str = "auto"                    # "auto", or the hand plan it is (``autopar.planning.baselines``)
    gather_outputs: bool = True           # outputs returned whole on every rank (else as DTensors)
    precision: Precision = "fp32"         # the policy the model computes under (``autopar.core.precision``)
    reduce_precision: Precision = "fp32"  # the dtype gradients are summed over ranks in
    batch_size: int = 1                   # rows of the global batch planned for (dim 0 of the inputs)
    microbatches: int = 1                 # gradient accumulation: microbatches per step (``train_step``)
    recompute: dict[str, RecomputeMode] = field(default_factory=dict)   # repeated block path -> "full" or "selective" (its attention core)
    pipeline: PipelinePlan | None = None  # stages over a mesh axis, or None
    expert_parallel: ExpertParallelPlan | None = None   # MoE experts split by expert, or None
    version: int = PLAN_FORMAT_VERSION

    @property
    def planning_s(self) -> float:
        """Seconds the planning call took: its stages' ``timings`` add up to its wall time."""
        return sum(self.timings.values())

    @property
    def microbatch_size(self) -> int:
        """Rows of one microbatch: what the nodes' shapes and predicted memory are for."""
        return max(1, self.batch_size // self.microbatches)

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in this plan")

    @property
    def parameters(self) -> dict[str, NodePlan]:
        return {n.fqn: n for n in self.nodes if n.op == "parameter"}

    @property
    def recompute_mode(self) -> RecomputeMode:
        """The recomputation mode of every block it recomputes ("selective" or "full"), or "none"."""
        return next(iter(self.recompute.values()), "none")

    @property
    def pipeline_axis(self) -> int | None:
        """The index of the mesh axis carrying pipeline stages, or None."""
        return None if self.pipeline is None else self.mesh.axis_names.index(self.pipeline.axis)

    def within_stage(self) -> "Plan":
        """The plan one pipeline stage runs: the mesh without the pipeline axis, every placement
        without its entry for it (this plan itself when there is no pipeline)."""
        a = self.pipeline_axis
        if a is None:
            return self

        def drop(ps: Placements | None) -> Placements | None:
            return None if ps is None else ps[:a] + ps[a + 1:]

        mesh = MeshSpec(self.mesh.shape[:a] + self.mesh.shape[a + 1:],
                        self.mesh.axis_names[:a] + self.mesh.axis_names[a + 1:], self.mesh.hardware)
        nodes = [replace(n, out=drop(n.out), ins=tuple(drop(i) for i in n.ins), storage=drop(n.storage))
                 for n in self.nodes]
        return replace(self, mesh=mesh, nodes=nodes, pipeline=None)

    @property
    def context_parallel(self) -> ContextParallel | None:
        """Where attention is split by sequence, and how (None: nowhere); read off the nodes'
        strategies, so every plan (hand plans, reloaded files) says it."""
        from autopar.core.ops.attention import SDPA, context_layout, context_of  # the rule's names

        found = [(n.name, context_of(n)) for n in self.nodes if n.op == str(SDPA)]
        split = [(name, c) for name, c in found if c is not None]
        if not split:
            return None
        axes = dict.fromkeys(self.mesh.axis_names[a] for _, (a, _) in split)
        kinds = dict.fromkeys(k for _, (_, k) in split)
        layouts = dict.fromkeys(context_layout(self.node(name)) for name, _ in split)
        return ContextParallel("+".join(axes), "+".join(kinds), "+".join(layouts), tuple(name for name, _ in split))

    @property
    def offloaded(self) -> list[str]:
        """Parameters whose shards, gradients and optimizer states live in host memory."""
        return [fqn for fqn, n in self.parameters.items() if n.offloaded]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "autopar-plan",
            "version": self.version,
            "model_name": self.model_name,
            "fingerprint": self.fingerprint,
            "mesh": self.mesh.to_dict(),
            "memory_budget": self.memory_budget,
            "name": self.name,
            "gather_outputs": self.gather_outputs,
            "precision": self.precision,
            "reduce_precision": self.reduce_precision,
            "batch_size": self.batch_size,
            "microbatches": self.microbatches,
            "recompute": self.recompute,
            "pipeline": self.pipeline.to_dict() if self.pipeline is not None else None,
            "context_parallel": cp.to_dict() if (cp := self.context_parallel) is not None else None,   # read off the nodes
            "expert_parallel": self.expert_parallel,
            "feasible": self.feasible,
            "shortfall_bytes": self.shortfall_bytes,
            "predicted": asdict(self.predicted),
            "solver": self.solver,
            "timings": self.timings,
            "warnings": self.warnings,
            "nodes": [n.to_dict() for n in self.nodes],
        }

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> "Plan":
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            try:
                with open(text_or_path) as f:
                    text = f.read()
            except OSError as e:
                raise PlanFileError(f"cannot read plan file {text_or_path!r}: {e}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFileError(f"plan file is not valid JSON ({e}); plans are written by Plan.to_json()") from None
        if not isinstance(d, dict) or d.get("format") != "autopar-plan":
            raise PlanFileError("this JSON is not an autopar plan (no 'format': 'autopar-plan')")
        if d.get("version") != PLAN_FORMAT_VERSION:
            raise PlanFileError(
                f"plan format version {d.get('version')} is not this autopar's version {PLAN_FORMAT_VERSION}; re-plan the model"
            )
        try:
            return cls(
                mesh=MeshSpec.from_dict(d["mesh"]),
                model_name=d["model_name"],
                fingerprint=d["fingerprint"],
                nodes=[NodePlan.from_dict(n) for n in d["nodes"]],
                predicted=Prediction(**d["predicted"]),
                memory_budget=d["memory_budget"],
                solver=d["solver"],
                timings=d["timings"],
                warnings=d["warnings"],
                feasible=d["feasible"],
                shortfall_bytes=d["shortfall_bytes"],
                name=d["name"],
                gather_outputs=d["gather_outputs"],
                precision=d["precision"],
                reduce_precision=d["reduce_precision"],
                batch_size=d["batch_size"],
                microbatches=d["microbatches"],
                recompute=d["recompute"],
                pipeline=PipelinePlan.from_dict(d["pipeline"]) if d["pipeline"] is not None else None,
                expert_parallel=d.get("expert_parallel"),   # absent from plans written before it
                version=d["version"],
            )
        except (KeyError, TypeError) as e:
            raise PlanFileError(f"plan file is missing or has a malformed field: {e}") from None

    def check_matches(self, fingerprint: str, mesh: MeshSpec, precision: str = "fp32") -> None:
        """Refuse to apply a plan made for another model, input shape, precision or mesh.
        ``fingerprint``: of the model captured as the plan runs it, at one microbatch for a
        pipeline plan (``PipelinePlan.microbatch_fingerprint``), else at the batch."""
        wanted = self.pipeline.microbatch_fingerprint if self.pipeline is not None else self.fingerprint
        if precision != self.precision:
            raise PlanFileError(f"this plan computes in {self.precision}, the model was captured in {precision}; "
                                f"compile with precision={self.precision!r} (or pass the plan, whose precision is used)")
        if fingerprint != wanted:
            raise PlanFileError(
                f"this plan was made for another model or input shapes ({self.model_name}, fingerprint "
                f"{wanted}); the model given has fingerprint {fingerprint}. Re-plan with autopar.plan()."
            )
        if tuple(mesh.shape) != tuple(self.mesh.shape):
            raise PlanFileError(f"this plan is for mesh {self.mesh.shape} ({self.mesh.describe()}), not {mesh.shape}; "
                                "re-plan for this mesh")
        if tuple(mesh.axis_names) != tuple(self.mesh.axis_names):
            raise PlanFileError(
                f"this plan names the mesh axes {self.mesh.axis_names}, the mesh given {mesh.axis_names}: axes in "
                "another order would get each other's placements. Build the mesh with the plan's mesh_dim_names, "
                "or re-plan for this mesh")
        if mesh.hardware != self.mesh.hardware:
            raise PlanFileError(
                f"this plan was costed for {self.mesh.hardware}, the mesh given runs on {mesh.hardware}; re-plan "
                f"with MeshSpec(..., hardware={mesh.hardware!r}) (a plan's choices follow its hardware's speeds)")

    def report(self, top: int | None = 12) -> str:
        """The planning report; ``top=None`` lists every node's predicted compute, communication
        and memory, and whether each figure was measured or came from the roofline."""
        return format_report(self, top=top)

    def to_html(self, path: str | None = None, schedule: Sequence[Interval] | None = None) -> str:
        """The plan as one self-contained HTML page of charts (``autopar.core.report_html``);
        written to ``path`` if given. ``schedule``: a pipeline plan's simulated computations, for
        its Gantt chart (``autopar.planning.pipeline.schedule_timeline(plan)``)."""
        from autopar.core.report_html import plan_html

        text = plan_html(self, schedule)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def __repr__(self) -> str:
        p = self.predicted
        return (f"Plan({self.model_name} on {self.mesh.describe()}: step {p.step_time_s * 1e3:.3f} ms, "
                f"peak {p.peak_memory_bytes / 2**30:.3f} GiB)")

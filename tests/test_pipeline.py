"""Pipeline plans (``Plan.pipeline``) train exactly as one device does, under every schedule.

Each case compiles pipeline plans of a four-block model (``tests.pipeline_models``) on a 2x2 gloo
mesh whose first axis carries the stages: two stages (one per rank) under GPipe and 1F1B, four
(two per rank) under the interleaved, looped and zero-bubble schedules; each stage runs a hand
plan of the other axis (tensor parallel, FSDP, ZeRO-1, DDP). Losses of 3 AdamW steps and the final
parameters must equal one device's, on every rank; one case on 2x2x2 (8 processes).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import autopar
from autopar.core.capture import capture
from autopar.core.errors import AutoparError, InputMismatchError, MeshError, PlanFileError
from autopar.core.mesh import MeshSpec
from autopar.core.microbatch import captured_rows, microbatch_capture
from autopar.core.plan import Plan
from autopar.core.strategies import build_space
from autopar.planning.baselines import pipeline_hand_plans
from autopar.planning.options import PlanOptions
from autopar.planning.planner import priced_workloads
from autopar.profiling.launch import run_on_gloo_mesh, run_on_local_tensor_mesh
from cost_models.profile import OpTime, Profile, local_fingerprint
from cost_models.profile_ops import op_calls
from tests.equivalence import ATOL, RTOL, build, loss_of, make_batches, padded_batches, train_reference, train_steps
from tests.tiers import slow

#: Every schedule of ``torch.distributed.pipelining`` the planner may pick, with its stages per rank.
SCHEDULES = (("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2), ("ScheduleLoopedBFS", 2),
             ("ScheduleInterleavedZeroBubble", 2), ("ScheduleZBVZeroBubble", 2))
MICROBATCHES = 4


def pipeline_plans(name: str, batches, mesh: MeshSpec, stage_plan: str,
                   schedules=SCHEDULES) -> list[str]:
    """The pipeline hand plan over ``mesh``'s first axis with ``stage_plan`` in each stage, per
    schedule, as JSON."""
    args, kwargs = batches[0]
    model = build(name)
    captured = capture(model, args, kwargs)
    out = []
    for schedule, virtual in schedules:
        options = PlanOptions(profile=None, pipeline={"axis": mesh.axis_names[0], "schedule": schedule,
                                                      "microbatches": MICROBATCHES, "virtual_stages": virtual})
        plans = pipeline_hand_plans(captured, mesh, options, microbatch_capture(model, args, kwargs, "fp32"))
        wanted = f"pp({mesh.axis_names[0]}, {schedule.removeprefix('Schedule')}) x {stage_plan}"
        assert wanted in plans, f"{wanted} not among {sorted(plans)}"
        out.append(plans[wanted].to_json())
    return out


def _train_each(mesh, name, plans, batches):
    """On every rank: each plan compiled and trained; its losses and final whole state. The first
    plan's module also evaluates the first batch before training (``forward``)."""
    results = []
    for k, text in enumerate(plans):
        args, kwargs = batches[0]
        pmodel = autopar.compile(build(name), mesh, args, kwargs, plan=Plan.from_json(text))
        evaluated = float(loss_of(pmodel(*args, **kwargs))) if k == 0 else None
        losses = [float(l) for l in train_steps(pmodel, batches)]
        results.append((losses, autopar.full_state_dict(pmodel), evaluated))
    return results


def check_pipelines(name: str, mesh: MeshSpec, stage_plan: str, batches, schedules=SCHEDULES) -> None:
    plans = pipeline_plans(name, batches, mesh, stage_plan, schedules)
    ref_losses, ref_state = train_reference(name, batches)
    results = run_on_gloo_mesh(_train_each, mesh.shape, name, plans, batches, axis_names=mesh.axis_names,
                               start_method="forkserver", timeout_s=900)
    for (schedule, _), text, k in zip(schedules, plans, range(len(plans)), strict=True):
        stages = json.loads(text)["pipeline"]["stages"]
        assert len(stages) == mesh.shape[0] * dict(schedules)[schedule]
        for r, per_plan in enumerate(results):
            losses, state, evaluated = per_plan[k]
            where = f"{schedule} rank {r}"
            if evaluated is not None:
                assert evaluated == pytest.approx(ref_losses[0], rel=RTOL), f"{where}: evaluation"
            assert losses == pytest.approx(ref_losses, rel=RTOL, abs=ATOL), f"{where}: losses"
            assert state.keys() == ref_state.keys(), where
            for key, want in ref_state.items():
                torch.testing.assert_close(state[key], want, rtol=RTOL, atol=ATOL, msg=lambda m, where=where, key=key: f"{where} {key}: {m}")


CASES = [   # (model, pipeline x other axis, the stage's hand plan, padded labels)
    ("gpt", ("pp", "tp"), "tp", False),
    ("gpt2", ("pp", "tp"), "tp+sp", True),
    ("llama", ("pp", "tp"), "tp", False),
    ("gpt", ("pp", "dp"), "fsdp", False),
    ("gpt2", ("pp", "dp"), "ddp", True),
    ("llama", ("pp", "dp"), "zero1", False),
]


def _half_of_the_schedules(case: int) -> tuple[tuple[str, int], ...]:
    """Every other schedule, starting at ``case``'s: over the cases each model, and each of the
    pipeline's partner axes (tp, dp), runs all six schedules, and each stage plan three of them,
    in half the CI time of every case running all six."""
    return tuple(SCHEDULES[(case + 2 * k) % len(SCHEDULES)] for k in range(len(SCHEDULES) // 2))


@pytest.mark.parametrize("case, model, axes, stage_plan, padded", [(i, *c) for i, c in enumerate(CASES)],
                         ids=[f"{c[0]}-{'x'.join(c[1])}-{c[2]}" for c in CASES])
@slow
def test_pipeline_trains_exactly_under_every_schedule(case, model, axes, stage_plan, padded):
    name = f"tests.pipeline_models:{model}"
    batches = padded_batches(name) if padded else make_batches(name, 8, 16)
    check_pipelines(name, MeshSpec((2, 2), axes), stage_plan, batches, schedules=_half_of_the_schedules(case))


def test_the_schedule_cases_run_every_schedule_with_every_model_and_axis():
    runs = {(CASES[i][0], CASES[i][1][1], s) for i in range(len(CASES)) for s, _ in _half_of_the_schedules(i)}
    everything = {s for s, _ in SCHEDULES}
    assert all({s for m, _, s in runs if m == model} == everything for model, *_ in CASES)
    assert all({s for _, a, s in runs if a == axis} == everything for axis in ("tp", "dp"))


@slow
def test_pipeline_with_data_and_tensor_parallel_stages_trains_exactly():
    name = "tests.pipeline_models:llama"
    check_pipelines(name, MeshSpec((2, 2, 2), ("pp", "dp", "tp")), "dp(dp) x tp(tp)", make_batches(name, 8, 16),
                    schedules=(("Schedule1F1B", 1),))


@slow
def test_pipeline_of_a_model_no_other_case_runs_trains_exactly():
    """HF OPT (tied embeddings, learned positions offset by 2, ReLU), tensor-parallel stages."""
    name = "tests.pipeline_models:opt"
    check_pipelines(name, MeshSpec((2, 2), ("pp", "tp")), "tp", make_batches(name, 8, 16),
                    schedules=(("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2)))


def test_pipeline_plan_round_trips_and_reports_its_stages():
    name = "tests.pipeline_models:gpt"
    text = pipeline_plans(name, make_batches(name, 8, 16, steps=1), MeshSpec((2, 2), ("pp", "tp")), "tp",
                          schedules=(("ScheduleInterleaved1F1B", 2),))[0]
    plan = Plan.from_json(text)
    assert plan.to_json() == text
    p = plan.pipeline
    assert (p.axis, p.schedule, p.num_microbatches, p.virtual_stages, p.num_stages) == \
        ("pp", "ScheduleInterleaved1F1B", MICROBATCHES, 2, 4)
    assert [s.blocks for s in p.stages] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert p.stages[0].modules[0] == "transformer.wte" and p.stages[-1].modules[-1] == "lm_head"
    assert 0 < p.bubble_fraction < 1 and all(s.forward_s > 0 and s.backward_s > s.forward_s for s in p.stages)
    assert all(isinstance(n.out[0], torch.distributed.tensor.Replicate) for n in plan.nodes)
    report = plan.report()
    assert "Pipeline" in report and "ScheduleInterleaved1F1B" in report and "transformer.h.3" in report
    within = plan.within_stage()
    assert within.mesh.shape == (2,) and within.pipeline is None and len(within.nodes[0].out) == 1


def test_pipeline_needs_a_second_axis_and_enough_blocks():
    name = "gpt-tiny"   # two blocks
    model, (args, kwargs) = build(name), make_batches(name, 8, 16, steps=1)[0]
    with pytest.raises(AutoparError, match="leaves no mesh for its stages"):
        autopar.plan(model, MeshSpec((2,)), args, kwargs, profile=None, pipeline={"schedule": "Schedule1F1B"})
    with pytest.raises(AutoparError, match="2 repeated blocks, at least one per stage"):
        autopar.plan(model, MeshSpec((2, 2)), args, kwargs, profile=None,
                     pipeline={"schedule": "ScheduleInterleaved1F1B", "virtual_stages": 2})
    with pytest.raises(AutoparError, match="unknown pipeline schedule"):
        PlanOptions(pipeline="Chimera")
    with pytest.raises(AutoparError, match="pipeline axis 'pp' is not an axis"):
        autopar.plan(model, MeshSpec((2, 2)), args, kwargs, profile=None, pipeline={"axis": "pp"})


def test_pipeline_refuses_simulated_ranks():
    name = "tests.pipeline_models:gpt"
    batches = make_batches(name, 8, 16, steps=1)
    plan = Plan.from_json(pipeline_plans(name, batches, MeshSpec((2, 2), ("pp", "tp")), "tp",
                                         schedules=(("Schedule1F1B", 1),))[0])
    model, (args, kwargs) = build(name), batches[0]
    with pytest.raises(MeshError, match="one process per rank"):
        run_on_local_tensor_mesh(lambda mesh: autopar.compile(model, mesh, args, kwargs, plan=plan), (2, 2),
                                 axis_names=("pp", "tp"))


def _other_batch(mesh, name, text, batches):
    """(compile's error for an example of another batch size, train_step's for such a batch)."""
    args, kwargs = batches[0]
    half = make_batches(name, 4, 16, steps=1)[0]
    messages = []
    try:
        autopar.compile(build(name), mesh, *half, plan=Plan.from_json(text))
    except PlanFileError as e:
        messages.append(str(e))
    pmodel = autopar.compile(build(name), mesh, args, kwargs, plan=Plan.from_json(text))
    try:
        pmodel.train_step(*half[0], **half[1])
    except InputMismatchError as e:
        messages.append(str(e))
    pmodel.eval()   # the model has no op eval mode runs otherwise: evaluates
    messages.append(float(loss_of(pmodel(*args, **kwargs))))
    return messages


@slow
def test_pipeline_refuses_another_batch_size():
    name = "tests.pipeline_models:gpt"
    batches = make_batches(name, 8, 16, steps=1)
    text = pipeline_plans(name, batches, MeshSpec((2, 2), ("pp", "tp")), "tp", schedules=(("Schedule1F1B", 1),))[0]
    messages = run_on_gloo_mesh(_other_batch, (2, 2), name, text, batches, axis_names=("pp", "tp"),
                                start_method="forkserver")
    for compiled, stepped, evaluated in messages:
        assert "runs batches of 8 rows, the example has 4" in compiled and "batches of 8 rows" in stepped
        assert math.isfinite(evaluated)


def test_a_pipeline_refuses_eval_mode_where_the_model_runs_otherwise_in_it():
    """Its stages run the training-mode capture: dropout and batch norm there are named in eval
    mode, not run as in training."""
    from types import SimpleNamespace

    from codegen.pipelined import PipelinedModule

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1), torch.nn.BatchNorm1d(4))
    graph = capture(model, (torch.randn(3, 4),)).graph
    stub = SimpleNamespace(training=False, _captured=SimpleNamespace(graph=graph),
                           plan=SimpleNamespace(model_name="Sequential"))
    with pytest.raises(AutoparError, match=r"evaluates only as in training mode.*Sequential.* 2 op\(s\)"):
        PipelinedModule._refuse_eval_mode(stub)
    stub.training = True
    PipelinedModule._refuse_eval_mode(stub)   # in training mode: runs as captured


def test_pipeline_stages_are_priced_on_the_jobs_profile():
    """A stage plan runs on a sub-mesh of the job (2 of its 4 processes) at one microbatch's
    shapes: the profile of the 4-process job prices it, where it holds those op calls
    (``planner.priced_workloads`` lists what to measure), and not the roofline. The schedule's
    own costs (``pipeline_microbatch`` on each stage's forward and backward of a microbatch,
    ``pipeline_step`` once) add to 1F1B's critical path of microbatches + stages - 1 pairs."""
    name = "tests.pipeline_models:gpt"
    mesh = MeshSpec((2, 2), ("pp", "dp"))
    model, (args, kwargs) = build(name), make_batches(name, 8, 16, steps=1)[0]
    recapture = microbatch_capture(model, args, kwargs, "fp32")
    options = PlanOptions(pipeline={"axis": "pp", "schedule": "Schedule1F1B", "microbatches": 4})
    workloads = priced_workloads(capture(model, args, kwargs), mesh, options, recapture)
    stage = [(graph, on) for graph, on in workloads if on.shape == (2,)]
    assert len(stage) == 1 and stage[0][1].processes == 4 and captured_rows(stage[0][0]) == 2
    calls = {c.key for graph, on in workloads for c in op_calls(build_space(graph, on), on.shape)}
    profile = Profile(local_fingerprint(mesh), ops={key: OpTime(1e-4, 2e-4) for key in calls})
    plan = autopar.plan(model, mesh, args, kwargs, profile=profile, pipeline=options.pipeline)
    assert plan.pipeline is not None and plan.predicted.cost_source.startswith("profile"), plan.predicted.cost_source
    roofline = [n.name for n in plan.nodes if n.op not in ("parameter", "input", "buffer", "output")
                and n.source.startswith("roofline")]
    assert roofline == []
    profile.overheads = {"pipeline_microbatch": 1.0, "pipeline_step": 0.5}   # seconds: they dominate
    slower = autopar.plan(model, mesh, args, kwargs, profile=profile, pipeline=options.pipeline)
    added = slower.predicted.step_time_s - plan.predicted.step_time_s
    assert added == pytest.approx((4 + 2 - 1) * 1.0 + 0.5, rel=0.01)


@slow
def test_auto_weighs_a_pipeline_where_the_first_axis_crosses_nodes():
    """On 2 nodes of 8 H100 the first axis crosses nodes: "auto" plans without a pipeline and with
    one over a factor of that axis (as ``pipeline={"axis": "auto"}`` forces) and keeps the faster,
    the pipeline only where it gains ``min_gain``; on one node it weighs none."""
    model = build("tests.deep_gpt:build")
    args, kwargs = make_batches("tests.deep_gpt:build", 64, 32, steps=1)[0]
    nodes = MeshSpec((2, 8), ("dp", "tp"), hardware="h100-80gb")
    options = PlanOptions(time_limit=None)   # solved to optimality: the three plans compare exactly
    without = autopar.plan(model, nodes, args, kwargs, options=options, pipeline=False)
    forced = autopar.plan(model, nodes, args, kwargs, options=options, pipeline={"axis": "auto"})
    auto = autopar.plan(model, nodes, args, kwargs, options=options)
    assert without.pipeline is None and forced.pipeline is not None and forced.pipeline.num_stages >= 2
    kept = forced.predicted.step_time_s < (1 - options.min_gain) * without.predicted.step_time_s
    assert auto.predicted.step_time_s == pytest.approx((forced if kept else without).predicted.step_time_s)
    assert (auto.pipeline is not None) == kept
    assert auto.solver["pipeline"].startswith("kept" if kept else "not kept"), auto.solver["pipeline"]
    assert auto.solver["hand_plans"] == without.solver["hand_plans"]   # what it was weighed against, either way
    node = MeshSpec((8,), hardware="h100-80gb")
    assert "pipeline" not in autopar.plan(model, node, args, kwargs, options=options).solver

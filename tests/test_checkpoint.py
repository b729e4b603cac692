"""Checkpoints (``autopar.save`` / ``autopar.load``): training resumed from one equals training
never stopped (losses and final parameters equal one device's), loaded into the same plan, another
plan, a mesh of another shape and a pipeline; a pipeline's checkpoint loads back into a plan
without one; the whole state goes into a fresh Hugging Face model and round trips through
``save_pretrained``. One gloo launch of four ranks runs every round trip in turn. Loads that cannot
go as asked raise ``CheckpointError`` (single process: DCP runs without a process group)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.core.errors import CheckpointError
from autopar.core.mesh import MeshSpec
from autopar.core.plan import Plan
from autopar.planning.baselines import candidates
from autopar.profiling.launch import run_on_gloo_mesh
from tests.equivalence import ATOL, EPS, LR, RTOL, build, loss_of, make_batches, train_reference
from tests.tiers import slow

NAME = "tests.pipeline_models:gpt2"   # HF GPT-2 (tied embeddings), four blocks: two pipeline stages
MESH = MeshSpec((2, 2), ("pp", "tp"))
#: In turn, on the same four ranks: (case, mesh, hand plan, the checkpoint it loads (None: none),
#: the steps it trains (from, to), the checkpoint it saves then (None: none)).
CASES = [
    ("saved", "2x2", "ddp", None, (0, 2), "ddp"),
    ("same plan", "2x2", "ddp", "ddp", (2, 4), None),
    ("another plan", "2x2", "fsdp(pp) x tp(tp)", "ddp", (2, 4), "sharded"),
    ("pipelined", "2x2", "pp(pp, 1F1B) x tp", "ddp", (2, 4), "pipelined"),
    ("another mesh", "4", "tp", "sharded", (4, 5), None),
    ("from pipelined", "2x2", "ddp", "pipelined", (4, 5), None),
]
#: the kinds of module and parameters each case must run (else it tests less than it says):
#: replicated plans hold plain tensors, sharded ones DTensors (``_StridedShard`` in fsdp x tp)
KINDS = {"saved": ("ShardedModule", {"Parameter"}), "same plan": ("ShardedModule", {"Parameter"}),
         "another plan": ("ShardedModule", {"DTensor"}), "pipelined": ("PipelinedModule", {"DTensor"}),
         "another mesh": ("ShardedModule", {"DTensor"}), "from pipelined": ("ShardedModule", {"Parameter"})}


def _plans(batches) -> dict[str, str]:
    """The hand plans the cases run, as JSON: on 2x2 (a pipeline of two stages among them), and
    tensor parallel on a 1-D mesh of the same four ranks."""
    args, kwargs = batches[0]
    square = candidates(build(NAME), MESH, args, kwargs, profile=None,
                        pipeline={"axis": "pp", "schedule": "Schedule1F1B", "microbatches": 4})
    line = candidates(build(NAME), MeshSpec((4,), ("dp",)), args, kwargs, profile=None, pipeline=False)
    return {plan: (square if mesh == "2x2" else line)[plan].to_json() for _, mesh, plan, *_ in CASES}


def _train(pmodel, opt, batches) -> list[float]:
    losses = []
    for args, kwargs in batches:
        losses.append(float(pmodel.train_step(*args, **kwargs)))
        opt.step()
        opt.zero_grad()
    return losses


def _round_trips(square, root, plans, batches):
    """On every rank, each case in turn: compiled afresh with a fresh AdamW, loaded, trained,
    saved. Per case: its losses, whether the random generator came back as saved, the kinds of
    module and parameters, and (rank 0) the whole state."""
    meshes = {"2x2": square, "4": init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))}
    generators, out = {}, {}
    for case, mesh, plan, source, (first, last), target in CASES:
        args, kwargs = batches[0]
        pmodel = autopar.compile(build(NAME), meshes[mesh], args, kwargs, plan=Plan.from_json(plans[plan]))
        opt = torch.optim.AdamW(pmodel.parameters(), lr=LR, eps=EPS)
        restored = True
        if source is not None:
            torch.manual_seed(1)   # load restores the generator
            autopar.load(pmodel, opt, root / source)
            restored = torch.equal(torch.get_rng_state(), generators[source])
        losses = _train(pmodel, opt, batches[first:last])
        if target is not None:
            autopar.save(pmodel, opt, root / target)
            generators[target] = torch.get_rng_state()
        kinds = type(pmodel).__name__, {type(p).__name__ for p in pmodel.parameters()}
        state = autopar.full_state_dict(pmodel)
        out[case] = (losses, restored, kinds, state if dist.get_rank() == 0 else None)
    return out


def _assert_state(state, want, where):
    assert state.keys() == want.keys(), where
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m, key=key: f"{where} {key}: {m}")


@slow
def test_checkpoints_resume_training_exactly_in_every_plan_and_export_to_hugging_face(tmp_path):
    batches = make_batches(NAME, 8, 16, steps=max(last for *_, (_, last), _ in CASES))
    ref_losses, _ = train_reference(NAME, batches)
    ref_states = {last: train_reference(NAME, batches[:last])[1] for *_, (_, last), _ in CASES}
    results = run_on_gloo_mesh(_round_trips, MESH.shape, tmp_path, _plans(batches), batches,
                               axis_names=MESH.axis_names, start_method="forkserver", timeout_s=900)
    for case, *_, (first, last), _ in CASES:
        for r, out in enumerate(results):
            losses, restored, kinds, _ = out[case]
            assert kinds == KINDS[case], f"{case} rank {r}: runs {kinds}"
            assert losses == pytest.approx(ref_losses[first:last], rel=RTOL, abs=ATOL), f"{case} rank {r}: losses"
            assert restored, f"{case} rank {r}: the random generator was not restored"
        _assert_state(results[0][case][3], ref_states[last], case)
    _check_hugging_face(results[0]["another mesh"][3], ref_states[5], tmp_path / "hf", batches[0])


def _check_hugging_face(state, want, path, batch):
    """The whole state loads into a fresh model of the config (``strict``), and ``save_pretrained``
    / ``from_pretrained`` give back the same parameters and loss."""
    fresh = build(NAME)
    fresh.load_state_dict(state)
    fresh.save_pretrained(path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    _assert_state(loaded.state_dict(), want, "from_pretrained")
    args, kwargs = batch
    with torch.no_grad():
        assert float(loss_of(loaded(*args, **kwargs))) == float(loss_of(fresh(*args, **kwargs)))


# ----------------------------------------------------------------------------- refused loads
def _tiny_trained():
    """A single-device model and its AdamW after one step (``save`` and ``load`` take any module)."""
    model = build("gpt-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    args, kwargs = make_batches("gpt-tiny", 2, 8, steps=1)[0]
    loss_of(model(*args, **kwargs)).backward()
    opt.step()
    opt.zero_grad()
    return model, opt, (args, kwargs)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # DCP in one process, as asked
def test_load_refuses_what_it_cannot_load_as_asked(tmp_path):
    model, opt, (args, kwargs) = _tiny_trained()
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        autopar.load(model, opt, tmp_path / "none")
    autopar.save(model, None, tmp_path / "model")
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        autopar.load(model, opt, tmp_path / "model")
    other = build("gpt2-tiny")
    with pytest.raises(CheckpointError, match="another model's"):
        autopar.load(other, None, tmp_path / "model")
    with pytest.raises(CheckpointError, match="not the module's"):
        autopar.load(build("gpt-tiny"), opt, tmp_path / "model")
    autopar.save(model, opt, tmp_path / "both")
    fresh = build("gpt-tiny")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR, eps=EPS)
    with pytest.raises(CheckpointError, match="has taken no step"):   # torch would count a step of its own
        autopar.save(fresh, fresh_opt, tmp_path / "fresh")
    assert not fresh_opt.state
    loss_of(fresh(*args, **kwargs)).backward()   # gradients, no step: no optimizer state to load into
    with pytest.raises(CheckpointError, match="zero_grad"):
        autopar.load(fresh, fresh_opt, tmp_path / "both")
    fresh_opt.zero_grad()
    autopar.load(fresh, fresh_opt, tmp_path / "both")
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
    torch.testing.assert_close(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

"""The loop users write: ``loss = pmodel(**batch).loss; loss.backward(); opt.step()``.

Outputs' collectives are deferred to where they are read (``autopar.core.launched``; the loss's
sum rides in the gradients' all-reduce): a loss read on every rank or after the backward, logits
read or not, an evaluation forward nobody reads, must all give one device's values and leave no
collective behind; a rank reading alone what only every rank together can sum is told so."""
from __future__ import annotations

import datetime

import torch

import autopar
import autopar.core.launched as launched
from autopar.core.launched import Pending, _Cell, _Launched
from autopar.models.zoo import get_model
from autopar.planning.baselines import candidates
from autopar.profiling.launch import run_on_gloo_mesh
from tests.equivalence import make_batches
from tests.tiers import slow

NAME, STEPS = "gpt2-tiny", 3


def _pending(value: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    waits = []

    def finish() -> torch.Tensor:
        waits.append(1)
        return value
    return _Launched.apply(x, _Cell(None, finish), tuple(value.shape), lambda grad: grad * 2), waits


def test_pending_waits_only_when_read():
    """The backward's seed and ``detach`` read no value; an op does, once; the gradient goes
    back through the mapping given."""
    x = torch.ones(3, requires_grad=True)
    out, waits = _pending(torch.tensor([1.0, 2.0, 3.0]), x)
    assert isinstance(out, Pending) and out.shape == (3,) and not waits
    kept = out.detach()
    assert torch.ones_like(out).sum().item() == 3 and not waits
    (out * 1).sum().backward()
    assert waits == [1]
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    assert kept.tolist() == [1.0, 2.0, 3.0] and waits == [1]   # the same value, waited for once


def _reference(batches) -> list[tuple[float, torch.Tensor]]:
    torch.manual_seed(0)
    model = get_model(NAME).build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for args, kwargs in batches:
        o = model(*args, **kwargs)
        o.loss.backward()
        opt.step()
        opt.zero_grad()
        out.append((o.loss.item(), o.logits.detach().clone()))
    return out


def _plain_loop(mesh, plans: dict[str, str], batches) -> dict[str, list]:
    """Each plan's plain loop: the loss read on rank 0 only after its backward (carried in the
    gradients' all-reduce) and once on every rank before it (summed there at once), the logits
    read at the last step on every rank; then an evaluation forward nobody reads. Returns what
    was read and how many collectives were left registered, never waited for."""
    rank = torch.distributed.get_rank()
    results = {}
    for label, text in plans.items():
        torch.manual_seed(0)
        pmodel = autopar.compile(get_model(NAME).build(), mesh, *batches[0], plan=autopar.Plan.from_json(text))
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
        read = []
        for step, (args, kwargs) in enumerate(batches):
            out = pmodel(*args, **kwargs)
            early = out.loss.item() if step == 1 else None   # before the backward, every rank
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            assert early is None or early == out.loss.item()
            read.append((out.loss.item() if rank == 0 else None,
                         out.logits.detach().clone() if step == len(batches) - 1 else None))
        pmodel.eval()
        with torch.no_grad():
            pmodel(*batches[0][0], **batches[0][1])
        results[label] = (read, torch._C._distributed_c10d._get_work_registry_size())
    return results


@slow
def test_plain_loop_equals_one_device_on_2x2():
    """gpt2-tiny on 2x2, a batch of 6 rows: data parallel over both axes (6 rows on 4 ranks:
    uneven, the logits gathered at once) and FSDP x TP (3 rows a dp rank, the vocabulary split
    on tp: the gather launched, waited for where read)."""
    spec = autopar.MeshSpec((2, 2), ("dp", "tp"), hardware="cpu")
    batches = make_batches(NAME, 6, 16)
    torch.manual_seed(0)
    hands = candidates(get_model(NAME).build(), spec, *batches[0], options=autopar.PlanOptions(profile=None))
    plans = {k: hands[k].to_json() for k in ("ddp", "fsdp(dp) x tp(tp)")}
    want = _reference(batches)
    ranks = run_on_gloo_mesh(_plain_loop, (2, 2), plans, batches, axis_names=("dp", "tp"), start_method="forkserver")
    for r, results in enumerate(ranks):
        for label, (read, left) in results.items():
            assert left == 0, f"{label} rank {r}: {left} collectives never waited for"
            for step, ((loss, logits), (want_loss, want_logits)) in enumerate(zip(read, want, strict=True)):
                if loss is not None:
                    assert abs(loss - want_loss) <= 1e-5 + 1e-4 * abs(want_loss), (label, step, loss, want_loss)
                if logits is not None:
                    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)


def _reads_that_differ(mesh, text: str, batches) -> dict[str, object]:
    """An evaluation forward (grad enabled) whose loss rank 0 alone reads (its peers sum it at
    their next forward); then each rank reading another step's split logits, logits read on rank
    0 only, a loss read on rank 0 only before its backward: each rank says what it was told (a
    timeout leaves the read groups closed: those cases come last); the step's own collectives go
    on unharmed."""
    launched.READ_TIMEOUT = datetime.timedelta(seconds=3)
    rank = torch.distributed.get_rank()
    pmodel = autopar.compile(get_model(NAME).build(), mesh, *batches[0], plan=autopar.Plan.from_json(text))
    told: dict[str, object] = {}
    evaluated = pmodel(*batches[0][0], **batches[0][1])
    told["evaluated"] = evaluated.loss.item() if rank == 0 else None
    told["again"] = pmodel(*batches[0][0], **batches[0][1]).loss.item()   # the same batch, every rank reading
    outs = [pmodel(*args, **kwargs) for args, kwargs in batches[:2]]
    try:
        outs[rank].logits.sum().item()   # rank 0 the first forward's, rank 1 the second's
    except autopar.AutoparError as e:
        told["another"] = str(e)
    out = pmodel(*batches[2][0], **batches[2][1])
    if rank == 0:
        try:
            out.logits.sum().item()
        except autopar.AutoparError as e:
            told["alone"] = str(e)
        try:
            out.loss.item()
        except autopar.AutoparError as e:
            told["loss alone"] = str(e)
    out.loss.backward()   # the step's own collectives still pair up
    told["loss"] = out.loss.item()
    return told


@slow
def test_split_outputs_read_unlike_are_told():
    """Logits are gathered when read (nothing is gathered for a loop that never reads them): a
    rank reading them alone is told its peers did not, within ``READ_TIMEOUT``, and so is a rank
    reading the loss alone before its backward; ranks reading different steps' logits are told
    so, never handed each other's. An evaluation forward's loss read on one rank only is summed
    with its peers at their next forward."""
    spec = autopar.MeshSpec((2,), ("dp",), hardware="cpu")
    batches = make_batches(NAME, 4, 16)
    torch.manual_seed(0)
    text = candidates(get_model(NAME).build(), spec, *batches[0], options=autopar.PlanOptions(profile=None), names=["ddp"])["ddp"].to_json()
    ranks = run_on_gloo_mesh(_reads_that_differ, (2,), text, batches, axis_names=("dp",), start_method="forkserver")
    assert "did not read it within 3 s" in ranks[0]["alone"] and "alone" not in ranks[1]
    assert "read the loss before its backward" in ranks[0]["loss alone"] and "loss alone" not in ranks[1]
    for told in ranks:
        assert "read different outputs" in told["another"]
    assert ranks[0]["loss"] == ranks[1]["loss"]
    assert ranks[0]["evaluated"] == ranks[0]["again"] == ranks[1]["again"]


def _sharded_plain_loop(mesh, text: str, batches) -> tuple[list, list[bool], int]:
    """The plain loop on outputs kept sharded (``gather_outputs=False``): after each forward,
    whether the loss is a replicated DTensor whose sum is still unlaunched; the loss read on
    rank 0 only after its backward, the logits gathered by every rank at the last step."""
    from torch.distributed.tensor import DTensor, Replicate

    torch.manual_seed(0)
    pmodel = autopar.compile(get_model(NAME).build(), mesh, *batches[0], plan=autopar.Plan.from_json(text))
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    read, unlaunched = [], []
    for step, (args, kwargs) in enumerate(batches):
        out = pmodel(*args, **kwargs)
        loss = out.loss
        unlaunched.append(isinstance(loss, DTensor) and loss.placements == (Replicate(),)
                          and isinstance(loss._local_tensor, Pending) and loss._local_tensor._cell in launched._DEFERRED)
        loss.backward()
        opt.step()
        opt.zero_grad()
        read.append((loss.item() if torch.distributed.get_rank() == 0 else None,
                     out.logits.full_tensor().detach() if step == len(batches) - 1 else None))
    return read, unlaunched, torch._C._distributed_c10d._get_work_registry_size()


def test_a_sharded_outputs_loss_rides_with_the_gradients():
    """``gather_outputs=False`` hands the loss back as a replicated DTensor: its sum over ranks
    stays on its way through the forward and rides in the gradients' all-reduce, as under the
    default outputs (wrapping it as DTensor's ``from_local`` does would wait for it: a blocking
    all-reduce in every forward, 15% of gpt-tiny's step on 4 gloo processes); losses and logits
    equal one device's."""
    spec = autopar.MeshSpec((2,), ("dp",), hardware="cpu")
    batches = make_batches(NAME, 4, 16)[:STEPS]
    torch.manual_seed(0)
    options = autopar.PlanOptions(profile=None, gather_outputs=False)
    text = candidates(get_model(NAME).build(), spec, *batches[0], options=options, names=["ddp"])["ddp"].to_json()
    want = _reference(batches)
    for r, (read, unlaunched, left) in enumerate(run_on_gloo_mesh(_sharded_plain_loop, (2,), text, batches,
                                                                   axis_names=("dp",), start_method="forkserver")):
        assert unlaunched == [True] * STEPS and left == 0, (r, unlaunched, left)
        for (loss, logits), (want_loss, want_logits) in zip(read, want, strict=True):
            if loss is not None:
                assert abs(loss - want_loss) <= 1e-5 + 1e-4 * abs(want_loss), (r, loss, want_loss)
            if logits is not None:
                torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)

"""Tests for autopar.profiling.launch: gloo multi-process meshes and in-process LocalTensorMode meshes."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autopar.core.errors import AutoparError
from autopar.profiling.launch import (
    DistributedRunError,
    per_rank,
    rank_map,
    run_on_gloo_mesh,
    run_on_local_tensor_mesh,
)
from tests.tiers import slow

# ----------------------------------------------------------------------------
# gloo (real processes). Each run costs a few seconds of process start: keep few.
# Functions run in spawned children, so they must be module-level.
# ----------------------------------------------------------------------------


def _gloo_all_reduce_ranks(mesh, scale):
    rank = dist.get_rank()
    t = torch.full((3,), float(rank)) * scale
    dist.all_reduce(t)
    return rank, mesh.get_coordinate(), torch.get_num_threads(), t


def _gloo_named_axes(mesh):
    rank = dist.get_rank()
    assert mesh.mesh_dim_names == ("dp", "tp")
    x = torch.arange(12.0).reshape(4, 3)
    # Shard -> Replicate over "tp" only is an all-gather along tp.
    d = distribute_tensor(x, mesh, [Replicate(), Shard(0)])
    local = d.to_local().clone()
    gathered = d.redistribute(mesh, [Replicate(), Replicate()])
    # Partial -> Replicate over "tp" only is an all-reduce along tp.
    p = DTensor.from_local(torch.tensor([float(rank)]), mesh, [Replicate(), Partial()])
    reduced = p.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    # The same with a plain collective on the named axis' group.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    return local, gathered.full_tensor(), reduced, t


def _gloo_rank1_raises(mesh):
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 would block here forever without the launcher's kill
    return t


def _zombie_children() -> list[int]:
    """PIDs of this process's children (and grandchildren) left as zombies (Linux)."""
    if not os.path.isdir("/proc"):
        return []
    ppid_state = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ppid_state[int(pid)] = (int(fields[1]), fields[0])
    ours = {os.getpid()}
    for _ in range(3):  # children of the forkserver too
        ours |= {p for p, (pp, _) in ppid_state.items() if pp in ours}
    return [p for p in ours if ppid_state.get(p, (0, ""))[1] == "Z"]


def _gloo_rank1_hangs(mesh):
    if dist.get_rank() == 1:
        time.sleep(600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t


def _gloo_rank0_dies(mesh):
    if dist.get_rank() == 0:
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t


@slow
def test_gloo_all_reduce_4_ranks():
    # forkserver: ranks fork from a server with torch preloaded (much faster than
    # spawn on a loaded 2-core machine; the first call pays the server start).
    results = run_on_gloo_mesh(
        _gloo_all_reduce_ranks, (4,), 2.0, timeout_s=120, start_method="forkserver"
    )
    assert [r[0] for r in results] == [0, 1, 2, 3]
    for rank, coord, threads, t in results:
        assert list(coord) == [rank]
        assert threads == 1
        torch.testing.assert_close(t, torch.full((3,), 2.0 * (0 + 1 + 2 + 3)))


def _collector_reach(mesh):
    import gc

    return gc.get_freeze_count(), len(gc.get_objects())


def test_a_ranks_inherited_heap_is_out_of_the_collectors_reach():
    """What a rank forks with (torch and autopar preloaded) is frozen: a full collection walks only
    what the rank made, instead of every inherited object and the pages they sit on."""
    for frozen, tracked in run_on_gloo_mesh(_collector_reach, (2,), timeout_s=120, start_method="forkserver"):
        assert frozen > 100_000 and frozen > 5 * tracked


@slow
def test_gloo_2x2_named_axis_dtensor():
    results = run_on_gloo_mesh(
        _gloo_named_axes, (2, 2), axis_names=("dp", "tp"), timeout_s=120,
        start_method="forkserver",
    )
    x = torch.arange(12.0).reshape(4, 3)
    for rank, (local, full, reduced, t) in enumerate(results):
        tp_coord = rank % 2  # mesh [[0, 1], [2, 3]]: tp is the inner axis
        torch.testing.assert_close(local, x[2 * tp_coord : 2 * tp_coord + 2])
        torch.testing.assert_close(full, x)
        tp_sum = float(sum(r for r in range(4) if r // 2 == rank // 2))
        torch.testing.assert_close(reduced, torch.tensor([tp_sum]))
        torch.testing.assert_close(t, torch.tensor([tp_sum]))


@slow
def test_gloo_failing_rank_raises_promptly():
    start = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_on_gloo_mesh(_gloo_rank1_raises, (2,), timeout_s=120)  # default: spawn
    elapsed = time.monotonic() - start
    err = info.value
    assert isinstance(err, AutoparError)
    assert err.rank == 1
    assert "rank 1" in str(err)
    assert "ValueError: boom on purpose" in str(err)
    assert "_gloo_rank1_raises" in err.child_traceback  # the full child traceback
    assert elapsed < 60, f"took {elapsed:.1f}s: the launcher waited for the hung rank"
    assert not _zombie_children()


@slow
def test_gloo_timeout_and_crash_are_reported():
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="timed out") as info:
        run_on_gloo_mesh(_gloo_rank1_hangs, (2,), timeout_s=4, start_method="forkserver")
    assert info.value.rank is None
    assert time.monotonic() - start < 20
    with pytest.raises(DistributedRunError, match="rank 0 of 2") as info:
        run_on_gloo_mesh(_gloo_rank0_dies, (2,), timeout_s=60, start_method="forkserver")
    assert info.value.exit_code == 3
    assert not _zombie_children()


def test_gloo_unpicklable_fn_fails_fast():
    with pytest.raises(DistributedRunError, match="picklable"):
        run_on_gloo_mesh(lambda mesh: 1, (2,))


def test_bad_mesh_shape():
    with pytest.raises(DistributedRunError):
        run_on_local_tensor_mesh(lambda mesh: None, (2, 0))
    with pytest.raises(DistributedRunError):
        run_on_local_tensor_mesh(lambda mesh: None, (2, 2), axis_names=("dp",))


# ----------------------------------------------------------------------------
# LocalTensorMode (all ranks in this process)
# ----------------------------------------------------------------------------

MESHES = [(1,), (2,), (3,), (4,), (2, 2)]


def _mesh_id(shape):
    return "x".join(map(str, shape))


@pytest.mark.parametrize("shape", MESHES, ids=_mesh_id)
def test_local_mesh_ranks_and_all_reduce(shape):
    n = 1
    for s in shape:
        n *= s

    def fn(mesh):
        assert mesh.shape == shape
        ranks = rank_map(lambda r: torch.tensor([float(r)]))
        # Partial over every mesh axis -> Replicate is an all-reduce over all ranks.
        p = DTensor.from_local(ranks, mesh, [Partial()] * mesh.ndim)
        total = p.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        return ranks, total

    ranks, total = run_on_local_tensor_mesh(fn, shape)
    assert [v.item() for v in per_rank(ranks)] == [float(r) for r in range(n)]
    assert [v.item() for v in per_rank(total)] == [float(n * (n - 1) // 2)] * n


def test_local_mesh_named_axis_all_reduce():
    def fn(mesh):
        assert mesh.mesh_dim_names == ("dp", "tp")
        ranks = rank_map(lambda r: torch.tensor([float(r)]))
        p = DTensor.from_local(ranks, mesh, [Replicate(), Partial()])
        return p.redistribute(mesh, [Replicate(), Replicate()]).to_local()

    out = run_on_local_tensor_mesh(fn, (2, 2), axis_names=("dp", "tp"))
    assert [v.item() for v in per_rank(out)] == [1.0, 1.0, 5.0, 5.0]


def _matmul_fwd_bwd(mesh, x, w):
    k = mesh.ndim
    dx = distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (k - 1)).requires_grad_()
    dw = distribute_tensor(w, mesh, [Replicate()] * k).requires_grad_()
    y = dx @ dw
    (y * y).sum().backward()
    return y.full_tensor(), dx.grad.full_tensor(), dw.grad.full_tensor(), per_rank(dx)


@pytest.mark.parametrize("shape", [(2,), (3,), (2, 2)], ids=_mesh_id)
@pytest.mark.parametrize("rows", [12, 5], ids=["even", "uneven"])
def test_local_dtensor_matmul_forward_backward(shape, rows):
    torch.manual_seed(0)
    x, w = torch.randn(rows, 4), torch.randn(4, 3)
    y, gx, gw, x_shards = run_on_local_tensor_mesh(_matmul_fwd_bwd, shape, x, w)

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = xr @ wr
    (yr * yr).sum().backward()
    n = len(x_shards)
    for got, want in [(y, yr), (gx, xr.grad), (gw, wr.grad)]:
        vals = per_rank(got)
        assert len(vals) == n
        for v in vals:
            torch.testing.assert_close(v, want.detach())
    # Shard(0) over the first mesh axis: torch.chunk-style split (uneven: 3+2, 2+2+1).
    chunks = torch.chunk(x, shape[0], dim=0)
    expected = [chunks[r // (n // shape[0])] for r in range(n)]
    for got_shard, want_shard in zip(x_shards, expected, strict=True):
        torch.testing.assert_close(got_shard, want_shard)


def test_local_adamw_step_on_dtensor_parameter():
    torch.manual_seed(0)
    x, w = torch.randn(6, 4), torch.randn(4, 3)

    def fn(mesh):
        p = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
        opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.01)
        for _ in range(2):
            opt.zero_grad()
            (distribute_tensor(x, mesh, [Replicate()]) @ p).pow(2).sum().backward()
            opt.step()
        return p.full_tensor()

    got = run_on_local_tensor_mesh(fn, (2,))

    pr = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([pr], lr=0.1, weight_decay=0.01)
    for _ in range(2):
        opt.zero_grad()
        (x @ pr).pow(2).sum().backward()
        opt.step()
    for v in per_rank(got):
        torch.testing.assert_close(v, pr.detach())


def test_local_mesh_repeated_calls_and_teardown_on_error():
    def ok(mesh):
        return mesh.size()

    assert run_on_local_tensor_mesh(ok, (2,)) == 2
    assert run_on_local_tensor_mesh(ok, (3,)) == 3

    def boom(mesh):
        raise KeyError("inside fn")

    with pytest.raises(KeyError, match="inside fn"):
        run_on_local_tensor_mesh(boom, (2, 2))
    assert not dist.is_initialized()
    assert run_on_local_tensor_mesh(ok, (2, 2)) == 4
    assert not dist.is_initialized()


def test_local_uneven_sharding():
    x = torch.arange(20.0).reshape(5, 4)

    def fn(mesh):
        d = distribute_tensor(x, mesh, [Shard(0)])
        out = {
            "shards": [tuple(s.shape) for s in per_rank(d)],
            "full": d.full_tensor(),
            "sum0": d.sum(0).full_tensor(),
            "to_shard1": d.redistribute(mesh, [Shard(1)]).full_tensor(),
            "softmax0": torch.softmax(d, 0).full_tensor(),
        }
        # Flattening an unevenly sharded dim is refused by DTensor itself.
        with pytest.raises(RuntimeError, match="unevenly sharded"):
            d.view(-1)
        # DTensor.from_local cannot infer an uneven global shape: it guesses
        # local_rows * n per rank (a per-rank symbolic size under LocalTensorMode, and
        # inconsistent shapes on real ranks) and later ops fail. Pass shape=/stride=.
        bad = DTensor.from_local(d.to_local(), mesh, [Shard(0)], run_check=False)
        assert not isinstance(bad.shape[0], int)
        with pytest.raises(TypeError):
            bad.full_tensor()
        d2 = DTensor.from_local(
            d.to_local(), mesh, [Shard(0)], run_check=False, shape=x.shape, stride=x.stride()
        )
        out["from_local"] = d2.full_tensor()
        return out

    for n, shards in [(2, [(3, 4), (2, 4)]), (3, [(2, 4), (2, 4), (1, 4)]),
                      (4, [(2, 4), (2, 4), (1, 4), (0, 4)])]:
        out = run_on_local_tensor_mesh(fn, (n,))
        assert out["shards"] == shards
        for key, want in [("full", x), ("sum0", x.sum(0)), ("to_shard1", x),
                          ("softmax0", torch.softmax(x, 0)), ("from_local", x)]:
            for v in per_rank(out[key]):
                torch.testing.assert_close(v, want, msg=f"{key} on {n} ranks")


def test_per_rank_plain_tensor():
    t = torch.ones(2)
    assert len(per_rank(t)) == 1
    assert len(per_rank(t, world_size=3)) == 3

    def fn(mesh, plain):
        made_inside = torch.ones(2)  # factory inside the mode -> LocalTensor
        return len(per_rank(plain)), per_rank(made_inside), made_inside

    n_plain, inside, lt = run_on_local_tensor_mesh(fn, (3,), t)
    assert n_plain == 3
    assert len(inside) == 3 and all(type(v) is torch.Tensor for v in inside)
    assert len(per_rank(lt)) == 3  # also works after the mode has exited

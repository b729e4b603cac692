"""Pipeline schedules played out from the order ``torch.distributed.pipelining`` runs them in
(``cost_models.pipeline``), against the closed forms of the papers where they have one."""
from __future__ import annotations

import pytest

from autopar.core.errors import AutoparError
from cost_models.pipeline import SCHEDULES, StageCost, balanced_stages, simulate, stages_per_rank

P, M = 4, 8
F, B, W = 1.0, 2.0, 1.0


def uniform(schedule: str, virtual: int = 2, activation: float = 100.0) -> list[StageCost]:
    """Stages of one model cut evenly: each rank's share of the work is the same whatever its stage count."""
    v = stages_per_rank(schedule, virtual)
    return [StageCost(F / v, B / v, W / v, activation / v)] * (P * v)


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_single_stage_schedules_have_the_gpipe_bubble(schedule):
    """(m + p - 1)(f + b), a bubble of (p - 1) / (m + p - 1). Sends across ranks lengthen GPipe by
    the first forward's way down and the last backward's way up; 1F1B, whose ranks wait on each
    other's backwards all along, by more."""
    step = simulate(schedule, uniform(schedule), P, M)
    assert step.step_s == pytest.approx((M + P - 1) * (F + B))
    assert step.bubble_fraction == pytest.approx((P - 1) / (M + P - 1))
    sent = simulate(schedule, uniform(schedule), P, M, send_s=0.25).step_s
    ends = (M + P - 1) * (F + B) + 2 * (P - 1) * 0.25
    assert sent == pytest.approx(ends) if schedule == "ScheduleGPipe" else sent > ends


def test_1f1b_keeps_fewer_microbatches_in_flight_than_gpipe():
    """GPipe keeps every microbatch's activations until its backwards; torch's 1F1B runs p - r
    forwards on rank r before its first backward, and keeps that many."""
    costs = [StageCost(F, B, 0.0, a) for a in (400.0, 300.0, 200.0, 100.0)]
    gpipe, one = simulate("ScheduleGPipe", costs, P, M), simulate("Schedule1F1B", costs, P, M)
    assert gpipe.peak_in_flight == (M,) * P
    assert one.peak_in_flight == tuple(P - r for r in range(P))
    assert one.peak_activation_bytes == tuple((P - r) * c.activation_bytes for r, c in enumerate(costs))


def test_interleaving_divides_the_bubble_by_the_virtual_stages():
    """Megatron's interleaved schedule: a bubble of (p - 1) / (v m) of the ideal step."""
    for v in (2, 4):
        step = simulate("ScheduleInterleaved1F1B", uniform("ScheduleInterleaved1F1B", v), P, M)
        assert step.step_s == pytest.approx(M * (F + B) * (1 + (P - 1) / (v * M)))


def test_every_schedule_does_the_same_work_and_the_zero_bubble_ones_idle_least():
    steps = {s: simulate(s, uniform(s), P, M) for s in SCHEDULES}
    for s, step in steps.items():   # busy time per rank: every microbatch's forward and backward
        assert [step.step_s * (1 - b) for b in step.bubble] == pytest.approx([M * (F + B)] * P), s
    one = steps["Schedule1F1B"].bubble_fraction
    assert steps["ScheduleInterleaved1F1B"].bubble_fraction < one
    assert steps["ScheduleInterleavedZeroBubble"].bubble_fraction < steps["ScheduleInterleaved1F1B"].bubble_fraction
    assert steps["ScheduleZBVZeroBubble"].bubble_fraction < steps["ScheduleInterleaved1F1B"].bubble_fraction
    # breadth first runs every forward of both local stages before a backward: the most in flight
    assert steps["ScheduleLoopedBFS"].peak_in_flight[0] == 2 * M


def test_bad_schedules_are_refused():
    with pytest.raises(AutoparError, match="unknown pipeline schedule 'Chimera'; the schedules are"):
        simulate("Chimera", uniform("ScheduleGPipe"), P, M)
    with pytest.raises(AutoparError, match="Schedule1F1B cannot run 2 microbatches on 4 ranks"):
        simulate("Schedule1F1B", uniform("Schedule1F1B"), P, 2)
    with pytest.raises(AutoparError, match="runs 8 stages, got 4"):
        simulate("ScheduleZBVZeroBubble", uniform("ScheduleGPipe"), P, M)


def test_stages_balance_the_blocks_with_the_embedding_and_the_head():
    """Even blocks cut evenly; the stages that also run the embedding or the head take fewer
    blocks; uneven blocks are cut where the slowest stage is fastest."""
    assert balanced_stages([1.0] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with_head = balanced_stages([1.0] * 8, 4, first=0.5, last=2.0)
    assert with_head[-1] == range(7, 8) and sum(len(r) for r in with_head) == 8
    assert max(sum(1.0 for _ in r) + (0.5 if k == 0 else 0) + (2.0 if k == 3 else 0)
               for k, r in enumerate(with_head)) == 3.0
    assert balanced_stages([4.0, 1.0, 1.0, 1.0, 1.0], 2) == [range(0, 1), range(1, 5)]
    with pytest.raises(AutoparError, match="3 repeated blocks cannot make 4 pipeline stages"):
        balanced_stages([1.0] * 3, 4)

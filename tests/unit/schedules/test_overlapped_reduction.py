"""The simulator's overlapped data-parallel reduction (``Costs.grad_reduce``): a chunk's buckets
become ready over its last gradient-producing interval and share one channel per rank; only what
is left when the rank reaches SYNC_GRADS is charged."""
from __future__ import annotations

import pytest

from pipedream.schedules import Kind, build_schedule, schedule_placement
from pipedream.schedules.simulate import Costs, simulate


def _sync(result, rank: int):
    return next(i for i in result.timelines[rank] if i.action.kind is Kind.SYNC_GRADS)


def _last_backward_end(result, rank: int, chunk: int) -> float:
    return max(i.end for i in result.timelines[rank]
               if i.action.kind in (Kind.BWD, Kind.WEIGHT) and i.action.chunk == chunk)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_reduction_shorter_than_the_remaining_backward_is_hidden_a_longer_one_exposed_by_the_difference(rank):
    """Interleaved p = 2, v = 2: chunk 1's gradients are final well before chunk 0's last backward,
    so chunk 1's reduction runs under it; one unit longer than that gap shows as one unit of SYNC."""
    schedule = build_schedule("interleaved", 2, 4, 2)
    base = Costs(forward=1.0, backward=2.0)
    blocking = simulate(schedule, base, vpp=2)
    gap = _sync(blocking, rank).start - _last_backward_end(blocking, rank, 1)
    assert gap > 1.0
    for seconds, exposed in ((gap / 2, 0.0), (gap + 0.7, 0.7)):
        reduce = {(r, c): seconds if c == 1 else 0.0 for r in range(2) for c in range(2)}
        result = simulate(schedule, Costs(forward=1.0, backward=2.0, grad_reduce=reduce), vpp=2)
        sync = _sync(result, rank)
        assert sync.start == pytest.approx(_sync(blocking, rank).start)   # the compute is untouched
        assert sync.end - sync.start == pytest.approx(exposed)


def test_one_chunk_exposes_its_last_bucket_or_what_outlasts_the_last_backward():
    """1F1B, B = 2, n = 4 buckets over the last backward: R = 1 leaves only the last bucket (R/n);
    R = 6 leaves R - B (1 - 1/n) = 4.5. A blocking ``sync`` is added after the reductions."""
    schedule = build_schedule("1f1b", 2, 4)
    for seconds, exposed in ((1.0, 0.25), (6.0, 4.5)):
        result = simulate(schedule, Costs(forward=1.0, backward=2.0, grad_reduce=seconds, grad_buckets=4, sync=0.5))
        for rank in range(2):
            sync = _sync(result, rank)
            assert sync.end - sync.start == pytest.approx(exposed + 0.5)


def test_reductions_of_one_rank_share_one_channel():
    """Two chunks whose reductions could each hide alone: serialised, the second waits for the first."""
    schedule = build_schedule("interleaved", 2, 4, 2)
    blocking = simulate(schedule, Costs(forward=1.0, backward=2.0), vpp=2)
    rank = 0
    chunk1_done, sync_start = _last_backward_end(blocking, rank, 1), _sync(blocking, rank).start
    long = sync_start - chunk1_done + 1.0           # chunk 1's reduction ends 1 after SYNC begins ...
    reduce = {(r, c): (long if c == 1 else 0.5) for r in range(2) for c in range(2)}
    result = simulate(schedule, Costs(forward=1.0, backward=2.0, grad_reduce=reduce), vpp=2)
    sync = _sync(result, rank)
    assert sync.end - sync.start == pytest.approx(1.0 + 0.5)   # ... and chunk 0's runs after it


def test_weight_actions_produce_the_gradients_in_split_backward_schedules():
    """zb_h2: a chunk's buckets become ready over its last W (1 long), not its last B. Two buckets
    of 1.5: the first is ready half-way through that W, so the second ends 2.5 after it."""
    placement = schedule_placement("zb_h2", 2, 1)
    schedule = build_schedule("zb_h2", 2, 4, 1)
    costs = dict(forward=1.0, backward=2.0, weight_grad=1.0)
    blocking = simulate(schedule, Costs(**costs), vpp=placement.vpp, peer=placement.peer, needs=placement.needs)
    for rank in range(2):
        last_w = max(i.end for i in blocking.timelines[rank] if i.action.kind is Kind.WEIGHT)
        assert last_w == pytest.approx(_sync(blocking, rank).start)
    result = simulate(schedule, Costs(**costs, grad_reduce=3.0, grad_buckets=2), vpp=placement.vpp, peer=placement.peer,
                      needs=placement.needs)
    assert [_sync(result, r).end - _sync(result, r).start for r in range(2)] == pytest.approx([2.5, 2.5])


def test_blocking_sync_is_unchanged_and_buckets_are_checked():
    schedule = build_schedule("1f1b", 2, 4)
    plain = simulate(schedule, Costs(forward=1.0, backward=2.0, sync=1.5))
    zero = simulate(schedule, Costs(forward=1.0, backward=2.0, sync=1.5, grad_reduce=0.0, grad_buckets=8))
    assert plain.iteration_time == zero.iteration_time == pytest.approx(simulate(schedule).iteration_time + 1.5)
    assert [_sync(plain, r).end - _sync(plain, r).start for r in range(2)] == [1.5, 1.5]
    with pytest.raises(ValueError, match="grad_buckets >= 1"):
        Costs(grad_buckets=0)

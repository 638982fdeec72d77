"""The simulator on hand-made schedules: deadlocks, mismatched channels, costs, memory."""
from __future__ import annotations

import pytest

from pipedream.schedules import ScheduleError, build_schedule, parse_actions
from pipedream.schedules.channels import ChannelError, check_channel_order
from pipedream.schedules.simulate import Costs, DeadlockError, simulate
from tests.support.schedule_checks import check_compute


def ranks(*lines: str):
    return [parse_actions(line) for line in lines]


def test_deadlock_names_each_blocked_rank() -> None:
    # Rank 0 runs one micro-batch at a time, but rank 1 wants both forwards before any backward.
    schedule = ranks("F0 SA0 RG0 B0 F1 SA1 RG1 B1",
                     "RA0 F0 RA1 F1 B0 SG0 B1 SG1")
    check_channel_order(schedule, 2, 1)  # the channels are fine; only the timing is impossible
    with pytest.raises(DeadlockError) as info:
        simulate(schedule)
    assert str(info.value) == ("deadlock: rank 0 blocked at B0 (waiting for RG0 from rank 1), "
                               "rank 1 blocked at F1 (waiting for RA1 from rank 0)")
    assert isinstance(info.value, RuntimeError)


def test_both_ranks_receiving_first_deadlocks() -> None:
    schedule = ranks("RG0 B0 F0 SA0", "RA0 F0 B0 SG0")
    with pytest.raises(DeadlockError) as info:
        simulate(schedule)
    assert str(info.value) == ("deadlock: rank 0 blocked at B0 (waiting for RG0 from rank 1), "
                               "rank 1 blocked at F0 (waiting for RA0 from rank 0)")


def test_receives_out_of_send_order() -> None:
    with pytest.raises(ChannelError, match=r"rank 0 -> rank 1: message #0 is sent for RA0 but rank 1 posts RA1"):
        check_channel_order(ranks("F0 SA0 F1 SA1", "RA1 RA0 F0 F1"), 2, 1)


def test_unmatched_send_and_receive() -> None:
    with pytest.raises(ChannelError, match="rank 0 sends a message that rank 1 never receives"):
        check_channel_order(ranks("F0 SA0 F1 SA1", "RA0 F0 F1"), 2, 1)
    with pytest.raises(ChannelError, match="rank 1 posts RA1 but rank 0 never sends it"):
        check_channel_order(ranks("F0 SA0 F1", "RA0 F0 RA1 F1"), 2, 1)
    with pytest.raises(ChannelError, match="unmatched"):
        simulate(ranks("F0 SA0 F1", "RA0 F0 RA1 F1"))


def test_consumer_without_posted_receive_and_backward_before_forward() -> None:
    with pytest.raises(ScheduleError, match="F0 consumes RA0, which is not posted before it"):
        simulate(ranks("F0 SA0", "F0 RA0"))
    with pytest.raises(ScheduleError, match="B0 comes before its forward"):
        check_compute(ranks("B0 F0"), 1, 1)
    with pytest.raises(ScheduleError, match="missing"):
        check_compute(ranks("F0 B0"), 2, 1)


def test_latency_and_bandwidth_delay_the_consumer() -> None:
    schedule = build_schedule("1f1b", 2, 1)
    costs = Costs(forward=1.0, backward=2.0, latency=0.5, bandwidth=100.0, act_bytes=50.0, grad_bytes=100.0)
    result = simulate(schedule, costs)
    # F on rank 0 [0,1], message 1.0 -> F on rank 1 [2,3], B [3,5], grad 1.5 -> B on rank 0 [6.5, 8.5]
    assert result.iteration_time == pytest.approx(8.5)
    assert [(str(i.action), i.start, i.end) for i in result.timelines[1] if i.end > i.start] == [
        ("F0", 2.0, 3.0), ("B0", 3.0, 5.0)]
    assert [(str(w.action), w.start, w.end) for w in result.waits[0]] == [("B0", 1.0, 6.5)]
    assert result.busy == [3.0, 3.0]
    assert result.idle == pytest.approx([5.5, 5.5])
    assert result.idle_fractions == pytest.approx([5.5 / 8.5] * 2)
    assert result.bubble_fraction == pytest.approx(5.5 / 3.0)


def test_per_stage_costs_and_sync_step() -> None:
    schedule = build_schedule("gpipe", 2, 2)
    costs = Costs(forward={(0, 0): 1.0, (1, 0): 3.0}, backward={(0, 0): 2.0, (1, 0): 6.0}, sync=1.0, step=0.5)
    result = simulate(schedule, costs)
    # rank 1 is the bottleneck: F [1,4],[4,7], B [7,13],[13,19]; rank 0 B [13,15],[19,21] + 1.5
    assert result.iteration_time == pytest.approx(22.5)
    assert result.busy == [6.0, 18.0]
    assert result.idle == pytest.approx([22.5 - 6.0 - 1.5, 22.5 - 18.0 - 1.5])
    with pytest.raises(KeyError, match=r"Costs.forward has no entry for \(rank, chunk\) = \(1, 0\)"):
        simulate(schedule, Costs(forward={(0, 0): 1.0}))


def test_weight_gradients_run_after_sends_and_held_back() -> None:
    """F = 1, B = 2 of which W = 1 runs after the send: 1F1B at p = 2, m = 8 takes 27 units whole,
    26 with W right after its own send and 25 held behind the next backward's send (the last
    stage skips one W before its second forward); GPipe gains the first unit only. The first
    stage holds its W behind the next forward's activation send."""
    schedule = build_schedule("1f1b", 2, 8)
    whole = simulate(schedule, Costs(forward=1.0, backward=2.0))
    split = Costs(forward=1.0, backward=2.0, weight_grad=1.0)
    at_send, held = (simulate(schedule, split, weight_grads_delay=d) for d in (0, 1))
    assert (whole.iteration_time, at_send.iteration_time, held.iteration_time) == (27.0, 26.0, 25.0)
    assert held.busy == whole.busy == [24.0, 24.0]
    # rank 1 sends every backward's input gradient: W(k) runs after B(k+1) (and its send)
    labels = [("W" if i.weight_grads else "") + str(i.action) for i in held.timelines[1]]
    assert labels[:5] == ["F0", "B0", "F1", "B1", "WB0"]
    assert labels[-6:] == ["F7", "B7", "WB6", "WB7", "SYNC", "STEP"]
    assert [label for label in labels if label.startswith("W")] == [f"WB{k}" for k in range(8)]
    # the first stage sends no gradient: its W(k) waits for the activation send of F(k+2), except
    # where a backward follows (the drain)
    first = [("W" if i.weight_grads else "") + str(i.action) for i in held.timelines[0]]
    assert first[:8] == ["F0", "F1", "B0", "F2", "WB0", "B1", "F3", "WB1"]
    assert first[-6:] == ["F7", "WB5", "B6", "B7", "SYNC", "STEP"]
    gpipe = build_schedule("gpipe", 2, 8)
    assert [simulate(gpipe, split, weight_grads_delay=d).iteration_time for d in (0, 1)] == [26.0, 26.0]


def test_stash_bytes_follow_in_flight() -> None:
    stash = {(r, c): 10.0 * (c + 1) for r in range(4) for c in range(2)}
    result = simulate(build_schedule("1f1b", 4, 8), Costs(stash_bytes={(r, 0): 7.0 for r in range(4)}))
    assert result.peak_in_flight == [4, 3, 2, 1]
    assert result.peak_stash_bytes == [28.0, 21.0, 14.0, 7.0]
    result = simulate(build_schedule("interleaved", 4, 8, 2), Costs(stash_bytes=stash))
    assert all(b >= 10.0 * n for b, n in zip(result.peak_stash_bytes, result.peak_in_flight))
    assert result.peak_stash_bytes[3] == 10.0 * 4 + 20.0  # warm-up 0..3 on chunk 0, then F0 of chunk 1


def test_custom_peer_function_is_used() -> None:
    schedule = ranks("F0 SA0 RG0 B0", "RA0 F0 B0 SG0")
    swapped = []

    def peer(rank, action, pp, vpp):
        swapped.append(str(action))
        return 1 - rank, 0

    result = simulate(schedule, Costs(backward=1.0), peer=peer)
    assert result.iteration_time == 4.0 and "SA0" in swapped

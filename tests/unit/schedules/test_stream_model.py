"""Point-to-point order under NCCL's rules (``stream_model``): the executor's issue order never
deadlocks with one process group per direction, for every schedule and size, and it does deadlock
when both directions share a stream, which is why the runtime uses two groups."""
from __future__ import annotations

import pytest

from pipedream.schedules.async_segment import build_segment
from pipedream.config.layout import ParallelLayout
from pipedream.schedules import ScheduleError, build_schedule, parse_actions
from pipedream.schedules.issue_order import issue_order
from pipedream.schedules.replicated import ReplicatedPipeline
from pipedream.schedules.simulate import DeadlockError, simulate
from pipedream.schedules.stream_model import check_stream_order

FLUSH = ("gpipe", "1f1b", "interleaved")


def orders(schedule: str, pp: int, m: int, vpp: int = 1) -> list:
    return [issue_order(actions) for actions in build_schedule(schedule, pp, m, vpp)]


def test_issue_order_posts_receives_one_compute_ahead() -> None:
    actions = parse_actions("RA0 F0 SA0 RA1 F1 SA1 RG0 B0 SG0 RG1 B1 SG1 SYNC STEP")
    assert issue_order(actions) == parse_actions("RA0 RA1 F0 SA0 RG0 F1 SA1 RG1 B0 SG0 B1 SG1 SYNC STEP")


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("schedule", FLUSH)
def test_every_flush_schedule_and_size_is_deadlock_free_on_directed_streams(schedule: str, pp: int) -> None:
    checked = 0
    for m in range(1, 33):
        for vpp in range(1, 5 if schedule == "interleaved" else 2):
            try:
                per_rank = orders(schedule, pp, m, vpp)
            except ScheduleError:
                continue
            check_stream_order(per_rank, pp, vpp, streams="direction")
            checked += 1
    assert checked >= 32   # every m with one chunk, and more interleaved


@pytest.mark.parametrize("schedule,replicas,m", [
    ("2bw", (1, 1), 2), ("2bw", (1, 1, 1, 1), 4), ("2bw", (1, 1, 1), 5), ("pipedream", (1, 1), 1),
    ("pipedream", (1, 1, 1, 1), 3), ("pipedream", (2, 1), 2), ("pipedream", (1, 2, 1), 4), ("pipedream", (3, 2, 1), 6)])
def test_asynchronous_windows_are_deadlock_free_on_directed_streams(schedule, replicas, m) -> None:
    """What the runtime runs: each step's window, then the loss all-reduce of every rank."""
    topology = ReplicatedPipeline(replicas)
    segment = build_segment(schedule, topology, m, 4)
    per_rank = [[a for window in windows for a in issue_order(list(window)) + [None]] for windows in segment.windows]
    for streams in ("channel", "direction"):
        check_stream_order(per_rank, topology.pp, 1, streams=streams, peer=topology.peer, needs=topology.needs,
                           sync_groups=topology.sync_group, sends_before_sync=False)


def test_one_stream_for_both_directions_deadlocks() -> None:
    """1F1B on 2 ranks: rank 0 posts RG0 before F1, rank 1 posts RA1 before B0; with both directions
    on one stream each receive blocks the send its peer waits for. Gloo's rules (the simulator) run it."""
    per_rank = orders("1f1b", 2, 4)
    simulate(build_schedule("1f1b", 2, 4))
    for streams in ("pair", "group"):
        with pytest.raises(DeadlockError) as info:
            check_stream_order(per_rank, 2, 1, streams=streams)
        message = str(info.value)
        assert "rank 0: compute at B0 (waiting for RG0)" in message
        assert "rank 1: compute at F1 (waiting for RA1)" in message
    check_stream_order(per_rank, 2, 1, streams="channel")


def test_unmatched_and_unposted_messages_are_reported() -> None:
    with pytest.raises(DeadlockError, match="1 sends but 0 receives"):
        check_stream_order([parse_actions("F0 SA0"), []], 2, 1)
    with pytest.raises(DeadlockError, match="F0 consumes RA0, which is not posted before it"):
        check_stream_order([parse_actions("F0 SA0"), parse_actions("F0 RA0")], 2, 1)


def test_p2p_channels_cover_every_message_of_every_layout() -> None:
    cases = [(ParallelLayout(pp=2), "1f1b", 4), (ParallelLayout(pp=3, dp=2, tp=2), "1f1b", 4),
             (ParallelLayout(pp=2, vpp=2), "interleaved", 4), (ParallelLayout(pp=4, vpp=3), "interleaved", 8)]
    for layout, schedule, m in cases:
        schedule_actions = build_schedule(schedule, layout.pp, m, layout.vpp)
        used = set()
        for rank in range(layout.world_size):
            for action in schedule_actions[layout.coords(rank).pp]:
                if action.kind.name.startswith("SEND"):
                    used.add((rank, layout.peer_rank(rank, action.microbatch, action.chunk, action.kind.name == "SEND_ACT")))
        channels = layout.p2p_channels()
        assert used <= set(channels) and channels == sorted(channels)
        assert all((dst, src) in channels for src, dst in channels)
    replicated = ParallelLayout(pp=3, stage_replicas=(2, 1, 2))
    assert replicated.p2p_channels() == [(0, 2), (1, 2), (2, 0), (2, 1), (2, 3), (2, 4), (3, 2), (4, 2)]
    assert ParallelLayout(pp=1, dp=2).p2p_channels() == []

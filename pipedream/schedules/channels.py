"""Point-to-point channels of a schedule: every send has its receive, posted in send order.

NCCL (and the executor's Gloo path) match messages on each ordered (src, dst) pair by order, so a
schedule whose receives are posted in another order pairs the wrong tensors. Checked on the action
lists alone, before any simulation or process (``pipedream.schedules.simulate`` runs it first).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from pipedream.schedules.actions import COMM_KINDS, Action, Kind
from pipedream.schedules.placement import Placement
from pipedream.schedules.actions import ScheduleError

PeerFn = Callable[[int, Action, int, int], tuple[int, int]]
"""(rank, comm action, pp, vpp) -> (peer rank, peer chunk)."""

RECEIVE_OF = {  # a send -> the receive that matches it
    Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}


class ChannelError(ScheduleError):
    """Sends and receives do not match (count or order) on some (src, dst) channel."""


def _messages(schedule: list[list[Action]], pp: int, vpp: int, peer: PeerFn) -> tuple[dict, dict]:
    """Per (src, dst): the receiver-side actions in send order, and the receives in post order."""
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule):
        for action in actions:
            if action.kind in RECEIVE_OF:
                dst, chunk = peer(rank, action, pp, vpp)
                sends.setdefault((rank, dst), []).append(Action(RECEIVE_OF[action.kind], action.microbatch, chunk))
            elif action.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                src, _ = peer(rank, action, pp, vpp)
                recvs.setdefault((src, rank), []).append(action)
    return sends, recvs


def _check_matching(sends: dict, recvs: dict) -> None:
    problems = []
    for src, dst in sorted(set(sends) | set(recvs)):
        sent, posted = Counter(sends.get((src, dst), [])), Counter(recvs.get((src, dst), []))
        for msg in sorted(sent - posted, key=str):
            problems.append(f"rank {src} sends a message that rank {dst} never receives ({msg} is not posted there)")
        for msg in sorted(posted - sent, key=str):
            problems.append(f"rank {dst} posts {msg} but rank {src} never sends it")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ChannelError("unmatched communication: " + "; ".join(problems[:3]) + more)


def check_channel_order(schedule: list[list[Action]], pp: int, vpp: int, peer: PeerFn | None = None) -> None:
    """For each ordered (src, dst) pair, receives are posted in the order the sends are issued.

    NCCL matches point-to-point messages by order, so any other order pairs the wrong tensors.
    Checks matching first; raises ChannelError.
    """
    checked_peers(schedule, pp, vpp, peer)


def checked_peers(schedule: list[list[Action]], pp: int, vpp: int,
                  peer: PeerFn | None = None) -> list[list[tuple[int, int] | None]]:
    """``check_channel_order``, returning each action's ``peer`` (None for a non-comm action), so
    that the simulator need not ask again. ``peer`` defaults to round-robin placement's."""
    if peer is None:
        peer = Placement(pp, vpp).peer
    peers = [[peer(rank, a, pp, vpp) if a.kind in COMM_KINDS else None for a in actions]
             for rank, actions in enumerate(schedule)]
    # messages as (receive kind, microbatch, chunk) per channel: equal lists on both sides leave
    # nothing to report, and the common case compares them without building actions or counters
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    for rank, (actions, ends) in enumerate(zip(schedule, peers)):
        for action, end in zip(actions, ends):
            if end is None:
                continue
            receive = RECEIVE_OF.get(action.kind)
            if receive is not None:
                sends.setdefault((rank, end[0]), []).append((receive, action.microbatch, end[1]))
            else:
                recvs.setdefault((end[0], rank), []).append((action.kind, action.microbatch, action.chunk))
    if sends != recvs:
        _raise_channel_error(schedule, pp, vpp, peer)
    return peers


def _raise_channel_error(schedule: list[list[Action]], pp: int, vpp: int, peer: PeerFn) -> None:
    """Names the first unmatched or out-of-order message."""
    sends, recvs = _messages(schedule, pp, vpp, peer)
    _check_matching(sends, recvs)
    for channel in sorted(sends):
        for i, (sent, posted) in enumerate(zip(sends[channel], recvs[channel])):
            if sent != posted:
                src, dst = channel
                raise ChannelError(f"channel rank {src} -> rank {dst}: message #{i} is sent for {sent} but rank "
                                   f"{dst} posts {posted} there; receives must follow the send order")

"""Run schedule action lists against a cost model, without torch or processes.

The execution model is the executor's: sends never block the sender, a RECV only posts a receive
(zero cost), and the FWD/BWD that consumes a message waits until it has arrived. Messages on each
ordered (src, dst) channel are matched by order, as NCCL does. The simulator gives timelines, the
iteration time, bubbles, peak in-flight micro-batches and stash bytes, and finds deadlocks and
mismatched communication before any process is started. Used by tests, the planner and plots.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Hashable, Union

from pipedream.schedules.actions import COMPUTE_KINDS, Action, Kind
from pipedream.schedules.common import ScheduleError, needed_receive, peer_stage

PeerFn = Callable[[int, Action, int, int], tuple[int, int]]
"""(rank, comm action, pp, vpp) -> (peer rank, peer chunk)."""
NeedsFn = Callable[[int, Action], Union[Action, None]]
"""(rank, compute action) -> the receive it consumes, or None."""
SyncGroupFn = Callable[[int], Union[Hashable, None]]
"""rank -> the group whose members' SYNC_GRADS meet (an all-reduce), or None for a local one."""
Value = Union[float, Mapping[tuple[int, int], float]]
"""A scalar for every (rank, chunk), or a mapping (rank, chunk) -> value."""

_RECV_OF = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}


class DeadlockError(RuntimeError):
    """No rank can make progress; the message names where each rank is blocked."""


class ChannelError(ScheduleError):
    """Sends and receives do not match (count or order) on some (src, dst) channel."""


@dataclass(frozen=True)
class Costs:
    """Durations (any time unit) and sizes (bytes) for the simulator.

    ``forward``/``backward``: per (rank, chunk) duration of one micro-batch's FWD/BWD.
    A message sent by (rank, chunk) takes ``latency + bytes / bandwidth``, with ``act_bytes`` for
    activations and ``grad_bytes`` for gradients; messages on one channel are serialized.
    ``stash_bytes``: activation bytes (rank, chunk) keeps per in-flight micro-batch.
    ``sync``/``step``: SYNC_GRADS and STEP durations (0 by default so bubbles are pure pipeline).
    ``weight_grad``: the part of ``backward`` that is weight-gradient GEMMs, which a backward whose
    input gradient is sent runs after that send, held back behind later sends as the executor
    does (``simulate``'s ``weight_grads_delay``); 0 runs every backward whole.
    """

    forward: Value = 1.0
    backward: Value = 2.0
    latency: float = 0.0
    bandwidth: float = math.inf
    act_bytes: Value = 0.0
    grad_bytes: Value = 0.0
    stash_bytes: Value = 0.0
    sync: float = 0.0
    step: float = 0.0
    weight_grad: Value = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0 or self.sync < 0 or self.step < 0:
            raise ValueError(f"Costs need bandwidth > 0 and latency, sync, step >= 0; got {self}")

    def of(self, name: str, rank: int, chunk: int) -> float:
        value = getattr(self, name)
        if isinstance(value, Mapping):
            if (rank, chunk) not in value:
                raise KeyError(f"Costs.{name} has no entry for (rank, chunk) = ({rank}, {chunk})")
            return float(value[(rank, chunk)])
        return float(value)


@dataclass(frozen=True)
class Interval:
    """``action`` ran (or, in ``SimResult.waits``, waited for its input) from ``start`` to ``end``."""

    action: Action
    start: float
    end: float
    weight_grads: bool = False   # the held-back weight-gradient GEMMs of the BWD ``action``


@dataclass(frozen=True)
class SimResult:
    """What one simulated iteration looked like.

    ``bubble_fractions[r]`` = idle time of rank r / its compute (FWD+BWD) time: the dissertation's
    "bubble time fraction" t_pb / t_id, (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) interleaved.
    ``idle_fractions[r]`` = idle time / iteration time. Idle excludes SYNC_GRADS and STEP.
    ``bubble_fraction`` and ``idle_fraction`` are the same over all ranks (summed device time).
    """

    pp: int
    vpp: int
    timelines: list[list[Interval]]
    waits: list[list[Interval]]
    iteration_time: float
    busy: list[float]
    idle: list[float]
    bubble_fractions: list[float]
    idle_fractions: list[float]
    bubble_fraction: float
    idle_fraction: float
    peak_in_flight: list[int]
    peak_stash_bytes: list[float]
    starts: list[list[float]] = field(default_factory=list)  # per rank, per action: when it started


def _messages(schedule: list[list[Action]], pp: int, vpp: int, peer: PeerFn) -> tuple[dict, dict]:
    """Per (src, dst): the receiver-side actions in send order, and the receives in post order."""
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule):
        for action in actions:
            if action.kind in _RECV_OF:
                dst, chunk = peer(rank, action, pp, vpp)
                sends.setdefault((rank, dst), []).append(Action(_RECV_OF[action.kind], action.microbatch, chunk))
            elif action.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                src, _ = peer(rank, action, pp, vpp)
                recvs.setdefault((src, rank), []).append(action)
    return sends, recvs


def check_matching(schedule: list[list[Action]], pp: int, vpp: int, peer: PeerFn = peer_stage) -> None:
    """Every send has exactly one matching receive and vice versa; else ChannelError."""
    _check_matching(*_messages(schedule, pp, vpp, peer))


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


def check_channel_order(schedule: list[list[Action]], pp: int, vpp: int, peer: PeerFn = peer_stage) -> None:
    """For each ordered (src, dst) pair, receives are posted in the order the sends are issued.

    NCCL matches point-to-point messages by order, so any other order pairs the wrong tensors.
    Checks matching first; raises ChannelError.
    """
    sends, recvs = _messages(schedule, pp, vpp, peer)
    _check_matching(sends, recvs)
    for channel in sorted(sends):
        for i, (sent, posted) in enumerate(zip(sends[channel], recvs[channel])):
            if sent != posted:
                src, dst = channel
                raise ChannelError(f"channel rank {src} -> rank {dst}: message #{i} is sent for {sent} but rank "
                                   f"{dst} posts {posted} there; receives must follow the send order")


def check_compute(schedule: list[list[Action]], microbatches: int, vpp: int) -> None:
    """Each rank forwards and backwards every (microbatch, chunk) exactly once, backward after forward."""
    expected = {(mb, c) for mb in range(microbatches) for c in range(vpp)}
    for rank, actions in enumerate(schedule):
        seen: dict[Kind, set[tuple[int, int]]] = {Kind.FWD: set(), Kind.BWD: set()}
        for action in actions:
            if action.kind not in COMPUTE_KINDS:
                continue
            key = (action.microbatch, action.chunk)
            if key in seen[action.kind]:
                raise ScheduleError(f"rank {rank}: {action} appears twice")
            if action.kind is Kind.BWD and key not in seen[Kind.FWD]:
                raise ScheduleError(f"rank {rank}: {action} comes before its forward")
            seen[action.kind].add(key)
        for kind, keys in seen.items():
            if keys != expected:
                missing = sorted(expected - keys)[:3]
                raise ScheduleError(f"rank {rank}: {kind.name} covers {len(keys)} of {len(expected)} "
                                    f"(microbatch, chunk) pairs; missing e.g. {missing}")


def simulate(schedule: list[list[Action]], costs: Costs | None = None, *, vpp: int | None = None,
             peer: PeerFn = peer_stage, needs: NeedsFn | None = None,
             sync_groups: SyncGroupFn | None = None, weight_grads_delay: int = 1) -> SimResult:
    """Simulate one iteration; raises ChannelError, ScheduleError or DeadlockError.

    ``needs`` tells which receive a compute consumes (default: by pipeline position, as
    ``needed_receive``). With ``sync_groups``, the n-th SYNC_GRADS of every member of a group starts
    when the last member reaches it (an all-reduce), so collectives take part in deadlock detection.
    With ``costs.weight_grad``, a backward's weight-gradient part runs once ``weight_grads_delay``
    later backwards of its rank have sent their input gradients, or before SYNC_GRADS.
    """
    costs = costs or Costs()
    pp = len(schedule)
    vpp = vpp or 1 + max((a.chunk for actions in schedule for a in actions), default=0)
    if needs is None:
        def needs(rank: int, action: Action) -> Action | None:
            return needed_receive(rank, action, pp, vpp)
    check_channel_order(schedule, pp, vpp, peer)
    members: dict[Hashable, list[int]] = {}
    for rank in range(pp):
        group = sync_groups(rank) if sync_groups else None
        if group is not None:
            members.setdefault(group, []).append(rank)
    syncs_done = [0] * pp
    sync_arrivals: dict[tuple[Hashable, int], dict[int, float]] = {}
    starts: list[list[float]] = [[] for _ in range(pp)]

    pc, clock = [0] * pp, [0.0] * pp
    arrivals: dict[tuple[int, int], list[float]] = {}  # channel -> arrival time of each sent message
    channel_free: dict[tuple[int, int], float] = {}
    posted: list[dict[Action, tuple[int, int]]] = [{} for _ in range(pp)]  # recv -> (src, index)
    n_posted: list[Counter] = [Counter() for _ in range(pp)]
    timelines: list[list[Interval]] = [[] for _ in range(pp)]
    waits: list[list[Interval]] = [[] for _ in range(pp)]
    in_flight: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    stash, peak, peak_stash = [0.0] * pp, [0] * pp, [0.0] * pp
    sent_back = {(rank, a.microbatch, a.chunk) for rank, actions in enumerate(schedule)
                 for a in actions if a.kind is Kind.SEND_GRAD}
    held: list[list[tuple[Action, float]]] = [[] for _ in range(pp)]   # weight-gradient parts, oldest first

    def run_weight_grads(rank: int, keep: int) -> None:
        while len(held[rank]) > keep:
            action, duration = held[rank].pop(0)
            timelines[rank].append(Interval(action, clock[rank], clock[rank] + duration, weight_grads=True))
            clock[rank] += duration

    def advance(rank: int, action: Action) -> bool:
        """Run ``action`` on ``rank`` if its input is there; False when blocked."""
        kind, key = action.kind, (action.microbatch, action.chunk)
        if kind in (Kind.RECV_ACT, Kind.RECV_GRAD, *_RECV_OF):
            starts[rank].append(clock[rank])
        if kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            src, _ = peer(rank, action, pp, vpp)
            posted[rank][action] = (src, n_posted[rank][src])
            n_posted[rank][src] += 1
            return True
        if kind in _RECV_OF:
            dst, _ = peer(rank, action, pp, vpp)
            size = costs.of("act_bytes" if kind is Kind.SEND_ACT else "grad_bytes", rank, action.chunk)
            start = max(clock[rank], channel_free.get((rank, dst), 0.0))
            channel_free[(rank, dst)] = start + size / costs.bandwidth
            arrivals.setdefault((rank, dst), []).append(start + size / costs.bandwidth + costs.latency)
            if kind is Kind.SEND_GRAD:
                run_weight_grads(rank, weight_grads_delay)
            return True
        start = clock[rank]
        if kind in COMPUTE_KINDS:
            need = needs(rank, action)
            if need is not None:
                if need not in posted[rank]:
                    raise ScheduleError(f"rank {rank}: {action} consumes {need}, which is not posted before it")
                src, index = posted[rank][need]
                if index >= len(arrivals.get((src, rank), [])):
                    return False
                del posted[rank][need]
                start = max(start, arrivals[(src, rank)][index])
                if start > clock[rank]:
                    waits[rank].append(Interval(action, clock[rank], start))
            if kind is Kind.FWD:
                in_flight[rank].add(key)
                stash[rank] += costs.of("stash_bytes", rank, action.chunk)
                peak[rank] = max(peak[rank], len(in_flight[rank]))
                peak_stash[rank] = max(peak_stash[rank], stash[rank])
                duration = costs.of("forward", rank, action.chunk)
            else:
                if key not in in_flight[rank]:
                    raise ScheduleError(f"rank {rank}: {action} runs without an earlier forward")
                in_flight[rank].remove(key)
                stash[rank] -= costs.of("stash_bytes", rank, action.chunk)
                duration = costs.of("backward", rank, action.chunk)
                weight_grad = costs.of("weight_grad", rank, action.chunk)
                if weight_grad > 0 and (rank, *key) in sent_back:
                    duration -= weight_grad
                    held[rank].append((action, weight_grad))
        else:
            if kind is Kind.SYNC_GRADS:
                run_weight_grads(rank, 0)
                start = clock[rank]
            duration = costs.sync if kind is Kind.SYNC_GRADS else costs.step
            group = sync_groups(rank) if sync_groups and kind is Kind.SYNC_GRADS else None
            if group is not None:
                arrived = sync_arrivals.setdefault((group, syncs_done[rank]), {})
                arrived[rank] = clock[rank]
                if len(arrived) < len(members[group]):
                    return False
                start = max(arrived.values())
                syncs_done[rank] += 1
        starts[rank].append(start)
        timelines[rank].append(Interval(action, start, start + duration))
        clock[rank] = start + duration
        return True

    while any(pc[r] < len(schedule[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            while pc[rank] < len(schedule[rank]) and advance(rank, schedule[rank][pc[rank]]):
                pc[rank] += 1
                progressed = True
        if not progressed:
            raise DeadlockError(_describe_deadlock(schedule, pc, posted, pp, vpp, peer, needs))
    for rank in range(pp):
        run_weight_grads(rank, 0)
    return _result(pp, vpp, timelines, waits, clock, peak, peak_stash, starts)


def _describe_deadlock(schedule: list[list[Action]], pc: list[int], posted: list[dict[Action, tuple[int, int]]],
                       pp: int, vpp: int, peer: PeerFn, needs: NeedsFn) -> str:
    blocked = []
    for rank, actions in enumerate(schedule):
        if pc[rank] < len(actions):
            action = actions[pc[rank]]
            if action.kind is Kind.SYNC_GRADS:
                blocked.append(f"rank {rank} blocked at {action} (waiting for the other members of its all-reduce)")
                continue
            need = needs(rank, action)
            src = posted[rank][need][0] if need in posted[rank] else peer(rank, need, pp, vpp)[0]
            blocked.append(f"rank {rank} blocked at {action} (waiting for {need} from rank {src})")
    return "deadlock: " + ", ".join(blocked)


def _result(pp: int, vpp: int, timelines: list[list[Interval]], waits: list[list[Interval]], clock: list[float],
            peak: list[int], peak_stash: list[float], starts: list[list[float]]) -> SimResult:
    total = max(clock, default=0.0)
    busy = [sum(i.end - i.start for i in tl if i.action.kind in COMPUTE_KINDS) for tl in timelines]
    other = [sum(i.end - i.start for i in tl if i.action.kind not in COMPUTE_KINDS) for tl in timelines]
    idle = [total - b - o for b, o in zip(busy, other)]
    return SimResult(
        pp=pp, vpp=vpp, timelines=timelines, waits=waits, iteration_time=total, busy=busy, idle=idle,
        bubble_fractions=[i / b if b else 0.0 for i, b in zip(idle, busy)],
        idle_fractions=[i / total if total else 0.0 for i in idle],
        bubble_fraction=sum(idle) / sum(busy) if sum(busy) else 0.0,
        idle_fraction=sum(idle) / (pp * total) if total else 0.0,
        peak_in_flight=list(peak), peak_stash_bytes=list(peak_stash), starts=starts)

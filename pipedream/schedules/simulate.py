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
from pipedream.schedules.channels import RECEIVE_OF, PeerFn, check_channel_order
from pipedream.schedules.common import needed_receive, peer_stage
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.weight_hold import held_until_activation_send

NeedsFn = Callable[[int, Action], Union[Action, None]]
"""(rank, compute action) -> the receive it consumes, or None."""
SyncGroupFn = Callable[[int], Union[Hashable, None]]
"""rank -> the group whose members' SYNC_GRADS meet (an all-reduce), or None for a local one."""
Value = Union[float, Mapping[tuple[int, int], float]]
"""A scalar for every (rank, chunk), or a mapping (rank, chunk) -> value."""

class DeadlockError(RuntimeError):
    """No rank can make progress; the message names where each rank is blocked."""


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
    does (``simulate``'s ``weight_grads_delay``); 0 runs every backward whole. In a schedule with
    WEIGHT actions, BWD takes ``backward - weight_grad`` and each WEIGHT takes ``weight_grad``.
    ``grad_reduce``: per (rank, chunk) duration of the data-parallel reduction of that chunk's
    gradients when it overlaps the backward (``train.overlap_grad_reduce``), in ``grad_buckets``
    equal buckets that become ready evenly over the chunk's last gradient-producing interval (its
    last BWD, held-back weight gradients or WEIGHT) and run one at a time per rank; SYNC_GRADS then
    ends at max(its start, the last bucket's end) + ``sync``. 0 (the default): no overlapped part,
    ``sync`` is the whole (blocking) reduction.
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
    grad_reduce: Value = 0.0
    grad_buckets: Value = 1

    def __post_init__(self) -> None:
        buckets = self.grad_buckets.values() if isinstance(self.grad_buckets, Mapping) else [self.grad_buckets]
        if not self.bandwidth > 0 or self.latency < 0 or self.sync < 0 or self.step < 0 or min(buckets, default=1) < 1:
            raise ValueError(f"Costs need bandwidth > 0, latency, sync, step >= 0 and grad_buckets >= 1; got {self}")

    @property
    def overlaps_reduction(self) -> bool:
        return isinstance(self.grad_reduce, Mapping) or self.grad_reduce > 0

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
    ``steady_bubble_fraction`` counts only the idle time between a rank's first and last compute:
    the bubble left when iterations follow each other without a global synchronisation at the
    optimizer step, where one iteration's drain overlaps the next one's fill.
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
    steady_bubble_fraction: float = 0.0


def simulate(schedule: list[list[Action]], costs: Costs | None = None, *, vpp: int | None = None,
             peer: PeerFn = peer_stage, needs: NeedsFn | None = None,
             sync_groups: SyncGroupFn | None = None, weight_grads_delay: int = 1) -> SimResult:
    """Simulate one iteration; raises ChannelError, ScheduleError or DeadlockError.

    ``needs`` tells which receive a compute consumes (default: by pipeline position, as
    ``needed_receive``). With ``sync_groups``, the n-th SYNC_GRADS of every member of a group starts
    when the last member reaches it (an all-reduce), so collectives take part in deadlock detection.
    With ``costs.weight_grad``, a backward's weight-gradient part runs once ``weight_grads_delay``
    later backwards of its rank have sent their input gradients, or before SYNC_GRADS, unless the
    schedule places it as a WEIGHT action. A micro-batch counts as in flight (and stashed) from its
    FWD to its BWD, or to its WEIGHT where there is one (the weight gradient needs the activations).
    """
    pp = len(schedule)
    vpp = vpp or 1 + max((a.chunk for actions in schedule for a in actions), default=0)
    if needs is None:
        def needs(rank: int, action: Action) -> Action | None:
            return needed_receive(rank, action, pp, vpp)
    check_channel_order(schedule, pp, vpp, peer)
    simulation = _Simulation(schedule, costs or Costs(), vpp, peer, needs, sync_groups, weight_grads_delay)
    simulation.run()
    return _result(pp, vpp, simulation.ranks)


@dataclass
class _Rank:
    """One rank's progress through its action list."""

    pc: int = 0                      # index of the next action
    clock: float = 0.0
    posted: dict[Action, tuple[int, int]] = field(default_factory=dict)   # recv -> (src, index on that channel)
    n_posted: Counter = field(default_factory=Counter)                    # src -> receives posted so far
    timeline: list[Interval] = field(default_factory=list)
    waits: list[Interval] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    in_flight: set[tuple[int, int]] = field(default_factory=set)          # (microbatch, chunk) forwarded, not back
    backed: set[tuple[int, int]] = field(default_factory=set)             # BWD done, its WEIGHT not yet
    stash: float = 0.0
    peak: int = 0
    peak_stash: float = 0.0
    held: list[tuple[Action, float]] = field(default_factory=list)       # weight-gradient parts, oldest first
    syncs_done: int = 0

    def run(self, action: Action, start: float, duration: float) -> None:
        self.starts.append(start)
        self.timeline.append(Interval(action, start, start + duration))
        self.clock = start + duration

    def run_weight_grads(self, keep: int) -> None:
        """Runs the held-back weight-gradient parts, oldest first, until ``keep`` are left."""
        while len(self.held) > keep:
            action, duration = self.held.pop(0)
            self.timeline.append(Interval(action, self.clock, self.clock + duration, weight_grads=True))
            self.clock += duration

    def run_held_until(self, send: Action, held_until: dict[Action, Action]) -> None:
        """Runs the weight-gradient parts held until ``send`` (a first stage's), leaving the others."""
        for entry in [e for e in self.held if held_until.get(e[0]) == send]:
            self.held.remove(entry)
            action, duration = entry
            self.timeline.append(Interval(action, self.clock, self.clock + duration, weight_grads=True))
            self.clock += duration


class _Simulation:
    """One iteration in progress: every rank runs its actions in turn until it is blocked (an input
    not yet sent, an all-reduce whose members have not all arrived) or done."""

    def __init__(self, schedule: list[list[Action]], costs: Costs, vpp: int, peer: PeerFn, needs: NeedsFn,
                 sync_groups: SyncGroupFn | None, weight_grads_delay: int) -> None:
        self.schedule, self.costs, self.pp, self.vpp = schedule, costs, len(schedule), vpp
        self.peer, self.needs, self.sync_groups = peer, needs, sync_groups
        self.weight_grads_delay = weight_grads_delay
        self.ranks = [_Rank() for _ in schedule]
        self.arrivals: dict[tuple[int, int], list[float]] = {}  # channel -> arrival time of each sent message
        self.channel_free: dict[tuple[int, int], float] = {}    # channel -> when its link is free again
        self.members: dict[Hashable, list[int]] = {}            # sync group -> its ranks
        for rank in range(self.pp):
            group = sync_groups(rank) if sync_groups else None
            if group is not None:
                self.members.setdefault(group, []).append(rank)
        self.sync_arrivals: dict[tuple[Hashable, int], dict[int, float]] = {}  # (group, n-th sync) -> rank -> time
        # backwards that send an input gradient: only those hold their weight-gradient part back
        self.sends_grad = {(rank, a.microbatch, a.chunk) for rank, actions in enumerate(schedule)
                           for a in actions if a.kind is Kind.SEND_GRAD}
        self.explicit_weight = {(rank, a.microbatch, a.chunk) for rank, actions in enumerate(schedule)
                                for a in actions if a.kind is Kind.WEIGHT}
        # backwards that send none (the first stage's) but precede a forward's activation send: held
        # until that send, as the executor does (``schedules.weight_hold``)
        self.held_until = [held_until_activation_send(actions) for actions in schedule]

    def run(self) -> None:
        while any(state.pc < len(actions) for state, actions in zip(self.ranks, self.schedule)):
            if not self._run_until_blocked():
                raise DeadlockError(_describe_deadlock(self.schedule, [s.pc for s in self.ranks],
                                                       [s.posted for s in self.ranks], self.pp, self.vpp,
                                                       self.peer, self.needs))
        for state in self.ranks:
            state.run_weight_grads(0)

    def _run_until_blocked(self) -> bool:
        """One pass over the ranks; False when none of them could run anything."""
        progressed = False
        for rank, (state, actions) in enumerate(zip(self.ranks, self.schedule)):
            while state.pc < len(actions) and self._advance(rank, actions[state.pc]):
                state.pc += 1
                progressed = True
        return progressed

    def _advance(self, rank: int, action: Action) -> bool:
        """Run ``action`` on ``rank`` if its input is there; False when blocked."""
        if action.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            self._post_receive(rank, action)
            return True
        if action.kind in RECEIVE_OF:
            self._send(rank, action)
            return True
        if action.kind in COMPUTE_KINDS:
            return self._compute(rank, action)
        if action.kind is Kind.SYNC_GRADS:
            return self._sync_grads(rank, action)
        state = self.ranks[rank]
        state.run(action, state.clock, self.costs.step)
        return True

    def _post_receive(self, rank: int, action: Action) -> None:
        """Posting costs nothing; the compute that consumes the message waits for it."""
        state = self.ranks[rank]
        state.starts.append(state.clock)
        src, _ = self.peer(rank, action, self.pp, self.vpp)
        state.posted[action] = (src, state.n_posted[src])
        state.n_posted[src] += 1

    def _send(self, rank: int, action: Action) -> None:
        """Never blocks the sender; the message queues behind earlier ones on its channel."""
        state, costs = self.ranks[rank], self.costs
        state.starts.append(state.clock)
        dst, _ = self.peer(rank, action, self.pp, self.vpp)
        size = costs.of("act_bytes" if action.kind is Kind.SEND_ACT else "grad_bytes", rank, action.chunk)
        start = max(state.clock, self.channel_free.get((rank, dst), 0.0))
        self.channel_free[(rank, dst)] = start + size / costs.bandwidth
        self.arrivals.setdefault((rank, dst), []).append(start + size / costs.bandwidth + costs.latency)
        if action.kind is Kind.SEND_GRAD:
            state.run_weight_grads(self.weight_grads_delay)
        else:
            state.run_held_until(action, self.held_until[rank])

    def _compute(self, rank: int, action: Action) -> bool:
        state = self.ranks[rank]
        start = self._input_arrival(rank, action)
        if start is None:
            return False
        if start > state.clock:
            state.waits.append(Interval(action, state.clock, start))
        if action.kind is Kind.FWD:
            duration = self._forward(rank, action)
        elif action.kind is Kind.BWD:
            duration = self._backward(rank, action)
        else:
            duration = self._weight(rank, action)
        state.run(action, start, duration)
        return True

    def _input_arrival(self, rank: int, action: Action) -> float | None:
        """When ``action`` can start: now, or when the message it consumes arrives; None if not sent yet."""
        state = self.ranks[rank]
        need = self.needs(rank, action)
        if need is None:
            return state.clock
        if need not in state.posted:
            raise ScheduleError(f"rank {rank}: {action} consumes {need}, which is not posted before it")
        src, index = state.posted[need]
        if index >= len(self.arrivals.get((src, rank), [])):
            return None
        del state.posted[need]
        return max(state.clock, self.arrivals[(src, rank)][index])

    def _forward(self, rank: int, action: Action) -> float:
        state = self.ranks[rank]
        state.in_flight.add((action.microbatch, action.chunk))
        state.stash += self.costs.of("stash_bytes", rank, action.chunk)
        state.peak = max(state.peak, len(state.in_flight))
        state.peak_stash = max(state.peak_stash, state.stash)
        return self.costs.of("forward", rank, action.chunk)

    def _backward(self, rank: int, action: Action) -> float:
        """The backward's duration now; its weight-gradient part is held back if it sends a gradient."""
        state, key = self.ranks[rank], (action.microbatch, action.chunk)
        if key not in state.in_flight:
            raise ScheduleError(f"rank {rank}: {action} runs without an earlier forward")
        duration = self.costs.of("backward", rank, action.chunk)
        weight_grad = self.costs.of("weight_grad", rank, action.chunk)
        if (rank, *key) in self.explicit_weight:
            state.backed.add(key)
            return duration - weight_grad
        self._release(state, rank, key)
        if weight_grad > 0 and ((rank, *key) in self.sends_grad or action in self.held_until[rank]):
            duration -= weight_grad
            state.held.append((action, weight_grad))
        return duration

    def _weight(self, rank: int, action: Action) -> float:
        """An explicit weight gradient: frees the micro-batch's activations."""
        state, key = self.ranks[rank], (action.microbatch, action.chunk)
        if key not in state.backed:
            raise ScheduleError(f"rank {rank}: {action} runs without an earlier backward")
        state.backed.remove(key)
        self._release(state, rank, key)
        return self.costs.of("weight_grad", rank, action.chunk)

    def _release(self, state: _Rank, rank: int, key: tuple[int, int]) -> None:
        state.in_flight.remove(key)
        state.stash -= self.costs.of("stash_bytes", rank, key[1])

    def _sync_grads(self, rank: int, action: Action) -> bool:
        """Held-back weight gradients run first; in a sync group, every member must have arrived."""
        state = self.ranks[rank]
        state.run_weight_grads(0)
        start = state.clock
        group = self.sync_groups(rank) if self.sync_groups else None
        if group is not None:
            arrived = self.sync_arrivals.setdefault((group, state.syncs_done), {})
            arrived[rank] = state.clock
            if len(arrived) < len(self.members[group]):
                return False
            start = max(arrived.values())
            state.syncs_done += 1
        exposed = 0.0
        if self.costs.overlaps_reduction:
            exposed = max(0.0, overlapped_reduction_end(state.timeline, self.costs, rank) - start)
        state.run(action, start, exposed + self.costs.sync)
        return True


def overlapped_reduction_end(timeline: list[Interval], costs: Costs, rank: int) -> float:
    """When the last bucket of ``rank``'s overlapped gradient reduction ends (``Costs.grad_reduce``),
    for the iteration since the last SYNC_GRADS of ``timeline``: a chunk's buckets become ready
    evenly over its last gradient-producing interval, and a rank's buckets share one channel,
    in the order they become ready."""
    last: dict[int, Interval] = {}
    for interval in reversed(timeline):
        kind = interval.action.kind
        if kind is Kind.SYNC_GRADS:
            break
        if kind in (Kind.BWD, Kind.WEIGHT):
            chunk = interval.action.chunk
            if chunk not in last or interval.end > last[chunk].end:
                last[chunk] = interval
    buckets = []
    for chunk, interval in last.items():
        n = int(costs.of("grad_buckets", rank, chunk))
        span, seconds = interval.end - interval.start, costs.of("grad_reduce", rank, chunk)
        buckets += [(interval.start + span * (k + 1) / n, seconds / n) for k in range(n)]
    buckets.sort()
    free = 0.0
    for ready, duration in buckets:
        free = max(free, ready) + duration
    return free


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


def _result(pp: int, vpp: int, ranks: list[_Rank]) -> SimResult:
    timelines = [state.timeline for state in ranks]
    total = max((state.clock for state in ranks), default=0.0)
    busy = [sum(i.end - i.start for i in tl if i.action.kind in COMPUTE_KINDS) for tl in timelines]
    other = [sum(i.end - i.start for i in tl if i.action.kind not in COMPUTE_KINDS) for tl in timelines]
    idle = [total - b - o for b, o in zip(busy, other)]
    spans = [[i for i in tl if i.action.kind in COMPUTE_KINDS] for tl in timelines]
    inner_idle = sum(max(i.end for i in s) - min(i.start for i in s) - b for s, b in zip(spans, busy) if s)
    return SimResult(
        pp=pp, vpp=vpp, timelines=timelines, waits=[state.waits for state in ranks], iteration_time=total,
        busy=busy, idle=idle,
        bubble_fractions=[i / b if b else 0.0 for i, b in zip(idle, busy)],
        idle_fractions=[i / total if total else 0.0 for i in idle],
        bubble_fraction=sum(idle) / sum(busy) if sum(busy) else 0.0,
        idle_fraction=sum(idle) / (pp * total) if total else 0.0,
        peak_in_flight=[state.peak for state in ranks], peak_stash_bytes=[state.peak_stash for state in ranks],
        starts=[state.starts for state in ranks],
        steady_bubble_fraction=inner_idle / sum(busy) if sum(busy) else 0.0)

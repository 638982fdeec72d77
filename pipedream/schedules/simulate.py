"""Run schedule action lists against a cost model, without torch or processes.

The execution model is the executor's: sends never block the sender, a RECV only posts a receive
(zero cost), and the FWD/BWD that consumes a message waits until it has arrived. Messages on each
ordered (src, dst) channel are matched by order, as NCCL does. The simulator gives timelines, the
iteration time, bubbles, peak in-flight micro-batches and stash bytes, and finds deadlocks and
mismatched communication before any process is started. Used by tests, the planner and plots.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Hashable

from pipedream.schedules.actions import COMPUTE_KINDS, Action, Kind
from pipedream.schedules.channels import PeerFn, check_channel_order, checked_peers  # noqa: F401 (re-exported)
from pipedream.schedules.common import needed_receive
from pipedream.schedules.placement import Placement
from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.paired import pair_partners
from pipedream.schedules.weight_hold import held_until_activation_send
from pipedream.schedules.simulation_model import (  # noqa: F401 (Costs ... SimResult re-exported)
    Costs, DeadlockError, Interval, NeedsFn, SimResult, SyncGroupFn, Value, overlapped_reduction_end)


def simulate(schedule: list[list[Action]], costs: Costs | None = None, *, vpp: int | None = None,
             peer: PeerFn | None = None, needs: NeedsFn | None = None,
             sync_groups: SyncGroupFn | None = None, weight_grads_delay: int = 1) -> SimResult:
    """Simulate one iteration; raises ChannelError, ScheduleError or DeadlockError.

    ``peer`` and ``needs`` tell who is at the other end of a message and which receive a compute
    consumes (default: round-robin placement, ``Placement.peer`` and ``needed_receive``). With
    ``sync_groups``, the n-th SYNC_GRADS of every member of a group starts when the last member
    reaches it (an all-reduce), so collectives take part in deadlock detection.
    With ``costs.weight_grad``, a backward's weight-gradient part runs once ``weight_grads_delay``
    later backwards of its rank have sent their input gradients, or before SYNC_GRADS, unless the
    schedule places it as a WEIGHT action. A micro-batch counts as in flight (and stashed) from its
    FWD to its BWD, or to its WEIGHT where there is one (the weight gradient needs the activations).
    """
    pp = len(schedule)
    vpp = vpp or 1 + max((a.chunk for actions in schedule for a in actions), default=0)
    round_robin = Placement(pp, vpp)
    peer = peer or round_robin.peer
    if needs is None:
        def needs(rank: int, action: Action) -> Action | None:
            return needed_receive(round_robin, rank, action)
    peers = checked_peers(schedule, pp, vpp, peer)
    simulation = _Simulation(schedule, costs or Costs(), vpp, peer, needs, sync_groups, weight_grads_delay, peers)
    simulation.run()
    return _result(pp, vpp, simulation.ranks)


@dataclass
class _Rank:
    """One rank's progress through its action list."""

    pc: int = 0                      # index of the next action
    clock: float = 0.0
    # recv, as (kind, microbatch, chunk) -> (src, index on that channel)
    posted: dict[tuple[Kind, int, int], tuple[int, int]] = field(default_factory=dict)
    n_posted: dict[int, int] = field(default_factory=dict)                # src -> receives posted so far
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
        if not self.held:
            return
        for entry in [e for e in self.held if held_until.get(e[0]) == send]:
            self.held.remove(entry)
            action, duration = entry
            self.timeline.append(Interval(action, self.clock, self.clock + duration, weight_grads=True))
            self.clock += duration


class _PerChunk(dict):
    """``costs.of(name, rank, chunk)`` by (rank, chunk), each asked for once (Costs is frozen)."""

    def __init__(self, costs: Costs, name: str) -> None:
        super().__init__()
        self.costs, self.name = costs, name

    def __missing__(self, key: tuple[int, int]) -> float:
        value = self[key] = self.costs.of(self.name, *key)
        return value


_NOT_ASKED = object()   # a compute whose ``needs`` has not been asked yet


class _Simulation:
    """One iteration in progress: every rank runs its actions in turn until it is blocked (an input
    not yet sent, an all-reduce whose members have not all arrived) or done.

    A blocked rank is tried again on every pass, so what an action needs (its peer, the receive it
    consumes, its durations) is worked out once per action, not once per try."""

    def __init__(self, schedule: list[list[Action]], costs: Costs, vpp: int, peer: PeerFn, needs: NeedsFn,
                 sync_groups: SyncGroupFn | None, weight_grads_delay: int,
                 peers: list[list[tuple[int, int] | None]]) -> None:
        self.schedule, self.costs, self.pp, self.vpp = schedule, costs, len(schedule), vpp
        self.peer, self.needs, self.sync_groups = peer, needs, sync_groups
        self.weight_grads_delay = weight_grads_delay
        self.peers = peers   # per rank and action index: peer(rank, action), None for a non-comm action
        # per rank and action index: the receive (action, posted key) a compute consumes, or None
        self.needed: list[list] = [[_NOT_ASKED] * len(actions) for actions in schedule]
        self.forward_cost, self.backward_cost = _PerChunk(costs, "forward"), _PerChunk(costs, "backward")
        self.weight_cost, self.stash_cost = _PerChunk(costs, "weight_grad"), _PerChunk(costs, "stash_bytes")
        self.act_bytes, self.grad_bytes = _PerChunk(costs, "act_bytes"), _PerChunk(costs, "grad_bytes")
        self.all_to_all = _PerChunk(costs, "all_to_all")
        exchanges = isinstance(costs.all_to_all, Mapping) or costs.all_to_all > 0
        # per rank: paired FWD <-> BWD, each hiding the other's all-to-all behind its compute
        self.partners = [pair_partners(actions) if exchanges and costs.pairs_hide_all_to_all else {}
                         for actions in schedule]
        self.ranks = [_Rank() for _ in schedule]
        self.arrivals: dict[tuple[int, int], list[float]] = {}  # channel -> arrival time of each sent message
        self.channel_free: dict[tuple[int, int], float] = {}    # channel -> when its link is free again
        self.members: dict[Hashable, list[int]] = {}            # sync group -> its ranks
        for rank in range(self.pp):
            group = sync_groups(rank) if sync_groups else None
            if group is not None:
                self.members.setdefault(group, []).append(rank)
        self.sync_arrivals: dict[tuple[Hashable, int], dict[int, float]] = {}  # (group, n-th sync) -> rank -> time
        # only a positive weight-gradient part is ever held back: without one, nothing below is read
        holds = isinstance(costs.weight_grad, Mapping) or costs.weight_grad > 0
        # backwards that send an input gradient: only those hold their weight-gradient part back
        self.sends_grad = {(rank, a.microbatch, a.chunk) for rank, actions in enumerate(schedule)
                           for a in actions if a.kind is Kind.SEND_GRAD} if holds else set()
        self.explicit_weight = {(rank, a.microbatch, a.chunk) for rank, actions in enumerate(schedule)
                                for a in actions if a.kind is Kind.WEIGHT}
        # backwards that send none (the first stage's) but precede a forward's activation send: held
        # until that send, as the executor does (``schedules.weight_hold``)
        self.held_until = [held_until_activation_send(actions) if holds else {} for actions in schedule]

    def run(self) -> None:
        while any(state.pc < len(actions) for state, actions in zip(self.ranks, self.schedule)):
            if not self._run_until_blocked():
                posted = [{Action(*key): entry for key, entry in s.posted.items()} for s in self.ranks]
                raise DeadlockError(_describe_deadlock(self.schedule, [s.pc for s in self.ranks], posted,
                                                       self.pp, self.vpp, self.peer, self.needs))
        for state in self.ranks:
            state.run_weight_grads(0)

    def _run_until_blocked(self) -> bool:
        """One pass over the ranks; False when none of them could run anything."""
        progressed = False
        advance = self._advance
        for rank, (state, actions) in enumerate(zip(self.ranks, self.schedule)):
            end = len(actions)
            while state.pc < end and advance(rank, actions[state.pc]):
                state.pc += 1
                progressed = True
        return progressed

    def _advance(self, rank: int, action: Action) -> bool:
        """Run ``action`` on ``rank`` if its input is there; False when blocked."""
        kind = action.kind
        if kind is Kind.RECV_ACT or kind is Kind.RECV_GRAD:
            self._post_receive(rank, action)
            return True
        if kind is Kind.SEND_ACT or kind is Kind.SEND_GRAD:
            self._send(rank, action)
            return True
        if kind is Kind.FWD or kind is Kind.BWD or kind is Kind.WEIGHT:
            return self._compute(rank, action)
        if kind is Kind.SYNC_GRADS:
            return self._sync_grads(rank, action)
        state = self.ranks[rank]
        state.run(action, state.clock, self.costs.step)
        return True

    def _post_receive(self, rank: int, action: Action) -> None:
        """Posting costs nothing; the compute that consumes the message waits for it."""
        state = self.ranks[rank]
        state.starts.append(state.clock)
        src = self.peers[rank][state.pc][0]
        count = state.n_posted.get(src, 0)
        state.posted[(action.kind, action.microbatch, action.chunk)] = (src, count)
        state.n_posted[src] = count + 1

    def _send(self, rank: int, action: Action) -> None:
        """Never blocks the sender; the message queues behind earlier ones on its channel."""
        state, costs = self.ranks[rank], self.costs
        state.starts.append(state.clock)
        channel = (rank, self.peers[rank][state.pc][0])
        size = (self.act_bytes if action.kind is Kind.SEND_ACT else self.grad_bytes)[(rank, action.chunk)]
        start = max(state.clock, self.channel_free.get(channel, 0.0))
        self.channel_free[channel] = start + size / costs.bandwidth
        self.arrivals.setdefault(channel, []).append(start + size / costs.bandwidth + costs.latency)
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
        needed = self.needed[rank]
        need = needed[state.pc]
        if need is _NOT_ASKED:
            receive = self.needs(rank, action)
            need = needed[state.pc] = None if receive is None else (
                receive, (receive.kind, receive.microbatch, receive.chunk))
        if need is None:
            return state.clock
        receive, key = need
        posted = state.posted.get(key)
        if posted is None:
            raise ScheduleError(f"rank {rank}: {action} consumes {receive}, which is not posted before it")
        src, index = posted
        arrivals = self.arrivals.get((src, rank))
        if arrivals is None or index >= len(arrivals):
            return None
        del state.posted[key]
        return max(state.clock, arrivals[index])

    def _forward(self, rank: int, action: Action) -> float:
        state = self.ranks[rank]
        state.in_flight.add((action.microbatch, action.chunk))
        state.stash += self.stash_cost[(rank, action.chunk)]
        state.peak = max(state.peak, len(state.in_flight))
        state.peak_stash = max(state.peak_stash, state.stash)
        return self.forward_cost[(rank, action.chunk)] + self._exposed_all_to_all(rank, action)

    def _exposed_all_to_all(self, rank: int, action: Action) -> float:
        """The part of ``action``'s all-to-alls its pair partner's compute does not hide (all of it
        without a partner)."""
        seconds = self.all_to_all[(rank, action.chunk)]
        partner = self.partners[rank].get(action)
        if partner is None or seconds == 0:
            return seconds
        if partner.kind is Kind.FWD:
            hiding = self.forward_cost[(rank, partner.chunk)]
        else:   # a split backward's B computes without its weight-gradient part
            hiding = self.backward_cost[(rank, partner.chunk)]
            if (rank, partner.microbatch, partner.chunk) in self.explicit_weight:
                hiding -= self.weight_cost[(rank, partner.chunk)]
        return max(0.0, seconds - hiding)

    def _backward(self, rank: int, action: Action) -> float:
        """The backward's duration now; its weight-gradient part is held back if it sends a gradient."""
        state, key = self.ranks[rank], (action.microbatch, action.chunk)
        if key not in state.in_flight:
            raise ScheduleError(f"rank {rank}: {action} runs without an earlier forward")
        duration = self.backward_cost[(rank, action.chunk)] + self._exposed_all_to_all(rank, action)
        weight_grad = self.weight_cost[(rank, action.chunk)]
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
        return self.weight_cost[(rank, action.chunk)]

    def _release(self, state: _Rank, rank: int, key: tuple[int, int]) -> None:
        state.in_flight.remove(key)
        state.stash -= self.stash_cost[(rank, key[1])]

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

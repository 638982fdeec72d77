"""What NCCL would do with the ranks' issue orders: a deadlock check that runs on a CPU.

The simulator (``simulate.py``) models Gloo: a send never blocks anything and a receive waits
only for its own message. NCCL is stricter, and an order that runs on Gloo can hang on GPUs. The
rules modelled here:

- the CPU never waits for the GPU: every call is issued at once, in issue order;
- FWD, BWD, SYNC_GRADS and STEP run in order on the rank's compute stream; a compute waits for
  the receive it consumes; with ``sends_before_sync``, SYNC_GRADS also waits for every earlier
  send and receive (the executor completes its sends before the gradient all-reduce);
- every send and receive runs on a communicator stream, one call after the other, and starts only
  after the computes issued before it (PyTorch makes the NCCL stream wait on the current stream);
- a started call completes once its counterpart (the n-th send on a channel src -> dst meets the
  n-th receive posted for it) has started: a send may wait for its receive, since NCCL does not
  promise to buffer it, and meanwhile blocks every later call on its stream.

Which calls share a stream (``streams``):

- ``"pair"``: both directions between two ranks share one stream, as PyTorch's send/recv do on one
  process group: the executor's early receives then deadlock (a receive posted ahead of the send
  that the peer waits for);
- ``"channel"``: one stream per direction of each pair, as with one process group per direction
  (``groups.p2p``), each with its own pair communicators;
- ``"direction"``: one stream per rank for all messages to higher ranks and one for all messages to
  lower ranks, as the same two process groups give when their communicators are initialised
  eagerly (one stream per group);
- ``"group"``: one stream per rank for everything.

``None`` in an issue order is a collective of every rank (an asynchronous run's per-step loss
all-reduce between windows), reached after the rank's sends and receives complete.
``check_stream_order`` raises ``DeadlockError`` naming where every rank is stuck.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Optional

from pipedream.schedules.actions import COMM_KINDS, COMPUTE_KINDS, Action, Kind
from pipedream.schedules.common import needed_receive
from pipedream.schedules.placement import Placement
from pipedream.schedules.simulate import DeadlockError, NeedsFn, PeerFn, SyncGroupFn

STREAM_POLICIES = ("pair", "channel", "direction", "group")
EVERY_RANK = "every rank"
_SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})

IssueOrder = list[Optional[Action]]
"""One rank's actions in issue order; None marks a collective of every rank."""


@dataclass(slots=True)
class _Call:
    """One send or receive of one rank."""

    action: Action
    stream: Hashable
    computes_before: int                  # computes issued before it on the rank
    partner: tuple[int, int] | None = None   # (peer rank, index of its call)
    started: bool = False
    done: bool = False


@dataclass
class _Rank:
    calls: list[_Call] = field(default_factory=list)
    computes: list[Action | None] = field(default_factory=list)
    waits: list[list[int]] = field(default_factory=list)     # per compute: the calls it waits for
    computed: int = 0                                         # computes finished


def check_stream_order(orders: list[IssueOrder], pp: int, vpp: int, *, streams: str = "channel",
                       peer: PeerFn | None = None, needs: NeedsFn | None = None,
                       sync_groups: SyncGroupFn | None = None, sends_before_sync: bool = True) -> None:
    """Runs every rank's issue order under the rules above; DeadlockError if it cannot finish."""
    if streams not in STREAM_POLICIES:
        raise ValueError(f"streams={streams!r}: choose one of {', '.join(STREAM_POLICIES)}")
    round_robin = Placement(pp, vpp)   # unless ``peer`` and ``needs`` say otherwise
    peer = peer or round_robin.peer
    if needs is None:
        def needs(rank: int, action: Action) -> Action | None:
            return needed_receive(round_robin, rank, action)
    ranks = _build(orders, pp, vpp, streams, peer, needs, sends_before_sync)
    queues: dict[tuple[int, Hashable], list[int]] = {}
    for r, rank in enumerate(ranks):
        for index, call in enumerate(rank.calls):
            queues.setdefault((r, call.stream), []).append(index)

    def collective(r: int, action: Action | None) -> Hashable | None:
        if action is None:
            return EVERY_RANK
        if sync_groups is not None and action.kind is Kind.SYNC_GRADS:
            return sync_groups(r)
        return None

    members = Counter(g for r, rank in enumerate(ranks) for g in {collective(r, a) for a in rank.computes})
    met: Counter = Counter()           # (rank, group) -> collectives of the group it has finished
    arrivals: Counter = Counter()      # (group, n) -> members that reached their n-th one
    arrived: set = set()

    def compute_ready(r: int) -> bool:
        rank = ranks[r]
        calls = rank.calls
        for i in rank.waits[rank.computed]:
            if not calls[i].done:
                return False
        group = collective(r, rank.computes[rank.computed])
        if group is None:
            return True
        key = (group, met[(r, group)])
        if (r, key) not in arrived:
            arrived.add((r, key))
            arrivals[key] += 1
        return arrivals[key] == members[group]

    progress = True
    while progress:
        progress = False
        for r, rank in enumerate(ranks):
            while rank.computed < len(rank.computes) and compute_ready(r):
                group = collective(r, rank.computes[rank.computed])
                if group is not None:
                    met[(r, group)] += 1
                rank.computed += 1
                progress = True
        for (r, _), queue in queues.items():
            if not queue:
                continue
            call = ranks[r].calls[queue[0]]
            if not call.started and ranks[r].computed >= call.computes_before:
                call.started = progress = True
        for (r, _), queue in queues.items():
            if not queue:
                continue
            call = ranks[r].calls[queue[0]]
            other, index = call.partner
            if call.started and ranks[other].calls[index].started:
                call.done = progress = True
                queue.pop(0)
    if any(queues.values()) or any(rank.computed < len(rank.computes) for rank in ranks):
        raise DeadlockError(_describe(ranks, queues))


def _build(orders: list[IssueOrder], pp: int, vpp: int, streams: str, peer: PeerFn, needs: NeedsFn,
           sends_before_sync: bool) -> list[_Rank]:
    ranks = [_Rank() for _ in orders]
    sent: dict[tuple[int, int], list[tuple[int, int]]] = {}       # channel -> (rank, call) per send
    posted: dict[tuple[int, int], list[tuple[int, int]]] = {}     # channel -> (rank, call) per receive
    stream_of: dict[tuple[int, tuple[int, int]], Hashable] = {}   # (rank, channel) -> its stream
    for r, order in enumerate(orders):
        rank = ranks[r]
        holder: dict[tuple[Kind, int, int], int] = {}   # receive, as (kind, microbatch, chunk) -> its call
        for action in order:
            if action is not None and action.kind in COMM_KINDS:
                other, _ = peer(r, action, pp, vpp)
                sends = action.kind in _SENDS
                channel = (r, other) if sends else (other, r)
                (sent if sends else posted).setdefault(channel, []).append((r, len(rank.calls)))
                if not sends:
                    holder[(action.kind, action.microbatch, action.chunk)] = len(rank.calls)
                stream = stream_of.get((r, channel))
                if stream is None:
                    stream = stream_of[(r, channel)] = _stream_key(streams, r, channel)
                rank.calls.append(_Call(action, stream, len(rank.computes)))
                continue
            wait: list[int] = []
            if action is None or (action.kind is Kind.SYNC_GRADS and sends_before_sync):
                wait = list(range(len(rank.calls)))
            elif action.kind in COMPUTE_KINDS and (need := needs(r, action)) is not None:
                call = holder.get((need.kind, need.microbatch, need.chunk))
                if call is None:
                    raise DeadlockError(f"rank {r}: {action} consumes {need}, which is not posted before it")
                wait = [call]
            rank.computes.append(action)
            rank.waits.append(wait)
    for channel in sorted(set(sent) | set(posted)):
        senders, receivers = sent.get(channel, []), posted.get(channel, [])
        if len(senders) != len(receivers):
            raise DeadlockError(f"channel rank {channel[0]} -> rank {channel[1]}: {len(senders)} sends but "
                                f"{len(receivers)} receives, so some call never completes")
        for (s_rank, s_call), (r_rank, r_call) in zip(senders, receivers):
            ranks[s_rank].calls[s_call].partner = (r_rank, r_call)
            ranks[r_rank].calls[r_call].partner = (s_rank, s_call)
    return ranks


def _stream_key(streams: str, rank: int, channel: tuple[int, int]) -> Hashable:
    src, dst = channel
    if streams == "pair":
        return (min(src, dst), max(src, dst))
    if streams == "channel":
        return channel
    if streams == "direction":
        return "to higher ranks" if src < dst else "to lower ranks"
    return "p2p"


def _describe(ranks: list[_Rank], queues: dict[tuple[int, Hashable], list[int]]) -> str:
    blocked = []
    for r, rank in enumerate(ranks):
        parts = []
        if rank.computed < len(rank.computes):
            pending = [str(rank.calls[i].action) for i in rank.waits[rank.computed] if not rank.calls[i].done]
            where = rank.computes[rank.computed] or "the all-rank collective"
            parts.append(f"compute at {where}" + (f" (waiting for {', '.join(pending)})" if pending else ""))
        for (owner, stream), queue in sorted(queues.items(), key=lambda kv: str(kv[0])):
            if owner == r and queue:
                call = rank.calls[queue[0]]
                state = "started, its counterpart not" if call.started else "not started"
                parts.append(f"stream {stream} at {call.action} ({state})")
        if parts:
            blocked.append(f"rank {r}: " + "; ".join(parts))
    return "deadlock under NCCL's rules: " + " | ".join(blocked)

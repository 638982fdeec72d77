"""Helpers shared by the schedule generators: the comm actions around compute. Which virtual stage
a chunk is (round-robin unless a schedule says otherwise) is ``placement.Placement``'s to say."""
from __future__ import annotations

from typing import Callable

from pipedream.schedules.actions import Action, Kind, ScheduleError
from pipedream.schedules.placement import Placement


def peer_stage(rank: int, action: Action, pp: int, vpp: int) -> tuple[int, int]:
    """(rank, chunk) at the other end of a comm action under round-robin placement: the next virtual
    stage for SEND_ACT and RECV_GRAD, the previous one for RECV_ACT and SEND_GRAD (the simulator's
    ``PeerFn``; ``Placement.peer`` for any placement). Peers are derived, never stored."""
    return Placement(pp, vpp).peer(rank, action)


def forward_block(microbatch: int, chunk: int, rank: int, pp: int, vpp: int = 1) -> list[Action]:
    """Receive the input (unless first), run the forward, send the output (unless last); round-robin."""
    placement = Placement(pp, vpp)
    block = []
    if not placement.is_first(rank, chunk):
        block.append(Action(Kind.RECV_ACT, microbatch, chunk))
    block.append(Action(Kind.FWD, microbatch, chunk))
    if not placement.is_last(rank, chunk):
        block.append(Action(Kind.SEND_ACT, microbatch, chunk))
    return block


def backward_block(microbatch: int, chunk: int, rank: int, pp: int, vpp: int = 1) -> list[Action]:
    """Receive the output gradient (unless last), run the backward, send the input gradient (unless
    first); round-robin."""
    placement = Placement(pp, vpp)
    block = []
    if not placement.is_last(rank, chunk):
        block.append(Action(Kind.RECV_GRAD, microbatch, chunk))
    block.append(Action(Kind.BWD, microbatch, chunk))
    if not placement.is_first(rank, chunk):
        block.append(Action(Kind.SEND_GRAD, microbatch, chunk))
    return block


def flush_update() -> list[Action]:
    """End of a flushed iteration: all-reduce gradients across replicas, then one optimizer step."""
    return [Action(Kind.SYNC_GRADS), Action(Kind.STEP)]


def check_sizes(pp: int, microbatches: int, vpp: int) -> None:
    for name, value in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ScheduleError(f"{name} = {value!r} must be an integer")
        if value < 1:
            raise ScheduleError(f"{name} = {value} must be >= 1")


def add_communication(compute: list[list[Action]], pp: int, vpp: int, placement=None) -> list[list[Action]]:
    """Turn per-rank compute orders (FWD/BWD/WEIGHT) into full action lists.

    Each FWD/BWD is followed by its send. Receives are posted lazily, just before the first
    compute that needs one, and always in the order the sender sends on that (src, dst) channel,
    because NCCL matches point-to-point messages by order. On channels that carry both
    activations and gradients (pp = 2 with interleaving) this posts some receives early.
    ``placement`` (a ``placement.Placement``) maps chunks to virtual stages; default round-robin.
    """
    if placement is None:
        placement = Placement(pp, vpp)
    with_sends: list[list[Action]] = []
    for rank, actions in enumerate(compute):
        out: list[Action] = []
        for action in actions:
            out.append(action)
            send = placement.sends(rank, action)
            if send is not None:
                out.append(send)
        with_sends.append(out)

    incoming: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> receiver-side actions in send order
    for src, actions in enumerate(with_sends):
        for action in actions:
            if action.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                dst, chunk = placement.peer(src, action)
                kind = Kind.RECV_ACT if action.kind is Kind.SEND_ACT else Kind.RECV_GRAD
                incoming.setdefault((src, dst), []).append(Action(kind, action.microbatch, chunk))

    result = []
    for dst, actions in enumerate(with_sends):
        cursor: dict[int, int] = {}
        posted: set[tuple[Kind, int, int]] = set()   # receives as (kind, microbatch, chunk): cheap to hash
        out = []
        for action in actions:
            need = placement.needs(dst, action)
            if need is not None and (wanted := (need.kind, need.microbatch, need.chunk)) not in posted:
                src = placement.peer(dst, need)[0]
                queue = incoming.get((src, dst), [])
                while True:
                    i = cursor.get(src, 0)
                    if i >= len(queue):
                        raise ScheduleError(f"rank {dst}: {action} needs {need} but rank {src} never sends it")
                    receive = queue[i]
                    out.append(receive)
                    posted.add(key := (receive.kind, receive.microbatch, receive.chunk))
                    cursor[src] = i + 1
                    if key == wanted:
                        break
            out.append(action)
        result.append(out)
    return result


def needed_receive(placement: Placement, rank: int, action: Action) -> Action | None:
    """The RECV whose message ``action`` consumes, by pipeline position alone, or None. Unlike
    ``Placement.needs`` it asks for a message between two chunks of one rank too (pp = 1)."""
    if action.kind is Kind.FWD and not placement.is_first(rank, action.chunk):
        return Action(Kind.RECV_ACT, action.microbatch, action.chunk)
    if action.kind is Kind.BWD and not placement.is_last(rank, action.chunk):
        return Action(Kind.RECV_GRAD, action.microbatch, action.chunk)
    return None


def one_f_one_b_order(rank: int, pp: int, total: int, forward: Callable[[int], list[Action]],
                      backward: Callable[[int], list[Action]]) -> list[Action]:
    """The 1F1B order at ``rank``: p - rank - 1 warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards. ``forward(mb)``/``backward(mb)`` give each block."""
    warmup = min(pp - rank - 1, total)
    actions: list[Action] = []
    for mb in range(warmup):
        actions += forward(mb)
    for i in range(total - warmup):
        actions += forward(warmup + i) + backward(i)
    for mb in range(total - warmup, total):
        actions += backward(mb)
    return actions

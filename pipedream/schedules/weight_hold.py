"""Which backwards of a chunk that sends no input gradient (the first stage's) hold their
weight-gradient GEMMs until the rank's next activation send.

A backward whose input gradient is sent runs its weight-gradient GEMMs after that send (the
executor's ``weight_grads_after_send``). The first stage sends no gradient, but in 1F1B's steady
state its backward is followed by a forward whose activation the next stage waits for: running
the GEMMs after that send hands the next stage its input one weight-gradient pass sooner. Only a
backward followed by such a forward before the rank's next backward holds (not GPipe's run of
backwards, nor the last one before the flush). Every held group runs in the order it was held, so
each weight's gradient is summed over micro-batches in the same order as without holding.

Pure data (no torch): the executor and the simulator read the same answer.
"""
from __future__ import annotations

from pipedream.schedules.actions import Action, Kind


def held_until_activation_send(actions: list[Action]) -> dict[Action, Action]:
    """BWD -> the SEND_ACT after which its weight-gradient GEMMs run, for each BWD of ``actions``
    (one rank's list, in schedule or issue order) that sends no input gradient and has no WEIGHT
    action of its own."""
    sends_grad = {(a.microbatch, a.chunk) for a in actions if a.kind is Kind.SEND_GRAD or a.kind is Kind.WEIGHT}
    held: dict[Action, Action] = {}
    for index, action in enumerate(actions):
        if action.kind is not Kind.BWD or (action.microbatch, action.chunk) in sends_grad:
            continue
        for later in actions[index + 1:]:
            if later.kind is Kind.SEND_ACT:
                held[action] = later
            if later.kind in (Kind.SEND_ACT, Kind.BWD, Kind.WEIGHT, Kind.SYNC_GRADS):
                break
    return held

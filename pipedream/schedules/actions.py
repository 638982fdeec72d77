"""The action record that every schedule emits and every consumer (executor, simulator, plots) reads.

An action is pure data. Its peer rank is never stored: it follows from the layout (the next or
previous virtual stage of ``chunk``), so one schedule serves every pipeline replica.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(enum.Enum):
    FWD = "F"
    BWD = "B"        # the whole backward, or only its input gradient when the list also has a WEIGHT
    WEIGHT = "W"     # weight gradient of a micro-batch (and chunk) whose BWD ran earlier
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    SYNC_GRADS = "SYNC"
    STEP = "STEP"
    # memory-virtualised schedules (harmony.py): chunk is the task, microbatch -1 the pack's state
    UPDATE = "U"         # the optimizer update of a task's layer pack (on the host tier)
    SWAP_IN = "SI"       # pack weights to the device; with a micro-batch: its stashed pack input
    SWAP_OUT = "SO"      # pack state off the device (gradients to the host); with a micro-batch: a stash
    PREFETCH = "PF"      # start the next task's weight swap-in early (side stream on CUDA)

    # Members are singletons compared by identity, so the identity hash is valid; Enum's own
    # hashes the name in Python, which every set and dict of actions pays on each lookup.
    __hash__ = object.__hash__


COMPUTE_KINDS = frozenset({Kind.FWD, Kind.BWD, Kind.WEIGHT})
COMM_KINDS = frozenset({Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD})


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` applied to ``microbatch`` of model ``chunk``.

    Per-iteration actions (SYNC_GRADS, STEP) use microbatch -1. A list without WEIGHT actions runs
    each backward whole (its weight-gradient part may be held back by the executor); a list with
    them splits every backward into BWD (input gradient) and WEIGHT (weight gradient).
    """

    kind: Kind
    microbatch: int = -1
    chunk: int = 0

    def __str__(self) -> str:
        if self.microbatch < 0:
            return f"{self.kind.value}.{self.chunk}" if self.chunk else self.kind.value
        if self.chunk:
            return f"{self.kind.value}{self.microbatch}.{self.chunk}"
        return f"{self.kind.value}{self.microbatch}"


_ACTION_RE = re.compile(r"^(SYNC|STEP|SA|RA|SG|RG|SI|SO|PF|F|B|W|U)(\d+)?(?:\.(\d+))?$")


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``: ``"F3.1"`` -> Action(FWD, 3, 1)."""
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ValueError(f"cannot parse action {text!r}: expected e.g. F3, B2.1, W2.1, SA0, SYNC, STEP")
    code, microbatch, chunk = match.groups()
    return Action(Kind(code), -1 if microbatch is None else int(microbatch), int(chunk or 0))


def format_actions(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    return [parse_action(t) for t in text.split()]


class ScheduleError(ValueError):
    """A schedule cannot be built for the requested sizes; the message names the rule."""

"""What the schedule simulator (``simulate.py``) takes and gives: its cost model (``Costs``, with the
overlapped data-parallel reduction's bucket timing), the intervals of a timeline, the result of one
simulated iteration and the deadlock it may find."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Hashable, Union

from pipedream.schedules.actions import Action, Kind

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
    ``all_to_all``: per (rank, chunk) seconds of expert parallelism's all-to-alls in one micro-batch's
    FWD, and again in its BWD, which wait for them. With ``pairs_hide_all_to_all`` (a runtime that
    runs a FWD with the next BWD of another chunk at once, ``schedules.paired``) each of the two
    waits only for the part its partner's compute does not hide.
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
    all_to_all: Value = 0.0
    pairs_hide_all_to_all: bool = False

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

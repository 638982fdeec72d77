"""What the rest of the project knows about a schedule: one frozen ``ScheduleInfo`` per schedule,
declared beside its build function and listed in ``registry.py``.

The formulas are the schedule's own iteration played out by the simulator at unit costs (t_f = 1,
t_b = 2 per chunk; with split backwards B = W = 1), with free messages;
``tests/unit/schedules/test_infos.py`` measures every one of them on the action lists the schedule builds. They
accept numbers or numpy arrays (the planner evaluates thousands of layouts at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pipedream.schedules.actions import ScheduleError
from pipedream.schedules.placement import Placement


@dataclass(frozen=True)
class SizeRule:
    """One size the schedule refuses: ``ok(pp, microbatches, vpp)`` is false there (elementwise on
    arrays), and ``message(pp, microbatches, vpp)`` is the one-line ScheduleError that says so."""

    ok: Callable[[Any, Any, Any], Any]
    message: Callable[[int, int, int], str]


def no_bubble(p, m, v):
    return np.zeros(np.broadcast(np.asarray(p), np.asarray(m), np.asarray(v)).shape)


def exact(p: int, m: int) -> int:
    return 0


def one_version(in_flight):
    return np.ones(np.shape(in_flight)) if np.ndim(in_flight) else 1.0


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule's name, how it is built and its properties.

    ``bubble(p, m, v)``: idle over compute time of one iteration at unit costs ((p-1)/m for 1F1B); for
    the asynchronous schedules the steady state's (their run's one fill and drain is not in it).
    ``bubble_slack(p, m)``: chunk-steps by which the built order may exceed ``bubble`` (0: exact).
    ``in_flight(stage, p, m, v)``: (micro-batch, chunk) pairs rank ``stage`` holds at its peak, from a
    forward to its backward (to its W with a split backward); divided by ``chunks(v)`` it is in units of
    a whole stage's activations. ``weight_versions(in_flight)``: weight copies a rank keeps with that
    many micro-batches in flight.
    """

    name: str
    build: Callable[..., list] | None   # (pp, microbatches, vpp[, steps]) -> actions per rank; None: harmony_pp
    in_flight: Callable[[Any, Any, Any, Any], Any]
    bubble: Callable[[Any, Any, Any], Any] = no_bubble
    bubble_slack: Callable[[int, int], int] = exact
    bubble_rule: str = "none in steady state"   # ``bubble`` as the planner's report prints it
    weight_versions: Callable[[Any], Any] = one_version
    refuses: tuple[SizeRule, ...] = ()
    asynchronous: bool = False          # no flush: the lists span the run, weights have several versions
    split_backward: bool = False        # WEIGHT actions: every BWD is the input gradient only
    placement: str = "round-robin"      # how chunks sit on ranks (placement.py)
    fixed_chunks: int | None = None     # chunks per rank whatever parallel.vpp says (a V: 2)
    interleaves: bool = False           # parallel.vpp > 1 chunks per rank, round-robin
    updates_per_microbatch: bool = False   # every micro-batch is its own mini-batch (pipedream)
    replicated_stages: bool = False     # parallel.stage_replicas and schedule.vertical_sync (1F1B-RR)
    memory_virtualised: bool = False    # layer packs swapped through the devices (harmony_pp, harmony_dp)
    replicated_packs: bool = False      # every device runs every pack on its own micro-batches (harmony_dp)
    not_planned: str | None = None      # why planner.schedules cannot include it; None: it can
    overlaps_all_to_all: bool = False   # F+B pairs of two chunks run together, hiding each one's all-to-all

    def chunks(self, vpp: int = 1) -> int:
        """Chunks per rank under ``parallel.vpp = vpp``."""
        return self.fixed_chunks or vpp

    def placement_for(self, pp: int, vpp: int = 1) -> Placement:
        return Placement(pp, self.chunks(vpp), self.placement)

    def accepts(self, pp, microbatches, vpp=1):
        """Whether the sizes pass every rule (elementwise on arrays)."""
        ok = np.ones(np.broadcast(np.asarray(pp), np.asarray(microbatches), np.asarray(vpp)).shape, dtype=bool)
        for rule in self.refuses:
            ok = ok & rule.ok(pp, microbatches, vpp)
        return ok

    def check(self, pp: int, microbatches: int, vpp: int = 1) -> None:
        """The first rule the sizes break, as a ScheduleError."""
        for rule in self.refuses:
            if not rule.ok(pp, microbatches, vpp):
                raise ScheduleError(rule.message(pp, microbatches, vpp))

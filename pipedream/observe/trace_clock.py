"""Clocks for the trace (no torch: the events are duck-typed, so tests drive this with a fake device).

The executor reads its clock before and after each action and subtracts two readings for a
receive's wait; the trace recorder turns the readings into seconds. On CPU the clock is
``time.perf_counter`` and a reading is already seconds. On a device that runs kernels
asynchronously a host reading would time the launches, and waiting for the device around every
action (what the trace did before) stalls the host, so the device has nothing queued and the trace
times a serialised run. An ``EventClock`` instead stamps each reading in traced iterations with an
event recorded on the compute stream (``EventStamp``; a difference of two is an ``EventSpan``) and
the recorder resolves the stamps once at the end of the step: one synchronisation, then each
event's device time relative to the step's first event, placed at the host time of that first
event (``EventClock.resolver``). Outside traced iterations it is the host clock.

What each reading measures on the device: an event completes when the stream has finished all the
work queued before it, so an action's span is the time the compute stream spent on the action's
kernels (and on the waits it was made to do, e.g. for a receive), and a wait's span is how long the
compute stream stood idle for the message: a receive that blocked the host while the stream still
had queued work costs the stream nothing. The recorder's per-step totals (``CommTotals``) stay host
seconds (``host_seconds``): they add up how long the host blocked in receives, sends and the
gradient sync, in every step, traced or not.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol


class DeviceEvent(Protocol):
    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this event to ``end_event``; both must have completed."""


@dataclass(frozen=True, slots=True)
class EventStamp:
    """A clock reading in a traced iteration: the event recorded on the compute stream, and the
    host clock when it was recorded."""

    host: float
    event: DeviceEvent

    def __sub__(self, earlier: EventStamp) -> EventSpan:
        return EventSpan(earlier, self)


@dataclass(frozen=True, slots=True)
class EventSpan:
    """The difference of two stamps (the executor's receive wait), resolved with the stamps."""

    start: EventStamp
    end: EventStamp

    @property
    def host(self) -> float:
        return self.end.host - self.start.host


Reading = float | EventStamp | EventSpan


def host_seconds(reading: Reading) -> float:
    """The host-clock value of a reading (a difference for a span)."""
    return reading if isinstance(reading, (int, float)) else reading.host


class EventClock:
    """The host clock outside traced iterations; inside, every reading is an ``EventStamp``.

    ``record_event`` records a new timing event on the compute stream and returns it;
    ``synchronize`` waits until the compute stream has run everything queued on it;
    ``host`` is the host clock (``time.perf_counter``; a test's fake)."""

    def __init__(self, record_event: Callable[[], DeviceEvent], synchronize: Callable[[], None],
                 host: Callable[[], float] = time.perf_counter):
        self._record_event = record_event
        self._synchronize = synchronize
        self._host = host
        self._traced = False

    def __call__(self) -> Reading:
        if not self._traced:
            return self._host()
        event = self._record_event()
        return EventStamp(self._host(), event)

    def start_traced(self) -> None:
        """Before a traced iteration's opening barrier: drains what earlier steps left queued, so
        the iteration's first event completes as it is recorded and its host time is its device
        time (the anchor of ``resolver``), and the iteration's spans contain only its own work."""
        self._synchronize()
        self._traced = True

    def stop_traced(self) -> None:
        self._traced = False

    def resolver(self, origin: EventStamp) -> Callable[[Reading], float]:
        """Waits once for the stream (every event recorded so far completes), then maps readings
        to host-clock seconds: ``origin.host`` plus the device time elapsed since ``origin``."""
        self._synchronize()

        def seconds(reading: Reading) -> float:
            if isinstance(reading, EventStamp):
                return origin.host + origin.event.elapsed_time(reading.event) / 1e3
            if isinstance(reading, EventSpan):
                return reading.start.event.elapsed_time(reading.end.event) / 1e3
            return reading   # a wait of 0.0 that was never measured
        return seconds

"""Traced iterations timed with device events (``pipedream/observe/trace_clock.py``), driven by a fake
device: a stream that runs the work queued on it behind a fake host clock, and events that know
when the stream reaches them. Shows what the CUDA clock does without CUDA: spans are device times
measured from the step's first event and placed at its host time, they follow the stream's order,
and the device is waited for only before the opening barrier and once at the step's end."""
from __future__ import annotations

import time

import pytest
import torch

from pipedream.observe.device_clock import clock_for
from pipedream.runtime.executor import Executor
from pipedream.schedules import build_schedule
from pipedream.observe.trace import RankTrace, TraceRecorder, chrome_trace, step_offsets
from pipedream.observe.trace_clock import EventClock
from tests.support.loopback import FakeClock
from tests.support.tick_stage import FORWARD_S, batches, tick_executor, traced_two_stage_step

LAUNCH_S = 0.001   # host time to queue one piece of device work
LATENCY_S = 1.0


class FakeEvent:
    def __init__(self, stream: "FakeStream", device_time: float):
        self.stream = stream
        self.device_time = device_time

    def elapsed_time(self, end_event: "FakeEvent") -> float:
        for event in (self, end_event):
            if self.stream.host.now < event.device_time:   # CUDA's "not ready"
                raise RuntimeError(f"event at device time {event.device_time} has not completed")
        return (end_event.device_time - self.device_time) * 1e3


class FakeStream:
    """A compute stream behind the host: work queued at host time h starts when the stream is
    free, never before h; queueing costs the host LAUNCH_S. An event completes when the stream
    reaches it."""

    def __init__(self, host: FakeClock):
        self.host = host
        self.free_at = host.now
        self.synchronizations = 0
        self.events = 0

    def launch(self, seconds: float) -> None:
        self.free_at = max(self.free_at, self.host.now) + seconds
        self.host.advance(LAUNCH_S)

    def record_event(self) -> FakeEvent:
        self.free_at = max(self.free_at, self.host.now)
        self.events += 1
        return FakeEvent(self, self.free_at)

    def synchronize(self) -> None:
        self.synchronizations += 1
        self.host.now = max(self.host.now, self.free_at)


def event_executor(stream: FakeStream, is_first: bool, is_last: bool, comm=None) -> tuple[Executor, TraceRecorder]:
    """Every cost of ``tick_executor`` is device work queued on ``stream``."""
    recorder = TraceRecorder(EventClock(stream.record_event, stream.synchronize, host=stream.host))
    return tick_executor(stream.launch, recorder, is_first, is_last, comm), recorder


def spans(recorder: TraceRecorder, index: int = 0) -> list[tuple[str, float, float, float]]:
    return [(e.action, round(e.start, 9), round(e.end, 9), round(e.wait, 9)) for e in recorder.steps[index].events]


SINGLE_STAGE = [("F0", 0.0, 2.0, 0.0), ("B0", 2.0, 5.0, 0.0), ("F1", 5.0, 7.0, 0.0), ("B1", 7.0, 10.0, 0.0),
                ("SYNC", 10.0, 10.5, 0.0), ("STEP", 10.5, 10.75, 0.0)]


def test_spans_are_device_times_from_the_step_start_placed_on_the_host_clock():
    host = FakeClock(now=100.0)
    stream = FakeStream(host)
    executor, recorder = event_executor(stream, is_first=True, is_last=True)
    actions = build_schedule("1f1b", 1, 2)[0]

    recorder.begin_step(1, traced=False)   # untraced: host readings, no events, no waiting
    executor.run(actions, batches(2), loss_scale=0.5)
    recorder.end_step()
    assert (stream.events, stream.synchronizations) == (0, 0)
    assert stream.free_at == pytest.approx(110.75) and host.now < 100.1   # the device is 10 s behind

    for step in (2, 3):
        syncs = stream.synchronizations
        recorder.begin_step(step, traced=True, barrier=lambda: host.advance(0.5))
        assert stream.synchronizations == syncs + 1   # drained before the barrier
        executor.run(actions, batches(2), loss_scale=0.5)
        assert stream.synchronizations == syncs + 1   # nothing waits for the device inside the step
        recorder.end_step()
        assert stream.synchronizations == syncs + 2   # once, to resolve the step's events

    assert spans(recorder, 0) == spans(recorder, 1) == SINGLE_STAGE
    first, second = recorder.steps
    # step 2 starts when step 1's queued work is done (110.75) and the barrier has passed (+0.5);
    # step 3 when step 2's work is done (111.25 + 10.75) and its barrier has passed
    assert (first.origin, second.origin) == (pytest.approx(111.25), pytest.approx(122.5))
    assert first.end == pytest.approx(10.75)
    assert step_offsets([RankTrace(0, 0, 0, recorder.steps)]) == {2: 0.0, 3: pytest.approx(11.25)}
    # the totals stay host time: the host only queued the gradient sync
    assert recorder.totals.sync_grads_s == pytest.approx(3 * LAUNCH_S)

    events = stream.events
    recorder.begin_step(4, traced=False)
    executor.run(actions, batches(2), loss_scale=0.5)
    recorder.end_step()
    assert stream.events == events and len(recorder.steps) == 2


def test_waits_show_how_long_the_compute_stream_stood_idle_and_boxes_tile_the_iteration():
    """Each receive blocks the host for LATENCY_S. The last stage's first forward waits on an idle
    stream (a 1 s wait box); its second wait passes while the stream still runs B0, so the stream
    never waits (no box) although the host did."""
    first, last = traced_two_stage_step(
        lambda rank, host, comm: event_executor(FakeStream(host), rank == 0, rank == 1, comm), LATENCY_S)
    assert spans(last) == [
        ("F0", 0.0, 3.0, 1.0), ("B0", 3.0, 6.0, 0.0), ("SG0", 6.0, 6.0, 0.0),
        ("F1", 6.0, 8.0, 0.0), ("B1", 8.0, 11.0, 0.0), ("SG1", 11.0, 11.0, 0.0),
        ("W0", 11.0, 11.0, 0.0), ("W1", 11.0, 11.0, 0.0), ("SYNC", 11.0, 11.5, 0.0), ("STEP", 11.5, 11.75, 0.0)]
    assert last.totals.recv_wait_s == pytest.approx(2 * LATENCY_S)   # the host blocked twice
    trace = chrome_trace([RankTrace(0, 0, 0, first.steps), RankTrace(1, 1, 0, last.steps)])
    for rank, recorder in enumerate((first, last)):
        boxes = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
                       if e["ph"] == "X" and e["pid"] == rank and e["cat"] != "iteration")
        assert all(start >= previous_end - 1e-3 for (_, previous_end), (start, _) in zip(boxes, boxes[1:]))
        # nothing else ran on the stream: the boxes cover the iteration
        assert sum(end - start for start, end in boxes) == pytest.approx(recorder.steps[0].end * 1e6)


def test_resolving_needs_the_events_completed():
    """The recorder reads elapsed times only after its wait at the step's end: a fake event that
    has not completed refuses, as CUDA does."""
    host = FakeClock()
    stream = FakeStream(host)
    clock = EventClock(stream.record_event, stream.synchronize, host=host)
    clock.start_traced()
    origin = clock()
    stream.launch(FORWARD_S)
    later = clock()
    with pytest.raises(RuntimeError, match="not completed"):
        origin.event.elapsed_time(later.event)
    seconds = clock.resolver(origin)
    assert (seconds(origin), seconds(later), seconds(later - origin)) == (0.0, FORWARD_S, FORWARD_S)
    assert (later - origin).host == pytest.approx(LAUNCH_S)


def test_cpu_keeps_the_host_clock():
    assert clock_for(torch.device("cpu")) is time.perf_counter

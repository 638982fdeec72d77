"""The executor's and the trace recorder's injected clock: with a fake clock that moves only when a
layer computes or a transfer arrives, every recorded span is known exactly."""
from __future__ import annotations

from pipedream.schedules import build_schedule
from pipedream.observe.trace import TraceRecorder
from tests.support.loopback import FakeClock
from tests.support.tick_stage import BACKWARD_S, SYNC_S, batches, tick_executor, traced_two_stage_step

LATENCY_S = 1.0


def traced_executor(clock: FakeClock, is_first: bool, is_last: bool, comm=None):
    recorder = TraceRecorder(clock=clock)
    return tick_executor(clock.advance, recorder, is_first, is_last, comm), recorder


def spans(recorder: TraceRecorder) -> list[tuple[str, float, float, float]]:
    (step,) = recorder.steps
    return [(e.action, e.start, e.end, e.wait) for e in step.events]


def test_single_stage_spans_are_measured_from_the_step_origin():
    clock = FakeClock(now=100.0)
    executor, recorder = traced_executor(clock, is_first=True, is_last=True)
    recorder.begin_step(1, traced=True)
    executor.run(build_schedule("1f1b", 1, 2)[0], batches(2), loss_scale=0.5)
    recorder.end_step()
    assert spans(recorder) == [("F0", 0.0, 2.0, 0.0), ("B0", 2.0, 5.0, 0.0), ("F1", 5.0, 7.0, 0.0),
                               ("B1", 7.0, 10.0, 0.0), ("SYNC", 10.0, 10.5, 0.0), ("STEP", 10.5, 10.75, 0.0)]
    assert recorder.steps[0].origin == 100.0 and recorder.steps[0].end == 10.75
    assert recorder.totals.sync_grads_s == SYNC_S and recorder.totals.recv_wait_s == 0.0


def test_untraced_steps_keep_totals_only_and_evaluation_is_ignored():
    clock = FakeClock()
    executor, recorder = traced_executor(clock, is_first=True, is_last=True)
    recorder.begin_step(1, traced=False)
    executor.run(build_schedule("1f1b", 1, 2)[0], batches(2), loss_scale=0.5)
    recorder.end_step()
    executor.run(build_schedule("1f1b", 1, 2)[0], batches(2), loss_scale=0.5)   # outside a step
    assert recorder.steps == [] and recorder.totals.steps == 1 and recorder.totals.sync_grads_s == SYNC_S


def test_two_stage_waits_and_held_back_weight_gradients():
    """The last stage waits LATENCY_S for each activation; its weight gradients run after the
    next backward's send (weight_grads_delay=1), the last ones before the gradient sync."""
    first, last = traced_two_stage_step(
        lambda rank, clock, comm: traced_executor(clock, rank == 0, rank == 1, comm), LATENCY_S)
    assert spans(last) == [
        ("F0", 0.0, 3.0, 1.0), ("B0", 3.0, 6.0, 0.0), ("SG0", 6.0, 6.0, 0.0),
        ("F1", 6.0, 9.0, 1.0), ("B1", 9.0, 12.0, 0.0), ("SG1", 12.0, 12.0, 0.0),
        ("W0", 12.0, 12.0, 0.0), ("W1", 12.0, 12.0, 0.0), ("SYNC", 12.0, 12.5, 0.0), ("STEP", 12.5, 12.75, 0.0)]
    assert last.totals.recv_wait_s == 2 * LATENCY_S
    # the first stage's backwards wait for their gradients; it holds no weight gradients back
    backwards = [span for span in spans(first) if span[0].startswith("B")]
    assert [wait for *_, wait in backwards] == [LATENCY_S, LATENCY_S]
    assert [end - start for _, start, end, _ in backwards] == [LATENCY_S + BACKWARD_S] * 2
    assert not any(name.startswith("W") for name, *_ in spans(first))

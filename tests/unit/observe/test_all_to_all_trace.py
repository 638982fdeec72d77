"""Expert parallelism's all-to-alls in the trace: the recorder keeps each one's interval with the
action it belongs to, and the Chrome trace draws them on their own row of the rank."""
from __future__ import annotations

from pipedream.observe.trace import ALL_TO_ALL, RankTrace, TraceRecorder, chrome_trace
from pipedream.schedules import Action, Kind


def test_all_to_all_intervals_reach_their_own_row() -> None:
    ticks = iter(range(100))
    recorder = TraceRecorder(clock=lambda: float(next(ticks)))
    recorder.begin_step(1, traced=True)                          # origin 0
    recorder.record(Action(Kind.BWD, 1, 1), 1.0, 9.0, 0.0)
    recorder.record_exchange("dispatch F3", 2.0, 5.0)
    recorder.record_exchange("combine B1.1", 6.0, 7.0)
    recorder.end_step()
    events = recorder.steps[0].events
    exchanges = [e for e in events if e.kind == ALL_TO_ALL]
    assert [(e.action, e.microbatch, e.chunk, e.start, e.end) for e in exchanges] == [
        ("dispatch F3", 3, 0, 2.0, 5.0), ("combine B1.1", 1, 1, 6.0, 7.0)]
    drawn = chrome_trace([RankTrace(0, 0, 0, recorder.steps)])["traceEvents"]
    rows = {e["args"]["name"]: e["tid"] for e in drawn if e["name"] == "thread_name"}
    boxes = [e for e in drawn if e.get("cat") == "all_to_all"]
    assert [b["name"] for b in boxes] == ["dispatch F3", "combine B1.1"]
    assert {b["tid"] for b in boxes} == {rows["expert all-to-all"]} != {rows["pipeline"]}
    assert boxes[0]["args"]["microbatch"] == 3 and boxes[1]["args"]["chunk"] == 1

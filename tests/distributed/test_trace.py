"""Execution trace: the recorder, the Chrome trace format, and a real 2-rank run whose trace must
cover every executed action once, in the schedule's order, with the timeline PNGs and metrics."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipedream.schedules import Action, Kind, build_schedule
from pipedream.schedules.weight_hold import held_until_activation_send
from pipedream.config.specs import TraceSpec
from pipedream.observe.trace import WEIGHT_GRADS, RankTrace, StepTrace, TraceEvent, TraceRecorder, chrome_trace, traced_steps
from pipedream.observe.trace_report import bubble_fraction, measured_costs, representative_step, write_trace_outputs
from tests.support.workers import run_workers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_MLP = ["model=mlp", "data=synthetic", "model.num_layers=4", "model.hidden_size=32", "train.global_batch_size=16",
            "train.micro_batch_size=4", "train.steps=4", "train.log_every=1", "train.eval_every=0",
            "train.eval_batches=1", "train.progress=false", "train.timeout_s=60", "optim=sgd", "train.lr=0.01",
            "trace.steps=[2,3]"]
RUNS = {"1f1b": ["schedule=1f1b"], "interleaved": ["schedule=interleaved", "parallel.vpp=2"],
        "1f1b-no-delay": ["schedule=1f1b", "train.weight_grads_delay=0"]}
WEIGHT_GRADS_DELAY = {"1f1b-no-delay": 0}   # default: 1


def expected_weight_grad_order(actions: list[Action], delay: int) -> list[str]:
    """Sends and weight-gradient events as the executor interleaves them: W of a backward whose
    input gradient is sent right after the send of the backward ``delay`` later (the rest right
    after the last send); W of a first stage's backward that a forward's send follows
    (``held_until_activation_send``) right after that send."""
    held_until = held_until_activation_send(actions)
    sends_grad = {(a.microbatch, a.chunk) for a in actions if a.kind is Kind.SEND_GRAD}
    order: list[str] = []
    held: list[str] = []
    for action in actions:
        if action.kind is Kind.BWD and (action.microbatch, action.chunk) in sends_grad:
            held.append(WEIGHT_GRADS + str(action).removeprefix("B"))
        elif action.kind is Kind.SEND_GRAD:
            order.append(str(action))
            while len(held) > delay:
                order.append(held.pop(0))
        elif action.kind is Kind.SEND_ACT:
            order.append(str(action))
            order += [WEIGHT_GRADS + str(b).removeprefix("B") for b, send in held_until.items() if send == action]
    return order + held


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_recorder_keeps_only_traced_training_steps() -> None:
    clock = FakeClock()
    recorder = TraceRecorder(clock)
    barriers = []
    recorder.record(Action(Kind.FWD, 0), 0.0, 1.0, 0.5)          # evaluation: outside any step
    recorder.begin_step(1, traced=False)
    recorder.record(Action(Kind.FWD, 0), 0.0, 1.0, 0.25)
    recorder.end_step()
    recorder.begin_step(2, traced=True, barrier=lambda: barriers.append(1))
    origin = recorder.steps[-1].origin
    recorder.record(Action(Kind.FWD, 0), origin + 1, origin + 3, 0.5)
    recorder.record(Action(Kind.SEND_ACT, 0), origin + 3, origin + 4, 0.0)
    recorder.record(Action(Kind.SYNC_GRADS), origin + 4, origin + 6, 0.0)
    recorder.end_step()
    assert barriers == [1]
    assert [s.step for s in recorder.steps] == [2]
    step = recorder.steps[0]
    assert [e.action for e in step.events] == ["F0", "SA0", "SYNC"]
    assert step.events[0] == TraceEvent("F0", "F", 0, 0, 1.0, 3.0, 0.5)
    assert step.end == 1.0   # the fake clock ticks once at end_step
    assert recorder.totals.recv_wait_s == 0.75 and recorder.totals.send_s == 1.0
    assert recorder.totals.sync_grads_s == 2.0 and recorder.totals.steps == 2


def test_traced_steps_selection() -> None:
    auto = TraceSpec(enabled="auto", steps=None, timeline=True)
    assert traced_steps(auto, 300, warmup=5) == {6, 7, 8}
    assert traced_steps(auto, 2, warmup=0) == {1, 2}
    assert traced_steps(auto, 10_000, warmup=5) == frozenset()        # auto: long runs are not traced
    assert traced_steps(TraceSpec(enabled=True, steps=(3, 99), timeline=True), 10, 2) == {3}
    assert traced_steps(TraceSpec(enabled=False, steps=(3,), timeline=True), 10, 2) == frozenset()
    assert traced_steps(TraceSpec(enabled=True, steps=None, timeline=True), 10, 2) == {3, 4, 5}


def _synthetic_traces() -> list[RankTrace]:
    r0 = StepTrace(7, origin=50.0, end=10.0, events=[TraceEvent("F0", "F", 0, 0, 0.0, 2.0),
                                                     TraceEvent("SA0", "SA", 0, 0, 2.0, 2.1),
                                                     TraceEvent("B0", "B", 0, 0, 2.1, 9.0, wait=3.0),
                                                     TraceEvent("STEP", "STEP", -1, 0, 9.0, 9.5)])
    r1 = StepTrace(7, origin=80.0, end=10.0, events=[TraceEvent("F0", "F", 0, 0, 0.0, 4.0, wait=2.0),
                                                     TraceEvent("B0", "B", 0, 0, 4.0, 8.0),
                                                     TraceEvent("SG0", "SG", 0, 0, 8.0, 8.2)])
    return [RankTrace(0, 0, 0, [r0]), RankTrace(1, 1, 0, [r1])]


def test_chrome_trace_is_well_formed() -> None:
    doc = json.loads(json.dumps(chrome_trace(_synthetic_traces(), {"schedule": "1f1b"})))
    events = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0 (stage 0, replica 0)"), (1, "rank 1 (stage 1, replica 0)")}
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0
    waits = [e for e in complete if e["cat"] == "wait"]
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in waits] == [(0, "wait B0", 2.1e6, 3e6),
                                                                        (1, "wait F0", 0.0, 2e6)]
    b0 = next(e for e in complete if e["pid"] == 0 and e["name"] == "B0")
    assert (b0["ts"], b0["dur"], b0["cat"], b0["args"]) == (5.1e6, 3.9e6, "backward",
                                                            {"step": 7, "microbatch": 0, "chunk": 0})
    iterations = [e for e in complete if e["cat"] == "iteration"]
    assert len(iterations) == 2
    for it in iterations:   # every event nests inside its rank's iteration
        inside = [e for e in complete if e["pid"] == it["pid"]]
        assert all(it["ts"] <= e["ts"] and e["ts"] + e["dur"] <= it["ts"] + it["dur"] + 1e-6 for e in inside)
    assert doc["otherData"] == {"schedule": "1f1b"}


def test_bubble_and_costs_from_trace() -> None:
    traces = _synthetic_traces()
    assert bubble_fraction(traces[0].steps[0]) == pytest.approx(1 - (2.0 + 3.9) / 10.0)
    assert bubble_fraction(traces[1].steps[0]) == pytest.approx(1 - (2.0 + 4.0) / 10.0)
    costs = measured_costs(traces)
    assert costs.forward == {(0, 0): 2.0, (1, 0): 2.0}
    assert costs.backward == {(0, 0): pytest.approx(3.9), (1, 0): 4.0}
    assert costs.step == 0.5 and costs.sync == 0.0
    assert representative_step(traces) == 7


def test_report_writes_trace_and_pngs(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    traces = _synthetic_traces()
    traces[0].steps[0].events.insert(0, TraceEvent("SYNC", "SYNC", -1, 0, 8.9, 9.0))
    report = write_trace_outputs(tmp_path, traces, "1f1b", pp=2, microbatches=1, vpp=1, weight_grads_delay=1)
    assert report is not None and report.steps == [7]
    assert report.ideal_bubble_fraction == pytest.approx(0.5)
    for name in ("timeline.png", "timeline_predicted.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert write_trace_outputs(tmp_path / "empty", [RankTrace(0, 0, 0, [])], "1f1b", 1, 1, 1,
                               weight_grads_delay=1) is None


def _train_runs(rank: int, world_size: int, runs: list[tuple[list[str], str]]) -> list[dict | None]:
    from pipedream.config.loading import compose_config
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.config.run_spec import build_run_spec
    from pipedream.trainer import train

    ctx = init_distributed("cpu", 60)
    summaries = []
    try:
        for overrides, run_dir in runs:
            cfg = compose_config(overrides + [f"train.run_dir={run_dir}"])
            outcome = train(build_run_spec(cfg, world_size), ctx)
            summaries.append(outcome.summary if rank == 0 else None)
    finally:
        shutdown()
    return summaries


@pytest.fixture(scope="module")
def traced_runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One 2-process group runs every schedule in RUNS (processes cost more than these tiny runs)."""
    root = tmp_path_factory.mktemp("traced")
    runs = [(TINY_MLP + overrides, str(root / name)) for name, overrides in RUNS.items()]
    summaries = run_workers(_train_runs, 2, runs, timeout=120)[0]
    return {name: (root / name, summary) for name, summary in zip(RUNS, summaries)}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_trace_covers_every_action_in_schedule_order(traced_runs, name) -> None:
    run_dir, summary = traced_runs[name]
    vpp = summary["parallel"]["vpp"]
    schedule = build_schedule(summary["schedule"], 2, summary["batch"]["num_microbatches"], vpp)
    events = json.loads((run_dir / "trace" / "trace.json").read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["step"] for e in complete} == {2, 3}
    for rank in (0, 1):
        expected = [str(a) for a in schedule[rank] if a.kind not in (Kind.RECV_ACT, Kind.RECV_GRAD)]
        for step in (2, 3):
            mine = sorted((e for e in complete if e["pid"] == rank and e["args"]["step"] == step),
                          key=lambda e: e["ts"])
            executed = [e for e in mine if e["cat"] not in ("wait", "iteration")]
            actions = [e for e in executed if not e["name"].startswith(WEIGHT_GRADS)]
            assert [e["name"] for e in actions] == expected          # each action once, in schedule order
            # Held-back weight gradients run once each, oldest first, right after a later send
            # (or the last ones right before the gradient sync): never with compute in between.
            names = [e["name"] for e in executed]
            sends = [n for n in names if n.startswith("SG")]
            sends_and_weight_grads = [n for n in names if n.startswith(("SG", "SA", WEIGHT_GRADS))]
            assert sends_and_weight_grads == expected_weight_grad_order(schedule[rank],
                                                                        WEIGHT_GRADS_DELAY.get(name, 1))
            sync = names.index("SYNC")
            for i, event in enumerate(names):
                if event.startswith(WEIGHT_GRADS):
                    tail = all(n.startswith(WEIGHT_GRADS) for n in names[i:sync])
                    assert tail or names[i - 1].startswith(("SG", "SA", WEIGHT_GRADS)), " ".join(names)
            if sends:
                assert names[sync - 1].startswith(WEIGHT_GRADS)
            for before, after in zip(actions, actions[1:]):
                assert before["ts"] + before["dur"] <= after["ts"] + 1e-3
            for wait in (e for e in mine if e["cat"] == "wait"):
                consumer = next(e for e in actions if e["name"] == wait["name"].removeprefix("wait "))
                assert wait["ts"] + wait["dur"] == pytest.approx(consumer["ts"], abs=1e-2)
                assert consumer["cat"] in ("forward", "backward")
    for png in ("timeline.png", "timeline_predicted.png"):
        assert (run_dir / "trace" / png).read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("name", sorted(RUNS))
def test_summary_metrics_are_consistent(traced_runs, name) -> None:
    run_dir, summary = traced_runs[name]
    written = json.loads((run_dir / "summary.json").read_text())
    assert {k: written[k] for k in ("samples_per_s", "mfu", "bubble_fraction", "trace")} == \
        {k: summary[k] for k in ("samples_per_s", "mfu", "bubble_fraction", "trace")}
    batch = summary["batch"]["global"]
    assert summary["samples_per_s"] * summary["median_step_time_s"] == pytest.approx(batch)
    assert summary["tokens_per_s"] is None          # MLP: samples without tokens
    flops = 3 * 4 * batch * 4 * 32 * 32    # 3 passes x 2 Linear(h, h) x 2 FLOPs x b x layers x h^2
    assert summary["model_flops_per_iteration"] == flops
    tflops = flops / summary["median_step_time_s"] / 2 / 1e12
    assert summary["tflops_per_device"] == pytest.approx(tflops)
    assert summary["mfu"] == pytest.approx(tflops * 1e12 / summary["peak_flops_per_device"]["flops"])
    trace = summary["trace"]
    assert trace["steps"] == [2, 3] and len(trace["bubble_fraction_per_rank"]) == 2
    assert all(0.0 < b < 1.0 for b in trace["bubble_fraction_per_rank"])
    assert summary["bubble_fraction"] == pytest.approx(sum(trace["bubble_fraction_per_rank"]) / 2)
    assert trace["ideal_bubble_fraction"] == pytest.approx(1 / (summary["parallel"]["vpp"] * 4 + 1))
    assert trace["predicted_iteration_time_s"] > 0 and not math.isnan(trace["iteration_time_s"])
    vpp = summary["parallel"]["vpp"]
    for rank in summary["ranks"]:
        assert rank["peak_memory_bytes"]["rss"] > 0
        assert rank["bubble_fraction"] == trace["bubble_fraction_per_rank"][rank["rank"]]
        # per micro-batch each rank sends 2v-1 tensors of 4 x 32 fp32 (activations and gradients
        # across the 2v-1 boundaries between virtual stages, half of them each way)
        assert rank["comm"]["bytes_sent_per_step"] == 4 * (2 * vpp - 1) * 4 * 32 * 4
        assert rank["comm"]["bytes_received_per_step"] == rank["comm"]["bytes_sent_per_step"]
        assert rank["comm"]["recv_wait_s_per_step"] >= 0 and rank["comm"]["sync_grads_s_per_step"] > 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["samples_per_s"] * m["step_time_s"] == pytest.approx(batch)
        assert m["mfu"] == pytest.approx(m["tflops_per_device"] * 1e12 / summary["peak_flops_per_device"]["flops"])

"""Execution trace: what each rank executed, when, and how long it waited.

Every rank hands a ``TraceRecorder`` to its executor. During training steps it sums the time spent
waiting for receives, posting sends and syncing gradients (a few float additions per action); in
the traced iterations (``trace.steps``) it also keeps one tuple per action. At the end rank 0
gathers every rank's events and writes ``<run_dir>/trace/trace.json`` in Chrome trace format
(one process row per rank; open it in https://ui.perfetto.dev or chrome://tracing).

Clock alignment: a traced iteration opens with a barrier, and each rank measures its events from
its own ``perf_counter`` reading taken right after it leaves that barrier. Ranks therefore agree to
within the barrier's exit skew (tens of microseconds on one host, about one network latency across
hosts) without assuming that hosts' clocks agree. Successive traced iterations are placed on rank
0's clock (iteration k starts at rank 0's origin_k - origin_first).

The clock is chosen once per rank (``device_clock.clock_for``): ``perf_counter`` on CPU; on CUDA
an ``EventClock`` whose readings in traced iterations are CUDA events, which ``end_step`` resolves
to seconds on the same host-clock axis after one synchronisation (``pipedream/observe/trace_clock.py``).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from pipedream.schedules import Action, Kind
from pipedream.config.specs import TraceSpec
from pipedream.observe.trace_clock import EventClock, Reading, host_seconds

_CATEGORY = {Kind.FWD: "forward", Kind.BWD: "backward", Kind.SEND_ACT: "send", Kind.SEND_GRAD: "send",
             Kind.RECV_ACT: "recv", Kind.RECV_GRAD: "recv", Kind.SYNC_GRADS: "sync", Kind.STEP: "step",
             Kind.SWAP_IN: "swap", Kind.SWAP_OUT: "swap", Kind.PREFETCH: "swap", Kind.UPDATE: "update"}
WEIGHT_GRADS = "W"
"""Event kind of a backward's weight-gradient GEMMs run after its input gradient was sent
(``Executor.weight_grads_after_send``): event ``W3`` belongs to ``B3``."""
GRAD_REDUCE = "R"
"""Event kind of one data-parallel gradient bucket's all-reduce, from its launch to when the rank
saw it complete (``numerics/grad_buckets.py``): event ``R0`` is bucket 0. Drawn on its own row,
so its overlap with the backward shows."""
ALL_TO_ALL = "A2A"
"""Event kind of one expert-parallel all-to-all, from its issue to the end of its wait: event
``dispatch F3.1`` sends the tokens of F3.1 to their experts, ``combine F3.1`` brings the results
back (``dispatch B3.1`` and ``combine B3.1``: their gradients, in B3.1). Drawn on its own row, so
its overlap with other micro-batches' compute shows."""
TRACE_AUTO_MAX_STEPS = 2000   # trace.enabled=auto traces runs up to this many steps
TRACED_ITERATIONS = 3         # trace.steps=null traces this many iterations right after warm-up


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One executed action; times in seconds from the iteration's aligned origin. ``wait`` is the
    part at the start of [start, end) spent waiting for the action's input (FWD/BWD only)."""

    action: str
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float
    wait: float = 0.0

    @property
    def compute_start(self) -> float:
        return self.start + self.wait


@dataclass
class StepTrace:
    step: int                 # 1-based, as in metrics.jsonl
    origin: float             # this rank's clock right after the opening barrier
    end: float = 0.0          # the iteration's end (train_step returned), from origin
    events: list[TraceEvent] = field(default_factory=list)


@dataclass
class CommTotals:
    """Seconds over all training steps: waiting for receives inside FWD/BWD, posting sends, and
    SYNC_GRADS (draining outstanding sends, then the gradient all-reduce)."""

    recv_wait_s: float = 0.0
    send_s: float = 0.0
    sync_grads_s: float = 0.0
    steps: int = 0

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"recv_wait_s_per_step": self.recv_wait_s / n, "send_s_per_step": self.send_s / n,
                "sync_grads_s_per_step": self.sync_grads_s / n}


@dataclass
class RankTrace:
    """What one rank sends to rank 0."""

    rank: int
    pp_rank: int
    dp_rank: int
    steps: list[StepTrace]


class TraceRecorder:
    """The executor's ``recorder``. Ignores actions outside training steps (evaluation)."""

    def __init__(self, clock: Callable[[], float] | EventClock = time.perf_counter):
        self.clock = clock
        self.totals = CommTotals()
        self.steps: list[StepTrace] = []
        self._in_step = False
        self._events = clock if isinstance(clock, EventClock) else None   # readings to resolve
        self._origin: Reading = 0.0
        self._raw: list[tuple[Action | str, Reading, Reading, Reading]] | None = None

    def begin_step(self, step: int, traced: bool, barrier: Callable[[], None] | None = None) -> None:
        """``traced``: keep this iteration's events; ``barrier`` aligns the ranks' origins first."""
        self._in_step = True
        if traced:
            if self._events is not None:
                self._events.start_traced()
            if barrier is not None:
                barrier()
            self._origin = self.clock()
            self.steps.append(StepTrace(step, host_seconds(self._origin)))
            self._raw = []

    def record(self, action: Action, start: Reading, end: Reading, wait: Reading) -> None:
        if not self._in_step:
            return
        if self._raw is not None:
            self._raw.append((action, start, end, wait))
            start, end, wait = host_seconds(start), host_seconds(end), host_seconds(wait)
        kind = action.kind
        if kind is Kind.FWD or kind is Kind.BWD:
            self.totals.recv_wait_s += wait
        elif kind is Kind.SEND_ACT or kind is Kind.SEND_GRAD:
            self.totals.send_s += end - start
        elif kind is Kind.SYNC_GRADS:
            self.totals.sync_grads_s += end - start

    def record_weight_grads(self, microbatch: int, chunk: int, start: Reading, end: Reading) -> None:
        if self._in_step and self._raw is not None:
            backward = str(Action(Kind.BWD, microbatch, chunk))
            self._raw.append((WEIGHT_GRADS + backward[1:], start, end, 0.0))

    def record_reduction(self, bucket: int, start: Reading, end: Reading) -> None:
        if self._in_step and self._raw is not None:
            self._raw.append((f"{GRAD_REDUCE}{bucket}", start, end, 0.0))

    def record_exchange(self, name: str, start: Reading, end: Reading) -> None:
        """An all-to-all's interval (``ALL_TO_ALL``); ``name``: "dispatch F3.1" and the like."""
        if self._in_step and self._raw is not None:
            self._raw.append((f"{ALL_TO_ALL} {name}", start, end, 0.0))

    def end_step(self) -> None:
        end = self.clock()
        self._in_step = False
        self.totals.steps += 1
        if self._raw is None:
            return
        if self._events is not None:
            seconds = self._events.resolver(self._origin)   # one wait for the device, then event times
            self._events.stop_traced()
        else:
            seconds = host_seconds   # host readings are seconds already
        current = self.steps[-1]
        origin = current.origin
        current.end = seconds(end) - origin
        current.events = [_event(a, seconds(s) - origin, seconds(e) - origin, seconds(w)) for a, s, e, w in self._raw]
        self._raw = None


def _event(action: Action | str, start: float, end: float, wait: float) -> TraceEvent:
    if isinstance(action, str) and action.startswith(ALL_TO_ALL + " "):   # "A2A dispatch F3.1"
        name = action[len(ALL_TO_ALL) + 1:]
        microbatch, _, chunk = name.split(" ")[1][1:].partition(".")
        return TraceEvent(name, ALL_TO_ALL, int(microbatch), int(chunk or 0), start, end, wait)
    if isinstance(action, str) and action.startswith(GRAD_REDUCE):   # a gradient bucket: "R0"
        return TraceEvent(action, GRAD_REDUCE, -1, int(action[1:]), start, end, wait)
    if isinstance(action, str):    # weight gradients: "W3" or "W3.1"
        microbatch, _, chunk = action[1:].partition(".")
        return TraceEvent(action, WEIGHT_GRADS, int(microbatch), int(chunk or 0), start, end, wait)
    return TraceEvent(str(action), action.kind.value, action.microbatch, action.chunk, start, end, wait)


def traced_steps(trace: TraceSpec, total_steps: int, warmup: int) -> frozenset[int]:
    """1-based steps to trace: ``trace.steps``, or the few right after warm-up; none if disabled."""
    enabled = trace.enabled
    if enabled == "auto":
        enabled = total_steps <= TRACE_AUTO_MAX_STEPS
    if not enabled:
        return frozenset()
    steps = trace.steps
    if steps is None:
        first = min(warmup + 1, total_steps)
        steps = range(first, min(first + TRACED_ITERATIONS, total_steps + 1))
    elif isinstance(steps, int):
        steps = [steps]
    return frozenset(int(s) for s in steps if 1 <= int(s) <= total_steps)


def gather_traces(recorder: TraceRecorder, rank: int, pp_rank: int, dp_rank: int, world_size: int
                  ) -> list[RankTrace] | None:
    """Collective: every rank calls it; rank 0 gets all ranks' traces, others None."""
    mine = RankTrace(rank, pp_rank, dp_rank, recorder.steps)
    gathered: list[RankTrace | None] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return [t for t in gathered if t is not None] if rank == 0 else None


def step_offsets(traces: list[RankTrace]) -> dict[int, float]:
    """Where each traced iteration starts on the common axis: rank 0's clock since its first one."""
    reference = next(t for t in traces if t.rank == 0) if any(t.rank == 0 for t in traces) else traces[0]
    if not reference.steps:
        return {}
    first = reference.steps[0].origin
    return {s.step: s.origin - first for s in reference.steps}


def _category(kind: str) -> str:
    if kind == WEIGHT_GRADS:
        return "backward"
    if kind == GRAD_REDUCE:
        return "grad_reduce"
    if kind == ALL_TO_ALL:
        return "all_to_all"
    return next((name for k, name in _CATEGORY.items() if k.value == kind), "other")


def chrome_trace(traces: list[RankTrace], metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace-event JSON: one process per rank, complete ("X") events in microseconds.

    Each action is one event; a FWD/BWD that waited for its input is preceded by a ``wait`` event
    (category "wait") covering the wait, so the compute box shows compute only. Each iteration is
    an enclosing event of category "iteration".
    """
    offsets = step_offsets(traces)
    events: list[dict[str, Any]] = []
    for trace in sorted(traces, key=lambda t: t.rank):
        pid = trace.rank
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {trace.rank} (stage {trace.pp_rank}, replica {trace.dp_rank})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "pipeline"}})
        if any(e.kind == GRAD_REDUCE for step in trace.steps for e in step.events):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1,
                           "args": {"name": "gradient all-reduce"}})
        if any(e.kind == ALL_TO_ALL for step in trace.steps for e in step.events):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 2,
                           "args": {"name": "expert all-to-all"}})
        for step in trace.steps:
            base = offsets.get(step.step, 0.0)

            def complete(name: str, cat: str, start: float, end: float, tid: int = 0, **args: Any) -> dict[str, Any]:
                return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                        "ts": round((base + start) * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3),
                        "args": {"step": step.step, **args}}

            events.append(complete(f"iteration {step.step}", "iteration", 0.0, step.end))
            for e in step.events:
                if e.kind == GRAD_REDUCE:
                    events.append(complete(e.action, _category(e.kind), e.start, e.end, tid=1, bucket=e.chunk))
                    continue
                if e.kind == ALL_TO_ALL:
                    events.append(complete(e.action, _category(e.kind), e.start, e.end, tid=2,
                                           microbatch=e.microbatch, chunk=e.chunk))
                    continue
                args = {"microbatch": e.microbatch, "chunk": e.chunk} if e.microbatch >= 0 else {}
                if e.wait > 0:
                    events.append(complete(f"wait {e.action}", "wait", e.start, e.compute_start, **args))
                events.append(complete(e.action, _category(e.kind), e.compute_start, e.end, **args))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata or {}}


def write_chrome_trace(path: Path, traces: list[RankTrace], metadata: dict[str, Any] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(traces, metadata), separators=(",", ":")) + "\n", encoding="utf-8")
    return path

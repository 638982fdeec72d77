"""What rank 0 derives from the gathered traces: measured bubble per rank, median forward/backward
durations, the simulator's prediction fed with those durations, and the two timeline PNGs
(measured and predicted, drawn the same way) next to ``trace.json``."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipedream.schedules import Kind, ScheduleError, build_schedule, schedule_info, schedule_placement
from pipedream.schedules.simulate import Costs, DeadlockError, SimResult, simulate
from pipedream.schedules.timeline_plot import Span, plot_timeline, spans_from_sim
from pipedream.observe.trace import GRAD_REDUCE, WEIGHT_GRADS, RankTrace, StepTrace, write_chrome_trace

_COMPUTE = (Kind.FWD.value, Kind.BWD.value, WEIGHT_GRADS)
_DRAWN = (*_COMPUTE, Kind.SYNC_GRADS.value, Kind.STEP.value,
          Kind.SWAP_IN.value, Kind.SWAP_OUT.value, Kind.PREFETCH.value, Kind.UPDATE.value)   # the last four: harmony_pp
MS = 1e3


def compute_seconds(step: StepTrace) -> float:
    """Time in FWD/BWD compute, waits for inputs excluded."""
    return sum(e.end - e.compute_start for e in step.events if e.kind in _COMPUTE)


def bubble_fraction(step: StepTrace) -> float:
    """Idle / iteration: the share of the traced iteration not spent in FWD/BWD compute (waiting
    for inputs, pipeline fill and drain, sends, gradient sync, optimizer step)."""
    return 1.0 - compute_seconds(step) / step.end if step.end > 0 else float("nan")


def ideal_bubble_fraction(pp: int, microbatches: int, vpp: int = 1, schedule: str = "1f1b") -> float:
    """(p-1) / (v*m + p-1): idle share of an iteration of a flush schedule with equal stages; for
    a schedule with W actions, its simulated iteration at F = B = W per chunk and free messages."""
    if not schedule_info(schedule).split_backward:
        return (pp - 1) / (vpp * microbatches + pp - 1)
    placement = schedule_placement(schedule, pp, vpp)
    unit = simulate(build_schedule(schedule, pp, microbatches, vpp), Costs(forward=1.0, backward=2.0, weight_grad=1.0),
                    vpp=placement.vpp, peer=placement.peer, needs=placement.needs)
    return 1.0 - max(unit.busy) / unit.iteration_time


@dataclass(frozen=True)
class MeasuredCosts:
    """Medians over traced iterations (and data-parallel replicas), in seconds."""

    forward: dict[tuple[int, int], float]     # (pp_rank, chunk) -> seconds
    backward: dict[tuple[int, int], float]    # the whole backward, held-back weight gradients included
    sync: float
    step: float
    weight_grad: dict[tuple[int, int], float] = field(default_factory=dict)   # their part of it
    grad_reduce: dict[tuple[int, int], float] = field(default_factory=dict)   # overlapped reduction, per chunk
    grad_buckets: dict[tuple[int, int], int] = field(default_factory=dict)

    def costs(self, scale: float = 1.0) -> Costs:
        overlapped = {}
        if self.grad_reduce:
            overlapped = dict(grad_reduce={k: self.grad_reduce.get(k, 0.0) * scale for k in self.backward},
                              grad_buckets={k: self.grad_buckets.get(k, 1) for k in self.backward})
        return Costs(forward={k: v * scale for k, v in self.forward.items()},
                     backward={k: v * scale for k, v in self.backward.items()},
                     weight_grad={k: self.weight_grad.get(k, 0.0) * scale for k in self.backward},
                     sync=self.sync * scale, step=self.step * scale, **overlapped)


def _overlapped_reduction(step: StepTrace) -> tuple[float, int, float] | None:
    """A step whose first gradient bucket left before SYNC_GRADS began (``train.overlap_grad_reduce``):
    the buckets' time on the rank's one channel (each from its launch, or the previous bucket's end,
    to its end), their count, and what SYNC_GRADS spent after the last one ended (its blocking part).
    None for a blocking reduction (every bucket inside SYNC_GRADS) or none at all."""
    buckets = sorted((e for e in step.events if e.kind == GRAD_REDUCE), key=lambda e: e.start)
    sync = next((e for e in step.events if e.kind == Kind.SYNC_GRADS.value), None)
    if not buckets or sync is None or buckets[0].start >= sync.start:
        return None
    busy, free = 0.0, buckets[0].start
    for bucket in buckets:
        busy += max(0.0, bucket.end - max(bucket.start, free))
        free = max(free, bucket.end)
    return busy, len(buckets), max(0.0, sync.end - max(sync.start, free))


def measured_costs(traces: list[RankTrace]) -> MeasuredCosts:
    """SYNC and STEP take the fastest rank's median: on the others they include waiting for peers
    (the gradient-norm all-reduce), which the simulator models as idle time instead. A backward's
    weight gradients run after a send (``W`` events) count towards that backward, and are also
    kept apart (``weight_grad``) so the simulator holds them back as the executor did. Where the
    gradient buckets left during the backward, their time is ``grad_reduce`` (the simulator places
    it after each chunk's last backward) and SYNC only what followed the last bucket's end."""
    samples: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    held: dict[tuple[int, int], list[float]] = defaultdict(list)
    per_rank: dict[tuple[str, int], list[float]] = defaultdict(list)
    reductions: dict[int, list[tuple[float, int]]] = defaultdict(list)   # pp rank -> (seconds, buckets)
    for trace in traces:
        for step in trace.steps:
            overlapped = _overlapped_reduction(step)
            if overlapped is not None:
                reductions[trace.pp_rank].append(overlapped[:2])
            weight_grads = {(e.microbatch, e.chunk): e.end - e.start for e in step.events if e.kind == WEIGHT_GRADS}
            for e in step.events:
                if e.kind in (Kind.FWD.value, Kind.BWD.value):
                    extra = weight_grads.get((e.microbatch, e.chunk), 0.0) if e.kind == Kind.BWD.value else 0.0
                    samples[(e.kind, trace.pp_rank, e.chunk)].append(e.end - e.compute_start + extra)
                    if e.kind == Kind.BWD.value:
                        held[(trace.pp_rank, e.chunk)].append(extra)
                elif e.kind == Kind.SYNC_GRADS.value and overlapped is not None:
                    per_rank[(e.kind, trace.rank)].append(overlapped[2])
                elif e.kind in (Kind.SYNC_GRADS.value, Kind.STEP.value):
                    per_rank[(e.kind, trace.rank)].append(e.end - e.start)

    def medians(kind: str) -> dict[tuple[int, int], float]:
        return {(r, c): statistics.median(v) for (k, r, c), v in samples.items() if k == kind}

    def fastest(kind: str) -> float:
        values = [statistics.median(v) for (k, _), v in per_rank.items() if k == kind]
        return min(values, default=0.0)

    forward = medians(Kind.FWD.value)
    grad_reduce, grad_buckets = {}, {}
    for pp_rank, values in reductions.items():   # a rank's buckets span its chunks: an even share each
        chunks = [c for r, c in forward if r == pp_rank] or [0]
        seconds = statistics.median(v for v, _ in values)
        buckets = max(n for _, n in values)
        for chunk in chunks:
            grad_reduce[(pp_rank, chunk)] = seconds / len(chunks)
            grad_buckets[(pp_rank, chunk)] = max(1, math.ceil(buckets / len(chunks)))
    return MeasuredCosts(forward, medians(Kind.BWD.value),
                         fastest(Kind.SYNC_GRADS.value), fastest(Kind.STEP.value),
                         {key: statistics.median(v) for key, v in held.items()}, grad_reduce, grad_buckets)


def representative_step(traces: list[RankTrace]) -> int | None:
    """The traced iteration with the median duration (the slowest rank's end)."""
    durations: dict[int, float] = defaultdict(float)
    for trace in traces:
        for step in trace.steps:
            durations[step.step] = max(durations[step.step], step.end)
    if not durations:
        return None
    ordered = sorted(durations, key=lambda s: (durations[s], s))
    return ordered[(len(ordered) - 1) // 2]


def measured_spans(traces: list[RankTrace], step: int, scale: float = MS) -> list[list[Span]]:
    """One row per rank: compute boxes (waits left white, as idle) plus SYNC and STEP."""
    rows = []
    for trace in sorted(traces, key=lambda t: t.rank):
        row: list[Span] = []
        for s in trace.steps:
            if s.step != step:
                continue
            for e in s.events:
                if e.kind in _DRAWN:
                    label = str(e.microbatch) if e.microbatch >= 0 else e.kind
                    row.append((label, e.kind, e.microbatch, e.chunk, e.compute_start * scale, e.end * scale))
        rows.append(row)
    return rows


def _figure_width(rows: list[list[Span]]) -> float:
    boxes = max((sum(1 for s in row if s[1] in _COMPUTE) for row in rows), default=0)
    return min(max(7.0, 0.45 * (boxes + 2 * len(rows))), 24.0)


@dataclass(frozen=True)
class TraceReport:
    """The ``trace`` section of summary.json (per-rank lists are in rank order)."""

    steps: list[int]
    bubble_fraction_per_rank: list[float]
    iteration_time_s: float
    predicted_iteration_time_s: float | None            # None for the asynchronous schedules
    predicted_bubble_fraction_per_pp_rank: list[float] | None
    ideal_bubble_fraction: float
    forward_s: dict[str, float]
    backward_s: dict[str, float]
    weight_grad_s: dict[str, float]       # the part of backward_s run after a later send
    files: dict[str, str]

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def predict(schedule: str, pp: int, microbatches: int, vpp: int, costs: MeasuredCosts,
            weight_grads_delay: int) -> SimResult | None:
    """The simulator's iteration (in ms) with measured costs; None where one iteration is not a
    self-contained action list (asynchronous schedules never flush) or costs are missing."""
    if schedule_info(schedule).asynchronous:
        return None
    try:
        placement = schedule_placement(schedule, pp, vpp)   # zbv's V: peers differ from round-robin
        return simulate(build_schedule(schedule, pp, microbatches, vpp), costs.costs(MS), vpp=vpp,
                        peer=placement.peer, needs=placement.needs, weight_grads_delay=weight_grads_delay)
    except (KeyError, ScheduleError, DeadlockError):
        return None


def write_trace_outputs(out_dir: Path, traces: list[RankTrace], schedule: str, pp: int, microbatches: int,
                        vpp: int, *, weight_grads_delay: int, draw: bool = True,
                        metadata: dict[str, Any] | None = None, degrees: str | None = None,
                        rank_names: dict[int, str] | None = None) -> TraceReport | None:
    """Writes trace.json (and timeline.png, timeline_predicted.png with ``draw``); returns the report.
    ``weight_grads_delay`` is the run's ``train.weight_grads_delay``, for the prediction. ``degrees``
    (``pp=2 tp=2 dp=1``) titles the timelines, ``rank_names`` label the measured rows (a rank's
    coordinates); the predicted rows are pipeline stages."""
    if not any(t.steps for t in traces):
        return None
    files = {"trace": str(write_chrome_trace(out_dir / "trace.json", traces, metadata))}
    step = representative_step(traces)
    costs = measured_costs(traces)
    sim = predict(schedule, pp, microbatches, vpp, costs, weight_grads_delay)
    per_rank = []
    for trace in sorted(traces, key=lambda t: t.rank):
        per_rank.append(statistics.median(bubble_fraction(s) for s in trace.steps) if trace.steps else float("nan"))
    iteration = max(s.end for t in traces for s in t.steps if s.step == step)
    if draw:
        label = f"{schedule} {degrees or f'pp={pp}'}{f' vpp={vpp}' if vpp > 1 else ''} m={microbatches}"
        ranks = sorted(t.rank for t in traces)
        names = [(rank_names or {}).get(rank, f"rank {rank}") for rank in ranks]
        rows = measured_spans(traces, step)
        if schedule_info(schedule).memory_virtualised:   # an action's chunk is its task there, not a model chunk: one shade
            rows = [[(label, kind, mb, 0, s, e) for label, kind, mb, _, s, e in row] for row in rows]
        width = _figure_width(rows)
        measured_png, predicted_png = out_dir / "timeline.png", out_dir / "timeline_predicted.png"
        plot_timeline(rows, str(measured_png), f"measured {label}, iteration {step}: {iteration * MS:.1f} ms",
                      xlabel="time (ms); white = idle or waiting for a message", width=width, row_names=names)
        files["timeline"] = str(measured_png)
        if sim is not None:
            plot_timeline(spans_from_sim(sim), str(predicted_png), f"predicted {label}: {sim.iteration_time:.1f} ms",
                          xlabel="time (ms); simulator fed with the measured median F/B durations", width=width,
                          row_names=[f"pp stage {stage}" for stage in range(pp)])
            files["timeline_predicted"] = str(predicted_png)
    return TraceReport(
        steps=sorted({s.step for t in traces for s in t.steps}),
        bubble_fraction_per_rank=per_rank,
        iteration_time_s=iteration,
        predicted_iteration_time_s=sim.iteration_time / MS if sim else None,
        predicted_bubble_fraction_per_pp_rank=[1.0 - b / sim.iteration_time if sim.iteration_time else 0.0
                                               for b in sim.busy] if sim else None,
        ideal_bubble_fraction=ideal_bubble_fraction(pp, microbatches, vpp, schedule),
        forward_s={f"{r}.{c}": v for (r, c), v in sorted(costs.forward.items())},
        backward_s={f"{r}.{c}": v for (r, c), v in sorted(costs.backward.items())},
        weight_grad_s={f"{r}.{c}": v for (r, c), v in sorted(costs.weight_grad.items())},
        files=files)

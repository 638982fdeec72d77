"""Keeps an asynchronous schedule's pipeline full across ``train_step`` calls.

One call runs this rank's window for the step (see ``async_segment``); micro-batch ids continue
across calls. The runner holds the step's micro-batches until their forward on this rank, the
weight store of the segment, and the cursor. The last step's window ends with the drain, so the
final weights are well defined; ``drain`` ends a segment early (e.g. before a checkpoint): it runs
the remaining backwards of the micro-batches already admitted, after which the next step starts a
new segment (a fresh warm-up, versions counted from the drained weights).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .async_segment import Segment, build_segment, simulate_topology, version_plan
from .executor import Batch, Executor, IterationResult
from .schedules import Action, Kind
from .schedules.replicated import ReplicatedPipeline
from .stage import Stage
from .weights import WeightStore


@dataclass
class AsyncRunner:
    schedule: str                  # "pipedream" or "2bw"
    topology: ReplicatedPipeline
    rank: int                      # this process's rank in ``topology``
    microbatches: int              # per step (per data-parallel pipeline)
    total_steps: int
    vertical_sync: bool
    executor: Executor
    stage: Stage
    params: list[nn.Parameter]
    build: Callable[..., Segment] = build_segment
    segment: Segment | None = None
    steps_done: int = 0
    peak_versions: int = 1
    _batches: dict[int, Batch] = field(default_factory=dict)   # segment-local micro-batch -> data

    def run_step(self, batches: dict[int, Batch], loss_scale: float) -> IterationResult:
        """Runs this rank's window of the next step; ``batches`` are that step's micro-batches by
        index (0 .. m-1)."""
        if self.steps_done >= self.total_steps:
            raise RuntimeError(f"all {self.total_steps} steps of the asynchronous schedule have run")
        if self.segment is None:
            self._start_segment()
        t = self.steps_done - self.segment.first_step
        self._keep(batches, t)
        result = self._run(list(self.segment.windows[self.rank][t]), loss_scale)
        self.steps_done += 1
        if t == self.segment.steps - 1:
            self._end_segment()
        return result

    def drain(self, loss_scale: float) -> IterationResult:
        """Finishes every micro-batch already admitted; afterwards no weight version but the
        newest exists and nothing is in flight."""
        if self.segment is None:
            return IterationResult()
        done = self.steps_done - self.segment.first_step
        if done == 0:
            self.segment = None
            return IterationResult()
        remainder = self._remainders(done)
        result = self._run(remainder[self.rank], loss_scale)
        self._end_segment()
        return result

    @property
    def store(self) -> WeightStore | None:
        return self.executor.weights

    def _start_segment(self) -> None:
        self.segment = self.build(self.schedule, self.topology, self.microbatches,
                                  self.total_steps - self.steps_done, self.steps_done, self.vertical_sync)
        self.executor.weights = WeightStore(self.params, self.stage.chunks, self.segment.versions(self.rank))

    def _end_segment(self) -> None:
        if self.store is not None:
            self.peak_versions = max(self.peak_versions, self.store.peak)
        self.executor.weights = None
        self.segment = None
        self._batches.clear()

    def _run(self, actions: list[Action], loss_scale: float) -> IterationResult:
        result = self.executor.run(actions, self._batches, loss_scale)
        offset = self.segment.first_step * self.microbatches   # losses by run-wide micro-batch id
        result.losses = {mb + offset: loss for mb, loss in result.losses.items()}
        for action in actions:
            if action.kind is Kind.FWD:
                self._batches.pop(action.microbatch, None)
        return result

    def _keep(self, batches: dict[int, Batch], t: int) -> None:
        """Keeps the micro-batches whose data this rank reads: inputs on the first stage, targets
        on the last, only those routed to this replica."""
        stage = self.topology.stage_of(self.rank)
        if stage not in (0, self.topology.pp - 1):
            return
        replicas, replica = self.topology.replicas[stage], self.topology.replica_of(self.rank)
        for index, batch in batches.items():
            mb = t * self.microbatches + index
            if mb % replicas == replica:
                self._batches[mb] = batch

    def _remainders(self, done: int) -> list[list[Action]]:
        """Per rank, what a segment of only the ``done`` admitted steps still has to run; checked
        with the simulator against what every rank has already run."""
        segment = self.segment
        shorter = self.build(self.schedule, self.topology, self.microbatches, done, segment.first_step,
                             self.vertical_sync)
        executed = [[a for window in rank[:done] for a in window] for rank in segment.windows]
        remainder = []
        for actions, ran in zip(shorter.actions, executed):
            left = Counter(ran)   # a multiset: SYNC_GRADS and STEP repeat
            rest = []
            for action in actions:
                if left[action] > 0:
                    left[action] -= 1
                else:
                    rest.append(action)
            remainder.append(rest)
        simulate_topology([ran + rest for ran, rest in zip(executed, remainder)], self.topology)
        uses = version_plan(self.schedule, self.topology, [list(a) for a in shorter.actions], self.rank,
                            self.microbatches, self.vertical_sync)
        self.store.replan(uses, executed[self.rank], remainder[self.rank])
        return remainder

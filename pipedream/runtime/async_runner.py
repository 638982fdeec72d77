"""Keeps an asynchronous schedule's pipeline full across steps (``ScheduleInfo.asynchronous``).

One call runs this rank's window for the step (see ``async_segment``); micro-batch ids continue
across calls. The runner holds the step's micro-batches until their forward on this rank, the
weight store of the segment (given to the executor with each run), and the cursor. The last
step's window ends with the drain, so the final weights are well defined; ``drain`` ends a
segment early (e.g. before a checkpoint): it runs the remaining backwards of the micro-batches
already admitted, after which the next step starts a new segment (a fresh warm-up, versions
counted from the drained weights).

Updates happen inside the window (after every micro-batch, or every m), and each stage clips its
own gradient: stages update at different times, so a global norm across stages would mix
micro-batches.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Callable

from pipedream.schedules.async_segment import Segment, build_segment, simulate_topology, version_plan
from pipedream.errors import InvariantError
from pipedream.runtime.executor import Batch, IterationResult
from pipedream.numerics.optim import NonFiniteError
from pipedream.config.run_spec import RunSpec
from pipedream.runtime.runner import RankParts, StepResult
from pipedream.schedules import Action, Kind
from pipedream.schedules.replicated import ReplicatedPipeline
from pipedream.runtime.weights import WeightStore


class AsyncRunner:
    global_grad_norm = False   # stages update at different times: each clips its own gradient

    @staticmethod
    def updates_per_step(spec: RunSpec, topology: ReplicatedPipeline, schedule_rank: int) -> int:
        """With ``ScheduleInfo.updates_per_microbatch``, one update per micro-batch this rank runs;
        otherwise one per step."""
        if not spec.schedule.updates_per_microbatch:
            return 1
        return len(topology.microbatches_of(schedule_rank, spec.microbatches))

    def __init__(self, parts: RankParts, build: Callable[..., Segment] = build_segment):
        self.parts = parts
        spec = parts.spec
        self.schedule, self.topology, self.rank = spec.schedule.name, parts.topology, parts.schedule_rank
        self.microbatches, self.total_steps, self.vertical_sync = spec.microbatches, parts.train.steps, spec.vertical_sync
        # updates_per_microbatch: every micro-batch is a mini-batch; otherwise the m micro-batches are averaged
        self.loss_scale = 1.0 if spec.schedule.updates_per_microbatch else 1.0 / spec.microbatches
        self.build = build
        self.executor = parts.make_executor(self._update, sends_before_sync=False)
        self.segment: Segment | None = None
        self.store: WeightStore | None = None
        self.steps_done = 0
        self.peak_versions = 1
        self.last_losses: dict[int, float] = {}   # run-wide micro-batch -> loss, of the last window
        self._batches: dict[int, Batch] = {}      # segment-local micro-batch -> data
        self._norm = 0.0
        self._nonfinite = ""

    @property
    def weight_versions(self) -> int:
        """Peak weight versions this rank has held."""
        return max(self.peak_versions, self.store.peak if self.store is not None else 1)

    def run_step(self, batches: dict[int, Batch], grad_norm: bool) -> StepResult:
        """Runs this rank's window of the next step; ``batches`` are that step's micro-batches by
        index (0 .. m-1). The loss is the mean of the micro-batches that completed in the window
        (NaN when none did, early in a deep pipeline's warm-up). The norm is always computed."""
        if self.steps_done >= self.total_steps:
            raise InvariantError(f"all {self.total_steps} steps of the asynchronous schedule have run")
        lr = self.parts.lr()
        self.parts.shapes.fix_run_shape(batches, self.schedule)
        if self.segment is None:
            self._start_segment()
        t = self.steps_done - self.segment.first_step
        self._keep(self.parts.to_device(batches), t)
        result = self._run(list(self.segment.windows[self.rank][t]))
        self.steps_done += 1
        if t == self.segment.steps - 1:
            self._end_segment()
        return self._result(result, lr)

    def drain(self) -> StepResult:
        """Finishes every micro-batch already admitted; afterwards no weight version but the
        newest exists and nothing is in flight."""
        lr = self.parts.lr()
        result = IterationResult()
        if self.segment is not None:
            done = self.steps_done - self.segment.first_step
            if done == 0:
                self.segment = None
            else:
                result = self._run(self._remainders(done)[self.rank])
                self._end_segment()
        return self._result(result, lr)

    def resume_at(self, step: int) -> None:
        """A run restored from a checkpoint taken after ``drain`` continues at ``step`` with a new
        segment."""
        if self.segment is not None:
            raise InvariantError("resume_at needs an empty pipeline: call drain() first")
        self.steps_done = step

    def _update(self) -> None:
        """One update. A non-finite gradient skips it (weights stay finite) and is reported by every
        rank at the end of the step, where they meet."""
        parts = self.parts
        self.store.before_update()
        try:
            self._norm = parts.gradients.clip(parts.train.grad_clip)
        except NonFiniteError as error:
            self._nonfinite = self._nonfinite or str(error)
        else:
            parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad(set_to_none=True)
        self.store.after_update()

    def _result(self, result: IterationResult, lr: float) -> StepResult:
        self.last_losses = result.losses
        loss_sum, count, nonfinite = self.parts.global_sums(result.loss_sum, float(result.loss_count),
                                                            float(bool(self._nonfinite)))
        loss = loss_sum / count if count else math.nan
        if nonfinite or (count and not math.isfinite(loss)):
            detail = self._nonfinite or f"training loss is {loss}"
            raise NonFiniteError(f"{detail} (under schedule={self.schedule}, on some rank): stopped; lower "
                                 f"train.lr or check the data")
        return StepResult(loss=loss, grad_norm=self._norm, lr=lr)

    def _start_segment(self) -> None:
        self.segment = self.build(self.schedule, self.topology, self.microbatches,
                                  self.total_steps - self.steps_done, self.steps_done, self.vertical_sync)
        self.store = WeightStore(self.parts.params, self.parts.stage.chunks, self.segment.versions(self.rank))

    def _end_segment(self) -> None:
        if self.store is not None:
            self.peak_versions = max(self.peak_versions, self.store.peak)
        self.store = None
        self.segment = None
        self._batches.clear()

    def _run(self, actions: list[Action]) -> IterationResult:
        result = self.executor.run(actions, self._batches, self.loss_scale, weights=self.store)
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

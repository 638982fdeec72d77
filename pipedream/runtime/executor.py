"""Walks one rank's action list in issue order (``schedules.issue_order``: receives posted one
compute ahead, so a transfer overlaps the compute before it): compute on the Stage, transfers
through PipeComm, gradient sync and the optimizer step through callbacks. Each action kind has
its handler (``Executor._handlers``). A run given a WeightStore (``ScheduleInfo.asynchronous``)
runs every forward and backward on the weight version the store assigns to it; without one, on
the parameters.

When a backward's weight-gradient GEMMs run is one ``WeightGradTiming``, chosen per run. A list
with WEIGHT actions (``ScheduleInfo.split_backward``) splits every backward: BWD computes the
input gradient only and leaves the Linear weight-gradient GEMMs of that (micro-batch, chunk) in
the stage's ``WeightGradQueue``; its WEIGHT runs them. Such a list holds nothing back by itself
(``weight_grads_delay`` does not apply).

With ``pair_forward_backward`` (``parallel.ep_overlap``) a forward whose next compute is a backward
of another chunk runs at the same time as it (``paired_compute``), so that each one's
expert-parallel all-to-all waits while the other computes."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

import torch

from pipedream.runtime.comm import PipeComm
from pipedream.runtime.paired_compute import PairedCompute, running
from pipedream.schedules import Action, Kind
from pipedream.schedules.issue_order import issue_order
from pipedream.schedules.paired import Pair, forward_backward_pairs
from pipedream.schedules.weight_hold import held_until_activation_send
from pipedream.runtime.stage import Stage
from pipedream.runtime.weight_grad_timing import WeightGradTiming
from pipedream.runtime.weights import WeightStore

Batch = tuple[torch.Tensor, torch.Tensor]


class Recorder(Protocol):
    def record(self, action: Action, start: float, end: float, wait: float) -> None: ...

    def record_weight_grads(self, microbatch: int, chunk: int, start: float, end: float) -> None: ...


class _Order(NamedTuple):
    """An action list prepared once: its issue order, whether it splits backwards (W actions), and
    per action of the order the backwards of a chunk that sends no gradient whose weight-gradient
    GEMMs it concerns (``schedules.weight_hold``): a BWD that holds them names itself, a SEND_ACT
    names those that run right after it; empty for any other action."""

    actions: tuple[Action, ...]
    order: list[Action]
    split: bool
    held: list[tuple[Action, ...]]
    pairs: dict[int, Pair]


@dataclass
class IterationResult:
    loss_sum: float = 0.0      # sum of unscaled micro-batch losses (last stage only)
    loss_count: int = 0
    losses: dict[int, float] = field(default_factory=dict)   # micro-batch -> its loss (last stage only)


@dataclass
class _Run:
    """What the handlers of one ``Executor.run`` share."""

    batches: dict[int, Batch]
    loss_scale: float
    train: bool
    weights: WeightStore | None
    weight_grads: WeightGradTiming
    result: IterationResult = field(default_factory=IterationResult)


Handler = Callable[[Action, tuple[Action, ...], _Run], None]


@dataclass
class Executor:
    stage: Stage
    comm: PipeComm | None                    # None when pp = 1
    sync_grads: Callable[[], None]
    step: Callable[[], None]                 # the optimizer update (a runner's; tests may wrap it)
    # Flush schedules complete their sends before the gradient all-reduce. Asynchronous ones must
    # not: a send's receive may be posted later in the window, and Gloo's send waits for it.
    sends_before_sync: bool
    # A backward whose input gradient is sent computes that gradient first, sends it, then runs
    # the weight-gradient GEMMs, so the previous stage starts its backward sooner. Runs without a
    # weight store only (weight versions take their gradients at the backward's end). The first
    # stage, which sends no gradient, holds them until its next activation send where a forward
    # comes before its next backward (``schedules.weight_hold``). See ``WeightGradTiming``.
    weight_grads_after_send: bool
    # How many later backwards' sends a backward's weight-gradient GEMMs wait for (0: right after
    # its own send). With 1, the GEMMs of B(k) run after B(k+1)'s send: the forward that follows a
    # backward in 1F1B starts as soon as its input arrives, and the last backward's input gradient
    # leaves one weight-gradient pass earlier, which shortens the flush (docs/design.md). Every
    # held group runs before the gradient sync.
    weight_grads_delay: int
    recorder: Recorder | None = None
    clock: Callable[[], float] = field(default=time.perf_counter)
    # chunk -> the chunk of this rank whose output is its input (the bottom of a V placement):
    # the tensor and its gradient change chunk here without a message
    handover: dict[int, int] = field(default_factory=dict)
    # run each forward whose next compute is a backward of another chunk at the same time as that
    # backward (training without weight versions): ``paired_compute``
    pair_forward_backward: bool = False

    def __post_init__(self) -> None:
        self._paired = PairedCompute()
        self._exchanges = None   # the model's ``ExchangeTally`` (expert parallelism), told who runs
        self._last_input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}   # forward outputs awaiting their send
        self._handed_to = {producer: consumer for consumer, producer in self.handover.items()}
        self._orders: dict[int, _Order] = {}   # id(actions) -> its prepared order
        self._handlers: dict[Kind, Handler] = {
            Kind.RECV_ACT: self._post_recv_activation, Kind.RECV_GRAD: self._post_recv_gradient,
            Kind.FWD: self._forward, Kind.BWD: self._backward, Kind.WEIGHT: self._weight,
            Kind.SEND_ACT: self._send_activation, Kind.SEND_GRAD: self._send_gradient,
            Kind.SYNC_GRADS: self._sync_grads, Kind.STEP: self._step,
        }

    def run(self, actions: list[Action], batches: dict[int, Batch], loss_scale: float,
            train: bool = True, weights: WeightStore | None = None) -> IterationResult:
        """``batches`` maps micro-batch ids to (input, target); only the first stage reads inputs
        and only the last reads targets. ``loss_scale`` is 1/m (losses are averaged over the batch).
        With ``train=False`` forwards run without a graph (evaluation); ``weights`` gives every
        forward and backward its weight version."""
        prepared = self._issue_order(actions)
        timing = WeightGradTiming.choose(prepared.split, self.weight_grads_after_send, weights is not None)
        run = _Run(batches, loss_scale, train, weights, timing)
        handlers, order, held = self._handlers, prepared.order, prepared.held
        self._exchanges = getattr(self.stage.statistics, "exchange", None)   # MoE with expert parallelism
        pairs = prepared.pairs if self.pair_forward_backward and train and weights is None else {}
        i = 0
        while i < len(order):
            pair = pairs.get(i)
            if pair is not None and not any(held[k] for k in pair.forward_sends):
                self._paired.run(pair, order, lambda k: handlers[order[k].kind](order[k], held[k], run))
                i = pair.backward + 1
            else:
                handlers[order[i].kind](order[i], held[i], run)
                i += 1
        self._run_weight_grads(keep=0)
        if self.comm is not None:
            self.comm.wait_sends()
        return run.result

    def _issue_order(self, actions: list[Action]) -> _Order:
        """``actions`` prepared (``_Order``), kept for the list a runner passes every step
        (prepared again when the list changes)."""
        key = tuple(actions)
        cached = self._orders.get(id(actions))
        if cached is None or cached.actions != key:
            split = any(a.kind is Kind.WEIGHT for a in actions)
            held = held_until_activation_send(actions) if self.weight_grads_after_send and not split else {}
            released: dict[Action, tuple[Action, ...]] = {}
            for backward, send in held.items():
                released[send] = (*released.get(send, ()), backward)
            order = issue_order(actions)
            cached = self._orders[id(actions)] = _Order(
                key, order, split, [(a,) if a in held else released.get(a, ()) for a in order],
                forward_backward_pairs(order))
            if len(self._orders) > 4:   # the training and evaluation lists, and a few asynchronous windows
                del self._orders[next(iter(self._orders))]
        return cached

    def _now(self) -> float:
        return self.clock() if self.recorder is not None else 0.0   # the clock only for the trace

    def _record(self, action: Action, start: float, wait: float = 0.0) -> None:
        if self.recorder is not None:
            self.recorder.record(action, start, self.clock(), wait)

    def _record_weight_grads(self, microbatch: int, chunk: int, start: float) -> None:
        if self.recorder is not None:
            self.recorder.record_weight_grads(microbatch, chunk, start, self.clock())

    # The handlers, one per action kind: (action, the backwards it holds or releases, the run).

    def _post_recv_activation(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        self.comm.post_recv_activation(action.microbatch, action.chunk)

    def _post_recv_gradient(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        self.comm.post_recv_gradient(action.microbatch, action.chunk)

    def _forward(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        start = self._now()
        mb, chunk = action.microbatch, action.chunk
        wait = 0.0
        if self.stage.is_first[chunk]:
            inputs = run.batches[mb][0]
        elif chunk in self.handover:
            inputs = self._outputs.pop((mb, self.handover[chunk]))
        else:
            before = self._now()
            inputs = self.comm.wait_activation(mb, chunk)
            if self.recorder is not None:
                wait = self.clock() - before
        target = run.batches[mb][1] if self.stage.is_last[chunk] else None
        if run.train:
            version = run.weights.weights_for(action) if run.weights is not None else None
            with running(self._exchanges, action):
                out = self.stage.forward(mb, chunk, inputs, target, run.loss_scale, version)
            if run.weights is not None:
                run.weights.after_forward(action)
        else:
            out = self.stage.forward_only(chunk, inputs, target)
        if self.stage.is_last[chunk]:
            loss = run.result.losses[mb] = float(out)
            run.result.loss_sum += loss
            run.result.loss_count += 1
        else:
            self._outputs[(mb, chunk)] = out
        self._record(action, start, wait)

    def _backward(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        start = self._now()
        mb, chunk = action.microbatch, action.chunk
        wait = 0.0
        grad_output = None
        if chunk in self._handed_to:
            grad_output = self._last_input_grads.pop((mb, self._handed_to[chunk]))
        elif not self.stage.is_last[chunk]:
            before = self._now()
            grad_output = self.comm.wait_gradient(mb, chunk)
            if self.recorder is not None:
                wait = self.clock() - before
        timing = run.weight_grads
        with running(self._exchanges, action):
            grad_input = self.stage.backward(mb, chunk, grad_output,
                                             defer_weight_grads=timing.defers(self.stage.is_first[chunk], bool(held)),
                                             split=timing.splits_backward)
        if run.weights is not None:
            run.weights.after_backward(action)
        if grad_input is not None:
            self._last_input_grads[(mb, chunk)] = grad_input
        self._record(action, start, wait)

    def _weight(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        start = self._now()
        with running(self._exchanges, action):   # a first chunk's W runs its whole backward
            self.stage.weight_grad(action.microbatch, action.chunk)
        self._record_weight_grads(action.microbatch, action.chunk, start)

    def _send_activation(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        start = self._now()
        self.comm.send_activation(action.microbatch, action.chunk,
                                  self._outputs.pop((action.microbatch, action.chunk)))
        self._record(action, start)
        if held and run.weight_grads.runs_after_sends:   # a first stage's held GEMMs, after the send
            self._run_held_weight_grads(held)

    def _send_gradient(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        start = self._now()
        grad = self._last_input_grads.pop((action.microbatch, action.chunk))
        self.comm.send_gradient(action.microbatch, action.chunk, grad)
        self._record(action, start)
        if run.weight_grads.runs_after_sends:
            self._run_weight_grads(keep=self.weight_grads_delay)

    def _sync_grads(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        self._run_weight_grads(keep=0)
        start = self._now()
        if self.comm is not None and self.sends_before_sync:
            self.comm.wait_sends()
        self.sync_grads()
        self._record(action, start)

    def _step(self, action: Action, held: tuple[Action, ...], run: _Run) -> None:
        start = self._now()
        self.step()
        self._record(action, start)

    def _run_weight_grads(self, keep: int) -> None:
        """Runs held weight-gradient groups, oldest first, until ``keep`` remain."""
        queue = self.stage.weight_grads
        while len(queue) > keep:
            start = self._now()
            microbatch, chunk = queue.run_oldest()
            self._record_weight_grads(microbatch, chunk, start)

    def _run_held_weight_grads(self, backwards: tuple[Action, ...]) -> None:
        """Runs the groups of these backwards only: other chunks' groups keep their own turn (each
        weight belongs to one chunk, so its gradient is summed in the same order either way)."""
        for backward in backwards:
            start = self._now()
            self.stage.weight_grads.run((backward.microbatch, backward.chunk))
            self._record_weight_grads(backward.microbatch, backward.chunk, start)

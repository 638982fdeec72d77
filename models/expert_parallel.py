"""Expert parallelism (``parallel.ep``): the experts of every MoE layer split over the ``ep`` ranks
of a group, each holding ``num_experts / ep`` consecutive ones. Tokens travel to their experts'
ranks and back by all-to-all with variable splits (``exchange``), whose backward is the reverse
all-to-all; ``ExpertParallel`` is a rank's context, which ``models.build_model`` passes to the
llama family's MoE MLPs.

With ``backward_group`` the exchanges of a backward (the reverse exchanges, and a forward recomputed
inside a backward) travel on a group of their own: a runtime that runs one micro-batch's forward
while another's backward runs on a second thread (``pipedream.runtime.paired_compute``) then issues
each group's collectives in one order on every rank, whichever thread reaches its exchange first."""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from models.group_context import GroupContext


@dataclass(frozen=True)
class ExpertParallel(GroupContext):
    """An expert-parallel group (``GroupContext``); ``size == 1`` holds every expert."""

    KIND: ClassVar[str] = "expert-parallel"

    backward_group: dist.ProcessGroup | None = None   # the same ranks, for the exchanges of backwards

    def group_now(self) -> dist.ProcessGroup:
        """The group of an exchange issued now: ``backward_group`` inside a backward (the autograd
        engine runs one on this thread), else ``group``."""
        if self.backward_group is not None and torch._C._current_graph_task_id() != -1:
            return self.backward_group
        return self.group

    def local_experts(self, num_experts: int) -> range:
        """The global indices of this rank's experts (consecutive)."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


@dataclass
class ExchangeTally:
    """What this rank's token exchanges cost since the run began (summary.json): bytes it sent to
    other ranks, and seconds it was blocked issuing them or waiting for them (forward and backward).

    A trace observes the exchanges with ``observe``: each one's interval, from its issue to the end
    of its wait, goes to ``observer`` as ("dispatch F3.1", start, end) on ``clock``, named after the
    action its thread runs (``running``; thread-local, as two actions may run at once)."""

    bytes_sent: int = 0
    seconds: float = 0.0
    clock: Callable[[], Any] = time.perf_counter
    observer: Callable[[str, Any, Any], None] | None = None
    _thread: threading.local = field(default_factory=threading.local, repr=False, compare=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> "ExchangeTally":
        return self   # the run's one tally, shared (a lock cannot be copied)

    def observe(self, observer: Callable[[str, Any, Any], None] | None, clock: Callable[[], Any]) -> None:
        self.observer, self.clock = observer, clock

    def running(self, action: str | None) -> None:
        """Names the action this thread runs (None: none)."""
        self._thread.action = action

    def add(self, sent: int, seconds: float) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.seconds += seconds

    def interval(self, kind: str, start: Any) -> None:
        """One exchange's interval from ``start`` (a ``clock`` reading) to now, to the observer."""
        action = getattr(self._thread, "action", None)
        if self.observer is not None and action is not None:
            self.observer(f"{kind} {action}", start, self.clock())


class PendingExchange:
    """An all-to-all issued asynchronously (``async_op=True``): ``wait`` before reading ``output``,
    so the caller can compute something else meanwhile."""

    def __init__(self, output: torch.Tensor, work: dist.Work | None, tally: ExchangeTally, kind: str = "",
                 issued: Any = None):
        self.output, self.work, self.tally, self.kind, self.issued = output, work, tally, kind, issued

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            started = time.perf_counter()
            self.work.wait()
            self.tally.add(0, time.perf_counter() - started)
            self.work = None
            if self.kind:
                self.tally.interval(self.kind, self.issued)
        return self.output


def all_to_all(x: torch.Tensor, send: list[int], receive: list[int], ep: ExpertParallel,
               tally: ExchangeTally, kind: str = "") -> PendingExchange:
    """Rows of ``x`` (``send[r]`` to rank r, in rank order) exchanged for ``receive[r]`` rows from each
    rank; ``kind`` ("dispatch", "combine") names it to a trace."""
    issued = tally.clock() if kind and tally.observer is not None else None
    started = time.perf_counter()
    output = x.new_empty((sum(receive), *x.shape[1:]))
    work = dist.all_to_all_single(output, x.contiguous(), output_split_sizes=receive, input_split_sizes=send,
                                  group=ep.group_now(), async_op=True)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()   # x may have no rows
    tally.add((sum(send) - send[ep.rank]) * row_bytes, time.perf_counter() - started)
    return PendingExchange(output, work, tally, kind if issued is not None else "", issued)


def exchange_counts(counts: torch.Tensor, ep: ExpertParallel, tally: ExchangeTally) -> torch.Tensor:
    """``counts`` [ep, L] (rows for each rank's L experts) -> [ep, L] rows each rank sends to my experts."""
    return all_to_all(counts, [1] * ep.size, [1] * ep.size, ep, tally).wait()


class _Start(torch.autograd.Function):
    """Issues the exchange of ``x`` and returns its (not yet filled) output; ``_Finish`` waits.
    Backward: the reverse exchange of the gradient (blocking: autograd needs it at once)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], ep: ExpertParallel,
                tally: ExchangeTally, holder: list, kind: str) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.ep, ctx.tally, ctx.kind = send, receive, ep, tally, kind
        pending = all_to_all(x, send, receive, ep, tally, kind)
        holder.append(pending)
        return pending.output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = all_to_all(grad, ctx.receive, ctx.send, ctx.ep, ctx.tally, ctx.kind).wait()
        return back, None, None, None, None, None, None


class _Finish(torch.autograd.Function):
    """Waits for the exchange ``_Start`` issued; identity for autograd."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, holder: list) -> torch.Tensor:
        holder.pop().wait()
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def start_exchange(x: torch.Tensor, send: list[int], receive: list[int], ep: ExpertParallel, tally: ExchangeTally,
                   kind: str = ""):
    """Issues the exchange; the returned ``finish()`` waits and gives the exchanged rows, differentiable.
    ``kind`` ("dispatch", "combine") names it, and its backward, to a trace."""
    holder: list = []
    started = _Start.apply(x, send, receive, ep, tally, holder, kind)
    return lambda: _Finish.apply(started, holder)

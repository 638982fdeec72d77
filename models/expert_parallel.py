"""Expert parallelism (``parallel.ep``): the experts of every MoE layer split over the ``ep`` ranks
of a group, each holding ``num_experts / ep`` consecutive ones. Tokens travel to their experts'
ranks and back by all-to-all with variable splits (``exchange``), whose backward is the reverse
all-to-all; ``ExpertParallel`` is a rank's context, which ``models.build_model`` passes to the
llama family's MoE MLPs."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from models.group_context import GroupContext


@dataclass(frozen=True)
class ExpertParallel(GroupContext):
    """An expert-parallel group (``GroupContext``); ``size == 1`` holds every expert."""

    KIND: ClassVar[str] = "expert-parallel"

    def local_experts(self, num_experts: int) -> range:
        """The global indices of this rank's experts (consecutive)."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


@dataclass
class ExchangeTally:
    """What this rank's token exchanges cost since the run began (summary.json): bytes it sent to
    other ranks, and seconds it was blocked issuing them or waiting for them (forward and backward)."""

    bytes_sent: int = 0
    seconds: float = 0.0


class PendingExchange:
    """An all-to-all issued asynchronously (``async_op=True``): ``wait`` before reading ``output``,
    so the caller can compute something else meanwhile."""

    def __init__(self, output: torch.Tensor, work: dist.Work | None, tally: ExchangeTally):
        self.output, self.work, self.tally = output, work, tally

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            started = time.perf_counter()
            self.work.wait()
            self.tally.seconds += time.perf_counter() - started
            self.work = None
        return self.output


def all_to_all(x: torch.Tensor, send: list[int], receive: list[int], ep: ExpertParallel,
               tally: ExchangeTally) -> PendingExchange:
    """Rows of ``x`` (``send[r]`` to rank r, in rank order) exchanged for ``receive[r]`` rows from each rank."""
    started = time.perf_counter()
    output = x.new_empty((sum(receive), *x.shape[1:]))
    work = dist.all_to_all_single(output, x.contiguous(), output_split_sizes=receive, input_split_sizes=send,
                                  group=ep.group, async_op=True)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()   # x may have no rows
    tally.bytes_sent += (sum(send) - send[ep.rank]) * row_bytes
    tally.seconds += time.perf_counter() - started
    return PendingExchange(output, work, tally)


def exchange_counts(counts: torch.Tensor, ep: ExpertParallel, tally: ExchangeTally) -> torch.Tensor:
    """``counts`` [ep, L] (rows for each rank's L experts) -> [ep, L] rows each rank sends to my experts."""
    return all_to_all(counts, [1] * ep.size, [1] * ep.size, ep, tally).wait()


class _Start(torch.autograd.Function):
    """Issues the exchange of ``x`` and returns its (not yet filled) output; ``_Finish`` waits.
    Backward: the reverse exchange of the gradient (blocking: autograd needs it at once)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], ep: ExpertParallel,
                tally: ExchangeTally, holder: list) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.ep, ctx.tally = send, receive, ep, tally
        pending = all_to_all(x, send, receive, ep, tally)
        holder.append(pending)
        return pending.output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = all_to_all(grad, ctx.receive, ctx.send, ctx.ep, ctx.tally).wait()
        return back, None, None, None, None, None


class _Finish(torch.autograd.Function):
    """Waits for the exchange ``_Start`` issued; identity for autograd."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, holder: list) -> torch.Tensor:
        holder.pop().wait()
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def start_exchange(x: torch.Tensor, send: list[int], receive: list[int], ep: ExpertParallel, tally: ExchangeTally):
    """Issues the exchange; the returned ``finish()`` waits and gives the exchanged rows, differentiable."""
    holder: list = []
    started = _Start.apply(x, send, receive, ep, tally, holder)
    return lambda: _Finish.apply(started, holder)

"""A one-chunk stage whose work costs known times on a fake clock, for the trace tests: its forward,
backward, gradient sync and optimizer step each hand their cost to ``spend`` (a fake host clock's
``advance``, or a fake device stream's ``launch``)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pipedream.runtime.executor import Executor
from models.grad_accumulation import fuse_grad_accumulation
from pipedream.config.layout import ParallelLayout
from pipedream.schedules import build_schedule
from pipedream.runtime.stage import Stage
from pipedream.observe.trace import TraceRecorder
from tests.support.loopback import FakeClock, LoopbackComm, LoopbackNetwork, run_ranks

FORWARD_S, BACKWARD_S, SYNC_S, STEP_S = 2.0, 3.0, 0.5, 0.25

Spend = Callable[[float], None]


class _Tick(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, spend: Spend) -> torch.Tensor:
        spend(FORWARD_S)
        ctx.spend = spend
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.spend(BACKWARD_S)
        return grad, None


class Tick(nn.Module):
    """Spends FORWARD_S in forward and BACKWARD_S in backward."""

    def __init__(self, spend: Spend):
        super().__init__()
        self.spend = spend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Tick.apply(x, self.spend)


def tick_executor(spend: Spend, recorder: TraceRecorder, is_first: bool, is_last: bool, comm=None) -> Executor:
    """The executor of a Linear then a Tick, timed with the recorder's clock."""
    # Linear first, so that the first stage's Tick output needs a gradient and its backward runs
    chunk = nn.Sequential(nn.Linear(3, 3), Tick(spend))
    stage = Stage([chunk], [is_first], [is_last], nn.MSELoss())
    fuse_grad_accumulation(chunk, stage.weight_grads)
    return Executor(stage, comm, sync_grads=lambda: spend(SYNC_S), step=lambda: spend(STEP_S), recorder=recorder,
                    clock=recorder.clock, sends_before_sync=True, weight_grads_after_send=True, weight_grads_delay=1)


def batches(count: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {mb: (torch.ones(2, 3), torch.zeros(2, 3)) for mb in range(count)}


def traced_two_stage_step(make: Callable[[int, FakeClock, LoopbackComm], tuple[Executor, TraceRecorder]],
                          latency: float) -> list[TraceRecorder]:
    """One traced 1F1B step (p = 2, m = 2) on loopback ranks, each with its own fake host clock on
    which every receive takes ``latency``; ``make(rank, host, comm)`` builds a rank's executor."""
    network = LoopbackNetwork(ParallelLayout(pp=2))

    def rank_run(rank: int) -> TraceRecorder:
        host = FakeClock()
        executor, recorder = make(rank, host, network.comm(rank, host, latency))
        recorder.begin_step(1, traced=True)
        executor.run(build_schedule("1f1b", 2, 2)[rank], batches(2), loss_scale=0.5)
        recorder.end_step()
        return recorder

    return run_ranks(rank_run, 2)

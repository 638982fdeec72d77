"""AsyncRunner on a two-stage pipeline in one process (loopback communicator, one thread per rank):
losses and final weights of PipeDream (weight stashing) and 2BW equal a per-micro-batch reference
written from the update rules, including a drain in the middle of the run."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pipedream.runtime.async_runner import AsyncRunner
from pipedream.errors import InvariantError
from pipedream.runtime.executor import Executor
from pipedream.schedules import schedule_info
from pipedream.config.layout import ParallelLayout
from pipedream.runtime.shapes import InputShapes
from pipedream.runtime.stage import Stage
from tests.support.loopback import LoopbackNetwork, run_ranks

PP, MICROBATCHES, STEPS, LR = 2, 2, 3, 0.1
LOSS = nn.MSELoss()


def stage_modules() -> list[nn.Sequential]:
    """Built in the test's thread: rank threads share the global RNG, so they only copy these."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 2))]


def step_batches(step: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + step)
    return {index: (torch.randn(3, 4, generator=generator), torch.randn(3, 2, generator=generator))
            for index in range(MICROBATCHES)}


def rules(schedule: str):
    """(weight version stage s uses for segment-local micro-batch k, micro-batches per update, loss scale)."""
    if schedule == "pipedream":
        return (lambda s, k: max(0, k - PP + s + 1)), 1, 1.0
    return (lambda s, k: max(0, k // MICROBATCHES - 1)), MICROBATCHES, 1.0 / MICROBATCHES


def reference(schedule: str, segments: list[int]) -> tuple[dict[int, float], list[nn.Module]]:
    """Losses by micro-batch and final stages; ``segments`` are the steps of each segment (a drain
    ends one: the next starts again from version 0, its newest weights)."""
    version_of, per_update, scale = rules(schedule)
    stages = stage_modules()
    losses: dict[int, float] = {}
    first_mb = 0
    for steps in segments:
        history = [[copy.deepcopy(stage)] for stage in stages]
        sums = [[torch.zeros_like(p) for p in stage.parameters()] for stage in stages]
        for k in range(steps * MICROBATCHES):
            mb = first_mb + k
            x, y = step_batches(mb // MICROBATCHES)[mb % MICROBATCHES]
            runs = [copy.deepcopy(history[s][version_of(s, k)]) for s in range(PP)]
            loss = LOSS(runs[1](runs[0](x)), y)
            (loss * scale).backward()
            losses[mb] = float(loss.detach())
            for s in range(PP):
                for total, p in zip(sums[s], runs[s].parameters()):
                    total += p.grad
            if (k + 1) % per_update == 0:
                for s in range(PP):
                    newest = copy.deepcopy(history[s][-1])
                    with torch.no_grad():
                        for p, total in zip(newest.parameters(), sums[s]):
                            p -= LR * total
                            total.zero_()
                    history[s].append(newest)
        stages = [h[-1] for h in history]
        first_mb += steps * MICROBATCHES
    return losses, stages


class LoopbackParts:
    """What ``AsyncRunner`` reads from its ``RankParts``, for one thread-rank: plain SGD without
    clipping, and the step's loss sums kept local (the last stage's are the test's)."""

    def __init__(self, schedule: str, rank: int, comm, stage: Stage, steps: int):
        self.spec = SimpleNamespace(schedule=schedule_info(schedule), microbatches=MICROBATCHES, vertical_sync=False)
        self.train = SimpleNamespace(steps=steps, grad_clip=0.0)
        self.stage, self.params, self.comm = stage, stage.parameters(), comm
        self.optimizer = torch.optim.SGD(self.params, lr=LR)
        self.scheduler = SimpleNamespace(step=lambda: None)
        self.gradients = SimpleNamespace(clip=lambda limit: 0.0, sync=lambda: None)
        self.topology = ParallelLayout(pp=PP if comm is not None else 1).replicated()
        self.schedule_rank = self.pp_rank = rank
        self.device = torch.device("cpu")
        self.shapes = InputShapes()

    def make_executor(self, update, sends_before_sync: bool) -> Executor:
        return Executor(self.stage, self.comm, self.gradients.sync, update, sends_before_sync=sends_before_sync,
                        weight_grads_after_send=True, weight_grads_delay=1)

    def lr(self) -> float:
        return LR

    def to_device(self, batches):
        return batches

    def global_sums(self, *values: float) -> list[float]:
        return list(values)


def pipeline_rank(rank: int, schedule: str, network: LoopbackNetwork, drain_after: int | None,
                  modules: list[nn.Module]):
    chunk = copy.deepcopy(modules[rank])
    stage = Stage([chunk], [rank == 0], [rank == PP - 1], LOSS)
    runner = AsyncRunner(LoopbackParts(schedule, rank, network.comm(rank), stage, STEPS))
    losses: dict[int, float] = {}
    for t in range(STEPS):
        runner.run_step(step_batches(t), grad_norm=False)
        losses.update(runner.last_losses)
        if t + 1 == drain_after:
            runner.drain()
            losses.update(runner.last_losses)
            assert runner.segment is None and runner.store is None
    assert runner.segment is None and stage.stash == {}
    return losses, chunk, runner.peak_versions


@pytest.mark.parametrize("schedule,drain_after", [("pipedream", None), ("pipedream", 2), ("2bw", None),
                                                  ("2bw", 1)])
def test_two_stages_follow_the_update_rule(schedule, drain_after):
    network = LoopbackNetwork(ParallelLayout(pp=PP))
    modules = stage_modules()
    ranks = run_ranks(lambda rank: pipeline_rank(rank, schedule, network, drain_after, modules), PP)
    segments = [STEPS] if drain_after is None else [drain_after, STEPS - drain_after]
    expected_losses, expected_stages = reference(schedule, segments)

    losses = ranks[-1][0]
    assert ranks[0][0] == {} and sorted(losses) == sorted(expected_losses)
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    for (_, chunk, _), expected in zip(ranks, expected_stages):
        for got, want in zip(chunk.parameters(), expected.parameters()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert network.undelivered() == []
    # PipeDream's first stage holds one stashed version besides the newest; 2BW holds two at most
    peaks = [peak for _, _, peak in ranks]
    if schedule == "pipedream":
        assert peaks == [2, 1]
    else:
        assert max(peaks) == 2


def test_a_run_ends_after_its_steps():
    chunk = stage_modules()[1]
    stage = Stage([chunk], [True], [True], LOSS)
    runner = AsyncRunner(LoopbackParts("2bw", 0, None, stage, steps=1))
    assert runner.drain().loss == pytest.approx(float("nan"), nan_ok=True)   # nothing admitted: nothing ran
    runner.run_step(step_batches(0), grad_norm=False)
    assert len(runner.last_losses) == MICROBATCHES and runner.segment is None and runner.store is None
    with pytest.raises(InvariantError, match="all 1 steps"):
        runner.run_step(step_batches(1), grad_norm=False)

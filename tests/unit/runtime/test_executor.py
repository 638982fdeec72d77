"""The executor, with every pipeline rank in this process: a flush schedule over a loopback
communicator gives the loss and gradients of one nn.Sequential forward/backward."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipedream.runtime.executor import Executor
from models.grad_accumulation import fuse_grad_accumulation
from pipedream.config.layout import ParallelLayout
from pipedream.schedules import Action, Kind, build_schedule
from pipedream.runtime.stage import Stage
from tests.support.loopback import LoopbackNetwork, run_ranks

MICROBATCHES = 4
LOSS = nn.MSELoss()


def blocks(count: int = 4) -> list[nn.Module]:
    """Linear-Tanh blocks ending in a plain Linear: one per virtual stage in the finest split."""
    torch.manual_seed(0)
    width = 6
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(count - 1)]
    return layers + [nn.Linear(width, 3)]


def microbatch_data() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return {mb: (torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator))
            for mb in range(MICROBATCHES)}


def reference(layers: list[nn.Module], batches) -> tuple[float, list[torch.Tensor]]:
    """Mean micro-batch loss and the gradients of its mean, in one process without a pipeline."""
    model = nn.Sequential(*copy.deepcopy(layers))
    losses = [LOSS(model(x), y) for x, y in batches.values()]
    total = torch.stack(losses).mean()
    total.backward()
    return sum(float(loss.detach()) for loss in losses), [p.grad for p in model.parameters()]


def rank_stage(rank: int, layout: ParallelLayout, layers: list[nn.Module], fused: bool
               ) -> tuple[Stage, list[nn.Module], list[int]]:
    """One rank's chunks (copies of the shared layers, placed by ``layout``) and its stage."""
    per_stage = len(layers) // layout.num_virtual_stages
    virtual_stages = [layout.virtual_stage(rank, c) for c in range(layout.vpp)]
    chunks = [nn.Sequential(*copy.deepcopy(layers[vs * per_stage:(vs + 1) * per_stage])) for vs in virtual_stages]
    last = layout.num_virtual_stages - 1
    stage = Stage(chunks, [vs == 0 for vs in virtual_stages], [vs == last for vs in virtual_stages], LOSS)
    if fused:
        for chunk in chunks:
            fuse_grad_accumulation(chunk, stage.weight_grads)
    return stage, chunks, virtual_stages


def pipeline_rank(rank: int, layout: ParallelLayout, schedule: str, layers: list[nn.Module], network: LoopbackNetwork,
                  batches, fused: bool):
    """What one rank does: its chunks (copies of the shared layers), its stage and its executor."""
    stage, chunks, virtual_stages = rank_stage(rank, layout, layers, fused)
    calls: list[str] = []
    executor = Executor(stage, network.comm(rank), sync_grads=lambda: calls.append("sync"),
                        step=lambda: calls.append("step"), sends_before_sync=True, weight_grads_after_send=True, weight_grads_delay=1)
    actions = build_schedule(schedule, layout.pp, MICROBATCHES, layout.vpp)[rank]
    result = executor.run(actions, batches, loss_scale=1.0 / MICROBATCHES)
    grads = {vs: [p.grad for p in chunk.parameters()] for vs, chunk in zip(virtual_stages, chunks)}
    return result, grads, calls, stage


@pytest.mark.parametrize("schedule,vpp,fused", [("1f1b", 1, False), ("1f1b", 1, True), ("gpipe", 1, False),
                                                ("gpipe", 1, True), ("interleaved", 2, True)])
def test_two_stages_match_one_sequential(schedule, vpp, fused):
    layout = ParallelLayout(pp=2, vpp=vpp)
    layers, batches = blocks(), microbatch_data()
    network = LoopbackNetwork(layout)
    ranks = run_ranks(lambda rank: pipeline_rank(rank, layout, schedule, layers, network, batches, fused), 2)

    loss_sum, expected_grads = reference(layers, batches)
    last = ranks[1][0]   # the last virtual stage is on pipeline rank 1 in both splits
    assert last.loss_count == MICROBATCHES and sorted(last.losses) == list(range(MICROBATCHES))
    assert ranks[0][0].loss_count == 0
    assert last.loss_sum == pytest.approx(loss_sum, rel=1e-6)
    grads = [g for vs in range(layout.num_virtual_stages) for g in next(r[1][vs] for r in ranks if vs in r[1])]
    assert len(grads) == len(expected_grads)
    for got, expected in zip(grads, expected_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    # every activation and gradient crossed once per virtual-stage boundary, nothing is left over
    boundaries = layout.num_virtual_stages - 1
    assert len(network.sent) == 2 * boundaries * MICROBATCHES
    assert network.undelivered() == []
    for _, _, calls, stage in ranks:
        assert calls == ["sync", "step"]
        assert stage.stash == {} and len(stage.weight_grads) == 0 and stage.stats.in_flight == 0


def test_stage_memory_peaks_follow_the_schedule():
    """GPipe holds every micro-batch on the first stage at once; 1F1B at most pp of them."""
    layout = ParallelLayout(pp=2)
    layers, batches = blocks(), microbatch_data()
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        network = LoopbackNetwork(layout)
        ranks = run_ranks(lambda rank: pipeline_rank(rank, layout, schedule, layers, network, batches, False), 2)
        peaks[schedule] = [stage.stats.peak_in_flight for _, _, _, stage in ranks]
    assert peaks == {"gpipe": [MICROBATCHES, MICROBATCHES], "1f1b": [2, 1]}


def test_evaluation_runs_without_a_graph():
    layout = ParallelLayout(pp=2)
    layers, batches = blocks(), microbatch_data()
    network = LoopbackNetwork(layout)
    forward_only = [[a for a in actions if a.kind in (Kind.FWD, Kind.SEND_ACT, Kind.RECV_ACT)]
                    for actions in build_schedule("gpipe", 2, MICROBATCHES)]

    def evaluate(rank: int):
        per_stage = len(layers) // 2
        chunk = nn.Sequential(*copy.deepcopy(layers[rank * per_stage:(rank + 1) * per_stage]))
        stage = Stage([chunk], [rank == 0], [rank == 1], LOSS)
        executor = Executor(stage, network.comm(rank), lambda: None, lambda: None, sends_before_sync=True, weight_grads_after_send=True, weight_grads_delay=1)
        return executor.run(forward_only[rank], batches, loss_scale=1.0, train=False), stage

    (_, first), (result, last) = run_ranks(evaluate, 2)
    model = nn.Sequential(*copy.deepcopy(layers))
    with torch.no_grad():
        expected = {mb: float(LOSS(model(x), y)) for mb, (x, y) in batches.items()}
    assert result.losses == pytest.approx(expected, rel=1e-6)
    assert first.stash == {} and last.stash == {}
    assert all(p.grad is None for p in model.parameters())


def test_a_receive_must_be_posted_before_its_wait():
    layout = ParallelLayout(pp=2)
    comm = LoopbackNetwork(layout).comm(1)
    chunk = nn.Linear(6, 3)
    executor = Executor(Stage([chunk], [False], [True], LOSS), comm, lambda: None, lambda: None,
                        sends_before_sync=True, weight_grads_after_send=True, weight_grads_delay=1)
    with pytest.raises(RuntimeError, match="never posted"):
        executor.run([Action(Kind.FWD, 0, 0)], {0: (torch.zeros(1, 6), torch.zeros(1, 3))}, 1.0)

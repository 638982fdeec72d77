"""The executor runs the zero-bubble schedules' explicit W actions and zbv's V placement: every
pipeline rank in this process over a loopback communicator gives the loss and gradients of one
nn.Sequential, and each rank's peak in-flight micro-batches equal the simulator's."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipedream.runtime.executor import Executor
from models.grad_accumulation import fuse_grad_accumulation
from pipedream.config.layout import ParallelLayout
from pipedream.runtime.runner import local_handovers
from pipedream.schedules import Action, Kind, build_schedule, schedule_placement
from pipedream.schedules.simulate import simulate
from pipedream.runtime.stage import Stage
from tests.support.loopback import LoopbackNetwork, run_ranks
from tests.unit.runtime.test_executor import LOSS, blocks, rank_stage, reference

MICROBATCHES = 6


class WeightEvents:
    """A recorder that keeps which W actions ran, in order."""

    def __init__(self) -> None:
        self.weight_grads: list[tuple[int, int]] = []

    def record(self, action: Action, start: float, end: float, wait: float) -> None:
        pass

    def record_weight_grads(self, microbatch: int, chunk: int, start: float, end: float) -> None:
        self.weight_grads.append((microbatch, chunk))


def data(count: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return {mb: (torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator))
            for mb in range(count)}


def layout_of(schedule: str, pp: int) -> ParallelLayout:
    placement = schedule_placement(schedule, pp)
    return ParallelLayout(pp=pp, vpp=placement.vpp, placement=placement.kind)


def zero_bubble_rank(rank: int, layout: ParallelLayout, schedule: str, layers, network, batches, fused: bool):
    stage, chunks, virtual_stages = rank_stage(rank, layout, layers, fused)
    recorder = WeightEvents()
    executor = Executor(stage, network.comm(rank), sync_grads=lambda: None, step=lambda: None,
                        sends_before_sync=True, weight_grads_after_send=True, weight_grads_delay=1,
                        recorder=recorder, handover=local_handovers(layout, rank))
    actions = build_schedule(schedule, layout.pp, len(batches), layout.vpp)[rank]
    result = executor.run(actions, batches, loss_scale=1.0 / len(batches))
    grads = {vs: [p.grad for p in chunk.parameters()] for vs, chunk in zip(virtual_stages, chunks)}
    return result, grads, stage, recorder, actions


@pytest.mark.parametrize("schedule,pp,fused", [("zb_h2", 2, True), ("zb_h2", 4, True), ("zb_h2", 2, False),
                                               ("zbv", 2, True), ("zbv", 2, False)])
def test_zero_bubble_ranks_match_one_sequential(schedule, pp, fused):
    layout = layout_of(schedule, pp)
    layers, batches = blocks(4), data(MICROBATCHES)
    network = LoopbackNetwork(layout)
    ranks = run_ranks(lambda rank: zero_bubble_rank(rank, layout, schedule, layers, network, batches, fused), pp)

    loss_sum, expected_grads = reference(layers, batches)
    last_rank = layout.stage_of(layout.num_virtual_stages - 1)[0]   # rank 0 under zbv's V
    assert ranks[last_rank][0].loss_sum == pytest.approx(loss_sum, rel=1e-6)
    grads = [g for vs in range(layout.num_virtual_stages) for g in next(r[1][vs] for r in ranks if vs in r[1])]
    assert len(grads) == len(expected_grads)
    for got, expected in zip(grads, expected_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert network.undelivered() == []
    placement = schedule_placement(schedule, pp)
    predicted = simulate([r[4] for r in ranks], vpp=placement.vpp, peer=placement.peer, needs=placement.needs)
    for rank, (_, _, stage, recorder, actions) in enumerate(ranks):
        assert stage.stash == {} and len(stage.weight_grads) == 0 and stage.stats.in_flight == 0
        assert stage.stats.peak_in_flight == predicted.peak_in_flight[rank]
        # every W of the list was run and reported, in the list's order
        assert recorder.weight_grads == [(a.microbatch, a.chunk) for a in actions if a.kind is Kind.WEIGHT]


def test_v_placement_hands_over_at_the_bottom_without_messages():
    """zbv at pp = 2: virtual stages 1 and 2 are both on rank 1, so only stages 0-1 and 2-3 talk."""
    layout = layout_of("zbv", 2)
    assert [layout.virtual_stage(1, c) for c in (0, 1)] == [1, 2]
    assert local_handovers(layout, 1) == {1: 0} and local_handovers(layout, 0) == {}
    assert layout.p2p_channels() == [(0, 1), (1, 0)]
    layers, batches = blocks(4), data(4)
    network = LoopbackNetwork(layout)
    run_ranks(lambda rank: zero_bubble_rank(rank, layout, "zbv", layers, network, batches, True), 2)
    # two boundaries cross ranks (0 -> 1 and 2 -> 3), each with an activation and a gradient
    assert len(network.sent) == 2 * 2 * 4


def test_a_split_backward_leaves_the_weight_gradient_to_its_w():
    torch.manual_seed(0)
    chunk = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    stage = Stage([chunk], [True], [True], LOSS)
    fuse_grad_accumulation(chunk, stage.weight_grads)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    stage.forward(0, 0, x, y)
    stage.backward(0, 0, split=True)
    weights = [chunk[0].weight, chunk[2].weight]
    assert all(w.grad is None for w in weights) and chunk[2].bias.grad is not None
    assert stage.stats.in_flight == 1          # W still needs the activations: counted until it runs
    stage.weight_grad(0, 0)
    assert stage.stats.in_flight == 0 and len(stage.weight_grads) == 0
    expected = copy.deepcopy(chunk)
    for layer in expected:
        if isinstance(layer, nn.Linear):
            layer.__class__ = nn.Linear
    expected.zero_grad(set_to_none=True)
    LOSS(expected(x), y).backward()
    for got, want in zip(weights, [expected[0].weight, expected[2].weight]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)

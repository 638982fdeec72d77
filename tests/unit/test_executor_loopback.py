"""The executor, the stage and the schedules together, in one process: every pipeline rank's
executor runs in a thread and boundary tensors travel through an in-process loopback
(tests/loopback.py). The gradients equal those of one nn.Sequential over the same micro-batches."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from models import mlp_model
from pipedream.executor import Executor
from pipedream.grad_accumulation import fuse_grad_accumulation
from pipedream.layout import split_layers
from pipedream.schedules import Kind, build_schedule
from pipedream.schedules.forward_only import forward_only
from pipedream.shapes import BoundaryShapes
from pipedream.stage import Stage
from tests.loopback import LoopbackNetwork, run_ranks

LAYERS, HIDDEN, MICRO, MICROBATCHES = 4, 8, 2, 4


class ListRecorder:
    def __init__(self) -> None:
        self.actions: list[tuple] = []
        self.weight_grads: list[tuple] = []

    def record(self, action, start: float, end: float, wait: float) -> None:
        self.actions.append((action, start, end, wait))

    def record_weight_grads(self, microbatch: int, chunk: int, start: float, end: float) -> None:
        self.weight_grads.append((microbatch, chunk, start, end))


def micro_batches(seed: int = 1) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(MICRO, HIDDEN, generator=generator), torch.randn(MICRO, HIDDEN, generator=generator))
            for k in range(MICROBATCHES)}


def build_rank(rank: int, pp: int, vpp: int, network: LoopbackNetwork, clock=None, recorder=None):
    """This rank's chunks (virtual stages rank, rank + pp, ...) and its executor."""
    model = mlp_model(LAYERS, HIDDEN, seed=0)
    bounds = split_layers(LAYERS, pp * vpp)
    stages = [chunk * pp + rank for chunk in range(vpp)]
    built = model.build([i for vs in stages for i in range(*bounds[vs])])
    chunks = [nn.Sequential(*(built[i] for i in range(*bounds[vs]))) for vs in stages]
    stage = Stage(chunks, [vs == 0 for vs in stages], [vs == pp * vpp - 1 for vs in stages], model.loss_fn)
    for chunk in chunks:
        fuse_grad_accumulation(chunk, stage.weight_grads)
    executor = Executor(stage, network.comm(rank) if pp > 1 else None, sync_grads=lambda: None, step=lambda: None,
                        sends_before_sync=True, weight_grads_after_send=True, weight_grads_delay=1,
                        recorder=recorder, clock=clock or itertools.count().__next__)
    return built, executor


def reference(batches) -> tuple[float, dict[int, nn.Module]]:
    """Single-process gradient accumulation over the same micro-batches."""
    model = mlp_model(LAYERS, HIDDEN, seed=0)
    layers = model.build()
    sequential = nn.Sequential(*(layers[i] for i in range(LAYERS)))
    total = 0.0
    for inputs, target in batches.values():
        loss = model.loss_fn(sequential(inputs), target)
        (loss / MICROBATCHES).backward()
        total += float(loss.detach())
    return total, layers


@pytest.mark.parametrize("schedule,pp,vpp", [("gpipe", 2, 1), ("1f1b", 2, 1), ("1f1b", 4, 1),
                                             ("interleaved", 2, 2)])
def test_pipeline_gradients_equal_single_process(schedule, pp, vpp):
    batches = micro_batches()
    network = LoopbackNetwork(pp)
    ranks = [build_rank(rank, pp, vpp, network) for rank in range(pp)]
    actions = build_schedule(schedule, pp, MICROBATCHES, vpp)
    results = run_ranks([lambda r=r: ranks[r][1].run(actions[r], batches, loss_scale=1 / MICROBATCHES)
                         for r in range(pp)])
    expected_loss, expected_layers = reference(batches)
    last = results[(pp * vpp - 1) % pp]
    assert last.loss_count == MICROBATCHES
    assert last.loss_sum == pytest.approx(expected_loss, rel=1e-6)
    for built, _ in ranks:
        for index, layer in built.items():
            for (name, param), (_, expected) in zip(layer.named_parameters(),
                                                    expected_layers[index].named_parameters()):
                torch.testing.assert_close(param.grad, expected.grad, rtol=1e-5, atol=1e-7,
                                           msg=f"layer {index} {name}")
    for _, executor in ranks:
        assert not executor.stage.stash and len(executor.stage.weight_grads) == 0   # nothing left behind


def test_receives_are_posted_before_they_are_waited_for_and_sends_match():
    network = LoopbackNetwork(2)
    ranks = [build_rank(rank, 2, 1, network) for rank in range(2)]
    actions = build_schedule("1f1b", 2, MICROBATCHES)
    batches = micro_batches()
    run_ranks([lambda r=r: ranks[r][1].run(actions[r], batches, loss_scale=1 / MICROBATCHES) for r in range(2)])
    first, last = (executor.comm.log for _, executor in ranks)
    assert [e for e in first if e[0] == "send_act"] == [("send_act", k, 0) for k in range(MICROBATCHES)]
    assert [e for e in last if e[0] == "send_grad"] == [("send_grad", k, 0) for k in range(MICROBATCHES)]
    # one compute ahead: the last stage posts micro-batch k+1's receive before it computes k, so
    # before k's input gradient leaves
    assert [e[1] for e in last if e[0] == "post_act"] == list(range(MICROBATCHES))
    for k in range(MICROBATCHES - 1):
        assert last.index(("post_act", k + 1, 0)) < last.index(("send_grad", k, 0))


def test_injected_clock_makes_the_recorded_spans_exact():
    network = LoopbackNetwork(2)
    recorders = [ListRecorder(), ListRecorder()]
    ranks = [build_rank(rank, 2, 1, network, recorder=recorders[rank]) for rank in range(2)]
    actions = build_schedule("1f1b", 2, MICROBATCHES)
    batches = micro_batches()
    run_ranks([lambda r=r: ranks[r][1].run(actions[r], batches, loss_scale=1 / MICROBATCHES) for r in range(2)])
    first = recorders[0].actions[0]
    assert (first[0].kind, first[0].microbatch, first[1:]) == (Kind.FWD, 0, (0, 1, 0.0))   # one tick, no wait
    for recorder, rank_actions in zip(recorders, actions):
        computes = [a for a, *_ in recorder.actions if a.kind in (Kind.FWD, Kind.BWD)]
        assert computes == [a for a in rank_actions if a.kind in (Kind.FWD, Kind.BWD)]
        stamps = [t for _, start, end, _ in recorder.actions for t in (start, end)]
        assert all(isinstance(t, int) for t in stamps) and stamps == sorted(stamps)
    # the last stage holds each backward's weight gradients back and runs them in micro-batch order;
    # the first stage has no input gradient to send first, so it runs none of them late
    assert [mb for mb, *_ in recorders[1].weight_grads] == list(range(MICROBATCHES))
    assert recorders[0].weight_grads == []


def test_evaluation_runs_forward_only_and_keeps_no_state():
    network = LoopbackNetwork(2)
    ranks = [build_rank(rank, 2, 1, network) for rank in range(2)]
    actions = forward_only(2, MICROBATCHES)
    batches = micro_batches()
    results = run_ranks([lambda r=r: ranks[r][1].run(actions[r], batches, loss_scale=1.0, train=False)
                         for r in range(2)])
    expected_loss, expected_layers = reference(batches)
    assert results[1].loss_sum == pytest.approx(expected_loss, rel=1e-6)
    for built, executor in ranks:
        assert not executor.stage.stash
        assert all(p.grad is None for layer in built.values() for p in layer.parameters())


def test_boundary_shapes_follow_the_input_shape():
    model = mlp_model(LAYERS, HIDDEN, seed=0)
    shapes = BoundaryShapes(model, split_layers(LAYERS, 2), torch.float32)
    assert shapes.stage_input((3, HIDDEN), 0) == (torch.Size([3, HIDDEN]), torch.float32)
    assert shapes.stage_output((5, HIDDEN), 0) == (torch.Size([5, HIDDEN]), torch.float32)
    assert shapes.stage_input((5, HIDDEN), 1) == shapes.stage_output((5, HIDDEN), 0)

"""A first stage's backward holds its weight-gradient GEMMs until the next forward's activation
send: which backwards hold (schedules.weight_hold), and the executor doing it without changing a
single gradient bit."""
from __future__ import annotations

import torch

from pipedream.runtime.executor import Executor
from pipedream.config.layout import ParallelLayout
from pipedream.schedules import Action, Kind, build_schedule
from pipedream.schedules.weight_hold import held_until_activation_send
from tests.support.loopback import LoopbackNetwork, run_ranks
from tests.unit.runtime.test_executor import MICROBATCHES, blocks, microbatch_data, rank_stage


def test_only_a_first_stage_backward_before_a_forward_send_holds() -> None:
    first, last = build_schedule("1f1b", 2, 6)
    held = held_until_activation_send(first)
    # B(k) waits for the send of F(k+2); the drain's B4 and B5 have no forward after them
    assert held == {Action(Kind.BWD, k, 0): Action(Kind.SEND_ACT, k + 2, 0) for k in range(4)}
    assert held_until_activation_send(last) == {}   # it sends every input gradient
    assert all(held_until_activation_send(r) == {} for r in build_schedule("gpipe", 2, 6))
    # a list with W actions places every weight gradient itself
    assert all(held_until_activation_send(r) == {} for r in build_schedule("zb_h2", 2, 6))


class _Events:
    def __init__(self) -> None:
        self.labels: list[str] = []

    def record(self, action: Action, start: float, end: float, wait: float) -> None:
        self.labels.append(str(action))

    def record_weight_grads(self, microbatch: int, chunk: int, start: float, end: float) -> None:
        self.labels.append(f"W{microbatch}")


def _run(weight_grads_after_send: bool):
    layout = ParallelLayout(pp=2)
    layers, batches = blocks(), microbatch_data()
    network = LoopbackNetwork(layout)

    def rank_run(rank: int):
        stage, chunks, _ = rank_stage(rank, layout, layers, fused=True)
        events = _Events()
        executor = Executor(stage, network.comm(rank), lambda: None, lambda: None, sends_before_sync=True,
                            weight_grads_after_send=weight_grads_after_send, weight_grads_delay=1, recorder=events)
        executor.run(build_schedule("1f1b", 2, MICROBATCHES)[rank], batches, loss_scale=1.0 / MICROBATCHES)
        return events.labels, [p.grad.clone() for chunk in chunks for p in chunk.parameters()]
    return run_ranks(rank_run, 2)


def test_first_stage_runs_held_gemms_after_the_activation_send_with_identical_gradients() -> None:
    held, whole = _run(True), _run(False)
    labels = held[0][0]
    assert labels[:7] == ["F0", "SA0", "F1", "SA1", "B0", "F2", "SA2"] and labels[7] == "W0"
    assert "W" not in "".join(whole[0][0])
    for (_, got), (_, expected) in zip(held, whole):
        assert all(torch.equal(g, e) for g, e in zip(got, expected))   # bit for bit

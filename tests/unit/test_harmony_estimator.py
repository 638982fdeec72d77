"""Harmony's event-driven estimator on small task lists whose times are worked out by hand, and the
configuration search on a 120-layer model."""
from __future__ import annotations

import pytest

from planner.harmony_estimator import Item, Links, Task, estimate
from planner.harmony_packing import LayerBytes
from planner.harmony_search import harmony_search
from planner.harmony_tasks import HarmonyConfig, TaskCosts, build_tasks, swap_volume
from planner.errors import DoesNotFitError
from planner.profile import LayerProfile, Profile

LINKS = Links(swap_bandwidth=10.0, p2p_bandwidth=5.0)


def test_one_device_swap_overlaps_the_previous_task():
    # task 0: swap-in 20 B at 10 B/s = 2 s, then items 1 s + 1 s -> computes [2, 4]
    # task 1: its swap-in (30 B = 3 s) is issued when task 0 starts computing (t = 2) and the
    #   copy stream is free (t = 2): done at 5; items need task 0's (same device, no send): 5..6..7
    # task 1 then swaps out 10 B of gradients: 7 + 1 = 8, and the host update 0.5 s: 8.5
    tasks = [Task(0, 0, "F", (Item(1.0), Item(1.0)), 20.0, resident_bytes=20.0, send_to=0),
             Task(1, 0, "B", (Item(1.0, needs=((0, 0),)), Item(1.0, needs=((0, 1),))), 30.0, 10.0, 30.0, 0.5)]
    est = estimate(tasks, 1, LINKS)
    assert est.task_spans == [(2.0, 4.0), (5.0, 7.0)]
    assert est.iteration_s == pytest.approx(8.5)
    # task 0 holds 20 B over [0, 4], task 1 30 B over [2, 8]: both resident over [2, 4] -> 50
    assert est.peak_bytes == [50.0]
    assert est.swap_in_bytes == 50.0 and est.swap_out_bytes == 10.0


def test_synchronous_copies_block_compute_and_a_tight_budget_delays_prefetch():
    tasks = [Task(0, 0, "F", (Item(1.0), Item(1.0)), 20.0, resident_bytes=20.0, send_to=0),
             Task(1, 0, "B", (Item(1.0, needs=((0, 0),)), Item(1.0, needs=((0, 1),))), 30.0, 10.0, 30.0, 0.5)]
    # CPU: swap-in [0,2], items [2,4]; task 1's swap-in on the compute stream [4,7], items [7,9],
    # gradients out [9,10] then the update [10,10.5]; task 0 released at 4 before task 1 takes 30 B
    est = estimate(tasks, 1, Links(10.0, 5.0, synchronous=True))
    assert est.task_spans == [(2.0, 4.0), (7.0, 9.0)] and est.iteration_s == pytest.approx(10.5)
    assert est.peak_bytes == [30.0]
    # copy streams but a 40 B budget: 20 + 30 > 40, so task 1's swap-in waits for task 0's release
    # at 4: [4,7], items [7,9], gradients out [9,10], update [10,10.5]
    est = estimate(tasks, 1, LINKS, budget=40.0)
    assert est.task_spans == [(2.0, 4.0), (7.0, 9.0)] and est.peak_bytes == [30.0]


def test_two_devices_pipeline_micro_batches_through_sends():
    # device 0: task 0, no swap, items 2 s each, each sends 10 B at 5 B/s = 2 s on its send stream:
    #   item 0 ends 2, arrives 4; item 1 ends 4, arrives 6
    # device 1: task 1 (swap-in 0), items 1 s: item 0 at 4..5, item 1 at 6..7
    tasks = [Task(0, 0, "F", (Item(2.0, 10.0), Item(2.0, 10.0)), 0.0, send_to=1),
             Task(1, 1, "F", (Item(1.0, needs=((0, 0),)), Item(1.0, needs=((0, 1),))), 0.0)]
    est = estimate(tasks, 2, LINKS)
    assert est.task_spans == [(0.0, 4.0), (4.0, 7.0)]
    assert est.iteration_s == 7.0
    assert est.p2p_bytes == 20.0 and est.compute_s == [4.0, 2.0]


def toy_profile(n: int, fwd: float = 1.0, weights: float = 100.0) -> Profile:
    # times linear in the micro-batch: 1 sample -> fwd, 2 samples -> 2 fwd; backward twice the forward
    layers = tuple(LayerProfile(f"l{i}", "block", (fwd, 2 * fwd), (2 * fwd, 4 * fwd), 1.0, weights, 0.0, 2.0, 1.0)
                   for i in range(n))
    return Profile("toy", "dev", "analytic", "fp32", 1, (1, 2), layers)


def test_task_list_of_a_configuration_by_hand():
    # 4 layers, packs F: [0,2), B: [0,2) [2,4) (the jit pack [2,4)), 2 devices, D = 2, U_F = U_B = 1
    costs = TaskCosts.of(toy_profile(4), per_byte=0.01)
    cfg = HarmonyConfig(1, ((0, 2),), 1, ((0, 2), (2, 4)), 2, 2, True)
    tasks = build_tasks(cfg, costs)
    assert [(t.kind, t.device) for t in tasks] == [("F", 0), ("B", 1), ("B", 0)]
    # forward [0,2): 2 layers x 1 s per micro-batch; sends 1 B per sample; stashes its input (0: the data)
    assert [i.seconds for i in tasks[0].items] == [2.0, 2.0]
    # jit pack [2,4): forward 2 s + backward 4 s per micro-batch, no stashes to bring in
    assert [i.seconds for i in tasks[1].items] == [6.0, 6.0] and tasks[1].swap_in_bytes == 200.0
    # backward [0,2) with recomputation: 2 + 4 s; host update 0.01 s per byte x 200 B = 2 s
    assert tasks[2].items[0].seconds == 6.0 and tasks[2].host_update_s == pytest.approx(2.0)
    # links: swap 100 B/s, p2p 1 B/s
    est = estimate(tasks, 2, Links(100.0, 1.0))
    # t0 (dev 0): swap-in 2 s -> items [2,4] [4,6]; sends 1 B (1 s): arrivals 5, 7
    # t1 (dev 1): swap-in [0,2]; items wait for arrivals: [5,11] [11,17]; sends 1 B each: arrive 12, 18;
    #             gradients out 200 B = 2 s: 19; update 2 s on host: 21
    # t2 (dev 0): swap-in issued at t0's start (2), 2 s -> 4; items [12,18] [18,24];
    #             gradients out [24,26], update [26,28]
    assert est.task_spans == [(2.0, 6.0), (5.0, 17.0), (12.0, 24.0)]
    assert est.iteration_s == pytest.approx(28.0)
    assert swap_volume(cfg, costs.layers.weights) == {"weights_in": 600.0, "gradients_out": 400.0}


def test_search_on_120_layers_stays_in_budget_and_refuses_impossible_ones():
    costs = TaskCosts.of(toy_profile(120))
    budget = 3000.0  # bytes: a backward pack of k layers needs 200 k + activations; halves for prefetch
    result = harmony_search(costs, Links(1e3, 1e3), 4, 8, budget, max_micro=8)
    best = result.best
    assert best.peak_bytes <= budget and result.considered >= 4
    packs = best.config.packs_f + best.config.packs_b
    assert all(LayerBytes.from_profile(costs.profile).weights[s:e].sum() * 2 <= budget for s, e in best.config.packs_b)
    assert packs and best.config.packs_b[0][0] == 0 and best.config.packs_b[-1][1] == 120
    # layer 1: weights 100 + gradients 100 + one sample's activations 2, input 1, output 1 = 204
    with pytest.raises(DoesNotFitError, match=r"layer 1 \(l1\) alone needs 204 bytes .* > the budget"):
        harmony_search(costs, Links(1e3, 1e3), 4, 8, 203.0)

"""Harmony's event-driven estimator on the runtime's own harmony_pp action lists, with times and
bytes worked out by hand, and the configuration search on a 120-layer model."""
from __future__ import annotations

import pytest

from pipedream.schedules.harmony import harmony_config, harmony_pp
from planner.errors import DoesNotFitError
from planner.harmony.estimator import ActionCosts, HarmonyOverheads, Links, estimate
from planner.harmony.search import harmony_search
from planner.inputs.profile import LayerProfile, Profile
from planner.inputs.runtime_costs import ScheduleOverheads


class HandCosts(ActionCosts):
    """Task 0: forward [0,1); task 1: the jit pack [1,2); task 2: backward [0,1)."""

    def forward_s(self, task):
        return {0: 1.0, 1: 2.0}[task]

    def backward_s(self, task):
        return {1: 3.0, 2: 4.0}[task]

    def weight_bytes(self, task):
        return {0: 10.0, 1: 20.0, 2: 10.0}[task]

    def stash_bytes(self, task):
        return 5.0

    def output_bytes(self, task):
        return 2.0

    def input_grad_bytes(self, task):
        return 2.0

    def activation_bytes(self, task):
        return 1.0

    def update_s(self, task):
        return 0.5


def test_two_devices_by_hand():
    config = harmony_config(2, 2, 2, [1, 1], [1, 1])
    lists = harmony_pp(config)
    assert " ".join(map(str, lists[0])) == "SI F0 SO0.2 SA0 PF.2 F1 SO1.2 SA1 SO SI.2 RG0.2 SI0.2 B0.2 RG1.2 SI1.2 B1.2 SO.2 U.2"
    assert " ".join(map(str, lists[1])) == "SI.1 RA0.1 F0.1 B0.1 SG0.1 RA1.1 F1.1 B1.1 SG1.1 SO.1 U.1"
    est = estimate(config, lists, HandCosts(), Links(swap_bandwidth=10.0, p2p_bandwidth=2.0))
    # swaps at 10 B/s, sends of 2 B at 2 B/s = 1 s each.
    # device 0: SI 10 B [0,1]; F0 [1,2]; SO0.2 5 B [2,2.5] on the copy stream; SA0 [2,3];
    #   PF.2 10 B [2,3]; F1 [2,3]; SO1.2 [3,3.5]; SA1 [3,4]; SO (forward: weights dropped);
    #   SI.2 prefetched, done at 3; RG0.2 arrives at 9; SI0.2 5 B [9,9.5]; B0.2 [9.5,13.5];
    #   RG1.2 arrives at 14; SI1.2 [14,14.5]; B1.2 [14.5,18.5]; SO.2 gradients 10 B [18.5,19.5];
    #   U.2 [19.5,20]
    # device 1: SI.1 20 B [0,2]; RA0.1 at 3; F0.1 [3,5]; B0.1 [5,8]; SG0.1 [8,9]; RA1.1 (at 4);
    #   F1.1 [8,10]; B1.1 [10,13]; SG1.1 [13,14]; SO.1 gradients 20 B [13,15]; U.1 [15,15.5]
    assert est.iteration_s == pytest.approx(20.0)
    assert est.compute_s == [10.0, 10.0]
    # weights in: SI 10 + PF.2 10 + SI.1 20; gradients out 10 + 20; stashes 2 x 5; sends 4 x 2
    assert (est.weights_in_bytes, est.gradients_out_bytes, est.stash_bytes, est.p2p_bytes) == (40, 30, 10, 8)
    # device 0 at t = 2: task 0's weights 10 + the stash going out 5 + task 2's weights and
    #   gradients 20 (prefetched) = 35 managed; with F1's activations (1) 36
    # device 1: the jit pack's weights and gradients 40; with one micro-batch's activations 41
    assert est.peak_managed_bytes == [35.0, 40.0]
    assert est.peak_bytes == [36.0, 41.0]


def test_synchronous_copies_run_on_the_compute_stream():
    config = harmony_config(2, 1, 1, [1, 1], [1, 1])
    lists = harmony_pp(config)
    assert " ".join(map(str, lists[0])) == "PF.1 SI F0 SO0.2 SO SI.1 F0.1 PF.2 B0.1 SO.1 U.1 SI.2 SI0.2 B0.2 SO.2 U.2"
    est = estimate(config, lists, HandCosts(), Links(10.0, 2.0, synchronous=True))
    # one stream: PF.1 20 B 2 s, SI 10 B 1 s, F0 1, SO0.2 0.5, F0.1 2, PF.2 1, B0.1 3, SO.1 2, U.1 0.5,
    # SI0.2 0.5, B0.2 4, SO.2 1, U.2 0.5: 19 s in all, nothing overlaps
    assert est.iteration_s == pytest.approx(19.0)
    assert est.compute_s == [10.0]


def toy_profile(n: int, fwd: float = 1.0, weights: float = 100.0) -> Profile:
    # times linear in the micro-batch: 1 sample -> fwd, 2 samples -> 2 fwd; backward twice the forward
    layers = tuple(LayerProfile(f"l{i}", "block", (fwd, 2 * fwd), (2 * fwd, 4 * fwd), 1.0, weights, 0.0, 2.0, 1.0)
                   for i in range(n))
    return Profile("toy", "dev", "analytic", "fp32", 1, (1, 2), layers)


def test_search_on_120_layers_stays_in_budget_and_refuses_impossible_ones():
    profile = toy_profile(120)
    budget = 3000.0  # bytes: a backward pack of k layers holds 200 k of weights and gradients
    result = harmony_search(profile, Links(1e3, 1e3), 4, 8, budget, max_micro=8)
    best = result.best.config
    assert max(result.best.estimate.peak_bytes) <= budget and result.considered >= 4
    assert best.packs_b[0][0] == 0 and best.packs_b[-1][1] == 120
    assert best.forward_packs[-1] == best.packs_b[-1]
    assert all(200 * (e - s) <= budget for s, e in best.packs_b)
    # 3|W| of weights per iteration: forward packs in, backward packs in, gradients out (the jit
    # pack comes in once)
    w = 100.0 * 120
    jit = 100.0 * (best.packs_b[-1][1] - best.packs_b[-1][0])
    assert result.best.estimate.weights_in_bytes == pytest.approx(2 * w - jit)
    assert result.best.estimate.gradients_out_bytes == pytest.approx(w)
    # layer 1: weights 100 + gradients 100 + one sample's activations 2, input 1, output 1, and
    # its stashed input 1 = 205
    with pytest.raises(DoesNotFitError, match=r"layer 1 \(l1\) alone needs 205 bytes .* > the budget"):
        harmony_search(profile, Links(1e3, 1e3), 4, 8, 204.0)


def test_profile_costs_by_hand():
    from planner.harmony.tasks import PlannedConfig, ProfileCosts, ir_config

    # 4 layers of the toy profile at b = 2: forward 2 s, backward 4 s per layer; weights 100 B;
    # activations 2 B, outputs 1 B per sample. P_F = [0,2) + the jit pack [2,4); P_B = [0,1) [1,2) [2,4)
    cfg = PlannedConfig(2, 1, ((0, 2),), 1, ((0, 1), (1, 2), (2, 4)), 2, 2)
    ir = ir_config(cfg)
    assert [(t.role, t.layers) for t in ir.tasks] == [("forward", (0, 2)), ("forward+backward", (2, 4)),
                                                       ("backward", (1, 2)), ("backward", (0, 1))]
    costs = ProfileCosts(toy_profile(4), ir, 2, update_per_byte=0.01, update_overhead=0.5)
    assert costs.forward_s(0) == 4.0 and costs.backward_s(1) == 8.0   # the jit pack does not recompute
    assert costs.backward_s(2) == 4.0 + 2.0                           # a backward pack does
    assert costs.activation_bytes(0) == 2 * 2.0                       # a forward: its largest layer's
    assert costs.activation_bytes(1) == 2 * 4.0                       # the jit pack: all of its layers'
    assert costs.stash_bytes(2) == 2 * 1.0 and costs.stash_bytes(3) == 0.0  # layer 0's input is the data
    assert costs.output_bytes(0) == 2.0 and costs.update_s(1) == pytest.approx(0.5 + 0.01 * 200)


def test_one_compute_slot_serialises_the_devices():
    config = harmony_config(2, 2, 2, [1, 1], [1, 1])
    lists = harmony_pp(config)
    free = estimate(config, lists, HandCosts(), Links(10.0, 2.0, synchronous=True))
    shared = estimate(config, lists, HandCosts(), Links(10.0, 2.0, synchronous=True, compute_slots=1))
    # with one slot no two devices work at once: the iteration is at least all work done in series
    # (compute 10 + 10; copies: weights in 4, gradients out 3, stashes 1 + 1; updates 0.5 + 0.5: 30 s)
    work = 20.0 + (40 + 30 + 10 + 10) / 10.0 + 2 * 0.5
    assert shared.iteration_s >= work - 1e-9 > free.iteration_s
    assert shared.compute_s == free.compute_s == [10.0, 10.0]


def test_runtime_costs_per_compute_action():
    config = harmony_config(2, 1, 1, [1, 1], [1, 1])
    lists = harmony_pp(config)
    est = estimate(config, lists, HandCosts(), Links(10.0, 2.0, synchronous=True),
                   ScheduleOverheads(compute_action_s=0.25))
    # the synchronous list above (19 s) has four FWD/BWD actions (F0, F0.1, B0.1, B0.2): + 4 x 0.25 s
    assert est.iteration_s == pytest.approx(20.0)
    assert est.compute_s == [11.0]


def test_runtime_costs_per_message_on_the_compute_stream():
    config = harmony_config(2, 2, 2, [1, 1], [1, 1])
    lists = harmony_pp(config)
    est = estimate(config, lists, HandCosts(), Links(swap_bandwidth=10.0, p2p_bandwidth=2.0),
                   ScheduleOverheads(message_s=0.5))
    # the lists of test_two_devices_by_hand, each send and receive 0.5 s on its device's compute stream
    # (a send's transfer starts once posted, a receive costs 0.5 s after its message arrives):
    # device 0: SI [0,1]; F0 [1,2]; SA0 posts [2,2.5], arrives 3.5; PF.2 [2.5,3.5]; F1 [2.5,3.5];
    #   SA1 posts [3.5,4], arrives 5; SI.2 (prefetched at 3.5); RG0.2 arrives 10.5, [10.5,11];
    #   SI0.2 [11,11.5]; B0.2 [11.5,15.5]; RG1.2 arrives 16.5, [16.5,17]; SI1.2 [17,17.5];
    #   B1.2 [17.5,21.5]; SO.2 [21.5,22.5]; U.2 [22.5,23]
    # device 1: SI.1 [0,2]; RA0.1 [3.5,4]; F0.1 [4,6]; B0.1 [6,9]; SG0.1 posts [9,9.5], arrives 10.5;
    #   RA1.1 [9.5,10]; F1.1 [10,12]; B1.1 [12,15]; SG1.1 posts [15,15.5], arrives 16.5;
    #   SO.1 [15.5,17.5]; U.1 [17.5,18]
    assert est.iteration_s == pytest.approx(23.0)
    assert est.compute_s == [10.0, 10.0]


def test_runtime_costs_per_step():
    config = harmony_config(2, 1, 1, [1, 1], [1, 1])
    est = estimate(config, harmony_pp(config), HandCosts(), Links(10.0, 2.0, synchronous=True),
                   ScheduleOverheads(step_s=0.5))
    # the synchronous list's 19 s and the step's part outside its actions, once per iteration
    assert est.iteration_s == pytest.approx(19.5)
    assert est.compute_s == [10.0]


def test_harmony_costs_per_action_kind():
    config = harmony_config(2, 1, 1, [1, 1], [1, 1])
    est = estimate(config, harmony_pp(config), HandCosts(), Links(10.0, 2.0, synchronous=True),
                   HarmonyOverheads(action_s=0.1, swap_s=0.2, stash_s=0.3, update_s=0.4))
    # the synchronous list's 19 s (PF.1 SI F0 SO0.2 SO SI.1 F0.1 PF.2 B0.1 SO.1 U.1 SI.2 SI0.2 B0.2 SO.2 U.2)
    # and, on its one stream, 12 actions besides FWD/BWD x 0.1 s; of them 8 weight swaps (PF.1 SI SO SI.1
    # PF.2 SO.1 SI.2 SO.2, a prefetched swap-in too: the runtime's Python runs for it) x 0.2 s, 2 stash
    # copies (SO0.2 SI0.2) x 0.3 s, 2 updates x 0.4 s: 19 + 1.2 + 1.6 + 0.6 + 0.8 = 23.2 s
    assert est.iteration_s == pytest.approx(23.2)
    assert est.compute_s == [10.0]   # the runtime's own costs are not layer compute


def test_harmony_costs_layer_ratios():
    config = harmony_config(2, 1, 1, [1, 1], [1, 1])
    est = estimate(config, harmony_pp(config), HandCosts(), Links(10.0, 2.0, synchronous=True),
                   HarmonyOverheads(forward_ratio=2.0, train_ratio=3.0))
    # the forward task's F0 (1 s) runs x2; the jit pack's F0.1 (2 s) and B0.1 (3 s) and the recomputing
    # backward task's B0.2 (4 s) x3: compute 2 + 27 = 29 s where it was 10, the iteration 19 + 19 = 38 s
    assert est.compute_s == [29.0]
    assert est.iteration_s == pytest.approx(38.0)


def test_flush_costs_carry_over_as_harmony_costs():
    flush = ScheduleOverheads(compute_action_s=0.25, message_s=0.5, step_s=0.125)
    assert HarmonyOverheads.from_schedule(flush) == HarmonyOverheads(0.25, 0.5, 0.125)


def test_harmony_dp_runs_the_one_device_lists_on_every_replica():
    """harmony_dp: two replicas of the one-device list, each stepping half of every pack's update;
    the same time as one device with half the update (no shared links), twice its bytes, and with
    one compute slot their compute in series."""
    from planner.harmony.estimator import estimate_dp

    class HalfUpdates(HandCosts):
        def update_s(self, task):
            return 0.25

    config = harmony_config(2, 2, 1, [1, 1], [1, 1])
    links = Links(swap_bandwidth=10.0, p2p_bandwidth=2.0)
    one = estimate(config, harmony_pp(config), HalfUpdates(), links)
    dp = estimate_dp(config, 2, HandCosts(), links)
    assert dp.iteration_s == pytest.approx(one.iteration_s)
    assert dp.compute_s == one.compute_s * 2
    assert (dp.weights_in_bytes, dp.gradients_out_bytes, dp.stash_bytes, dp.p2p_bytes) == \
        (2 * one.weights_in_bytes, 2 * one.gradients_out_bytes, 2 * one.stash_bytes, 0)
    serial = estimate_dp(config, 2, HandCosts(), Links(10.0, 2.0, compute_slots=1))
    assert serial.iteration_s >= sum(serial.compute_s) == 2 * sum(one.compute_s)   # one slot: no compute overlaps
    assert serial.iteration_s > one.iteration_s
    with pytest.raises(Exception, match="the configuration is one device's"):
        estimate_dp(harmony_config(2, 2, 2, [1, 1], [1, 1]), 2, HandCosts(), links)


def test_harmony_dp_search_splits_the_minibatch():
    profile = toy_profile(12)
    pp = harmony_search(profile, Links(1e3, 1e3), 2, 8, 3000.0, max_micro=2, fixed_micro=2)
    dp = harmony_search(profile, Links(1e3, 1e3), 2, 8, 3000.0, max_micro=2, fixed_micro=2, data_parallel=True)
    assert dp.best.config.minibatch == 4 and pp.best.config.minibatch == 8   # each device's share
    # every replica brings every pack in: twice one device's weight traffic for its share
    assert dp.best.estimate.weights_in_bytes > pp.best.estimate.weights_in_bytes

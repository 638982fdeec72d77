"""The cost of context parallelism and of the ZeRO levels (planner.costs.uniform): a rank keeps 1/c of
the activations; the K/V ring costs only what the attention block computed meanwhile does not hide;
ZeRO-2 and 3 peak where ZeRO-1 does (whole weights and gradients during the step) and save only between
steps, ZeRO-3 paying an extra all-gather; with reshard_after_forward ZeRO-3 holds the shards and about
two layers whole, for two gathers and a reduce-scatter per layer and micro-batch."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.config import cluster_for, compose
from planner.costs.collectives import allreduce_time
from planner.costs import fsdp
from planner.costs.uniform import estimate, rank_stats, ring_step_exposed, zero3_gather_seconds, zero3_layer_seconds
from planner.inputs.memory_options import MemoryOptions
from planner.inputs.model_specs import LlamaSpec
from planner.inputs.profile import analytic_profile

H100 = cluster_for(compose(["cluster=h100_x8", "cluster.nodes=4"]).cluster)   # 8 per node, 32 in all
B = np.array([1.0, 2.0])


def llama(seq: int, blocks: int = 4) -> LlamaSpec:
    return LlamaSpec("llama_8b_like", blocks, 4096, 32, 8, 14336, seq, 128256)


def stats(seq: int, t: int, c: int, d: int = 1, options: MemoryOptions = MemoryOptions(), recompute: bool = False,
          p: int = 1, v: int = 1, blocks: int = 4):
    profile = analytic_profile(llama(seq, blocks), H100.device, t)
    return rank_stats(profile, H100, t, p, v, d, recompute, B, options=options, c=c)


def test_a_rank_keeps_one_c_th_of_the_activations_and_computes_one_c_th():
    one, four = stats(8192, 2, 1), stats(8192, 2, 4)
    np.testing.assert_allclose(four.activation_bytes, one.activation_bytes / 4)
    np.testing.assert_allclose(four.working_bytes, one.working_bytes / 4)
    # a rank's b / c samples' worth of tokens: at b = 1 a quarter of the time (below one sample times scale with
    # the tokens), at b = 2 a quarter of b = 1's GEMM pace, never faster than a quarter of b = 2's
    np.testing.assert_allclose(four.compute[0], one.compute[0] / 4, rtol=1e-9)
    assert (four.compute[1] >= one.compute[1] / 4).all()
    np.testing.assert_array_equal(four.param_bytes, one.param_bytes)


def test_a_ring_step_costs_what_the_block_does_not_hide():
    assert ring_step_exposed(1e-3, 2e-3) == 0.0
    assert ring_step_exposed(3e-3, 2e-3) == pytest.approx(1e-3)


def test_long_sequences_hide_the_ring_short_ones_across_nodes_do_not():
    # 64K tokens: the attention block grows as (s/c)^2, the K/V block as s/c, so NVLink's ring hides
    hidden = stats(65536, 1, 8)
    assert hidden.cp_comm.shape == hidden.forward.shape and not hidden.cp_comm.any()
    # 512 tokens over 16 ranks (t x c = 32 spans four nodes): 32 tokens of attention per step, InfiniBand
    exposed = stats(512, 2, 16)
    assert (exposed.cp_comm > 0).all()
    assert stats(512, 2, 1).cp_comm is None   # no ring at c = 1


def test_the_backward_ring_carries_twice_the_bytes():
    # with compute negligible, exposure is the transfer: backward (K, V, dK, dV) twice the forward's
    s = stats(512, 2, 16)
    spec_block = llama(512).layer_specs(2)[1]
    level = H100.level_for_span(2 * 16)
    step = B[:, None] / 16 * spec_block.ring_bytes / 16 / level.bandwidth
    blocks = 4
    upper = blocks * 15 * (3 * step[:, 0] + 2 * level.latency)   # forward + backward, nothing hidden
    assert (s.cp_comm[:, 0] <= upper + 1e-12).all() and (s.cp_comm[:, 0] > 0.5 * upper).all()


def at_level(base, level: int, reshard: bool = False):
    return replace(base, options=replace(base.options, zero=level, reshard_after_forward=reshard))


def test_zero2_and_zero3_peak_where_zero1_does_and_save_only_between_steps():
    """The runtime accumulates whole gradients over the micro-batches and (ZeRO-3) gathers the stage's
    weights at its first forward and frees them after its last backward: at the peak every level
    holds whole weights and gradients, only the optimizer state is 1/(d c)."""
    d, c = 4, 2
    zero1 = stats(8192, 2, c, d, MemoryOptions(optimizer_shards=d * c, zero=1))
    est = {level: estimate(at_level(zero1, level), H100, "1f1b", d, 64, 0.0) for level in (1, 2, 3)}
    w, opt = zero1.param_bytes.max(), zero1.optimizer_bytes.max()
    for level in (1, 2, 3):
        assert est[level].parts["weights"][0] == pytest.approx(w)      # whole at the peak
        assert est[level].parts["gradients"][0] == pytest.approx(w)    # accumulated whole
        assert est[level].parts["optimizer"][0] == pytest.approx(opt)  # the 1/(d c) shard
        np.testing.assert_allclose(est[level].memory, est[1].memory)   # so the same peak
    # between steps: ZeRO-1 keeps weights and gradients, ZeRO-2 drops the gradients, ZeRO-3 keeps a weight shard
    between = {level: est[level].between_steps[0] for level in (1, 2, 3)}
    assert between[1] == pytest.approx(2 * w + opt)
    assert between[2] == pytest.approx(w + opt)
    assert between[3] == pytest.approx(w / (d * c) + opt)
    np.testing.assert_allclose(est[2].iteration_time, est[1].iteration_time)   # ZeRO-2's traffic is ZeRO-1's
    gather = float(allreduce_time(H100, zero1.param_bytes, d * c, 2).max()) / 2   # over the d x c ranks, t apart
    assert gather > 0 and zero3_gather_seconds(at_level(zero1, 3), H100, d) == gather
    np.testing.assert_allclose(est[3].iteration_time - est[1].iteration_time, gather)


def test_fully_sharded_zero3_holds_the_shards_and_two_layers_and_pays_per_layer():
    d, c, p, v = 4, 1, 2, 2   # 16 blocks: a rank holds 2 chunks of 4 blocks each (the embedding or head beside)
    zero1 = stats(8192, 2, c, d, MemoryOptions(optimizer_shards=d * c, zero=1), p=p, v=v, blocks=16)
    one = estimate(zero1, H100, "interleaved", d, 64, 0.0)
    keep = estimate(at_level(zero1, 3), H100, "interleaved", d, 64, 0.0)
    free = estimate(at_level(zero1, 3, reshard=True), H100, "interleaved", d, 64, 0.0)
    np.testing.assert_allclose(keep.memory, one.memory)            # reshard_after_forward=false: ZeRO-1's peak
    assert (free.memory < one.memory).all()
    two = zero1.layer_peak_bytes
    assert two.shape == (p,) and (two < zero1.param_bytes).all()
    shard = zero1.param_bytes * 2 / (d * c)   # bf16 weights: the fp32 gradient shard is twice their bytes / (d c)
    full = int(np.argmin(np.abs(two - free.parts["weights"][0])))   # the fullest rank
    assert free.parts["weights"][0] == pytest.approx(two[full])   # the fp32 master shard counts as optimizer state
    assert free.parts["gradients"][0] == pytest.approx(two[full] + shard[full])
    # per micro-batch: each layer's two gathers and reduce-scatter (1.5 all-reduces) beyond its neighbour's compute
    layers = zero3_layer_seconds(at_level(zero1, 3, True), d)
    assert layers.shape == (len(B), p) and (layers > 0).all()
    whole = allreduce_time(H100, zero1.param_bytes, d * c, 2)
    assert (layers <= 1.5 * whole[None, :] + 1e-12).all()
    assert zero3_gather_seconds(at_level(zero1, 3, True), H100, d) == 0.0   # nothing per step
    assert (free.iteration_time > one.iteration_time).all()
    np.testing.assert_allclose(zero3_layer_seconds(at_level(zero1, 3), d), 0.0)
    # one chunk per rank: resharding is taken at v = 1 too
    flat = stats(8192, 2, c, d, MemoryOptions(optimizer_shards=d * c, zero=1), p=p, blocks=16)
    at_one = estimate(at_level(flat, 3, reshard=True), H100, "1f1b", d, 64, 0.0)
    assert (at_one.memory < estimate(flat, H100, "1f1b", d, 64, 0.0).memory).all()


def test_split_backward_holds_the_stage_whole_and_recomputation_one_layer():
    d, p = 4, 2
    zero1 = stats(8192, 2, 1, d, MemoryOptions(optimizer_shards=d, zero=1), p=p, blocks=16)
    split = estimate(at_level(zero1, 3, reshard=True), H100, "zb_h2", d, 64, 0.0)
    assert split.parts["weights"][0] == pytest.approx(zero1.param_bytes.max())   # each layer whole from B to W
    rec = stats(8192, 2, 1, d, MemoryOptions(optimizer_shards=d, zero=1), recompute=True, p=p, v=2, blocks=16)
    rec_est = estimate(at_level(rec, 3, reshard=True), H100, "interleaved", d, 64, 0.0)
    plain = estimate(at_level(stats(8192, 2, 1, d, MemoryOptions(optimizer_shards=d, zero=1), p=p, v=2, blocks=16),
                              3, reshard=True), H100, "interleaved", d, 64, 0.0)
    # each layer is its own checkpoint: recomputation holds no more whole than the two largest layers
    assert rec_est.parts["weights"][0] == pytest.approx(plain.parts["weights"][0], rel=1e-3)
    assert rec_est.parts["weights"][0] < rec.param_bytes.max() / 2
    assert (zero3_layer_seconds(at_level(rec, 3, True), d) >= 0).all()


def test_per_layer_collectives_hide_behind_the_neighbouring_layer():
    ar = np.array([1.0, 1.0, 1.0])
    first, last = np.array([True, False, False]), np.array([False, False, True])
    idle = fsdp.exposed_per_microbatch(ar, np.zeros((1, 3)), np.zeros((1, 3)), first, last, None)
    np.testing.assert_allclose(idle, 1.5)   # two gathers and a reduce-scatter, half an all-reduce each
    busy = fsdp.exposed_per_microbatch(ar, np.full((1, 3), 10.0), np.full((1, 3), 10.0), first, last, None)
    np.testing.assert_allclose(busy, [[0.5, 0.0, 1.0]])   # only the chunk's ends have no neighbour on the rank
    again = fsdp.exposed_per_microbatch(ar, np.zeros((1, 3)), np.zeros((1, 3)), first, last, np.ones(3))
    np.testing.assert_allclose(again, 2.0)  # a recomputed forward gathers once more
    np.testing.assert_allclose(fsdp.two_largest(np.array([3.0, 1.0, 2.0, 5.0, 4.0]), np.array([0, 0, 0, 1, 1]), 2),
                               [5.0, 9.0])

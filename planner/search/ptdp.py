"""PTD-P search (dissertation ch. 4.3): over (p, t, c, d, b, v, recompute, ZeRO level, schedule) with
p t c d = n, and for MoE models the expert-parallel degree ep (a divisor of d c and of the experts); recompute is none, full or selective, the optimizer distributed or not (d c > 1; ZeRO-2
and 3 only where ZeRO-1 does not fit, and kept only where their peak is lower, which takes ZeRO-3
with reshard_after_forward), and sequence parallelism, which costs no time in the
model, is taken wherever it applies and is allowed. The context-parallel degree c (docs/planner.md,
Context parallelism and ZeRO levels) grows per (t, p) only until a configuration fits.

Iteration time is (m + (p-1)/v) (t_f + t_b + tensor-parallel and pipeline communication) plus the
data-parallel all-reduce (eq. 4.1 with ch. 4.2.2's interleaving and ch. 4.3's communication
volumes); memory follows each schedule's in-flight micro-batches. Every (t, p, v, recompute) is one
vectorised evaluation over all micro-batch sizes, so thousands of devices plan in well under a second.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from pipedream.schedules import schedule_info

from planner.costs import zero_bubble
from planner.errors import PlannerError
from planner.inputs.search_inputs import Inputs, divisors
from planner.search.pins import check_pins
from planner.search.ranking import Rows, SearchResult, rank
from planner.costs.uniform import Estimates, RankStats, even_boundaries, estimate, peak_memory, rank_stats, \
    sharded_optimizer
from planner.inputs.memory_options import MemoryOptions


def ptdp_search(inputs: Inputs) -> SearchResult:
    n, batch = inputs.cluster.num_devices, inputs.global_batch
    check_pins(inputs, "ptdp")
    check_pinned_depth(inputs)
    rows = Rows()
    for t in inputs.tp_degrees():
        profile = inputs.profile_at(t)
        all_b = np.array(inputs.micro_batches(batch) or [1], dtype=float)
        times_at = {}   # per context-parallel degree c: the layers' times for b / c samples
        for p in divisors(n // t):
            if inputs.pin_pp is not None and p != inputs.pin_pp:
                continue
            if even_boundaries(profile, p) is None:
                continue
            # c grows only until a configuration of this (t, p) fits: a larger c moves more of each
            # sequence around the ring to relieve memory that is no longer short
            for c in inputs.cp_degrees(n // (t * p)):
                d = n // (t * p * c)
                if (inputs.pin_dp is not None and d != inputs.pin_dp) or batch % d:
                    continue
                if c not in times_at:
                    times_at[c] = profile.times_many(all_b / c)
                # every expert-parallel degree (1 for dense models): ep trades expert memory for all-to-alls
                fits = [_price(inputs, rows, profile, all_b, times_at[c], t, p, c, d, ep)
                        for ep in inputs.ep_degrees(d * c)]
                if any(fits):
                    break
    return rank(inputs, "ptdp", rows)


def _price(inputs: Inputs, rows: Rows, profile, all_b: np.ndarray, times, t: int, p: int, c: int, d: int,
           ep: int = 1) -> bool:
    """Every (v, recompute, ZeRO level, schedule) of one (t, p, c, d, ep), vectorised over micro-batch
    sizes; whether any of them fits."""
    batch = inputs.global_batch
    fits = False
    chunk_counts = [1] + [v for v in divisors(len(_blocks(profile)) // p) if v > 1] if p > 1 else [1]
    for v in chunk_counts:
        schedules = [s for s in inputs.schedules if schedule_info(s).interleaves == (v > 1)
                     and zero_bubble.fits(s, p, len(_blocks(profile)))]
        if not schedules:
            continue
        unsharded = {}   # per (recompute, options without optimizer shards): the layers summed once
        for (rec, selective), sharded in itertools.product(recompute_modes(inputs, profile),
                                                           optimizer_modes(inputs, d * c)):
            per_kind = {}   # recompute.num_layers applies to the flush schedules only
            for partial in {not schedule_info(s).asynchronous for s in schedules}:
                options = inputs.memory_options(t, d * c, selective, profile, sharded, partial)
                key = (rec, replace(options, optimizer_shards=1, zero=0))
                if key not in unsharded:
                    unsharded[key] = rank_stats(profile, inputs.cluster, t, p, v, d, rec, all_b, times, key[1], c,
                                                     ep)
                per_kind[partial] = with_optimizer_shards(unsharded[key], options)
            for schedule in schedules:
                stats = per_kind[not schedule_info(schedule).asynchronous]
                if stats is None:
                    continue
                keys = dict(t=t, p=p, d=d, v=v, c=c, ep=ep, recompute=int(rec), selective_recompute=int(selective),
                            sequence_parallel=int(stats.options.sequence_parallel),
                            distributed_optimizer=int(stats.options.optimizer_shards > 1))
                est = estimate(stats, inputs.cluster, schedule, d, batch, inputs.workspace, inputs.runtime)
                rows.add(est, all_b, schedule, zero=stats.options.zero, reshard=0, **keys)
                fits |= bool((est.valid & (est.memory <= inputs.capacity)).any())
                if stats.options.zero == 1 and not schedule_info(schedule).asynchronous:
                    fits |= _deeper_zero(inputs, rows, stats, est, schedule, d, all_b, keys)
    return fits


def _deeper_zero(inputs: Inputs, rows: Rows, stats: RankStats, est: Estimates, schedule: str, d: int,
                 all_b: np.ndarray, keys: dict) -> bool:
    """ZeRO-2, ZeRO-3 and ZeRO-3 with ``reshard_after_forward``, each priced only for the
    micro-batch sizes the one before does not fit, and kept only where its peak is below that
    one's: ZeRO-2 and ZeRO-3 gather whole parameters and accumulate whole gradients for the step,
    so they peak where ZeRO-1 does (at ZeRO-1's time, ZeRO-3 plus an all-gather per step) and are
    never kept; ZeRO-3 with ``reshard_after_forward`` holds the shards and about two layers whole
    for two gathers and a reduce-scatter per layer and micro-batch. Whether one of them fits where
    ZeRO-1 did not."""
    variants = [(level, False) for level in range(2, inputs.max_zero + 1)]
    if inputs.max_zero >= 3:
        variants.append((3, True))
    below, fits = est, False
    for level, reshard in variants:
        need = below.valid & (below.memory > inputs.capacity)
        if not need.any():
            break
        deeper = replace(stats, options=replace(stats.options, zero=level, reshard_after_forward=reshard))
        memory, _ = peak_memory(deeper, schedule, est.microbatches, inputs.workspace, inputs.runtime.process_bytes)
        if not (need & (memory < below.memory)).any():
            continue   # the same peak as the level before: it fits nowhere that one does not
        priced = estimate(deeper, inputs.cluster, schedule, d, inputs.global_batch, inputs.workspace, inputs.runtime)
        lower = need & priced.valid & (priced.memory < below.memory)
        below = replace(priced, valid=need)
        rows.add(replace(priced, valid=lower), all_b, schedule, zero=level, reshard=int(reshard), **keys)
        fits |= bool((lower & (priced.memory <= inputs.capacity)).any())
    return fits


def with_optimizer_shards(stats: RankStats | None, options: MemoryOptions) -> RankStats | None:
    """``rank_stats`` under ``options`` from its result without optimizer shards: the distributed
    optimizer divides only the optimizer state, so the layer sums are not done again (a
    parametrised test checks it equals ``rank_stats`` under the sharded options)."""
    if stats is None or options.optimizer_shards == 1:
        return stats
    if stats.expert_optimizer_bytes is None:
        return replace(stats, optimizer_bytes=stats.optimizer_bytes / options.optimizer_shards, options=options)
    dense = stats.optimizer_bytes - stats.expert_optimizer_bytes
    return replace(stats, optimizer_bytes=sharded_optimizer(dense, stats.expert_optimizer_bytes,
                                                            options.optimizer_shards, stats.ep), options=options)


def recompute_modes(inputs: Inputs, profile) -> list[tuple[bool, bool]]:
    """(full, selective) pairs to price: the configured full/none options, and selective recomputation
    where it is allowed and the profile knows its layers' attention cores."""
    modes = [(bool(rec), False) for rec in inputs.recompute]
    if inputs.selective_recompute and profile.arrays["attention_core_bytes"].any():
        modes.append((False, True))
    return modes


def optimizer_modes(inputs: Inputs, d: int) -> tuple[bool, ...]:
    """With the distributed optimizer allowed and d > 1, both: it saves memory, but its parameters'
    all-gather is hidden only behind the next forward (whole after the step without overlap), so
    it can cost time."""
    return (False, True) if inputs.distributed_optimizer and d > 1 else (False,)


def check_pinned_depth(inputs: Inputs) -> None:
    """A pinned p must split the repeated blocks evenly (ch. 4.2.2): say so in terms of layers."""
    p = inputs.pin_pp
    if p is not None and even_boundaries(inputs.profile, p) is None:
        blocks = len(_blocks(inputs.profile))
        raise PlannerError(f"planner.pp={p} does not divide the {blocks} repeated blocks of {inputs.model} "
                           f"({inputs.profile.num_layers} layers with embedding and head): every stage gets the same "
                           f"number of blocks; choose p among {divisors(blocks)}")


def _blocks(profile) -> list[int]:
    kinds = [layer.kind for layer in profile.layers]
    return [i for i, k in enumerate(kinds) if k == "block"] or list(range(len(kinds)))

"""PipeDream-2BW's planner (dissertation ch. 3.3, Algorithm 1).

Sweeps the parallel-pipeline configurations (d, p) with d p = n and equal blocks per stage; for
each, SEARCH picks the micro-batch size b and whether to recompute activations, THROUGHPUT is
ch. 3.3.3's closed form (a micro-batch every max_i max(comp_i + comm_i, allreduce_i / m) seconds)
and MEMORY holds two weight versions and p in-flight micro-batches at the first stage; configurations
over the device memory are discarded. g = B / (d b) micro-batches are accumulated per update.
Algorithm 1 takes the largest b that fits; here every b that divides the batch is tried (the
largest wins whenever throughput grows with b, as it does in the closed form).
"""
from __future__ import annotations

import numpy as np

from planner.inputs.search_inputs import Inputs, divisors
from planner.search.pins import check_pins
from planner.search.ptdp import check_pinned_depth
from planner.search.ranking import Rows, SearchResult, rank
from planner.costs.uniform import estimate, rank_stats


def two_bw_search(inputs: Inputs) -> SearchResult:
    n, batch = inputs.cluster.num_devices, inputs.global_batch
    check_pins(inputs, "2bw")
    check_pinned_depth(inputs)
    profile = inputs.profile
    rows = Rows()
    for d in divisors(n):  # Algorithm 1: for d = 1 to N, for p = 1 to N / d (here p = N / d)
        p = n // d
        if batch % d or inputs.pin_pp not in (None, p) or inputs.pin_dp not in (None, d):
            continue
        bs = np.array(inputs.micro_batches(batch // d) or [1], dtype=float)
        # p = 1 is "model and data parallelism without pipelining" (ch. 3.3.3): plain data parallelism
        schedule = "2bw" if p > 1 else "1f1b"
        for rec in inputs.recompute:
            stats = rank_stats(profile, inputs.cluster, 1, p, 1, d, rec, bs)
            if stats is None:
                continue
            est = estimate(stats, inputs.cluster, schedule, d, batch, inputs.workspace, inputs.runtime)
            rows.add(est, bs, schedule, t=1, p=p, d=d, v=1, recompute=int(rec))
    notes = ("2BW relaxes the optimizer's semantics: weights lag by one version (W(t+1) = W(t) - lr grad f(W(t-1)))",)
    return rank(inputs, "2bw", rows, notes)

"""Bubble and memory of the zero-bubble schedules (``pipedream/schedules/zb_h2.py``, ``zbv.py``).

Both split a backward into B (input gradient) and W (weight gradient). The formulas are the
flushed iteration of the schedules' own order, played out by the simulator with t_f = t_b = t_w
per chunk (weight-gradient GEMMs are about half of a backward's FLOPs, so t_b here is the
planner's backward split in two): iteration time in units of one chunk's t_f, divided by the
ideal 3 m v. ``tests/unit/planner/search/test_zero_bubble.py`` checks them against the simulator.

Memory counts a micro-batch from its forward to its W (W still needs the activations), in units
of a whole stage's activations, like ``cost.in_flight``.
"""
from __future__ import annotations

import numpy as np

SCHEDULES = ("zb_h2", "zbv")
CHUNKS = {"zb_h2": 1, "zbv": 2}   # per rank; the planner plans zbv as one stage per rank (two halves)
WEIGHT_GRAD_SHARE = 0.5   # of a backward: the weight-gradient GEMMs, as many FLOPs as the input gradient's


def fits(schedule: str, p: int, blocks: int) -> bool:
    """Whether ``schedule`` can split ``blocks`` repeated blocks over ``p`` ranks: zbv needs two chunks
    per rank (the planner prices it as one stage per rank, split in two); every other schedule fits."""
    return schedule != "zbv" or blocks >= CHUNKS["zbv"] * p


def zb_h2_bubble(p, m):
    """ZB-H2: one forward of fill per stage, (p-1)/(3m); with m < p the first micro-batch's round trip
    is longer than the work, 2m + 2p - 1 steps."""
    p, m = np.asarray(p, dtype=float), np.asarray(m, dtype=float)
    return np.maximum(3.0 * m + p - 1.0, 2.0 * m + 2.0 * p - 1.0) / (3.0 * m) - 1.0


def zbv_bubble(p, m):
    """ZB-V: one chunk forward of fill per rank, (p-1)/(6m), half of ZB-H2's; a lower bound, the
    simulated order is at most 2 chunk-steps longer for m >= 2p."""
    p, m = np.asarray(p, dtype=float), np.asarray(m, dtype=float)
    return np.maximum(6.0 * m + p - 1.0, 2.0 * m + 4.0 * p - 1.0) / (6.0 * m) - 1.0


def zb_h2_in_flight(p, stage, m):
    """Up to 2p - 1 micro-batches at every stage (about twice 1F1B's p at stage 0)."""
    p, stage, m = (np.asarray(x, dtype=float) for x in (p, stage, m))
    return np.minimum(2.0 * p - 1.0, m) + 0.0 * stage


def zbv_in_flight(p, stage, m):
    """2p (micro-batch, chunk) pairs of half a stage each: p micro-batches, 1F1B's stage 0, at every rank."""
    p, stage, m = (np.asarray(x, dtype=float) for x in (p, stage, m))
    return np.minimum(p, m) + 0.0 * stage


def bubble_fraction(schedule: str, p, m):
    return {"zb_h2": zb_h2_bubble, "zbv": zbv_bubble}[schedule](p, m)


def in_flight(schedule: str, p, stage, m):
    return {"zb_h2": zb_h2_in_flight, "zbv": zbv_in_flight}[schedule](p, stage, m)


def chunk_costs(costs: dict, chunks: int) -> dict:
    """The simulator's costs for a zero-bubble schedule from the planner's per-rank ones (chunk 0 of a
    one-chunk plan): each of ``chunks`` chunks gets an equal share, and W its share of the backward."""
    split = {}
    for name, value in costs.items():
        if isinstance(value, dict):
            share = 1.0 / chunks if name in ("forward", "backward") else 1.0
            value = {(r, c): v * share for (r, _), v in value.items() for c in range(chunks)}
        split[name] = value
    backward = split["backward"]
    split["weight_grad"] = ({k: v * WEIGHT_GRAD_SHARE for k, v in backward.items()} if isinstance(backward, dict)
                            else backward * WEIGHT_GRAD_SHARE)
    return split

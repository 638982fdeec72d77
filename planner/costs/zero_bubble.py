"""What the planner adds for the split-backward schedules (zb_h2, zbv, dualpipev): their bubble and
memory are their ``ScheduleInfo``'s (``pipedream/schedules/``), the flushed iteration of the
schedules' own order played out by the simulator with t_f = t_b = t_w per chunk (weight-gradient
GEMMs are about half of a backward's FLOPs, so t_b there is the planner's backward split in two).

Memory counts a micro-batch from its forward to its W (W still needs the activations), in units
of a whole stage's activations, like ``cost.in_flight``.
"""
from __future__ import annotations

from pipedream.schedules import schedule_info

WEIGHT_GRAD_SHARE = 0.5   # of a backward: the weight-gradient GEMMs, as many FLOPs as the input gradient's


def fits(schedule: str, p: int, blocks: int) -> bool:
    """Whether ``schedule`` can split ``blocks`` repeated blocks over ``p`` ranks: a V schedule needs two
    chunks per rank (the planner prices it as one stage per rank, split in two); every other one fits."""
    chunks = schedule_info(schedule).fixed_chunks
    return chunks is None or blocks >= chunks * p


def chunk_costs(costs: dict, chunks: int) -> dict:
    """The simulator's costs for a zero-bubble schedule from the planner's per-rank ones (chunk 0 of a
    one-chunk plan): each of ``chunks`` chunks gets an equal share, and W its share of the backward."""
    split = {}
    for name, value in costs.items():
        if isinstance(value, dict):
            share = 1.0 / chunks if name in ("forward", "backward", "grad_reduce") else 1.0
            value = {(r, c): v * share for (r, _), v in value.items() for c in range(chunks)}
        split[name] = value
    backward = split["backward"]
    split["weight_grad"] = ({k: v * WEIGHT_GRAD_SHARE for k, v in backward.items()} if isinstance(backward, dict)
                            else backward * WEIGHT_GRAD_SHARE)
    return split

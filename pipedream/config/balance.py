"""The default layer split: contiguous stages whose costs are as equal as the layers allow.

A split by layer count alone leaves stages far apart when layers differ: a GPT's embedding and head
cost a fraction of a block, a VGG's first convolutions a fraction of its middle ones. Four stages
of [embedding, 4 blocks, head] split evenly by count give [2, 2, 1, 1] layers, so one stage runs two
blocks and another none; the V schedules (zbv, dualpipev), which pair the first and last stages on
one rank, then give one rank three blocks and the other one.

``balanced_counts`` minimises the costliest stage (the pipeline's pace); among the splits that
reach it, the one with the most even stage costs (least sum of squares), then the one whose
earlier stages hold more layers (as the even split does). Equal costs give the even split.
"""
from __future__ import annotations

from typing import Sequence

# What a forward costs on each kind of device, roughly: its FLOPs at a sustained rate, plus a fixed
# time per operator (dispatch and, on a GPU, a kernel launch), which dominates small layers.
FLOP_RATE = {"cpu": 5e10, "cuda": 1e14}          # FLOP/s
OPERATOR_SECONDS = {"cpu": 1e-5, "cuda": 5e-6}


def estimated_seconds(counts: Sequence[tuple[float, int]], counted_batch: int, micro_batch: int, device: str
                      ) -> list[float]:
    """Forward seconds per layer from its (FLOPs, operators) counted on ``counted_batch`` samples."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    scale = micro_batch / counted_batch
    return [flops * scale / FLOP_RATE[kind] + ops * OPERATOR_SECONDS[kind] for flops, ops in counts]


# A layer the cost count sees as free (an embedding lookup, a norm) still takes time: each layer
# costs at least this share of the mean layer's cost. Costs are compared as whole numbers on this
# scale, so equal layers tie exactly.
FLOOR_SHARE = 0.01
SCALE = 1_000_000


def integer_costs(costs: Sequence[float]) -> list[int]:
    """``costs`` on a whole-number scale (the mean layer = SCALE), each at least FLOOR_SHARE of it."""
    mean = sum(costs) / len(costs) if costs else 0.0
    if mean <= 0:
        return [SCALE] * len(costs)
    floor = int(FLOOR_SHARE * SCALE)
    return [max(floor, round(c / mean * SCALE)) for c in costs]


def balanced_counts(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage (each >= 1) for layers of the given costs, in order."""
    weights = integer_costs(costs)
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} layers cannot fill {num_stages} stages")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i: int, j: int) -> int:   # layers [i, j)
        return prefix[j] - prefix[i]

    # pace[k][j]: the least costliest stage when k stages hold the first j layers
    worst = prefix[n] + 1
    pace = [[worst] * (n + 1) for _ in range(num_stages + 1)]
    pace[0][0] = 0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            pace[k][j] = min(max(pace[k - 1][i], cost(i, j)) for i in range(k - 1, j))
    limit = pace[num_stages][n]

    # best[k][j]: (sum of squared stage costs, counts negated) over splits whose stages stay within
    # the limit; negated counts make the smallest tuple the one with more layers early
    best: list[list[tuple | None]] = [[None] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, ())
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            options = []
            for i in range(k - 1, j):
                prior, stage = best[k - 1][i], cost(i, j)
                if prior is not None and stage <= limit:
                    options.append((prior[0] + stage * stage, prior[1] + (i - j,)))
            best[k][j] = min(options) if options else None
    chosen = best[num_stages][n]
    assert chosen is not None   # the limit is reachable by construction
    return [-negated for negated in chosen[1]]

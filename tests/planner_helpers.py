"""Shared helpers for the planner tests: random small profiles and clusters, and brute-force references."""
from __future__ import annotations

import itertools
import math
import random

from planner import cost
from planner.hardware import DEVICES, Cluster, Level
from planner.profile import LayerProfile, Profile


def random_profile(rng: random.Random, n_layers: int, blocks: bool = False) -> Profile:
    layers = []
    for i in range(n_layers):
        f1, f2 = rng.uniform(0.1, 2.0), rng.uniform(0.1, 2.0)
        layers.append(LayerProfile(
            name=f"l{i}", kind="block" if blocks else "layer",
            forward_s=(f1, f1 * rng.uniform(1.2, 2.2)), backward_s=(f2, f2 * rng.uniform(1.2, 2.2)),
            output_bytes=rng.uniform(0, 3), parameter_bytes=rng.uniform(0, 5),
            optimizer_bytes=rng.uniform(0, 5), activation_bytes=rng.uniform(0, 4),
            activation_bytes_recompute=rng.uniform(0, 1), recomputable=rng.random() < 0.8,
            tp_forward_bytes=rng.uniform(0, 1), tp_backward_bytes=rng.uniform(0, 1)))
    return Profile("rand", "test", "analytic", "fp32", 1, (1, 2), tuple(layers), 100, 10.0, 13.0)


def random_cluster(rng: random.Random, levels: int, max_count: int = 3) -> Cluster:
    lv = tuple(Level(f"L{k}", rng.randint(1, max_count), rng.uniform(0.5, 5.0), rng.uniform(0, 0.01))
               for k in range(levels))
    return Cluster("rand", DEVICES["a100_80gb"], lv, lv[0].count)


def compositions(n_layers: int, start: int, end: int):
    """All ways to cut [start, end) into contiguous non-empty stages."""
    inner = range(start + 1, end)
    for k in range(0, end - start):
        for cuts in itertools.combinations(inner, k):
            bounds = (start, *cuts, end)
            yield list(zip(bounds[:-1], bounds[1:]))


def replica_splits(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in replica_splits(total - first, parts - 1):
            yield (first, *rest)

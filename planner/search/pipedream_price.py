"""What a PipeDream plan costs: the stage and boundary prices of one topology level, shared by the
hierarchical DP (``pipedream_dp``), which minimises them, and by ``plan_time``, which prices one
given plan with the very same formulas, so a plan's reported time is always its price.

At a level joining components by bandwidth B, a chain of stages over layers [i, j) costs the
slowest of: its first stage (a whole range on r components), each later stage, and each later
stage's boundaries. Under the cost models (docs/planner.md, PipeDream's two cost models):

* ``paper`` (dissertation ch. 2.4.1): a stage max(A, 2 (r-1) W / B) / r, a boundary before layer s
  2 a_s / B, whatever the replicas;
* ``released`` (``optimizer_graph_hierarchical.py``): a stage (A + 4 (r-1) W / (B r)) / r, the first
  stage's sync divided by the previous level's count; a later stage on r' replicas receives
  2 a_s / (B r') and, unless it ends the model, sends 2 a_j / (B r'), both divided by the activation
  compression ratio, and free when there is none (the released optimizer's default);
* a measured machine (either model): (A + the sheet's all-reduce fit of W over r) / r, as the
  runtime syncs after each backward, and paper boundaries.

A is the range's compute (level 0) or the best plan of the level below on all of a component.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from planner.costs import closed_form as cost

INF = np.inf


@dataclass(frozen=True)
class LevelPrices:
    """One level's prices; ``inner`` and ``params`` may be scalars or tables (numpy broadcasting)."""

    bandwidth: float
    boundary_bytes: np.ndarray  # bytes leaving each layer per micro-batch
    costs: str = "paper"  # paper | released
    compression: float | None = 1.0  # released: activation compression ratio; None = boundaries free
    first_divisor: float = 1.0  # released: the previous level's count
    replica_sync: Callable | None = None  # (bytes, r) -> s on a measured machine

    @property
    def num_layers(self) -> int:
        return len(self.boundary_bytes)

    def _stage(self, inner, params, replicas, divisor):
        if self.replica_sync is not None:
            return (np.asarray(inner) + self.replica_sync(params, replicas)) / float(replicas)
        if self.costs == "released":
            return cost.released_stage_time(inner, params, replicas, self.bandwidth, divisor)
        return cost.pipedream_stage_time(inner, params, replicas, self.bandwidth)

    def first(self, inner, params, replicas):
        """A chain's first stage: a whole range on ``replicas`` components."""
        return self._stage(inner, params, replicas, self.first_divisor)

    def later(self, inner, params, replicas):
        """Any later stage of a chain, boundaries aside."""
        return self._stage(inner, params, replicas, 1.0)

    def entry(self, start, replicas):
        """The boundary a later stage starting at layer ``start`` (>= 1) pays on ``replicas`` replicas."""
        start = np.asarray(start)
        sent = self.boundary_bytes[np.clip(start - 1, 0, self.num_layers - 1)]
        if self.replica_sync is None and self.costs == "released":
            return self._released_transfer(sent, replicas)
        return cost.pipedream_boundary_time(sent, self.bandwidth)

    def exit(self, end, replicas):
        """What a later stage ending at layer ``end`` pays to send on (released only; nothing at the model's end)."""
        end = np.asarray(end)
        if self.replica_sync is not None or self.costs != "released":
            return np.zeros(end.shape)
        sent = self.boundary_bytes[np.clip(end - 1, 0, self.num_layers - 1)]
        return np.where(end < self.num_layers, self._released_transfer(sent, replicas), 0.0)

    def _released_transfer(self, sent, replicas):
        if self.compression is None:
            return np.zeros(np.shape(sent))
        return 2.0 * sent / (self.bandwidth * replicas) / self.compression


@dataclass(frozen=True)
class PricedLevel:
    prices: LevelPrices
    count: int  # components of the level below (devices at level 0)
    devices_per_component: int


def plan_time(levels: Sequence[PricedLevel], compute: np.ndarray, params: np.ndarray,
              stages: Sequence[tuple[int, int, int]], fewer_devices: bool = True) -> float:
    """Seconds per input of a flattened plan, ``stages`` as (first layer, end layer, replicas) in
    pipeline order, under the same prices as the DP. A flattened plan does not say which devices
    share a component, so it is priced as the best hierarchical arrangement of its stages: at each
    level, consecutive stages grouped into ranges that run on c components each (every replica count
    of the group divisible by c, the rest on one component's devices). ``inf`` if none exists.
    ``compute`` and ``params`` are the per-layer tables ([i, j) sums) the DP uses."""
    stages = tuple((int(a), int(b), int(r)) for a, b, r in stages)
    if not _is_chain(stages, levels[0].prices.num_layers):
        return INF

    @lru_cache(maxsize=None)
    def best(k: int, group: tuple[tuple[int, int, int], ...]) -> float:
        """The group's time on one component of level k + 1: a chain on level k's components."""
        if k < 0:   # one device runs one stage
            return float(compute[group[0][0], group[0][1]]) if len(group) == 1 and group[0][2] == 1 else INF
        return chain(k, group, 0, levels[k].count)

    @lru_cache(maxsize=None)
    def chain(k: int, group: tuple, first: int, components: int) -> float:
        """Stages group[first:] as a chain on ``components`` of level k's components (at most, with
        fewer_devices), the first of them priced as a chain's first stage."""
        level = levels[k]
        out = INF
        for end in range(first + 1, len(group) + 1):
            part = group[first:end]
            for used in _component_choices(part, level.devices_per_component, components, fewer_devices):
                inner = best(k - 1, tuple((a, b, r // used) for a, b, r in part))
                if not np.isfinite(inner):
                    continue
                here = _group_time(level.prices, inner, params, part, used, first == 0)
                if end == len(group):
                    if used == components or fewer_devices:
                        out = min(out, here)
                elif components > used:
                    out = min(out, max(here, chain(k, group, end, components - used)))
        return out

    return best(len(levels) - 1, stages)


def _is_chain(stages: tuple[tuple[int, int, int], ...], num_layers: int) -> bool:
    """Non-empty stages covering [0, num_layers) in order, each on at least one device."""
    return bool(stages) and stages[0][0] == 0 and stages[-1][1] == num_layers \
        and all(a < b and r >= 1 for a, b, r in stages) \
        and all(stages[q][1] == stages[q + 1][0] for q in range(len(stages) - 1))


def _component_choices(part, per: int, components: int, fewer_devices: bool):
    """How many components c a group of stages may run on: every replica count divisible by c, and
    what is left for one component at most its ``per`` devices (exactly, unless fewer_devices)."""
    total = sum(r for _, _, r in part)
    gcd = math.gcd(*(r for _, _, r in part))
    for c in range(1, min(gcd, components) + 1):
        inside = total // c
        if gcd % c == 0 and inside <= per and (inside == per or fewer_devices):
            yield c


def _group_time(prices: LevelPrices, inner: float, params: np.ndarray, part, used: int, first: bool) -> float:
    """A group of stages as one stage of its level: a chain's first, or a later one with its boundaries."""
    start, stop = part[0][0], part[-1][1]
    weights = params[start, stop]
    if first:
        return float(prices.first(inner, weights, used))
    return max(float(prices.later(inner, weights, used)), float(prices.entry(start, used)),
               float(prices.exit(stop, used)))

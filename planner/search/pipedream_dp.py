"""PipeDream's hierarchical dynamic program with stage replication (dissertation ch. 2.4.1).

Level k of the topology has m_k components of level k-1 joined by bandwidth B_k. With
A^0(i->j) = sum of layer times, for every level (lowest first):

    T^k(i->j, r) = (1/r) max(A^{k-1}(i->j, m_{k-1}), 2 (r-1) sum|w| / B_k)
    A^k(i->j, m) = min( T^k(i->j, m),
                        min_{i<s<j, 1<=r<m} max(A^k(i->s, m-r), 2 a_s / B_k, T^k(s->j, r)) )

(half-open layer ranges [i, j)). Each (m, r) step is one numpy expression over all (i, s, j), so a
level costs O(m_k^2) vectorised passes instead of O(N^3 m_k^2) Python steps; the top level only
needs i = 0. ``replication=False`` keeps every stage on one component (straight pipelines).

With ``fewer_devices`` (as PipeDream's ``--use_fewer_machines``), A^k(i->j, m) is the best over at
most m components, so devices that would not speed anything up stay unused instead of replicating
layers that do no work. ``costs="released"`` uses the formulas of PipeDream's released optimizer
instead of the dissertation's, boundaries included (docs/planner.md, PipeDream's two cost models).
The stage and boundary formulas live in ``pipedream_price``, which also prices any given plan with
them (``price_plan``): the DP's answer is always priced at exactly the time it reports.

The optional memory constraint is checked where stages are built from devices (the lowest level):
a stage on r devices after m - r others in its component holds ceil((m_1 - m + r) / r) inputs in
flight (1F1B-RR's NOAM counted inside the component, as PipeDream's optimizer does), each with its
stashed weights and activations. For a one-level topology this is exactly the flattened count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.costs import closed_form as cost
from planner.inputs.cluster_sheet import calibration, measured_allreduce
from planner.errors import PlannerError
from planner.inputs.hardware import Cluster
from planner.inputs.profile import Profile
from planner.search.pipedream_price import LevelPrices, PricedLevel, plan_time

INF = np.inf


@dataclass(frozen=True)
class MemoryModel:
    """What a device must hold for a stage; ``limit`` None disables the constraint."""

    limit: float | None
    workspace: float = 0.0
    recompute: bool = False


@dataclass(frozen=True)
class DPStage:
    start: int
    end: int
    ranks: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class DPResult:
    time_per_input: float  # seconds per micro-batch through the slowest stage (the DP's objective)
    micro_batch: int
    stages: tuple[DPStage, ...]


@dataclass(frozen=True)
class DPOptions:
    replication: bool = True
    fewer_devices: bool = True
    costs: str = "paper"  # paper | released
    compression: float | None = 1.0  # released: activation compression ratio (None: boundaries cost nothing)
    layer_time_ratio: float = 1.0  # a measured runtime's layers at their traced pace (planner.inputs.runtime_costs)


@dataclass(frozen=True)
class _Level:
    count: int
    rows: np.ndarray  # the start layers i this level was solved for
    split: np.ndarray  # (count+1, len(rows), N+1): start of the last stage, -1 = one stage
    reps: np.ndarray  # replicas of the last stage
    used: np.ndarray  # components the best solution with at most m of them uses
    value: np.ndarray  # A[m] for m = count: (len(rows), N+1)


def _range_table(prefix: np.ndarray, empty: float = 0.0) -> np.ndarray:
    """table[i, j] = sum over layers [i, j); ``empty`` where j <= i (no such stage)."""
    table = prefix[None, :] - prefix[:, None]
    n = len(prefix)
    return np.where(np.arange(n)[None, :] > np.arange(n)[:, None], table, empty)


def _layer_tables(profile: Profile, micro_batch: int, recompute: bool, layer_time_ratio: float = 1.0):
    fwd, bwd = profile.times(micro_batch)
    col = profile.arrays
    kept = np.where(col["recomputable"], col["activation_bytes_recompute"], col["activation_bytes"]) \
        if recompute else col["activation_bytes"]
    compute = cost.stage_compute(fwd, bwd, recompute, fwd * col["recomputable"]) * layer_time_ratio
    pre = lambda x: np.concatenate([[0.0], np.cumsum(x)])  # noqa: E731
    return (_range_table(pre(compute), INF), _range_table(pre(col["parameter_bytes"])),
            _range_table(pre(col["optimizer_bytes"])), _range_table(pre(kept * micro_batch)),
            col["output_bytes"] * micro_batch,
            (col["activation_bytes"].max() if recompute else 0.0) * micro_batch)


def _memory_ok(params, opt, acts, working, in_flight, memory: MemoryModel) -> np.ndarray | bool:
    if memory.limit is None:
        return True
    need = cost.device_memory(params, opt, cost.weight_versions("pipedream", in_flight), acts, in_flight,
                              working, memory.workspace)
    return need <= memory.limit


def replica_stage_time(compute, sync_s, replicas):
    """A stage on r replicas as this repository's runtime runs it (a measured machine): after each
    backward the replicas all-reduce the stage's gradients before the update, blocking rather than
    overlapping compute, so an input costs (A + all-reduce(sum|w|, r)) / r."""
    return (np.asarray(compute) + np.asarray(sync_s)) / np.asarray(replicas, dtype=float)


def level_prices(cluster: Cluster, out_bytes: np.ndarray, options: DPOptions) -> list[PricedLevel]:
    """Every level's prices, lowest first (planner.search.pipedream_price)."""
    sync = replica_sync(cluster)
    counts = [lv.count for lv in cluster.levels]
    return [PricedLevel(LevelPrices(lv.bandwidth, out_bytes, options.costs, options.compression,
                                    float(counts[k - 1]) if k else 1.0, sync),
                        lv.count, int(np.prod(counts[:k])))
            for k, lv in enumerate(cluster.levels)]


def _solve_level(prev: np.ndarray, params: np.ndarray, level: PricedLevel, top: bool, options: DPOptions,
                 mem_check) -> _Level:
    n1 = prev.shape[1]
    count, prices = level.count, level.prices
    rows = np.arange(1) if top else np.arange(n1)
    ends = np.arange(n1)
    value = np.full((count + 1, len(rows), n1), INF)
    split = np.full(value.shape, -1, dtype=np.int32)
    reps = np.zeros(value.shape, dtype=np.int32)
    used = np.zeros(value.shape, dtype=np.int32)
    for m in range(1, count + 1):
        if options.replication or m == 1:
            value[m] = np.where(mem_check(m, m), prices.first(prev, params, m), INF)[rows]
            reps[m] = m
        used[m] = m
        if options.fewer_devices and m > 1:  # m - 1 components' solution if faster than replicating on m ...
            fewer = value[m - 1] < value[m] * (1 - 1e-9)
            value[m] = np.where(fewer, value[m - 1], value[m])
            used[m] = np.where(fewer, used[m - 1], m)
        for r in (range(1, m) if options.replication else [1] if m > 1 else []):  # ... kept unless a split is faster
            stage = np.maximum(prices.later(prev, params, r), prices.exit(ends, r)[None, :])
            last = np.where(mem_check(m, r), stage, INF)  # [s, j]
            entry = np.where(ends == 0, INF, prices.entry(ends, r))  # no cut before the first layer
            head = np.maximum(value[m - r], entry[None, :])  # [i, s]
            cand = np.maximum(head[:, :, None], last[None, :, :])  # [i, s, j]
            best = cand.argmin(axis=1)
            val = np.take_along_axis(cand, best[:, None, :], axis=1)[:, 0, :]
            better = val < value[m] * (1 - 1e-9)   # a tie keeps the earlier, fewer-device solution
            value[m] = np.where(better, val, value[m])
            split[m] = np.where(better, best, split[m])
            reps[m] = np.where(better, r, reps[m])
            used[m] = np.where(better, m, used[m])
    return _Level(count, rows, split, reps, used, value[count])


def _stages_of(level: _Level, i: int, j: int, m: int) -> list[tuple[int, int, int]]:
    row = int(np.searchsorted(level.rows, i))
    out = []
    while True:
        m = int(level.used[m, row, j])
        s, r = int(level.split[m, row, j]), int(level.reps[m, row, j])
        if s < 0:
            out.append((i, j, r))
            return out[::-1]
        out.append((s, j, r))
        j, m = s, m - r


def pipedream_dp(profile: Profile, cluster: Cluster, micro_batch: int, options: DPOptions = DPOptions(),
                 memory: MemoryModel | None = None) -> DPResult | None:
    """Solve every level, then unfold the partition into stages with global ranks (renumbered densely
    when devices stay unused); None if infeasible."""
    memory = memory or MemoryModel(None)
    compute, params, opt, acts, out_bytes, working = _layer_tables(profile, micro_batch, memory.recompute,
                                                                   options.layer_time_ratio)
    n_layers = profile.num_layers
    levels: list[_Level] = []
    prev = compute
    for k, priced in enumerate(level_prices(cluster, out_bytes, options)):
        top = k == len(cluster.levels) - 1
        if k == 0:
            def mem_check(m: int, r: int, _count=priced.count):
                flight = np.ceil((_count - m + r) / r)
                return _memory_ok(params, opt, acts, working, flight, memory)
        else:
            def mem_check(m: int, r: int):
                return True
        level = _solve_level(prev, params, priced, top, options, mem_check)
        levels.append(level)
        prev = level.value
    best = float(prev[0, n_layers])
    if not np.isfinite(best):
        return None
    sizes = np.cumprod([1] + [lv.count for lv in cluster.levels])  # devices per component of each level

    def unfold(k: int, i: int, j: int, first: int) -> list[DPStage]:
        stages, offset = [], 0
        for s0, s1, r in _stages_of(levels[k], i, j, levels[k].count):
            if k == 0:
                stages.append(DPStage(s0, s1, tuple(range(first + offset, first + offset + r))))
            else:
                inner = unfold(k - 1, s0, s1, 0)
                for st in inner:
                    ranks = tuple(first + (offset + c) * int(sizes[k]) + x for c in range(r) for x in st.ranks)
                    stages.append(DPStage(st.start, st.end, ranks))
            offset += r
        return stages

    stages = unfold(len(levels) - 1, 0, n_layers, 0)
    dense = {rank: k for k, rank in enumerate(sorted(r for st in stages for r in st.ranks))}
    return DPResult(best, micro_batch, tuple(DPStage(st.start, st.end, tuple(dense[r] for r in st.ranks))
                                             for st in stages))


def price_plan(profile: Profile, cluster: Cluster, micro_batch: int, stages, options: DPOptions = DPOptions(),
               recompute: bool = False) -> float:
    """Seconds per input of a flattened plan, (first layer, end layer, replicas) per stage, under the
    DP's own prices: for the DP's answer, exactly its ``time_per_input``; inf where the plan does not
    fit the topology (planner.search.pipedream_price.plan_time)."""
    compute, params, _, _, out_bytes, _ = _layer_tables(profile, micro_batch, recompute, options.layer_time_ratio)
    return plan_time(level_prices(cluster, out_bytes, options), compute, params, stages, options.fewer_devices)


def replica_sync(cluster: Cluster):
    """``(bytes, r) -> seconds`` of a replicated stage's gradient all-reduce on a measured machine
    (the sheet's fit; a measured sheet's p2p level has no meaningful bandwidth for the paper's
    2 (r-1) W / B_k), None elsewhere."""
    if calibration(cluster) is None:
        return None
    return lambda nbytes, replicas: measured_allreduce(cluster, np.asarray(nbytes, dtype=float), replicas)


def stage_memory(profile: Profile, stages: tuple[DPStage, ...], micro_batch: int, memory: MemoryModel) -> list[float]:
    """Per stage, bytes per device in the flattened 1F1B-RR pipeline (ceil(devices from here on / r) in flight)."""
    _, params, opt, acts, _, working = _layer_tables(profile, micro_batch, memory.recompute)
    total = sum(st.replicas for st in stages)
    out, before = [], 0
    for st in stages:
        flight = float(np.ceil((total - before) / st.replicas))
        out.append(float(cost.device_memory(params[st.start, st.end], opt[st.start, st.end],
                                            cost.weight_versions("pipedream", flight), acts[st.start, st.end],
                                            flight, working, memory.workspace)))
        before += st.replicas
    return out


def minimum_memory(profile: Profile, num_devices: int, micro_batch: int, memory: MemoryModel) -> float:
    """A lower bound on per-device memory for any partition: the heaviest single layer with one input in
    flight, or the model's weights, gradients and optimizer state spread over every device."""
    _, params, opt, acts, _, working = _layer_tables(profile, micro_batch, memory.recompute)
    n = profile.num_layers
    single = max(float(cost.device_memory(params[i, i + 1], opt[i, i + 1], 1.0, acts[i, i + 1], 1.0, working,
                                          memory.workspace)) for i in range(n))
    spread = (2 * params[0, n] + opt[0, n]) / num_devices + memory.workspace
    return max(single, spread)


def check_layers(profile: Profile, cluster: Cluster, options: DPOptions) -> None:
    """A straight pipeline that must use every device needs a layer per device."""
    if not options.replication and not options.fewer_devices and profile.num_layers < cluster.num_devices:
        raise PlannerError(f"a straight pipeline needs a layer per device: {profile.num_layers} layers < "
                           f"{cluster.num_devices} devices; set planner.fewer_devices=true, planner.replication=true "
                           f"or use at most {profile.num_layers} devices")

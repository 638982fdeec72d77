"""Simulator check of PipeDream plans (1F1B-RR, no flushes): the steady state, in bounded time.

An asynchronous pipeline has no per-iteration bubble, so the check compares the simulated time per
input in steady state (whole rounds after the first third of the run, before the drain) with the DP's
prediction, and reports idle time in that window (stage imbalance: replicas that wait for a slower
stage). The run is kept to about MAX_ACTIONS actions: a few rounds of lcm(replicas) micro-batches,
or, where one round is already too long, the straight pipeline with each stage's time divided by
its replicas (the DP's own view of a replicated stage).
"""
from __future__ import annotations

import math

from planner.check.simcheck import SimCheck, _simulate

MAX_ACTIONS = 20000  # simulated actions; about a second of the simulator on one core
WARM_ROUNDS = 3  # enough micro-batches for the fill, steady rounds and the drain


def _plan_run(replicas: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """(replicas simulated, micro-batches) within the action budget."""
    p, world = len(replicas), sum(replicas)
    per_microbatch = 6 * p  # forward, backward and four messages per stage boundary
    lcm = math.lcm(*replicas)
    rounds = max(1, math.ceil(max(WARM_ROUNDS * world, 30 * min(replicas)) / lcm))
    if lcm * rounds * per_microbatch <= MAX_ACTIONS:
        return replicas, lcm * rounds
    return (1,) * p, max(WARM_ROUNDS * p, min(MAX_ACTIONS // per_microbatch, 60 * p))


def _steady(result, ranks: range, period: int = 1) -> tuple[float, float]:
    """(seconds per input, idle / busy) after the fill, over whole rounds of ``period`` micro-batches
    of a stage's completions (the stage with the fewest replicas). A round's completions come in
    bursts (the replicas upstream finish together), so a window that cuts a burst would count a
    part of one as a steady rate; with fewer than two rounds past the first third, the middle third."""
    ends = sorted(iv.end for r in ranks for iv in result.timelines[r] if iv.action.kind.name == "BWD")
    k0 = -(-(len(ends) // 3) // period) * period   # the first round boundary after the first third
    k1 = k0 + (len(ends) - 1 - k0) // period * period
    if period == 1 or k1 - k0 < period:
        k0, k1 = len(ends) // 3, 2 * len(ends) // 3
    if k1 <= k0:
        return float("nan"), float("nan")
    lo, hi = ends[k0], ends[k1]
    busy = sum(max(0.0, min(iv.end, hi) - max(iv.start, lo)) for line in result.timelines for iv in line
               if iv.action.kind.name in ("FWD", "BWD"))
    idle = len(result.timelines) * (hi - lo) - busy
    return (hi - lo) / (k1 - k0), idle / busy if busy > 0 else float("nan")


def check_replicated(replicas: tuple[int, ...], forward: list[float], backward: list[float], out_bytes: list[float],
                     predicted_per_input: float, bandwidth: float, latency: float) -> SimCheck:
    sim_replicas, m = _plan_run(replicas)
    straight = sim_replicas != replicas
    scale = [r if straight else 1 for r in replicas]  # a straight stage runs r replicas' work in 1/r time
    stage_of = [s for s, r in enumerate(sim_replicas) for _ in range(r)]
    world = len(stage_of)
    costs = dict(forward={(k, 0): forward[stage_of[k]] / scale[stage_of[k]] for k in range(world)},
                 backward={(k, 0): backward[stage_of[k]] / scale[stage_of[k]] for k in range(world)},
                 act_bytes={(k, 0): out_bytes[stage_of[k]] / scale[stage_of[k]] for k in range(world)},
                 latency=latency, bandwidth=bandwidth)
    costs["grad_bytes"] = costs["act_bytes"]
    try:
        result = _simulate("pipedream", len(replicas), m, 1, costs, 1, sim_replicas)
    except Exception as err:  # noqa: BLE001 - report, never crash the dry run
        return SimCheck(False, f"simulator check failed: {type(err).__name__}: {err}")
    narrow = min(range(len(sim_replicas)), key=lambda s: sim_replicas[s])
    first = sum(sim_replicas[:narrow])
    per_input, idle = _steady(result, range(first, first + sim_replicas[narrow]), math.lcm(*sim_replicas))
    flight = [math.ceil(sum(sim_replicas[s:]) / sim_replicas[s]) for s in stage_of]
    how = (f"as a straight pipeline (one lcm({list(replicas)}) = {math.lcm(*replicas)} round is too long to "
           f"simulate)" if straight else f"with replicas {list(replicas)}")
    return SimCheck(True, f"simulated pipedream {how}, {m} micro-batches, steady state (compute and messages; "
                          f"the gradient all-reduce is not simulated)", m, idle, 0.0,
                    tuple(int(x) for x in result.peak_in_flight), tuple(flight), 1,
                    per_input_simulated=per_input, per_input_predicted=predicted_per_input)

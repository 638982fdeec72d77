"""Check a chosen plan with the runtime's schedule simulator (``pipedream.schedules.simulate``): the same
action lists the executor runs, timed with the planner's per-chunk costs. Kept in one small
module so a change of the simulator's interface touches only ``_simulate``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipedream.schedules import Kind, schedule_info

from planner.costs import closed_form as cost
from planner.costs import zero_bubble
from planner.costs.uniform import OverlappedReduction, RankStats

MAX_SIMULATED_MICROBATCHES = 6000  # p * m * v beyond this is simulated at a smaller m (at least p)


@dataclass(frozen=True)
class SimCheck:
    ran: bool
    note: str
    microbatches: int = 0  # m the simulation used (per step)
    bubble_simulated: float = 0.0
    bubble_formula: float = 0.0
    peak_in_flight: tuple[int, ...] = ()
    peak_in_flight_formula: tuple[int, ...] = ()
    steps: int = 1  # asynchronous schedules are simulated over several steps (no flush between them)
    per_input_simulated: float = 0.0  # pipedream: steady-state seconds per input, simulated ...
    per_input_predicted: float = 0.0  # ... and the DP's
    grad_sync_simulated: float | None = None  # overlapped reduction: seconds SYNC_GRADS waits, simulated ...
    grad_sync_formula: float | None = None    # ... and planner.costs.uniform.exposed_grad_sync's

    def to_json(self) -> dict:
        return {"ran": self.ran, "note": self.note, "microbatches": self.microbatches, "steps": self.steps,
                "bubble_simulated": self.bubble_simulated, "bubble_formula": self.bubble_formula,
                "peak_in_flight": list(self.peak_in_flight),
                "peak_in_flight_formula": list(self.peak_in_flight_formula),
                "per_input_simulated_s": self.per_input_simulated, "per_input_predicted_s": self.per_input_predicted,
                "grad_sync_simulated_s": self.grad_sync_simulated, "grad_sync_formula_s": self.grad_sync_formula}


ASYNC_STEPS = 3


def _simulate(schedule: str, p: int, m: int, v: int, costs: dict, steps: int = 1, replicas: tuple[int, ...] = ()):
    """The one place that calls the runtime's simulator; returns its SimResult."""
    from pipedream.schedules import build_schedule, schedule_placement
    from pipedream.schedules.simulate import Costs, simulate

    info = schedule_info(schedule)
    if info.split_backward:
        placement = schedule_placement(schedule, p, v)
        return simulate(build_schedule(schedule, p, m, v), Costs(**zero_bubble.chunk_costs(costs, placement.vpp)),
                        vpp=placement.vpp, peer=placement.peer, needs=placement.needs)
    costs = Costs(**costs)
    if replicas and any(r > 1 for r in replicas):
        from pipedream.schedules import ReplicatedPipeline, pipedream_replicated

        topo = ReplicatedPipeline(tuple(replicas))
        return simulate(pipedream_replicated(topo.replicas, m, steps), costs, peer=topo.peer, needs=topo.needs,
                        sync_groups=topo.sync_group)
    if info.asynchronous:
        return simulate(build_schedule(schedule, p, m, v, steps), costs, vpp=v)
    return simulate(build_schedule(schedule, p, m, v), costs, vpp=v)


def available_schedules() -> tuple[str, ...]:
    """Schedules the simulator knows (the zero-bubble ones included, which training cannot run yet)."""
    try:
        from pipedream.schedules import all_schedules
    except ImportError:
        return ()
    return tuple(all_schedules())


def _run(schedule: str, p: int, m: int, v: int, m_sim: int, costs: dict, formula: float, flight: list[int],
         steps: int, replicas: tuple[int, ...] = (), grad_sync_formula: float | None = None) -> SimCheck:
    try:
        result = _simulate(schedule, p, m_sim, v, costs, steps, replicas)
    except Exception as err:  # noqa: BLE001 - report, never crash the dry run
        return SimCheck(False, f"simulator check failed: {type(err).__name__}: {err}")
    scaled = f" (m = {m_sim} instead of {m}, to stay interactive)" if m_sim != m else ""
    over = f" over {steps} steps" if steps > 1 else ""
    grad_sync = None
    if grad_sync_formula is not None:   # the longest SYNC_GRADS of any rank: its exposed reduction
        grad_sync = max((i.end - i.start for tl in result.timelines for i in tl
                         if i.action.kind is Kind.SYNC_GRADS), default=0.0)
    return SimCheck(True, f"simulated {schedule} with p={p}, m={m_sim}, v={v}{over}{scaled}", m_sim,
                    float(result.bubble_fraction), formula, tuple(int(x) for x in result.peak_in_flight),
                    tuple(flight), steps, grad_sync_simulated=grad_sync, grad_sync_formula=grad_sync_formula)


def check_uniform(schedule: str, stats: RankStats, row: int, m: int, bandwidth: float, latency: float,
                  reduction: OverlappedReduction | None = None) -> SimCheck:
    """Simulate one pipeline of an equi-replicated plan at micro-batch row ``row`` of ``stats``.

    Flush schedules: one iteration, against their ``ScheduleInfo.bubble``; with ``reduction`` (the
    data-parallel reduction overlapping the backward), also its exposed part against the planner's.
    Asynchronous ones (2BW): a few steps without flushes, against the run's one fill and drain,
    (p-1)/(m steps); their steady state has no bubble.
    """
    p, v = stats.p, stats.v
    if schedule not in available_schedules():
        return SimCheck(False, f"simulator check skipped: schedule {schedule!r} is not in pipedream.schedules yet")
    info = schedule_info(schedule)
    steps = ASYNC_STEPS if info.asynchronous else 1
    m_sim = m
    if p * m * v * steps > MAX_SIMULATED_MICROBATCHES:   # the largest m below the cap that the schedule accepts
        cap = max(p, MAX_SIMULATED_MICROBATCHES // (p * v * steps))
        m_sim = next((k for k in range(cap, 0, -1) if info.accepts(p, k, info.chunks(v))), m)
    costs = dict(
        forward={(r, c): float(stats.chunk_forward[row, c, r]) for r in range(p) for c in range(v)},
        backward={(r, c): float(stats.chunk_backward[row, c, r]) for r in range(p) for c in range(v)},
        act_bytes={(r, c): float(stats.boundary_bytes[row, c, r]) / stats.t for r in range(p) for c in range(v)},
        latency=latency, bandwidth=bandwidth)
    costs["grad_bytes"] = costs["act_bytes"]
    grad_sync_formula = None
    if reduction is not None and not info.asynchronous:
        costs["grad_reduce"] = {(r, c): float(reduction.seconds[r]) for r in range(p) for c in range(v)}
        costs["grad_buckets"] = {(r, c): int(reduction.buckets[r]) for r in range(p) for c in range(v)}
        costs["sync"] = reduction.after
        grad_sync_formula = reduction.exposed
    if info.asynchronous:   # the run's one fill and drain; the steady state has none
        formula = (p - 1) / (m_sim * steps)
    else:
        formula = float(cost.bubble_fraction(schedule, p, m_sim, v))
    counted = info.chunks(v)   # the simulator counts (micro-batch, chunk) pairs
    flight = [int(np.ceil(cost.in_flight(schedule, p, r, m_sim, v) * counted - 1e-9)) for r in range(p)]
    return _run(schedule, p, m, v, m_sim, costs, formula, flight, steps, grad_sync_formula=grad_sync_formula)

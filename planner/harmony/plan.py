"""``planner.algorithm=harmony``: Harmony's search on the planner's inputs, as a SearchResult and a
plan file with a ``harmony`` section.

What the search takes from the inputs: the per-layer profile (analytic, measured or imported), the
mini-batch (``train.global_batch_size``), the devices of one server, the device budget
(``planner.device_budget_bytes``, else the device's memory less the planner's reserve), the
host<->device swap bandwidth (the cluster's ``host_bandwidth_gbit_s``; a measured sheet's
``device.swap_bandwidth``; for CPU clusters without either, half the sheet's copy bandwidth), the
point-to-point link between the devices, the host's optimizer step per parameter byte from a
measured sheet (without one the host update is not priced, and the plan says so), and on CPU
clusters how many processes compute at once (``cpu_slots``).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import replace

from planner.inputs.cluster_sheet import calibration
from planner.errors import PlannerError
from planner.harmony.estimator import HarmonyOverheads, Links
from planner.harmony.search import HarmonySearch, HostUpdate, Scored, harmony_search
from planner.harmony.tasks import PlannedConfig
from planner.inputs.search_inputs import Inputs
from planner.inputs.profile import Profile
from planner.candidates import Candidate, SearchResult

ALGORITHM = "harmony"
SCHEDULE = "harmony_pp"


def harmony_devices(inputs: Inputs) -> int:
    if inputs.cluster.nodes > 1:
        raise PlannerError(f"planner.algorithm=harmony plans one server, but cluster.nodes={inputs.cluster.nodes}: "
                           f"use cluster.nodes=1 (Harmony swaps through one host's memory)")
    if inputs.pin_tp not in (None, 1) or inputs.pin_dp not in (None, 1):
        raise PlannerError(f"planner.algorithm=harmony runs tp=1 and dp=1 (got planner.tp={inputs.pin_tp}, "
                           f"planner.dp={inputs.pin_dp}): drop the pins")
    devices = inputs.pin_pp or inputs.cluster.num_devices
    if devices > inputs.cluster.num_devices:
        raise PlannerError(f"planner.pp={devices} devices but the cluster has {inputs.cluster.num_devices}: "
                           f"pin at most {inputs.cluster.num_devices}")
    return devices


def harmony_budget(inputs: Inputs) -> float:
    budget = inputs.device_budget if inputs.device_budget is not None else inputs.capacity - inputs.workspace
    if budget <= 0:
        raise PlannerError(f"the device budget is {budget:.4g} bytes: set planner.device_budget_bytes to a positive "
                           f"number or lower planner.reserve_gib / planner.reserve_fraction")
    return float(budget)


def harmony_links(inputs: Inputs, devices: int) -> Links:
    cluster = inputs.cluster
    sheet = calibration(cluster)
    swap = cluster.extra.get("host_bandwidth") if cluster.extra else None
    if swap is None and sheet is not None:
        swap = sheet["device"].get("swap_bandwidth", sheet["device"]["memory_bandwidth"] / 2)
    if swap is None and cluster.runtime_device == "cpu":
        swap = cluster.device.memory_bandwidth / 2
    if swap is None:
        raise PlannerError(f"cluster {cluster.name} has no host_bandwidth_gbit_s (host <-> device bytes per second "
                           f"per device, e.g. 504 for PCIe 5.0 x16): add it to the cluster config for Harmony")
    level = cluster.level_for_span(devices)
    cpu = cluster.runtime_device == "cpu"
    return Links(float(swap), level.bandwidth, level.latency, synchronous=cpu, compute_slots=cpu_slots(sheet) if cpu else None)


def harmony_overheads(inputs: Inputs, devices: int = 2) -> HarmonyOverheads:
    """The runtime's own costs: measured from traced harmony_pp runs on as many processes as
    ``devices`` (the most calibrated, for more devices; ``planner.calibrate.harmony``); without
    those, the flush families' per-action and per-message costs (harmony_pp's executor posts
    messages and runs FWD/BWD actions as theirs do), the median over the families, as each
    family's is one short run, which another process on a shared machine can stall whole; none
    without a measured sheet."""
    if inputs.harmony_costs:
        known = sorted(inputs.harmony_costs)
        processes = max([n for n in known if n <= devices] or known[:1])
        return _without_time_slicing(inputs, processes, inputs.harmony_costs[processes])
    measured = list(inputs.runtime.schedules.values())
    if not measured:
        return HarmonyOverheads()
    return HarmonyOverheads(statistics.median(m.compute_action_s for m in measured),
                            statistics.median(m.message_s for m in measured),
                            statistics.median(m.step_s for m in measured))


def _without_time_slicing(inputs: Inputs, processes: int, costs: HarmonyOverheads) -> HarmonyOverheads:
    """Costs traced with more CPU processes than compute slots: each action's layers also waited
    while other processes held its core, and the estimator queues the devices' compute for the
    slots (``Links.compute_slots``) itself, so that share of the traced layer ratios is taken out
    (counted once: the slots, not the ratio)."""
    sheet = calibration(inputs.cluster)
    if inputs.cluster.runtime_device != "cpu" or sheet is None:
        return costs
    share = min(1.0, cpu_slots(sheet) / processes)
    if share == 1.0:
        return costs
    return replace(costs, forward_ratio=costs.forward_ratio * share, train_ratio=costs.train_ratio * share)


def cpu_slots(sheet) -> int:
    """How many CPU processes compute at once at the profile's speed: the calibration's processes
    over how much slower a matmul ran with all of them busy than alone (measured; on a shared
    machine the other users' load is in it), at most the machine's cores; the cores without a sheet."""
    cores = int((sheet or {}).get("cores") or os.cpu_count() or 1)
    if sheet is None:
        return cores
    parallel = int(sheet["processes"]) / max(float(sheet.get("matmul_slowdown_all_busy", 1.0)), 1.0)
    return max(1, min(cores, round(parallel)))


def host_update(inputs: Inputs) -> tuple[HostUpdate, str]:
    sheet = calibration(inputs.cluster)
    if sheet is None:
        return HostUpdate(), "host optimizer step not priced (no measured sheet: cluster=measured)"
    opt = sheet["optimizer"]
    return HostUpdate(float(opt["seconds_per_parameter_byte"]), float(opt["step_overhead_s"])), ""


def harmony_profile(inputs: Inputs, devices: int) -> Profile:
    """The profile the estimator starts from. A measured CPU profile is timed with every calibrated
    process computing at once; one device computes alone, which the calibration measured as
    ``matmul_slowdown_all_busy`` times faster; where harmony_pp's runs were calibrated, the
    model's own layers timed alone around them replace it (``profile_alone``). With
    harmony_pp's own costs in the sheet every device count starts from the layers alone: their
    ratios are a run's layers over the layers timed alone (``planner.calibrate.harmony``),
    contention between the processes included."""
    sheet = calibration(inputs.cluster)
    if inputs.cluster.runtime_device != "cpu" or inputs.profile.source != "measured" or not sheet:
        return inputs.profile
    if devices > 1 and not inputs.harmony_costs:
        return inputs.profile
    if inputs.harmony_alone_profile is not None:   # the model's own layers timed alone
        return inputs.harmony_alone_profile
    return profile_alone(inputs.profile, sheet)


def profile_alone(profile: Profile, sheet) -> Profile:
    """A profile calibrated with every process busy, timed for one process computing alone."""
    slowdown = max(float(sheet.get("matmul_slowdown_all_busy", 1.0)), 1.0)
    return profile if slowdown == 1.0 else scaled_times(profile, 1.0 / slowdown)


def scaled_times(profile: Profile, factor: float) -> Profile:
    """``profile`` with every layer's forward and backward times x ``factor``."""
    layers = tuple(replace(layer, forward_s=tuple(t * factor for t in layer.forward_s),
                           backward_s=tuple(t * factor for t in layer.backward_s)) for layer in profile.layers)
    return replace(profile, layers=layers)


def run_harmony(inputs: Inputs) -> tuple[HarmonySearch, tuple[str, ...]]:
    devices = harmony_devices(inputs)
    host, note = host_update(inputs)
    search = harmony_search(harmony_profile(inputs, devices), harmony_links(inputs, devices), devices, inputs.global_batch,
                            harmony_budget(inputs), inputs.max_micro_batch, host, inputs.top_k,
                            fixed_micro=inputs.micro_batch, overheads=harmony_overheads(inputs, devices))
    return search, (note,) if note else ()


def hardware_flops(inputs: Inputs, cfg: PlannedConfig) -> float:
    """The FLOPs one iteration executes: the model's 3 passes plus the forward of every layer before
    the jit pack again (each backward pack recomputes its forward; the jit pack keeps its graph)."""
    forward = inputs.profile.arrays["flops"]
    if not forward.any():   # a profile without per-layer FLOPs: eq. 4.2's 4 passes
        return inputs.hardware_flops(cfg.minibatch)
    jit_start = cfg.packs_b[-1][0]
    return inputs.model_flops(cfg.minibatch) + float(forward[:jit_start].sum()) * cfg.minibatch


def candidate(inputs: Inputs, scored: Scored, budget: float) -> Candidate:
    cfg, est = scored.config, scored.estimate
    time, n, batch = est.iteration_s, cfg.devices, cfg.minibatch
    idle = 1.0 - sum(est.compute_s) / (n * time) if time > 0 else 0.0
    return Candidate(
        ALGORITHM, n, 1, 1, 1, SCHEDULE, cfg.micro, cfg.microbatches, batch, True, (), time, batch / time,
        hardware_flops(inputs, cfg) / (time * n) / 1e12, idle, scored.peak_bytes, budget,
        {"compute": max(est.compute_s)}, model_tflops_per_device=inputs.model_flops(batch) / (time * n) / 1e12)


def harmony_result(inputs: Inputs) -> tuple[SearchResult, HarmonySearch]:
    search, notes = run_harmony(inputs)
    best = candidate(inputs, search.best, search.budget)
    alts = []
    for alt in search.alternatives:
        c = candidate(inputs, alt, search.budget)
        slower = alt.iteration_s / search.best.iteration_s - 1
        alts.append(Candidate(**{**c.__dict__, "why_lost": f"{slower:.1%} slower: {alt.config.brief()}"}))
    notes += (f"search: {search.considered} configurations estimated in {search.seconds:.3g} s, "
              f"{search.over_budget} over the budget in simulation",)
    return SearchResult(ALGORITHM, best, tuple(alts), search.considered, notes), search

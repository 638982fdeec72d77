"""PipeDream planning around the hierarchical DP: one DP per micro-batch size (and recomputation
only where nothing fits without it), plus the plain data-parallel and straight-pipeline baselines
as alternatives. PipeDream's throughput is b / (time per input at the slowest stage).
"""
from __future__ import annotations

import math

import numpy as np

from . import cost
from .errors import PlannerError
from .inputs import Inputs
from .pipedream_dp import DPStage, MemoryModel, minimum_memory, pipedream_dp, stage_memory
from .ranking import GIB, Candidate, SearchResult, why_lost


def data_parallel_time(inputs: Inputs, micro: int, recompute: bool) -> float:
    """One stage replicated on every device: T^k applied level by level (ch. 2.4.1)."""
    fwd, bwd = inputs.profile.times(micro)
    rec = inputs.profile.arrays["recomputable"]
    value = float(cost.stage_compute(fwd, bwd, recompute, fwd * rec).sum())
    weights = float(inputs.profile.arrays["parameter_bytes"].sum())
    for level in inputs.cluster.levels:
        value = float(cost.pipedream_stage_time(value, weights, level.count, level.bandwidth))
    return value


def _breakdown(inputs: Inputs, stages: tuple[DPStage, ...], micro: int, recompute: bool, per_input: float,
               inputs_per_iteration: float) -> dict[str, float]:
    """Attribute the slowest stage's time to compute or data-parallel sync (the larger of the two)."""
    fwd, bwd = inputs.profile.times(micro)
    rec = inputs.profile.arrays["recomputable"]
    comp = cost.stage_compute(fwd, bwd, recompute, fwd * rec)
    worst = max(float(comp[st.start:st.end].sum()) / st.replicas for st in stages)
    compute = min(worst, per_input) * inputs_per_iteration
    rest = max(per_input * inputs_per_iteration - compute, 0.0)
    sync_bound = len(stages) == 1 or any(st.replicas > 1 for st in stages)
    return {"compute": compute, "dp_comm" if sync_bound else "p2p_comm": rest}


def _candidate(inputs: Inputs, stages: tuple[DPStage, ...], micro: int, recompute: bool, per_input: float,
               memory: MemoryModel, label: str = "pipedream") -> Candidate | None:
    batch = inputs.global_batch
    first = stages[0].replicas
    lcm = math.lcm(*(st.replicas for st in stages))
    if batch % micro or (batch // micro) % lcm:
        return None  # 1F1B-RR routes micro-batches round-robin: every stage's replicas need whole rounds
    mem = max(stage_memory(inputs.profile, stages, micro, memory))
    time = per_input * batch / micro
    devices = sum(st.replicas for st in stages)
    return Candidate(
        label, len(stages), 1, first, 1, "pipedream", micro, batch // (micro * first), batch, recompute,
        tuple((st.start, st.end, st.ranks) for st in stages), time, batch / time,
        inputs.hardware_flops(batch) / (time * devices) / 1e12, 0.0, mem, inputs.capacity,
        _breakdown(inputs, stages, micro, recompute, per_input, batch / micro),
        model_tflops_per_device=inputs.model_flops(batch) / (time * devices) / 1e12)


def pipedream_search(inputs: Inputs) -> SearchResult:
    n = inputs.cluster.num_devices
    limit = inputs.capacity if inputs.memory_constraint else None
    found: list[Candidate] = []
    baselines: list[Candidate] = []
    considered = 0
    unusable: list[tuple[int, tuple[int, ...]]] = []  # (micro, replicas) the batch cannot feed
    for recompute in inputs.recompute:
        memory = MemoryModel(limit, inputs.workspace, recompute)
        for micro in inputs.micro_batches(inputs.global_batch):
            considered += 1
            result = pipedream_dp(inputs.profile, inputs.cluster, micro, inputs.replication, memory)
            if result is not None:
                cand = _candidate(inputs, result.stages, micro, recompute, result.time_per_input, memory)
                found += [cand] if cand is not None else []
                if cand is None:
                    unusable.append((micro, tuple(st.replicas for st in result.stages)))
            if inputs.replication:
                dp_stage = (DPStage(0, inputs.profile.num_layers, tuple(range(n))),)
                cand = _candidate(inputs, dp_stage, micro, recompute, data_parallel_time(inputs, micro, recompute),
                                  memory, "data-parallel")
                baselines += [cand] if cand is not None else []
        if found:
            break  # PipeDream does not recompute; only fall back to it when nothing fits without
    if not found and unusable:
        micro, reps = unusable[0]
        lcm = math.lcm(*reps)
        raise PlannerError(
            f"PipeDream's best partitions of {inputs.model} replicate stages {list(reps)} times, so the "
            f"micro-batches per step must be a multiple of {lcm}, but train.global_batch_size={inputs.global_batch} "
            f"gives {inputs.global_batch // micro} of size {micro}: use a global batch that is a multiple of "
            f"{lcm * micro}, or planner.algorithm=ptdp")
    if not found:
        micro = min(inputs.micro_batches(inputs.global_batch) or [1])
        need = minimum_memory(inputs.profile, n, micro, MemoryModel(limit, inputs.workspace, True))
        raise PlannerError(
            f"{inputs.model} fits no PipeDream partition on {n} x {inputs.cluster.device.name}: it needs at least "
            f"{need / GIB:.1f} GiB per device (micro-batch {micro}) but {inputs.capacity / GIB:.1f} GiB are "
            f"available; add devices, try planner.algorithm=ptdp (tensor parallelism) or a smaller model")
    found.sort(key=lambda c: (c.iteration_time, c.memory_bytes))
    best = found[0]
    others = found[1:inputs.top_k] + sorted(baselines, key=lambda c: c.iteration_time)[:1]
    others = [c for c in others if c.fits or c.iteration_time < best.iteration_time]
    alternatives = tuple(Candidate(**{**c.__dict__, "why_lost": why_lost(c, best)}) for c in others)
    notes = ("PipeDream relaxes the optimizer's semantics: weight stashing keeps a version per in-flight input "
             "(ch. 2.4.3); stages may be replicated unevenly (1F1B-RR)",)
    if len(inputs.cluster.levels) > 1 and limit is not None:
        notes += ("memory is checked per server like PipeDream's optimizer; the table shows the flattened "
                  "pipeline's in-flight count",)
    if not math.isfinite(best.iteration_time) or np.isnan(best.iteration_time):
        raise PlannerError(f"{inputs.model}: the profile gives no finite stage time")
    return SearchResult("pipedream", best, alternatives, considered, notes)

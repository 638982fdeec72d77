"""PipeDream planning around the hierarchical DP: one DP per micro-batch size (and recomputation
only where nothing fits without it), plus the plain data-parallel baseline as an alternative.
PipeDream's throughput is b / (time per input at the slowest stage).

``planner.memory_constraint=false`` ignores device memory throughout, as PipeDream's released
optimizer does by default: every partition is eligible, the fastest wins, and its memory is
still estimated and reported (marked over capacity where it is).

1F1B-RR routes micro-batches to a stage's replicas round-robin and the runtime updates every
stage's replicas together, so the micro-batches per step must be a multiple of lcm(replicas).
The pipedream schedule updates weights after every micro-batch (ch. 2.4.3), so the step only
groups micro-batches: when the global batch does not fit the replicas, the plan rounds the step to
the nearest multiple and says so (a note), instead of refusing the partition. A micro-batch larger
than the batch per replica round (B / lcm(replicas): for one replicated stage, B / d, the batch per
pipeline) would grow the step beyond the batch asked for (b = 32 on two replicas turned B = 32
into 64), so such a plan is chosen only where no plan keeps a round within the batch.
"""
from __future__ import annotations

import math

from planner.costs import closed_form as cost
from planner.inputs.cluster_sheet import optimizer_seconds
from planner.errors import DoesNotFitError
from planner.inputs.search_inputs import Inputs
from planner.search.pins import check_pins
from planner.search.pipedream_dp import (DPOptions, DPStage, MemoryModel, check_layers, minimum_memory, pipedream_dp,
                                         price_plan, replica_stage_time, replica_sync, stage_memory)
from planner.search.ranking import GIB, Candidate, SearchResult, why_lost

ALGORITHM = "pipedream"   # labels this search's candidates (the baselines carry others)


def dp_options(inputs: Inputs) -> DPOptions:
    return DPOptions(inputs.replication, inputs.fewer_devices, inputs.pipedream_costs, inputs.activation_compression,
                     inputs.runtime.for_schedule("pipedream").layer_time_ratio)


def data_parallel_time(inputs: Inputs, micro: int, recompute: bool) -> float:
    """One stage replicated on every device: T^k applied level by level (ch. 2.4.1), priced as the
    DP prices a plan."""
    n = inputs.cluster.num_devices
    sync = replica_sync(inputs.cluster)
    if sync is not None:  # a measured machine: one stage on all n, synced as the runtime does
        fwd, bwd = inputs.profile.times(micro)
        rec = inputs.profile.arrays["recomputable"]
        value = float(cost.stage_compute(fwd, bwd, recompute, fwd * rec).sum()) * dp_options(inputs).layer_time_ratio
        return float(replica_stage_time(value, sync(float(inputs.profile.arrays["parameter_bytes"].sum()), n), n))
    return price_plan(inputs.profile, inputs.cluster, micro, [(0, inputs.profile.num_layers, n)], dp_options(inputs),
                      recompute)


def _breakdown(inputs: Inputs, stages: tuple[DPStage, ...], micro: int, recompute: bool, per_input: float,
               inputs_per_iteration: float) -> dict[str, float]:
    """Attribute the slowest stage's time to compute or data-parallel sync (the larger of the two)."""
    fwd, bwd = inputs.profile.times(micro)
    rec = inputs.profile.arrays["recomputable"]
    comp = cost.stage_compute(fwd, bwd, recompute, fwd * rec) * dp_options(inputs).layer_time_ratio
    worst = max(float(comp[st.start:st.end].sum()) / st.replicas for st in stages)
    compute = min(worst, per_input) * inputs_per_iteration
    rest = max(per_input * inputs_per_iteration - compute, 0.0)
    sync_bound = len(stages) == 1 or any(st.replicas > 1 for st in stages)
    return {"compute": compute, "dp_comm" if sync_bound else "p2p_comm": rest}


def stage_replicas(c: Candidate) -> tuple[int, ...]:
    return tuple(len(ranks) for _, _, ranks in c.stages)


def holds_a_round(inputs: Inputs, c: Candidate) -> bool:
    """Does the batch asked for hold one micro-batch of ``c`` per replica of every stage (a multiple
    of lcm(replicas) micro-batches, as 1F1B-RR needs), so that the step is not grown beyond it?"""
    return c.micro * math.lcm(*stage_replicas(c)) <= inputs.global_batch


def step_microbatches(requested: int, replicas: tuple[int, ...]) -> int:
    """Micro-batches per step: the requested count, or the nearest multiple of lcm(replicas)."""
    lcm = math.lcm(*replicas)
    return max(lcm, round(requested / lcm) * lcm)


def _candidate(inputs: Inputs, stages: tuple[DPStage, ...], micro: int, recompute: bool, per_input: float,
               memory: MemoryModel, label: str = ALGORITHM) -> Candidate:
    microbatches = step_microbatches(inputs.global_batch // micro, tuple(st.replicas for st in stages))
    batch = microbatches * micro
    first = stages[0].replicas
    mem = max(stage_memory(inputs.profile, stages, micro, memory))
    # weight stashing updates after every micro-batch (ch. 2.4.3): a replica's optimizer step per input it
    # runs, with the runtime's calibrated work per update beyond the optimizer fit (cluster=measured)
    overheads = inputs.runtime.for_schedule("pipedream")
    weights = inputs.profile.arrays["parameter_bytes"]
    update = max((float(optimizer_seconds(inputs.cluster, weights[st.start:st.end].sum())) + overheads.update_s)
                 / st.replicas for st in stages)
    # the runtime's own work per input (cluster=measured): a FWD and a BWD, a send and a receive per
    # boundary side, spread over the stage's replicas; its per-step part over the step's inputs
    last = len(stages) - 1
    runtime = max(float(overheads.per_microbatch(2, 2 * ((i > 0) + (i < last)))) / st.replicas
                  for i, st in enumerate(stages))
    per_input += update + runtime + overheads.step_s / microbatches
    mem += inputs.runtime.process_bytes
    time = per_input * microbatches
    devices = sum(st.replicas for st in stages)
    return Candidate(
        label, len(stages), 1, first, 1, "pipedream", micro, microbatches // first, batch, recompute,
        tuple((st.start, st.end, st.ranks) for st in stages), time, batch / time,
        inputs.hardware_flops(batch, recompute) / (time * devices) / 1e12, 0.0, mem, inputs.capacity,
        _breakdown(inputs, stages, micro, recompute, per_input, microbatches),
        model_tflops_per_device=inputs.model_flops(batch) / (time * devices) / 1e12)


def eligible(inputs: Inputs, c: Candidate) -> bool:
    """May ``c`` be chosen: it fits device memory, or planner.memory_constraint=false ignores memory."""
    return c.fits or not inputs.memory_constraint


def search_candidates(inputs: Inputs) -> tuple[list[Candidate], list[Candidate], int]:
    n = inputs.cluster.num_devices
    limit = inputs.capacity if inputs.memory_constraint else None
    found: list[Candidate] = []
    baselines: list[Candidate] = []
    considered = 0
    for recompute in inputs.recompute:
        memory = MemoryModel(limit, inputs.workspace, recompute)
        for micro in inputs.micro_batches(inputs.global_batch):
            considered += 1
            result = pipedream_dp(inputs.profile, inputs.cluster, micro, dp_options(inputs), memory)
            if result is not None:
                found.append(_candidate(inputs, result.stages, micro, recompute, result.time_per_input, memory))
            if inputs.replication:
                dp_stage = (DPStage(0, inputs.profile.num_layers, tuple(range(n))),)
                baselines.append(_candidate(inputs, dp_stage, micro, recompute,
                                            data_parallel_time(inputs, micro, recompute), memory, "data-parallel"))
        if any(eligible(inputs, c) for c in found):
            break  # PipeDream does not recompute; only fall back to it when nothing fits without
    return found, baselines, considered


def pipedream_search(inputs: Inputs) -> SearchResult:
    check_pins(inputs, ALGORITHM)
    check_layers(inputs.profile, inputs.cluster, dp_options(inputs))
    n = inputs.cluster.num_devices
    found, baselines, considered = search_candidates(inputs)
    order = lambda c: (-c.samples_per_s, c.memory_bytes)  # noqa: E731 - batches may differ: rank by rate
    allowed = [c for c in found if eligible(inputs, c)]
    # the batch asked for, rounded at most to the replicas' round; grown beyond it only if nothing else is left
    fitting = sorted([c for c in allowed if holds_a_round(inputs, c)] or allowed, key=order)
    if not fitting:
        micro = min(inputs.micro_batches(inputs.global_batch) or [1])
        limit = inputs.capacity if inputs.memory_constraint else None
        need = min([c.memory_bytes for c in found] or
                   [minimum_memory(inputs.profile, n, micro, MemoryModel(limit, inputs.workspace, True))])
        raise DoesNotFitError(
            f"{inputs.model} fits no PipeDream partition on {n} x {inputs.cluster.device.name}: the smallest needs "
            f"{need / GIB:.1f} GiB per device but {(inputs.capacity - inputs.workspace) / GIB:.1f} GiB are usable "
            f"({inputs.workspace / GIB:.1f} GiB reserve); add devices, try planner.algorithm=ptdp (tensor "
            f"parallelism) or a smaller model")
    best = fitting[0]
    baseline = [c for c in baselines if eligible(inputs, c)]
    others = fitting[1:inputs.top_k] + sorted([c for c in baseline if holds_a_round(inputs, c)] or baseline,
                                              key=order)[:1]
    faster_oom = sorted((c for c in found + baselines if not eligible(inputs, c)
                         and c.samples_per_s > best.samples_per_s), key=order)[:1]
    alternatives = tuple(Candidate(**{**c.__dict__, "why_lost": why_lost(c, best)}) for c in others + faster_oom)
    notes = ["PipeDream relaxes the optimizer's semantics: weight stashing keeps a version per in-flight input "
             "(ch. 2.4.3); stages may be replicated unevenly (1F1B-RR)"]
    if not best.fits:
        notes.append(f"over device memory: needs {best.memory_bytes / GIB:.1f} GiB per device > "
                     f"{best.capacity_bytes / GIB:.1f} GiB, chosen because planner.memory_constraint=false "
                     f"ignores memory; set it to true for a plan that fits")
    used = sum(len(r) for _, _, r in best.stages)
    if used < n:
        notes.append(f"uses {used} of the {n} devices: more would not speed up any stage (planner.fewer_devices)")
    if best.global_batch != inputs.global_batch:
        reps = list(stage_replicas(best))
        notes.append(f"global batch {inputs.global_batch} -> {best.global_batch}: 1F1B-RR routes micro-batches "
                     f"round-robin to stage replicas {reps}, so a step needs a multiple of lcm = {math.lcm(*reps)} "
                     f"micro-batches of {best.micro}; pipedream updates weights every micro-batch (ch. 2.4.3), so "
                     f"only the step's length changes")
    if len(inputs.cluster.levels) > 1 and inputs.memory_constraint:
        notes.append("memory is checked per server like PipeDream's optimizer, then for the flattened pipeline")
    return SearchResult(ALGORITHM, best, alternatives, considered, tuple(notes))

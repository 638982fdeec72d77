"""Pick a search for the model and cluster (``planner.algorithm=auto``), run it, check the winner with
the schedule simulator, and assemble the Plan."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from pipedream.schedules import schedule_info
from pipedream.config.plan_file import Batch, ClusterInfo, Harmony, ModelInfo, Parallel, Plan, Predicted, Stage

from planner.errors import DoesNotFitError, PlannerError
from planner.inputs.search_inputs import Inputs
from planner.search.ranking import Candidate, SearchResult
from planner.check.simcheck import SimCheck, available_schedules, check_uniform
from planner.costs.uniform import overlapped_reduction, rank_stats


def _ptdp() -> Callable[[Inputs], SearchResult]:
    from planner.search.ptdp import ptdp_search
    return ptdp_search


def _two_bw() -> Callable[[Inputs], SearchResult]:
    from planner.search.two_bw import two_bw_search
    return two_bw_search


def _pipedream() -> Callable[[Inputs], SearchResult]:
    from planner.search.pipedream_search import pipedream_search
    return pipedream_search


# each search's function, imported when chosen: a plan runs one search, and start-up pays for it alone
SEARCHES: dict[str, Callable[[], Callable[[Inputs], SearchResult]]] = {
    "ptdp": _ptdp, "2bw": _two_bw, "pipedream": _pipedream}
ALGORITHMS = ("auto", *SEARCHES, "harmony")


@dataclass(frozen=True)
class Outcome:
    plan: Plan
    result: SearchResult
    reason: str
    sim: SimCheck
    harmony: object | None = None  # planner.harmony.search.HarmonySearch for harmony plans


def layer_spread(inputs: Inputs) -> float:
    """Coefficient of variation of per-layer compute (0 = all alike); profiles that mark repeated
    blocks are trusted to be uniform (measured times carry noise)."""
    fwd, bwd = inputs.profile.times(1)
    total = fwd + bwd
    kinds = [layer.kind for layer in inputs.profile.layers]
    units = total[[k == "block" for k in kinds]] if "block" in kinds else total
    return float(units.std() / units.mean()) if units.size and units.mean() > 0 else 0.0


def choose_algorithm(inputs: Inputs, semantics: str = "strict") -> tuple[str, str]:
    """(search, why). Uneven layers -> PipeDream's DP; repeated blocks -> PTD-P, or 2BW if relaxed
    semantics are allowed and tensor parallelism is unavailable."""
    spread = layer_spread(inputs)
    has_blocks = any(layer.kind == "block" for layer in inputs.profile.layers)
    if not has_blocks and spread > 0.1:
        why = (f"layers differ in cost (coefficient of variation {spread:.2f}) and are not repeated blocks: "
               f"PipeDream's hierarchical DP balances uneven stages and replicates them (ch. 2.4.1)")
        if semantics == "strict":
            why += "; note the pipedream schedule relaxes weight-update semantics (planner.algorithm=ptdp keeps them)"
        return "pipedream", why
    tp = inputs.tp_degrees()
    if semantics == "relaxed" and tp == [1]:
        return "2bw", ("repeated blocks, no tensor-parallel layout and relaxed semantics allowed: "
                       "2BW's parallel pipelines avoid flushes with two weight versions (ch. 3.3)")
    why = ("repeated blocks with strict optimizer semantics: PTD-P searches tensor, pipeline and "
           f"data parallelism with flush schedules (ch. 4.3); tensor-parallel degrees {tp}")
    return "ptdp", why


def _sim_check(inputs: Inputs, best: Candidate) -> SimCheck:
    if best.schedule not in available_schedules():
        return SimCheck(False, f"simulator check skipped: schedule {best.schedule!r} is not in "
                               f"pipedream.schedules yet (available: {', '.join(available_schedules()) or 'none'})")
    replicated = schedule_info(best.schedule).replicated_stages   # stages with their own replica counts
    level = inputs.cluster.level_for_span(sum(len(r) for _, _, r in best.stages) if replicated
                                          else best.pp * best.tp * best.dp * best.cp)
    if replicated:
        from planner.check.simcheck_async import check_replicated

        fwd, bwd = inputs.profile.times(best.micro)
        col = inputs.profile.arrays
        extra = fwd * col["recomputable"] if best.recompute else 0.0
        return check_replicated(tuple(len(r) for _, _, r in best.stages),
                                [float(fwd[s:e].sum()) for s, e, _ in best.stages],
                                [float((bwd + extra)[s:e].sum()) for s, e, _ in best.stages],
                                [float(col["output_bytes"][e - 1] * best.micro) for _, e, _ in best.stages],
                                (best.iteration_time - best.breakdown.get("dp_comm", 0.0)) * best.micro
                                / best.global_batch, level.bandwidth,
                                level.latency)
    profile = inputs.profile_at(best.tp)
    options = inputs.memory_options(best.tp, best.dp * best.cp, best.selective_recompute, profile,
                                    best.distributed_optimizer, not schedule_info(best.schedule).asynchronous)
    stats = rank_stats(profile, inputs.cluster, best.tp, best.pp, best.vpp, best.dp, best.recompute,
                       np.array([best.micro], dtype=float), options=replace(options, zero=best.zero, reshard_after_forward=best.reshard_after_forward),
                       c=best.cp, ep=best.ep)
    if stats is None:
        return SimCheck(False, "simulator check skipped: the layer split is not even")
    return check_uniform(best.schedule, stats, 0, best.num_microbatches, level.bandwidth, level.latency,
                         overlapped_reduction(stats, inputs.cluster, best.dp))


def _stages(c: Candidate, with_ranks: bool = True) -> list[Stage]:
    return [Stage((s, e), len(r) // (c.tp * c.cp), tuple(r) if with_ranks else ()) for s, e, r in c.stages]


def _predicted(c: Candidate) -> Predicted:
    return Predicted(c.iteration_time, c.samples_per_s, c.tflops_per_device, c.bubble_fraction, c.memory_bytes,
                     c.capacity_bytes)


def candidate_json(c: Candidate) -> dict:
    """An alternative in the plan file: the plan's shape (ranks left out) plus why it lost."""
    return {"algorithm": c.algorithm, "parallel": {"pp": c.pp, "tp": c.tp, "dp": c.dp, "vpp": c.vpp},
            "schedule": c.schedule,
            "batch": {"global": c.global_batch, "micro": c.micro, "num_microbatches": c.num_microbatches},
            "recompute": c.recompute_granularity, "sequence_parallel": c.sequence_parallel,
            "distributed_optimizer": c.distributed_optimizer, "context_parallel": c.cp, "zero": c.zero,
            "reshard_after_forward": c.reshard_after_forward, "expert_parallel": c.ep,
            "stages": [{"layers": [s, e], "replicas": len(r) // (c.tp * c.cp)} for s, e, r in c.stages],
            "predicted": vars(_predicted(c)), "breakdown_s": c.breakdown, "why_lost": c.why_lost}


def make_plan(inputs: Inputs, algorithm: str = "auto", semantics: str = "strict", simulate: bool = True) -> Outcome:
    if algorithm not in ALGORITHMS:
        raise PlannerError(f"planner.algorithm={algorithm!r} is unknown; choose one of {', '.join(ALGORITHMS)}")
    if algorithm == "harmony":
        return harmony_outcome(inputs, "planner.algorithm=harmony was asked for")
    if algorithm == "auto":
        algorithm, reason = choose_algorithm(inputs, semantics)
        try:
            result = SEARCHES[algorithm]()(inputs)
        except DoesNotFitError as err:
            if inputs.cluster.nodes > 1:
                raise
            try:
                return harmony_outcome(inputs, f"no {algorithm} plan fits device memory ({str(err).split(': ')[0]}): "
                                               f"Harmony keeps weights, gradients and optimizer state in host memory "
                                               f"and swaps layer packs in")
            except DoesNotFitError as harmony_err:   # the in-memory reason first: it says what to change
                raise DoesNotFitError(f"{err}; nor does a Harmony plan ({harmony_err})",
                                      smallest=err.smallest) from None
    else:
        reason = f"planner.algorithm={algorithm} was asked for"
        result = SEARCHES[algorithm]()(inputs)
    best = result.best
    sim = _sim_check(inputs, best) if simulate else SimCheck(False, "simulator check off (planner.simulate=false)")
    notes = list(result.notes)
    assert best.fits or not inputs.memory_constraint, "searches never choose a plan over device memory"
    plan = Plan(
        model=ModelInfo(inputs.model, inputs.profile.num_layers, int(inputs.profile.num_parameters)),
        cluster=ClusterInfo(inputs.cluster.name, inputs.cluster.num_devices, inputs.cluster.devices_per_node),
        parallel=Parallel(best.pp, best.tp, best.dp, best.vpp), schedule=best.schedule,
        batch=Batch(best.global_batch, best.micro, best.num_microbatches),
        recompute=best.recompute_granularity, stages=tuple(_stages(best)), predicted=_predicted(best),
        sequence_parallel=best.sequence_parallel, distributed_optimizer=best.distributed_optimizer,
        recompute_layers=_recompute_layers(inputs, best), context_parallel=best.cp, zero=best.zero,
        reshard_after_forward=best.reshard_after_forward, expert_parallel=best.ep,
        precision=inputs.spec.precision if inputs.spec is not None else inputs.profile.precision,
        alternatives=tuple(candidate_json(a) for a in result.alternatives),
        planner={"algorithm": algorithm, "reason": reason, "considered": result.considered,
                 "breakdown_s": best.breakdown, "simulator": sim.to_json(), "notes": notes,
                 "device": inputs.cluster.device.name, "profile_source": inputs.profile.source,
                 "memory_reserve_bytes": inputs.workspace,
                 "model_tflops_per_device": best.model_tflops_per_device,
                 **({"active_parameters": inputs.profile.num_active_parameters}
                    if inputs.profile.num_experts else {}),
                 **({"memory_bytes_by_part": best.memory_parts} if best.memory_parts else {}),
                 **({"memory_bytes_between_steps": best.between_steps_bytes} if best.between_steps_bytes else {})})
    return Outcome(plan, result, reason, sim)


def _recompute_layers(inputs: Inputs, best: Candidate) -> int | None:
    """recompute.num_layers as priced: the user's k where the plan recomputes on a flush schedule."""
    if best.recompute_granularity == "none" or best.algorithm != "ptdp" or schedule_info(best.schedule).asynchronous:
        return None
    return inputs.recompute_layers


def harmony_outcome(inputs: Inputs, reason: str) -> Outcome:
    """Harmony's search as an Outcome: the plan file's ``harmony`` section carries the configuration."""
    from planner.harmony.plan import SCHEDULE, harmony_result

    result, search = harmony_result(inputs)
    best, cfg, est = result.best, search.best.config, search.best.estimate
    harmony = Harmony(cfg.forward_packs, cfg.packs_b, cfg.u_f, cfg.u_b, cfg.devices, search.budget)
    sim = SimCheck(False, f"estimated by Harmony's event-driven simulator of the harmony_pp action lists "
                          f"(planner.harmony.estimator): {search.considered} configurations in {search.seconds:.3g} s")
    plan = Plan(
        model=ModelInfo(inputs.model, inputs.profile.num_layers, int(inputs.profile.num_parameters)),
        cluster=ClusterInfo(inputs.cluster.name, inputs.cluster.num_devices, inputs.cluster.devices_per_node),
        parallel=Parallel(cfg.devices, 1, 1, 1), schedule=SCHEDULE,
        batch=Batch(cfg.minibatch, cfg.micro, cfg.microbatches), recompute="full", stages=(),
        predicted=_predicted(best),
        precision=inputs.spec.precision if inputs.spec is not None else inputs.profile.precision,
        alternatives=tuple(candidate_json(a) for a in result.alternatives), harmony=harmony,
        planner={"algorithm": "harmony", "reason": reason, "considered": result.considered,
                 "breakdown_s": best.breakdown, "simulator": sim.to_json(), "notes": list(result.notes),
                 "device": inputs.cluster.device.name, "profile_source": inputs.profile.source,
                 "memory_reserve_bytes": inputs.workspace, "model_tflops_per_device": best.model_tflops_per_device,
                 "search_seconds": search.seconds,
                 **({"active_parameters": inputs.profile.num_active_parameters}
                    if inputs.profile.num_experts else {}),
                 "weight_bytes": float(inputs.profile.arrays["parameter_bytes"].sum()), "peak_bytes_per_device": est.peak_bytes,
                 "peak_managed_bytes_per_device": est.peak_managed_bytes,
                 "swap_bytes": {"weights_in": est.weights_in_bytes, "gradients_out": est.gradients_out_bytes,
                                "stashes_each_way": est.stash_bytes, "device_to_device": est.p2p_bytes}})
    return Outcome(plan, result, reason, sim, search)

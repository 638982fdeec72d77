"""Before launch: does the run fit this machine's memory? A coarse analytic estimate (fp32 training on
CPU), summed over the processes started on this machine, from the planner's per-layer model sizes."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from pipedream.errors import ConfigError
from pipedream.config.specs import OptimSpec
from pipedream.schedules import ScheduleInfo

GIB = 1024 ** 3
FP32 = 4
RUNTIME_BYTES_PER_PROCESS = 0.4 * GIB   # interpreter, torch's libraries, communication buffers


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes summed over the processes of this machine."""

    processes: int
    weights: float        # parameters, and the extra weight versions of 2BW / PipeDream
    gradients: float
    optimizer: float
    activations: float    # stashed for the micro-batches in flight
    runtime: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.runtime

    def breakdown(self) -> str:
        parts = [f"{name} {getattr(self, name) / GIB:.1f}"
                 for name in ("weights", "gradients", "optimizer", "activations", "runtime")]
        return f"{self.processes} processes: " + ", ".join(parts)


def optimizer_states(optim: OptimSpec) -> int:
    """fp32 states per parameter: AdamW keeps two moments, SGD one momentum buffer (none without)."""
    if optim.name == "sgd":
        return 1 if optim.momentum > 0 else 0
    return 2


def stage_in_flight(schedule: ScheduleInfo, stage: int, pp: int, microbatches: int, vpp: int) -> float:
    """Micro-batches whose activations ``stage`` holds at its peak, in whole stages' activations."""
    return float(schedule.in_flight(stage, pp, microbatches, vpp)) / schedule.chunks(vpp)


def weight_versions(schedule: ScheduleInfo, pp: int, microbatches: int, vpp: int = 1) -> float:
    """Weight copies the stage that holds most keeps (2BW double-buffers, PipeDream stashes one per
    micro-batch in flight, up to pp at stage 0)."""
    return max(float(schedule.weight_versions(stage_in_flight(schedule, stage, pp, microbatches, vpp)))
               for stage in range(pp))


def microbatches_in_flight(schedule: ScheduleInfo, pp: int, microbatches: int, vpp: int = 1) -> float:
    """Micro-batches whose activations a stage holds at the peak, averaged over the stages (the
    schedule's ``in_flight``: all m for GPipe, min(pp - i, m) at stage i of 1F1B)."""
    return sum(stage_in_flight(schedule, stage, pp, microbatches, vpp) for stage in range(pp)) / pp


def estimate_memory(model_cfg: Mapping[str, Any], spec: Any, processes: int) -> MemoryEstimate:
    """``spec`` is the run's ``RunSpec``; each process holds about 1/(pp tp) of the model."""
    from planner.inputs.model_specs import spec_from_config

    model = spec_from_config({**dict(model_cfg), "precision": "fp32"})
    parameters = sum(layer.parameters for layer in model.layer_specs(1))
    pp, tp = spec.layout.pp, spec.layout.tp
    share = processes / (pp * tp)
    per_sample = activation_bytes_per_sample(model.layer_specs(tp), spec) * tp   # per tp group, as weights
    weights = parameters * FP32 * share
    in_flight = microbatches_in_flight(spec.schedule, pp, spec.microbatches, spec.layout.vpp)
    # at the step's peak every level holds whole gradients (accumulated over the micro-batches) and
    # whole parameters, except fully sharded zero3 (``resharded_bytes``); the optimizer state is split
    # over the dp x cp ranks that average the gradients (zero1 and up). Each cp rank holds 1/cp of
    # every sample's activations.
    sharing = spec.layout.dp * spec.layout.cp if spec.optim.zero >= 1 else 1
    versions = weight_versions(spec.schedule, pp, spec.microbatches, spec.layout.vpp)
    held, grads = weights * versions, weights
    if spec.optim.zero == 3 and spec.optim.reshard_after_forward:
        held, grads = resharded_bytes(model.layer_specs(1), spec, weights / sharing, processes)
    return MemoryEstimate(
        processes=processes,
        weights=held,
        gradients=grads,
        optimizer=weights * optimizer_states(spec.optim) / sharing,
        activations=per_sample * spec.micro_batch * in_flight * share / spec.layout.cp,
        runtime=RUNTIME_BYTES_PER_PROCESS * processes)


def resharded_bytes(layers: list, spec: Any, shard: float, processes: int) -> tuple[float, float]:
    """Weights and gradients of zero3 with optim.reshard_after_forward (fully sharded): each process's
    fp32 1/(dp cp) shards (``shard``, summed over the processes) of both, plus about two layers whole
    (the one working, the next one's gather or the last one's reduce-scatter: a stage's two largest,
    averaged over the stages); full recomputation holds a recomputed chunk whole, and a split backward
    (zb_h2, zbv, dualpipev) keeps each layer whole from its B to its W: the whole stage."""
    pp, tp = spec.layout.pp, spec.layout.tp
    sizes = [layer.parameters * FP32 / tp for layer in layers]
    bounds = spec.bounds if len(layers) == spec.num_layers else ((0, len(layers)),)
    per_rank = [[] for _ in range(pp if len(bounds) > 1 else 1)]
    chunks = [0.0] * len(per_rank)
    for index, (start, end) in enumerate(bounds):
        rank = index % len(per_rank)
        per_rank[rank] += sizes[start:end]
        chunks[rank] = max(chunks[rank], sum(sizes[start:end]))
    two = sum(sum(sorted(held, reverse=True)[:2]) for held in per_rank) / len(per_rank)
    if spec.schedule.split_backward:
        stage = sum(sizes) / pp * processes
        return shard + stage, shard + stage
    whole = max(two, sum(chunks) / len(chunks)) if spec.recompute.full else two
    return shard + whole * processes, shard + two * processes


def activation_bytes_per_sample(layers: list, spec: Any) -> float:
    """Bytes one tensor-parallel rank keeps per sample over all layers, as the planner prices them
    (``planner.costs.uniform.kept_activation_bytes``): full recomputation keeps each recomputed
    layer's input, selective drops the attention cores, both only in each chunk's first
    ``recompute.num_layers`` layers; sequence parallelism keeps 1/t of the LayerNorm and dropout
    regions."""
    from planner.costs.uniform import kept_activation_bytes
    from planner.inputs.memory_options import MemoryOptions

    options = MemoryOptions(selective=spec.recompute.selective, sequence_parallel=spec.sequence_parallel,
                            recompute_layers=spec.recompute.num_layers)
    bounds = spec.bounds if len(layers) == spec.num_layers else ()
    return float(kept_activation_bytes(layers, spec.layout.tp, spec.recompute.full, options, bounds).sum())


def available_memory() -> tuple[float, str]:
    """Bytes this machine can still give (MemAvailable), else its physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024, "available"
    except OSError:
        pass
    import os
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "installed"


def for_model_set(estimate: MemoryEstimate, cfg: Any) -> MemoryEstimate:
    """``train.models=K``: every process holds K models' weights, gradients, optimizer state and
    activations (the runtime's own memory once)."""
    from pipedream.config.multi_model import multi_model_spec

    models = multi_model_spec(cfg)
    if models is None:
        return estimate
    k = models.count
    return replace(estimate, weights=estimate.weights * k, gradients=estimate.gradients * k,
                   optimizer=estimate.optimizer * k, activations=estimate.activations * k)


def check_memory(label: str, cfg: Any, spec: Any, processes: int, available: float | None = None) -> str | None:
    """Raises ConfigError when the run cannot fit; returns a note when the check does not apply."""
    if cfg.model.get("_target_"):
        return f"memory pre-check: skipped (model._target_={cfg.model._target_} has no analytic sizes)"
    if spec.device != "cpu":
        return f"memory pre-check: skipped for cluster.device={spec.device} (it checks host memory of CPU runs)"
    from omegaconf import OmegaConf
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    from planner.errors import PlannerError
    try:
        estimate = for_model_set(estimate_memory(model_cfg, spec, processes), cfg)
    except PlannerError as error:
        return f"memory pre-check: skipped ({error})"
    kind = "available"
    if available is None:
        available, kind = available_memory()
    if estimate.total > available:
        raise ConfigError(
            f"model={label} needs about {estimate.total / GIB:.1f} GiB on this machine ({estimate.breakdown()}) "
            f"but {available / GIB:.1f} GiB is {kind}: train a smaller model, use fewer processes per machine "
            f"(launcher.nnodes), recompute.granularity=full or a smaller train.micro_batch_size "
            f"(launcher.check_memory=false skips this check)")
    return None

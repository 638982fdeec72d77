"""A fused stage under ``memory.device_budget_bytes``: profile this rank's feature maps once at
start-up, plan swap or recompute per map (``feature_plan``) against this rank's schedule, then
run every fused group through ``FeatureMapMemory`` counted in a budgeted device tier."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pipedream.errors import ConfigError
from pipedream.offload import DeviceBudgetError, DeviceTier, HostTier
from pipedream.schedules.actions import Kind

from pipedream.multi_model.degree import choose_fusion_groups, stage_inputs
from pipedream.multi_model.feature_plan import BudgetTooSmall, Event, FeatureMap, FeaturePlan, plan
from pipedream.multi_model.fused import FusedLayer
from pipedream.multi_model.memory import FeatureMapMemory
from pipedream.multi_model.spec import MultiModelSpec

UNLIMITED = 1 << 62


@dataclass
class FusedStage:
    """What start-up decided for this rank's fused layers, for the summary."""

    fusion_timings: dict[int, float]
    plan: FeaturePlan | None = None
    memory: FeatureMapMemory | None = None
    decisions: dict[str, str] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        if self.memory is None:
            return {"fusion_timings_s": self.fusion_timings}
        tier = self.memory.tier
        return {"fusion_timings_s": self.fusion_timings, "device_budget_bytes": tier.budget_bytes,
                "simulated_unoptimised_peak_bytes": self.plan.unoptimised_peak_bytes,
                "simulated_peak_bytes": self.plan.planned_peak_bytes,
                "peak_resident_bytes": tier.peak_resident_bytes, "decisions": self.decisions,
                "moved_bytes": tier.counters.as_dict()["activations"]}


def _fused_layers(engine: Any) -> dict[int, list[FusedLayer]]:
    return {c: [m for m in chunk.modules() if isinstance(m, FusedLayer)] for c, chunk in enumerate(engine.stage.chunks)}


def _install(engine: Any, memory: FeatureMapMemory | None) -> None:
    for layers in _fused_layers(engine).values():
        for layer in layers:
            layer.__dict__["memory"] = memory


def _copy_bytes_per_s(device: torch.device) -> float:
    """Host <-> device copy rate: one 8 MiB copy each way, best of three."""
    source = torch.ones(1 << 21, device=device)
    host = torch.empty(source.shape, pin_memory=device.type == "cuda")
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        host.copy_(source)
        source.copy_(host)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - started) / 2)
    return source.nbytes / best


def profile_feature_maps(engine: Any) -> list[FeatureMap]:
    """One forward and backward of this rank's chunks on a micro-batch's shapes, everything kept:
    each group's saved bytes and forward time (its backward costed at twice that)."""
    params = list(engine.params)
    # the stacked parameters are weights, not feature maps, as in the run
    memory = FeatureMapMemory(DeviceTier(HostTier(), engine.device, UNLIMITED), parameters=params)
    memory.profile = []
    _install(engine, memory)
    layer_chunk = {layer.layer_index: c for c, layers in _fused_layers(engine).items() for layer in layers}
    for chunk, value in zip(engine.stage.chunks, stage_inputs(engine)):
        output = chunk(*value) if isinstance(value, tuple) else chunk(value)
        outputs = output if isinstance(output, tuple) else (output,)
        floats = [o.sum() for o in outputs if o.is_floating_point() and o.requires_grad]
        if floats:
            torch.autograd.backward(floats)
    memory.end_step()
    _install(engine, None)
    for param in params:
        param.grad = None
    maps = []
    for call in memory.profile:
        chunk = layer_chunk[call.layer]
        node = sum(1 for m in maps if m.chunk == chunk)
        maps.append(FeatureMap(chunk, node, call.layer, call.group, call.nbytes, call.forward_s, 2 * call.forward_s))
    return maps


def schedule_events(engine: Any) -> list[Event]:
    return [Event(a.kind is Kind.BWD, a.microbatch, a.chunk) for a in engine.runner.actions
            if a.kind in (Kind.FWD, Kind.BWD)]


def prepare_fused_stage(engine: Any, settings: MultiModelSpec) -> FusedStage:
    """The fusion degree, then (with a budget) the feature-map plan and its runtime."""
    stage = FusedStage(choose_fusion_groups(engine, settings.count, settings.fusion_groups))
    budget = settings.device_budget_bytes
    if budget is None:
        return stage
    maps = profile_feature_maps(engine)
    weights = sum(p.nbytes for p in engine.params)
    try:
        stage.plan = plan(maps, schedule_events(engine), weights, budget, _copy_bytes_per_s(engine.device),
                          overlapped_copies=engine.device.type == "cuda")
        tier = DeviceTier(HostTier(pin=engine.device.type == "cuda"), engine.device, budget)
        decisions = {(m.layer, m.group): stage.plan.decisions[(m.chunk, m.node)] for m in maps
                     if (m.chunk, m.node) in stage.plan.decisions}
        stage.memory = FeatureMapMemory(tier, decisions, list(engine.params))
    except (BudgetTooSmall, DeviceBudgetError) as error:
        raise ConfigError(f"{error}".splitlines()[0]) from None
    stage.decisions = {f"layer {layer} group {group}": d.value for (layer, group), d in sorted(decisions.items())}
    _install(engine, stage.memory)
    engine.runner.memory = stage.memory
    return stage

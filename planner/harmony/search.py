"""Harmony's configuration search (its Algorithm 1) over what the runtime runs: for every
micro-batch size b (dividing the mini-batch) pack the backward pass (Algorithm 2), then the layers
before the jit pack for the forward pass, build the runtime's ``harmony_pp`` action lists and
estimate them (``harmony_estimator``); keep the fastest whose simulated peak device bytes
(weights, gradients, stashes and one micro-batch's activations) stay within the budget.

Two departures from the paper, both because of the runtime: one micro-batch size b serves forward
and backward (the runtime's micro-batches are fixed; the paper's U_F, U_B are sizes in samples),
and U_F, U_B here are micro-batches per task group, every group swapping its pack in again; the
search takes whole groups (U = all micro-batches: in the estimator smaller groups only add
swaps). Packs are cut for several shares of the budget (``PACK_SHARES``: the whole, the paper's
largest packs, down to about a third), since the prefetched next pack must fit beside the
current one; the estimator decides.
Torch-free.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from pipedream.schedules.harmony import harmony_pp

from planner.errors import DoesNotFitError, PlannerError
from planner.harmony.estimator import Estimate, HarmonyOverheads, Links, estimate, estimate_dp
from planner.harmony.packing import LayerBytes, backward_pack_bytes, forward_pack_bytes, pack_layers
from planner.harmony.tasks import PlannedConfig, ProfileCosts, ir_config
from planner.inputs.runtime_costs import ScheduleOverheads
from planner.inputs.profile import Profile


PACK_SHARES = (1.0, 0.75, 0.5, 0.35)  # of the budget, per pack: room for the prefetched next pack


@dataclass(frozen=True)
class Scored:
    config: PlannedConfig
    estimate: Estimate

    @property
    def iteration_s(self) -> float:
        return self.estimate.iteration_s

    @property
    def peak_bytes(self) -> float:
        return max(self.estimate.peak_bytes)


@dataclass(frozen=True)
class HarmonySearch:
    best: Scored
    alternatives: tuple[Scored, ...]
    considered: int
    over_budget: int
    seconds: float
    budget: float


@dataclass(frozen=True)
class HostUpdate:
    """The host's optimizer step: seconds per parameter byte and per call (0: not priced)."""

    per_byte: float = 0.0
    overhead: float = 0.0


def micro_sizes(minibatch: int, largest: int) -> list[int]:
    return [u for u in range(1, min(minibatch, largest) + 1) if minibatch % u == 0]


def check_budget(profile: Profile, budget: float, micro: int = 1) -> None:
    """One line for budgets no configuration can meet: one layer's backward (weights, gradients,
    one micro-batch's activations and stash) must fit."""
    layers = LayerBytes.from_profile(profile)
    need = [max(backward_pack_bytes(layers, (i, i + 1), micro, micro), forward_pack_bytes(layers, (i, i + 1), micro, True))
            for i in range(layers.num_layers)]
    worst = max(range(len(need)), key=need.__getitem__)
    if need[worst] > budget:
        raise DoesNotFitError(
            f"planner.device_budget_bytes={budget:.4g}: layer {worst} ({profile.layers[worst].name}) alone needs "
            f"{need[worst]:.4g} bytes (weights, gradients, one sample's activations) > the budget; raise the budget "
            f"to at least {need[worst]:.4g} bytes or use a smaller model")


def evaluate(profile: Profile, cfg: PlannedConfig, links: Links, host: HostUpdate = HostUpdate(),
             overheads: HarmonyOverheads | ScheduleOverheads = HarmonyOverheads(),
             data_parallel: bool = False) -> Estimate:
    """The estimator on one configuration: the runtime's action lists, timed from the profile and
    the runtime's own measured costs. ``data_parallel`` (schedule=harmony_dp): ``cfg.minibatch`` is
    each device's share and every one of ``cfg.devices`` runs the one-device lists."""
    if data_parallel:
        ir = ir_config(replace(cfg, devices=1))
        costs = ProfileCosts(profile, ir, cfg.micro, host.per_byte, host.overhead)
        return estimate_dp(ir, cfg.devices, costs, links, overheads)
    ir = ir_config(cfg)
    return estimate(ir, harmony_pp(ir), ProfileCosts(profile, ir, cfg.micro, host.per_byte, host.overhead), links,
                    overheads)


def harmony_search(profile: Profile, links: Links, devices: int, minibatch: int, budget: float,
                   max_micro: int = 32, host: HostUpdate = HostUpdate(), top_k: int = 4,
                   fixed_micro: int | None = None,
                   overheads: HarmonyOverheads | ScheduleOverheads = HarmonyOverheads(),
                   data_parallel: bool = False) -> HarmonySearch:
    """``data_parallel``: Harmony DP, the paper's D <- D/N: each device's share of the mini-batch
    is searched and estimated with ``devices`` replicas (``evaluate``)."""
    if devices < 1 or minibatch < 1:
        raise PlannerError(f"harmony: devices = {devices} and the mini-batch = {minibatch} must be >= 1")
    if data_parallel:
        if minibatch % devices:
            raise PlannerError(f"harmony_dp: the mini-batch = {minibatch} must divide among {devices} devices")
        minibatch //= devices
    check_budget(profile, budget)
    start = time.perf_counter()
    scored: dict[PlannedConfig, Scored] = {}
    considered = over = 0
    for micro in [fixed_micro] if fixed_micro else micro_sizes(minibatch, max_micro):
        for cfg in _configs(profile, micro, budget, devices, minibatch):
            if cfg in scored:
                continue
            est = evaluate(profile, cfg, links, host, overheads, data_parallel)
            considered += 1
            if max(est.peak_bytes) > budget:
                over += 1
                continue
            scored[cfg] = Scored(cfg, est)
    elapsed = time.perf_counter() - start
    if not scored:
        raise DoesNotFitError(
            f"harmony: none of {considered} configurations stays within planner.device_budget_bytes={budget:.4g} "
            f"({over} over it in simulation, the rest could not be packed); raise the budget or use a smaller "
            f"micro-batch (train.micro_batch_size)")
    ranked = sorted(scored.values(), key=lambda s: (s.iteration_s, s.peak_bytes))
    return HarmonySearch(ranked[0], tuple(ranked[1:1 + top_k]), considered, over, elapsed, budget)


def _configs(profile: Profile, micro: int, budget: float, devices: int, minibatch: int):
    """Algorithm 1's inner loops for one micro-batch size: the backward packs (Algorithm 2 on
    backward + recompute times), then the forward packs over the layers before the jit pack, for
    each share of the budget."""
    layers = LayerBytes.from_profile(profile)
    fwd, bwd = profile.times(micro)
    groups = minibatch // micro
    for share in (budget * f for f in PACK_SHARES):
        packs_b = pack_layers("B", bwd + fwd, layers, micro, share, True, stash_samples=micro)
        if not packs_b:
            continue
        packs_f = pack_layers("F", fwd, layers, micro, share, True, last=packs_b[-1][0])
        if packs_f is not None:
            yield PlannedConfig(micro, groups, tuple(packs_f), groups, tuple(packs_b), devices, minibatch)

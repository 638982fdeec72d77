"""Harmony's configuration search (its Algorithm 1): for every backward micro-batch size U_B pack
the backward pass (Algorithm 2), then for every forward size U_F pack the layers before the jit
pack, build the wrap-around task list and estimate it (``harmony_estimator``); keep the fastest
whose simulated peak device memory is within the budget.

Packs are cut twice, for the whole budget (the paper's largest packs) and for half of it: the
runtime prefetches the next task's pack while the current one runs only if both fit, so halves
let swaps overlap compute where whole-budget packs would serialise them; the estimator decides.
Micro-batch sizes divide the mini-batch (every group has equal micro-batches). Torch-free.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .errors import DoesNotFitError, PlannerError
from .harmony_estimator import Estimate, Links, estimate
from .harmony_packing import backward_pack_bytes, forward_pack_bytes, pack_layers
from .harmony_tasks import HarmonyConfig, TaskCosts, build_tasks

GIB = 1024**3


@dataclass(frozen=True)
class Scored:
    config: HarmonyConfig
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


def micro_sizes(minibatch: int, largest: int) -> list[int]:
    return [u for u in range(1, min(minibatch, largest) + 1) if minibatch % u == 0]


def check_budget(costs: TaskCosts, budget: float, smallest_micro: int = 1) -> None:
    """One line for budgets no configuration can meet: a single layer's backward (weights, gradients,
    one micro-batch's activations) must fit."""
    layers = costs.layers
    need = [max(backward_pack_bytes(layers, (i, i + 1), smallest_micro),
                forward_pack_bytes(layers, (i, i + 1), smallest_micro, True)) for i in range(layers.num_layers)]
    worst = max(range(len(need)), key=need.__getitem__)
    if need[worst] > budget:
        name = costs.profile.layers[worst].name
        raise DoesNotFitError(
            f"memory.device_budget_bytes={budget:.4g}: layer {worst} ({name}) alone needs {need[worst]:.4g} bytes "
            f"(weights, gradients, one sample's activations) > the budget; raise the budget to at least "
            f"{need[worst]:.4g} bytes or use a smaller model")


def harmony_search(costs: TaskCosts, links: Links, devices: int, minibatch: int, budget: float,
                   max_micro: int = 32, recompute: tuple[bool, ...] = (True,), top_k: int = 4,
                   fixed_micro: int | None = None) -> HarmonySearch:
    if devices < 1 or minibatch < 1:
        raise PlannerError(f"harmony: devices = {devices} and the mini-batch = {minibatch} must be >= 1")
    check_budget(costs, budget)
    start = time.perf_counter()
    scored: dict[HarmonyConfig, Scored] = {}
    considered = over = 0
    sizes = [fixed_micro] if fixed_micro else micro_sizes(minibatch, max_micro)
    for rec in recompute:
        for u_b in sizes:
            for cfg in _configs(costs, sizes, u_b, budget, rec, devices, minibatch):
                if cfg in scored:
                    continue
                est = estimate(build_tasks(cfg, costs), devices, links, budget)
                considered += 1
                if max(est.peak_bytes) > budget:
                    over += 1
                    continue
                scored[cfg] = Scored(cfg, est)
    elapsed = time.perf_counter() - start
    if not scored:
        raise DoesNotFitError(
            f"harmony: none of {considered} configurations stays within memory.device_budget_bytes={budget:.4g} "
            f"({over} over it in simulation, the rest could not be packed); raise the budget or use a smaller "
            f"micro-batch (planner.max_micro_batch)")
    ranked = sorted(scored.values(), key=lambda s: (s.iteration_s, s.peak_bytes))
    return HarmonySearch(ranked[0], tuple(ranked[1:1 + top_k]), considered, over, elapsed, budget)


def _configs(costs: TaskCosts, sizes: list[int], u_b: int, budget: float, rec: bool, devices: int, minibatch: int):
    """Algorithm 1's inner loops for one U_B: the backward packs, then every U_F's forward packs
    over the layers before the jit pack, for the whole and the half budget."""
    fwd, bwd = costs.profile.times(u_b)
    for share in (budget, budget / 2.0):
        packs_b = pack_layers("B", bwd + fwd if rec else bwd, costs.layers, u_b, share, rec, stash_samples=minibatch)
        if not packs_b:
            continue
        for u_f in sizes:
            packs_f = pack_layers("F", costs.profile.times(u_f)[0], costs.layers, u_f, share, rec,
                                  last=packs_b[-1][0])
            if packs_f is not None:
                yield HarmonyConfig(u_f, tuple(packs_f), u_b, tuple(packs_b), devices, minibatch, rec)

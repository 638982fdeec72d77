"""The issue targets that scripts/bench/runtime.py checks, from the analysed cases (no torch):
on the MLP our 1f1b against torch's and the ideal, and our best zero-bubble schedule against
torch's best and the ideal at one core's speed while both work; on the small GPT every schedule of
ours against its torch counterpart."""
from __future__ import annotations

import statistics
from typing import Any

TARGET_VS_TORCH = 1.10
TARGET_OF_IDEAL = 0.95
TARGET_ZERO_BUBBLE_VS_TORCH = 1.10
TARGET_ZERO_BUBBLE_OF_IDEAL = 0.97
TARGET_SMALL_MODEL_VS_TORCH = 1.05
OUR_ZERO_BUBBLE = ("pipedream zb_h2", "pipedream zbv", "pipedream dualpipev")
TORCH_ZERO_BUBBLE = ("torch zbv", "torch interleaved_zb", "torch dualpipev")
OUR_SCHEDULES = ("pipedream gpipe", "pipedream 1f1b", "pipedream interleaved", *OUR_ZERO_BUBBLE)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    workloads = data["workloads"]
    found = mlp_targets(workloads["mlp"]["cases"]) if "mlp" in workloads else []
    return found + (small_model_targets(workloads["gpt"]["cases"]) if "gpt" in workloads else [])


def mlp_targets(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """The MLP workload (the compute-heavy blocks)."""
    ours = cases["pipedream 1f1b"]
    return zero_bubble_targets(cases) + [
        _target(f"our 1f1b >= {TARGET_VS_TORCH:.2f}x the throughput of torch Schedule1F1B (MLP)",
                ours["vs_torch"]["median"], TARGET_VS_TORCH, "ratio"),
        _target(f"our 1f1b >= {TARGET_OF_IDEAL:.0%} of the ideal (2 stages, m=8, MLP)",
                ours["of_ideal"]["median"], TARGET_OF_IDEAL, "percent")]


def best_zero_bubble(cases: dict[str, Any], names: tuple[str, ...]) -> str | None:
    """The fastest of ``names`` among the cases (median step time), or None."""
    present = [name for name in names if name in cases]
    return min(present, key=lambda n: cases[n]["step_time_s"]["median"]) if present else None


def zero_bubble_targets(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Our best zero-bubble schedule against torch's best, and against the ideal from one core's
    speed while both work (MLP)."""
    best, rival = best_zero_bubble(cases, OUR_ZERO_BUBBLE), best_zero_bubble(cases, TORCH_ZERO_BUBBLE)
    if best is None or rival is None:
        return []
    found = [_target(f"our best zero-bubble ({best}) >= {TARGET_ZERO_BUBBLE_VS_TORCH:.2f}x torch's best ({rival}) "
                     "(MLP, per-round throughput ratio)", paired_ratio(cases, best, rival),
                     TARGET_ZERO_BUBBLE_VS_TORCH, "ratio")]
    if "of_ideal_both_cores" in cases[best]:
        found.append(_target(f"{best} >= {TARGET_ZERO_BUBBLE_OF_IDEAL:.0%} of the ideal [both cores] (MLP)",
                             cases[best]["of_ideal_both_cores"]["median"], TARGET_ZERO_BUBBLE_OF_IDEAL, "percent"))
    return found


def small_model_targets(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Each schedule of ours against its torch counterpart on the small GPT, where per-action and
    per-message overhead weighs most: the torch schedule of the same name, and for zb_h2 (torch
    has none with one chunk per rank) torch's best zero-bubble schedule."""
    rival_zb = best_zero_bubble(cases, TORCH_ZERO_BUBBLE)
    found = []
    for name in OUR_SCHEDULES:
        rival = f"torch {name.split(' ', 1)[1]}"
        rival = rival if rival in cases else rival_zb
        if name in cases and rival in cases:
            found.append(_target(f"{name} >= {TARGET_SMALL_MODEL_VS_TORCH:.2f}x {rival} (GPT, per-round "
                                 "throughput ratio)", paired_ratio(cases, name, rival),
                                 TARGET_SMALL_MODEL_VS_TORCH, "ratio"))
    return found


def paired_ratio(cases: dict[str, Any], ours: str, rival: str) -> float:
    """Median over rounds of rival's step time / ours in the same round (our throughput ratio)."""
    return statistics.median(t / o for t, o in zip(cases[rival]["times_s"], cases[ours]["times_s"]))


def _target(name: str, value: float, goal: float, fmt: str) -> dict[str, Any]:
    return {"name": name, "value": value, "goal": goal, "met": value >= goal, "format": fmt}

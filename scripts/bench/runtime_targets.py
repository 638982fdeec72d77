"""The targets that scripts/bench/runtime.py checks, from the analysed cases (no torch): on every
workload each schedule of ours against its torch counterpart (1.25x on the MLP and the small GPT,
1.15x on the model built from torch's own modules); on the MLP our 1f1b against the ideal and
zb_h2 against the ideal at one core's speed while both work."""
from __future__ import annotations

import statistics
from typing import Any

TARGET_VS_TORCH = {"mlp": 1.25, "gpt": 1.25, "stock": 1.15}   # workload -> every schedule's goal
TARGET_OF_IDEAL = 0.95
TARGET_ZB_H2_OF_IDEAL = 1.00
OUR_ZERO_BUBBLE = ("pipedream zb_h2", "pipedream zbv", "pipedream dualpipev")
TORCH_ZERO_BUBBLE = ("torch zbv", "torch interleaved_zb", "torch dualpipev")
OUR_SCHEDULES = ("pipedream gpipe", "pipedream 1f1b", "pipedream interleaved", *OUR_ZERO_BUBBLE)


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for name, workload in data["workloads"].items():
        if name in TARGET_VS_TORCH:
            found += schedule_targets(workload["cases"], name, TARGET_VS_TORCH[name])
        if name == "mlp":
            found += ideal_targets(workload["cases"])
    return found


def ideal_targets(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """The MLP (the compute-heavy blocks): our 1f1b against the ideal, zb_h2 against the ideal at
    one core's speed while both cores work."""
    found = []
    if "of_ideal" in cases.get("pipedream 1f1b", {}):
        found.append(_target(f"our 1f1b >= {TARGET_OF_IDEAL:.0%} of the ideal (2 stages, m=8, MLP)",
                             cases["pipedream 1f1b"]["of_ideal"]["median"], TARGET_OF_IDEAL, "percent"))
    if "of_ideal_both_cores" in cases.get("pipedream zb_h2", {}):
        found.append(_target(f"pipedream zb_h2 >= {TARGET_ZB_H2_OF_IDEAL:.0%} of the ideal [both cores] (MLP)",
                             cases["pipedream zb_h2"]["of_ideal_both_cores"]["median"], TARGET_ZB_H2_OF_IDEAL,
                             "percent"))
    return found


def best_zero_bubble(cases: dict[str, Any], names: tuple[str, ...]) -> str | None:
    """The fastest of ``names`` among the cases (median step time), or None."""
    present = [name for name in names if name in cases]
    return min(present, key=lambda n: cases[n]["step_time_s"]["median"]) if present else None


def schedule_targets(cases: dict[str, Any], workload: str, goal: float) -> list[dict[str, Any]]:
    """Each schedule of ours against its torch counterpart: the torch schedule of the same name,
    and for zb_h2 (torch has none with one chunk per rank) torch's best zero-bubble schedule."""
    rival_zb = best_zero_bubble(cases, TORCH_ZERO_BUBBLE)
    found = []
    for name in OUR_SCHEDULES:
        rival = f"torch {name.split(' ', 1)[1]}"
        rival = rival if rival in cases else rival_zb
        if name in cases and rival in cases:
            found.append(_target(f"{name} >= {goal:.2f}x {rival} ({workload.upper()}, per-round throughput ratio)",
                                 paired_ratio(cases, name, rival), goal, "ratio"))
    return found


def paired_ratio(cases: dict[str, Any], ours: str, rival: str) -> float:
    """Median over rounds of rival's step time / ours in the same round (our throughput ratio)."""
    return statistics.median(t / o for t, o in zip(cases[rival]["times_s"], cases[ours]["times_s"]))


def _target(name: str, value: float, goal: float, fmt: str) -> dict[str, Any]:
    return {"name": name, "value": value, "goal": goal, "met": value >= goal, "format": fmt}

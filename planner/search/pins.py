"""Pinned degrees (``planner.tp`` / ``planner.pp`` / ``planner.dp``): every search honours each pin
or refuses it here, in one line, before searching."""
from __future__ import annotations

from planner.errors import PlannerError
from planner.inputs.search_inputs import Inputs

# What each search can pin: PTD-P all three; 2BW has no tensor parallelism (ch. 3.3); PipeDream's
# DP chooses the stages and each stage's replicas itself (ch. 2.4.1), so only t = 1 is meaningful.
SUPPORTED = {"ptdp": ("tp", "pp", "dp", "cp"), "2bw": ("pp", "dp"), "pipedream": ()}
WHY = {"2bw": "the 2BW planner has no tensor parallelism (ch. 3.3)",
       "pipedream": "PipeDream's DP chooses the stages and each stage's replicas itself (ch. 2.4.1)"}
WHY_CP = "context parallelism is priced for PTD-P's flush schedules only"


def pins(inputs: Inputs) -> dict[str, int]:
    return {k: v for k, v in (("tp", inputs.pin_tp), ("pp", inputs.pin_pp), ("dp", inputs.pin_dp),
                              ("cp", inputs.pin_cp)) if v is not None}


def check_pins(inputs: Inputs, algorithm: str) -> None:
    n = inputs.cluster.num_devices
    pinned = pins(inputs)
    for key, value in pinned.items():
        if not isinstance(value, int) or value < 1:
            raise PlannerError(f"planner.{key}={value!r} must be a positive integer (or null to search)")
        if key in ("tp", "cp") and value == 1:
            continue  # every search runs without tensor and context parallelism
        if key not in SUPPORTED[algorithm]:
            why = WHY_CP if key == "cp" else WHY[algorithm]
            raise PlannerError(f"planner.{key}={value} cannot be honoured by {algorithm}: {why}; "
                               f"use planner.algorithm=ptdp{' or 2bw' if key != 'tp' else ''} or planner.{key}=null")
        if key == "tp" and inputs.profile.num_experts:
            raise PlannerError(f"planner.tp={value} cannot be honoured for {inputs.model}: MoE models train at tp = 1 "
                               f"(experts split over data-parallel ranks with parallel.ep); use planner.tp=null or 1")
        if n % value:
            raise PlannerError(f"planner.{key}={value} does not divide the {n} devices: p t d = n; choose a "
                               f"divisor of {n} or planner.{key}=null")
    product = 1
    for value in pinned.values():
        product *= value
    every = len(pinned) == 4 or (len(pinned) == 3 and "cp" not in pinned and not inputs.context_parallel)
    if n % product or (every and product != n):
        raise PlannerError(f"planner.tp/pp/dp/cp = {pinned} multiply to {product}, which must "
                           f"{'equal' if every else 'divide'} the {n} devices (p t d c = n)")

"""seconds = latency + bytes / bandwidth, fitted to measured (bytes, seconds) points.

On a shared machine one size's median can be stalled by the scheduler by more than the transfer
itself takes (on 2 busy cores a 4 MiB ping-pong once measured faster than 512 KiB), and a slope
through the two largest sizes then comes out negative: an infinite bandwidth, and NaN where a cost
divides an impossible cut's infinite bytes by it. So the slope is the median of the slopes between
every pair of sizes (Theil-Sen: a stalled size moves only its own pairs), and where even that does
not rise with the size the bandwidth falls back to a bound, stated in the fit and logged: the
largest message's whole time counted as transfer (the lowest bandwidth the measurement allows, so
no message is priced below what it measured). Always positive and finite.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from planner.errors import PlannerError

THEIL_SEN = "theil-sen"
LARGEST_MESSAGE_BOUND = "largest-message bound"


@dataclass(frozen=True)
class LineFit:
    latency_s: float
    bandwidth: float   # bytes/s, positive and finite
    method: str        # THEIL_SEN, or LARGEST_MESSAGE_BOUND where the times do not rise with the size
    note: str = ""     # why the fallback was taken (empty for THEIL_SEN)

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v != ""}


def _checked(points: list, what: str) -> list[tuple[float, float]]:
    pts = sorted((float(x), float(t)) for x, t in points)
    if len({x for x, _ in pts}) < 2 or any(not (math.isfinite(x) and math.isfinite(t)) or x <= 0 or t <= 0
                                           for x, t in pts):
        raise PlannerError(f"{what}: cannot fit latency + bytes / bandwidth to {pts}: it needs positive, finite "
                           f"times of at least two message sizes; measure again (planner.calibrate_repeats)")
    return pts


def fit_latency_bandwidth(points: list, what: str) -> LineFit:
    """The fit of ``points`` ([bytes, seconds] pairs, at least two sizes); ``what`` names them in the note."""
    pts = _checked(points, what)
    slopes = [(t1 - t0) / (x1 - x0) for i, (x0, t0) in enumerate(pts) for x1, t1 in pts[i + 1:] if x1 > x0]
    slope = statistics.median(slopes)
    if slope > 0:
        method, note = THEIL_SEN, ""
        bandwidth = 1.0 / slope
    else:
        size, seconds = pts[-1]
        bandwidth = size / seconds
        method = LARGEST_MESSAGE_BOUND
        times = ", ".join(f"{x / 1024:.0f} KiB {t * 1e6:.0f} us" for x, t in pts)
        note = (f"{what} times do not rise with the message size ({times}; median pairwise slope "
                f"{slope:.3g} s/byte): the machine's noise exceeds the transfer; bandwidth bounded by the "
                f"largest message's whole time, {bandwidth / 1e9:.2f} GB/s")
    latency = max(0.0, statistics.median(t - x / bandwidth for x, t in pts))
    return LineFit(latency, bandwidth, method, note)

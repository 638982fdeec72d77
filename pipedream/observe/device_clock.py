"""The clock a rank's trace recorder and executor share, chosen once from the rank's device:
``time.perf_counter`` on CPU, where work is done when the call returns; on CUDA an
``EventClock`` (``pipedream/observe/trace_clock.py``) that stamps traced iterations with timing events on
the current (compute) stream and otherwise reads the host clock. The point-to-point and collective
streams get no events: the compute stream shows their cost where it waits for them."""
from __future__ import annotations

import time
from typing import Callable

import torch

from pipedream.observe.trace_clock import EventClock


def clock_for(device: torch.device) -> Callable[[], float] | EventClock:
    if device.type != "cuda":
        return time.perf_counter

    def record_event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    return EventClock(record_event, lambda: torch.cuda.current_stream(device).synchronize())

"""The trace's clock. On CUDA a kernel launch returns before the kernel runs, so host timestamps
would measure launches; in traced iterations (``exact``) this clock first waits for the current
stream's queued work, so an action's span is the time the device spent on it. Only the compute
stream is waited for: the point-to-point and collective streams may hold a receive whose sender
waits on this rank. Outside traced iterations, and on CPU, it is the plain host clock."""
from __future__ import annotations

import time

import torch


class DeviceClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.exact = False   # set by the trace recorder for the iterations it keeps

    def __call__(self) -> float:
        if self.exact and self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

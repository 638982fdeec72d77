"""Dropout randomness for tensor parallelism.

Replicated regions (embedding dropout, residual dropout after g) must drop the same elements on
every rank of the group, so they use the global generator, which the trainer seeds identically on
every rank. Sharded regions (dropout on this rank's attention heads) must draw independent masks
per rank, or every rank would drop the same pattern in different heads' positions.

``RNGTracker.fork`` runs a region under a generator seeded from (model seed, tp rank, one draw
from the global generator). It holds no state of its own: the forked stream is a function of the
global RNG state, so anything that saves and restores the global state also replays the forked
one. That is exactly what ``torch.utils.checkpoint`` does (``preserve_rng_state=True``, the
default), so activation recomputation reproduces the dropout masks of both regions without a
Megatron-style tracker-aware checkpoint function. The one draw per fork happens on every rank of
the group alike, so the global streams stay in step.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

MODEL_PARALLEL_SEED_OFFSET = 2718  # as Megatron: keeps the forked seeds away from the data/global ones
_MASK64 = (1 << 63) - 1


@dataclass(frozen=True)
class RNGTracker:
    seed: int
    tp_rank: int

    def _seed_for(self, draw: int) -> int:
        # a fixed, platform-independent mix (Python's hash of ints is not salted, but be explicit)
        value = (self.seed + MODEL_PARALLEL_SEED_OFFSET) * 0x9E3779B97F4A7C15 + self.tp_rank * 0xBF58476D1CE4E5B9
        return (value ^ draw) & _MASK64

    @contextmanager
    def fork(self, device: torch.device | str = "cpu") -> Iterator[None]:
        """Runs the body on this rank's own stream (for ``device``'s generator and the CPU one);
        the global state afterwards is as if only one integer had been drawn."""
        device = torch.device(device)
        draw = int(torch.randint(0, 1 << 62, (1,)).item())
        devices = [device] if device.type == "cuda" else []
        seed = self._seed_for(draw)
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            if devices:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
            yield

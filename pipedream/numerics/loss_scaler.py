"""fp16 dynamic loss scaling that every rank agrees on.

The last stage multiplies the loss by the scale; the gradients of every stage then carry it. At the
update each rank unscales its own gradients and checks them for inf/NaN, and one all-reduce of
the found-inf flag over the whole world (every pipeline, tensor- and data-parallel rank) tells
all of them whether any rank overflowed: then every rank skips the same step and multiplies the
scale by ``backoff_factor``; after ``growth_interval`` clean steps in a row every rank multiplies
it by ``growth_factor``. All ranks apply the same rule to the same flags, so the scale stays equal
everywhere without being sent. torch's ``ShardedGradScaler`` (given the world group) does exactly
this; this class adds the check the runner needs before clipping, the skip, and the
checkpoint state.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from pipedream.config.precision import LossScaleSpec


class LossScaler:
    def __init__(self, spec: LossScaleSpec, device: torch.device):
        self.scaler = ShardedGradScaler(device=device.type, init_scale=spec.initial_scale,
                                        growth_factor=spec.growth_factor, backoff_factor=spec.backoff_factor,
                                        growth_interval=spec.growth_interval, process_group=dist.group.WORLD)
        # creates the scale tensor on every rank, also on stages that never scale a loss themselves
        self.scaler.scale(torch.ones((), device=device))
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale())

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool:
        """Collective over the world: divides this rank's gradients by the scale; True when a
        gradient of any rank is not finite (every rank then skips this step)."""
        self.scaler.unscale_(optimizer)
        found = self.scaler._found_inf_per_device(optimizer)   # all-reduced over the world by unscale_
        return sum(float(flag) for flag in found.values()) > 0

    def step(self, optimizer: torch.optim.Optimizer, overflow: bool) -> None:
        """Steps the optimizer unless ``overflow``; then grows or backs off the scale. The gradients
        are unscaled already, so the optimizer steps plainly (not through ``GradScaler.step``,
        which hands fused optimizers a found-inf tensor of a shape their step count rejects)."""
        if not overflow:
            optimizer.step()
        self.scaler.update()
        self.skipped_steps += int(overflow)

    def state_dict(self) -> dict[str, Any]:
        return {**self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.skipped_steps = int(state.pop("skipped_steps", 0))
        self.scaler.load_state_dict(state)

"""A planned Harmony configuration as the runtime's schedule IR, and the per-action costs of its
tasks from the layer profile.

The planner's configuration is (b, U_F, P_F, U_B, P_B) on N devices: the micro-batch size b
(samples), the micro-batches per forward / backward task group (U_F, U_B; the runtime swaps a
pack's weights in once per group), the forward packs before the jit pack and the backward packs
(whose last is the jit pack, run forward and backward in one task). ``ir_config`` turns it into
``pipedream.schedules.harmony.HarmonyConfig``, whose ``harmony_pp`` lists the estimator simulates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipedream.schedules.harmony import BACKWARD, FORWARD, HarmonyConfig

from planner.harmony.estimator import ActionCosts
from planner.harmony.packing import LayerBytes, Pack
from planner.inputs.profile import Profile


@dataclass(frozen=True)
class PlannedConfig:
    micro: int                    # b, samples per micro-batch
    u_f: int                      # micro-batches per forward task group
    packs_f: tuple[Pack, ...]     # forward packs before the jit pack
    u_b: int                      # micro-batches per backward task group
    packs_b: tuple[Pack, ...]     # backward packs; the last is the jit pack
    devices: int
    minibatch: int

    @property
    def microbatches(self) -> int:
        return self.minibatch // self.micro

    def brief(self) -> str:
        return (f"b={self.micro} U_F={self.u_f} P_F: {len(self.packs_f) + 1} packs, U_B={self.u_b} "
                f"P_B: {len(self.packs_b)} packs")

    def describe(self) -> str:
        def show(packs):
            return " ".join(f"[{s},{e})" for s, e in packs)
        return (f"b={self.micro} U_F={self.u_f} P_F={show(self.forward_packs)} U_B={self.u_b} "
                f"P_B={show(self.packs_b)} N={self.devices}")

    @property
    def forward_packs(self) -> tuple[Pack, ...]:
        """P_F as the runtime takes it: ending with the jit pack."""
        return self.packs_f + (self.packs_b[-1],)


def ir_config(cfg: PlannedConfig) -> HarmonyConfig:
    return HarmonyConfig(cfg.packs_b[-1][1], cfg.forward_packs, cfg.packs_b, cfg.microbatches, cfg.u_f, cfg.u_b,
                         cfg.devices)


class ProfileCosts(ActionCosts):
    """Per task and micro-batch of ``micro`` samples, from the profile's per-layer columns. A
    backward task recomputes its pack's forward (the runtime keeps only pack inputs); the jit
    pack does not. A forward task keeps no graph (its backward recomputes), so only its largest
    layer's activations are live at once; the others hold the whole pack's. The host update:
    ``overhead + per_byte x`` the pack's parameter bytes."""

    def __init__(self, profile: Profile, config: HarmonyConfig, micro: int, update_per_byte: float = 0.0,
                 update_overhead: float = 0.0):
        self.layers = LayerBytes.from_profile(profile)
        fwd, bwd = profile.times(micro)
        prefix = lambda col: np.concatenate(([0.0], np.cumsum(col)))  # noqa: E731 - local helper
        f, b, w, act = prefix(fwd), prefix(bwd), prefix(self.layers.weights), prefix(self.layers.activations)
        self._rows = []
        for task in config.tasks:
            s, e = task.layers
            recompute = task.role == BACKWARD
            self._rows.append((f[e] - f[s], b[e] - b[s] + (f[e] - f[s] if recompute else 0.0), w[e] - w[s],
                               micro * float(self.layers.inputs[s]), micro * float(self.layers.outputs[e - 1]),
                               micro * (float(self.layers.activations[s:e].max()) if task.role == FORWARD
                                        else act[e] - act[s]),
                               update_overhead + update_per_byte * (w[e] - w[s]) if w[e] > w[s] else 0.0))

    def forward_s(self, task: int) -> float:
        return self._rows[task][0]

    def backward_s(self, task: int) -> float:
        return self._rows[task][1]

    def weight_bytes(self, task: int) -> float:
        return self._rows[task][2]

    def stash_bytes(self, task: int) -> float:
        return self._rows[task][3]

    def input_grad_bytes(self, task: int) -> float:
        return self._rows[task][3]

    def output_bytes(self, task: int) -> float:
        return self._rows[task][4]

    def activation_bytes(self, task: int) -> float:
        return self._rows[task][5]

    def update_s(self, task: int) -> float:
        return self._rows[task][6]

"""One Harmony configuration (U_F, P_F, U_B, P_B) as the estimator's task list, with the costs of
each task from the layer profile (Harmony's task graph generator, its Algorithm 3).

The wrap-around pipeline: the tasks are the forward packs in layer order, then the backward packs
in reverse (P_FB = P_F + reverse(P_B)); task i runs on device i mod N. The backward packs' last
pack is the jit pack: its forward runs straight before its backward, micro-batch by micro-batch,
so P_F covers only the layers before it. Every task runs over the whole mini-batch as a group of
micro-batches (D / U_F forward, D / U_B backward). A forward pack swaps in its weights and swaps
out what its backward will need (the pack input with recomputation, else its activations); a
backward pack swaps in its weights and those stashes, recomputes, and swaps out its gradients, on
which the host runs the pack's update.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .harmony_estimator import Item, Task
from .harmony_packing import LayerBytes, Pack, backward_pack_bytes, forward_pack_bytes, stash_per_sample
from .profile import Profile


@dataclass(frozen=True)
class HarmonyConfig:
    u_f: int
    packs_f: tuple[Pack, ...]
    u_b: int
    packs_b: tuple[Pack, ...]
    devices: int
    minibatch: int
    recompute: bool = True

    def describe(self) -> str:
        def show(packs):
            return " ".join(f"[{s},{e})" for s, e in packs)
        rec = " recompute" if self.recompute else ""
        return (f"U_F={self.u_f} P_F={show(self.packs_f) or '-'} U_B={self.u_b} P_B={show(self.packs_b)} "
                f"N={self.devices}{rec}")

    def brief(self) -> str:
        return (f"U_F={self.u_f} |P_F|={len(self.packs_f)} U_B={self.u_b} |P_B|={len(self.packs_b)}"
                + (" recompute" if self.recompute else ""))

    @property
    def task_packs(self) -> list[tuple[str, Pack]]:
        """P_FB: the forward packs, then the backward packs from the last (the jit pack) to the first."""
        return [("F", p) for p in self.packs_f] + [("B", p) for p in reversed(self.packs_b)]


@dataclass(frozen=True)
class TaskCosts:
    """What a task's costs are computed from: the profile, its byte columns and the host update rate."""

    profile: Profile
    layers: LayerBytes
    host_update_s_per_byte: float = 0.0   # optimizer step on the host per parameter byte
    host_update_overhead_s: float = 0.0   # per update call

    @classmethod
    def of(cls, profile: Profile, per_byte: float = 0.0, overhead: float = 0.0) -> "TaskCosts":
        return cls(profile, LayerBytes.from_profile(profile), per_byte, overhead)

    def seconds(self, micro: int, pack: Pack) -> tuple[float, float]:
        fwd, bwd = self.profile.times(micro)
        s, e = pack
        return float(fwd[s:e].sum()), float(bwd[s:e].sum())


def _covering(sample_lo: int, sample_hi: int, micro: int) -> range:
    """Micro-batches of size ``micro`` that hold samples [lo, hi)."""
    return range(sample_lo // micro, (sample_hi - 1) // micro + 1)


def build_tasks(cfg: HarmonyConfig, costs: TaskCosts) -> list[Task]:
    plan = cfg.task_packs
    n_f = len(cfg.packs_f)
    tasks: list[Task] = []
    weights = costs.layers.weights
    for i, (kind, pack) in enumerate(plan):
        s, e = pack
        device = i % cfg.devices
        send_to = (i + 1) % cfg.devices if i + 1 < len(plan) else None
        pack_weights = float(weights[s:e].sum())
        stash = stash_per_sample(costs.layers, pack, cfg.recompute)
        if kind == "F":
            fwd, _ = costs.seconds(cfg.u_f, pack)
            items = tuple(Item(fwd, cfg.u_f * float(costs.layers.outputs[e - 1]), cfg.u_f * stash,
                               ((i - 1, j),) if i > 0 else ())
                          for j in range(cfg.minibatch // cfg.u_f))
            tasks.append(Task(i, device, "F", items, pack_weights,
                              resident_bytes=forward_pack_bytes(costs.layers, pack, cfg.u_f, cfg.recompute),
                              send_to=send_to))
            continue
        fwd, bwd = costs.seconds(cfg.u_b, pack)
        jit = i == n_f
        seconds = fwd + bwd if (jit or cfg.recompute) else bwd
        grad_bytes = cfg.u_b * float(costs.layers.inputs[s])
        items = []
        for j in range(cfg.minibatch // cfg.u_b):
            if jit and n_f:
                needs = tuple((i - 1, k) for k in _covering(j * cfg.u_b, (j + 1) * cfg.u_b, cfg.u_f))
            else:
                needs = ((i - 1, j),) if i > 0 else ()
            items.append(Item(seconds, grad_bytes, 0.0, needs))
        stash_samples = 0 if jit else cfg.minibatch
        stash_in = stash_samples * stash
        update = (costs.host_update_overhead_s + costs.host_update_s_per_byte * pack_weights) if pack_weights else 0.0
        tasks.append(Task(i, device, "B", tuple(items), pack_weights + stash_in, swap_out_bytes=pack_weights,
                          resident_bytes=backward_pack_bytes(costs.layers, pack, cfg.u_b, stash_samples, cfg.recompute),
                          host_update_s=update, send_to=send_to))
    return tasks


def swap_volume(cfg: HarmonyConfig, weights: np.ndarray) -> dict[str, float]:
    """Weight bytes moved per iteration: swap-ins of forward and backward packs and the gradients
    swapped out (3|W| less the jit pack's second swap-in)."""
    def w(packs):
        return float(sum(weights[s:e].sum() for s, e in packs))
    return {"weights_in": w(cfg.packs_f) + w(cfg.packs_b), "gradients_out": w(cfg.packs_b)}

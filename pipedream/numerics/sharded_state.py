"""The distributed optimizer's checkpoint form (``sharded_optim.ShardedOptimizer``, which this
class is a part of: it reads the optimizer's ``pieces``, ``params``, ``offsets``, ``local`` and
``param_groups``).

Checkpoints see a whole-model optimizer: ``state_dict`` all-gathers each moment into the
per-parameter form that an undistributed optimizer of the same kind saves, and ``load_state_dict``
takes the own shard from that form, so DCP saves and resumes into any dp degree, distributed or
not (the gathered copy exists only while a checkpoint is written or read). ``state`` lists, per
parameter, the names of its state (the values live in the shard): DCP reads the names.
"""
from __future__ import annotations

from typing import Any

import torch


class WholeModelState:
    """``state_dict`` / ``load_state_dict`` in the form of an undistributed optimizer."""

    def state_dict(self) -> dict[str, Any]:
        """Collective over the group: the whole-model form (per parameter, full shapes)."""
        self.wait_parameters()
        self._ensure_local_state()
        states = [self.local.state[piece.view] for piece in self.pieces]
        per_element = [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0]
        scalars = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in states[0].items() if k not in per_element}
        full = {name: self._gathered(name) for name in per_element}
        state = {}
        for index, param in enumerate(self.params):
            offset = self.offsets[id(param)]
            state[index] = {**{k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()},
                            **{name: flat[offset:offset + param.numel()].view_as(param).clone()
                               for name, flat in full.items()}}
        groups, index = [], 0
        for inner, outer in zip(self.local.param_groups, self.param_groups):
            count = len(outer["params"])
            groups.append({**{k: v for k, v in inner.items() if k != "params"},
                           **{k: v for k, v in outer.items() if k != "params"},
                           "params": list(range(index, index + count))})
            index += count
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes this rank's shard of a whole-model state (keys matched by position, as torch does)."""
        self.wait_parameters()
        self._ensure_local_state()
        saved_groups = state_dict["param_groups"]
        key_of: dict[int, Any] = {}
        for saved, outer, inner in zip(saved_groups, self.param_groups, self.local.param_groups):
            for key, param in zip(saved["params"], outer["params"]):
                key_of[id(param)] = key
            for name, value in saved.items():
                if name == "params":
                    continue
                if name in outer:
                    outer[name] = value
                if name in inner:
                    inner[name] = value
        for piece in self.pieces:
            saved = state_dict["state"].get(key_of[id(piece.param)], {})
            mine = self.local.state[piece.view]
            for name, value in saved.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    mine[name].copy_(value.reshape(-1)[piece.begin:piece.end])
                elif torch.is_tensor(value) and torch.is_tensor(mine.get(name)):
                    mine[name].copy_(value)
                else:
                    mine[name] = value
        self._name_state()

    def _gathered(self, name: str) -> torch.Tensor:
        mine = torch.zeros(self.shard_numel, dtype=self._dtype, device=self._device)
        for piece in self.pieces:
            mine[piece.shard_offset:piece.shard_offset + piece.end - piece.begin].copy_(
                self.local.state[piece.view][name])
        return self._all_gathered(mine)

    def _ensure_local_state(self) -> None:
        """Creates the shard's state as DCP does for a fresh optimizer: one step at learning rate 0
        with zero gradients (local: no collective)."""
        if self.local.state:
            return
        lrs = [g["lr"] for g in self.local.param_groups]
        for g in self.local.param_groups:
            g["lr"] = 0.0
        for piece in self.pieces:
            piece.view.grad = torch.zeros_like(piece.view)
        self.local.step()
        for g, lr in zip(self.local.param_groups, lrs):
            g["lr"] = lr
        self.local.zero_grad(set_to_none=True)
        self._name_state()

    def _name_state(self) -> None:
        names = list(next(iter(self.local.state.values())).keys()) if self.local.state else []
        self.state.clear()
        if names:
            for param in self.params:
                self.state[param] = dict.fromkeys(names)

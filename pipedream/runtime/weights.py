"""Weight versions of one rank for the asynchronous schedules (weight stashing, vertical sync, 2BW).

The optimizer owns the stage's parameters, which always hold the newest version. Forwards and
backwards do not run on them: they run with ``torch.func.functional_call`` on a *version*, a list
of leaf tensors that share storage with the parameters but have their own autograd version
counter. So an update may proceed while earlier micro-batches still hold graphs over the old
weights:

- before an update, if some later action still needs the current version, the parameters move
  to a fresh copy (``param.data = param.data.clone()``) and the version keeps the old storage;
  otherwise the update happens in place and nothing is copied;
- after a backward, the version's gradients move into the parameters' ``.grad`` (where the
  optimizer and the gradient all-reduce read them), and versions no later action needs are freed.

Which version each action uses comes from ``schedules.versions`` (the same on every rank, so no
version id is sent). Memory is one copy of the weights per version held; ``peak`` is measured.
Flush schedules do not use this module: their stage runs on the parameters directly.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from pipedream.errors import InvariantError
from pipedream.schedules import Action
from pipedream.schedules.versions import Uses


class WeightStore:
    """One rank's versions for one segment of an asynchronous run; ``uses`` maps each FWD/BWD to
    its version (``schedules.versions``)."""

    def __init__(self, params: list[nn.Parameter], chunks: list[nn.Module], uses: Uses):
        self.params = params
        index = {id(p): i for i, p in enumerate(params)}
        self.names = [[(name, index[id(p)]) for name, p in chunk.named_parameters()] for chunk in chunks]
        self.uses = uses
        self.pending = Counter(uses.values())   # version -> actions still to run with it
        self.current = 0                        # the version the parameters hold
        self.versions: dict[int, list[torch.Tensor]] = {}
        self.peak = 1

    @property
    def held(self) -> int:
        """Distinct weight copies in memory: the parameters plus every older version kept."""
        return 1 + sum(1 for v in self.versions if v != self.current)

    def weights_for(self, action: Action) -> dict[str, torch.Tensor]:
        """The tensors ``action`` (a FWD or BWD) runs with, by parameter name within its chunk."""
        version = self.uses[action]
        if version not in self.versions:
            if version != self.current:
                state = "is not created yet" if version > self.current else "was freed"
                raise InvariantError(f"{action} needs weight version {version}, which {state} (current "
                                   f"{self.current}): the version plan and the schedule disagree")
            self.versions[version] = self._alias()
        tensors = self.versions[version]
        return {name: tensors[i] for name, i in self.names[action.chunk]}

    def after_forward(self, action: Action) -> None:
        self._used(action)

    def after_backward(self, action: Action) -> None:
        """Moves the gradients the backward left on its version into the parameters' ``.grad``."""
        version = self.uses[action]
        for param, tensor in zip(self.params, self.versions[version]):
            if tensor.grad is None:
                continue
            if param.grad is None:
                param.grad = tensor.grad
            else:
                param.grad.add_(tensor.grad)
            tensor.grad = None
        self._used(action)

    def before_update(self) -> None:
        """Keeps the current version alive across the in-place optimizer step if it is still needed."""
        if self.pending[self.current] == 0:
            self.versions.pop(self.current, None)
            return
        if self.current not in self.versions:
            self.versions[self.current] = self._alias()
        with torch.no_grad():
            for param in self.params:
                param.data = param.data.clone()

    def after_update(self) -> None:
        self.current += 1
        self.peak = max(self.peak, self.held)

    def replan(self, uses: Uses, executed: list[Action], remaining: list[Action]) -> None:
        """Switches to the plan of a shorter run (a drain) whose executed part is the same."""
        for action in executed:
            if action in uses and uses[action] != self.uses.get(action):
                raise InvariantError(f"draining changes the weight version of {action}: {self.uses.get(action)} -> "
                                   f"{uses[action]}")
        self.uses = uses
        self.pending = Counter(uses[a] for a in remaining if a in uses)
        for version in [v for v in self.versions if v != self.current and self.pending[v] == 0]:
            del self.versions[version]

    def _alias(self) -> list[torch.Tensor]:
        """The current version: leaves sharing the parameters' storage, with their own autograd
        version counter (``.data``), so an in-place update of the parameters is not an error for
        graphs built on them (it is avoided by ``before_update`` whenever they still matter)."""
        return [p.data.requires_grad_(True) for p in self.params]

    def _used(self, action: Action) -> None:
        version = self.uses[action]
        self.pending[version] -= 1
        if self.pending[version] == 0 and version != self.current:
            del self.versions[version]
        self.peak = max(self.peak, self.held)

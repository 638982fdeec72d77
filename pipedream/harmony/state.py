"""Where harmony_pp keeps the model state, and how a pack's state comes onto a device and leaves.

Every layer's fp32 weights live once, in a host tier in shared memory that every rank of the
server maps (``offload.HostTier`` with a folder under /dev/shm): any rank can swap in any pack,
and the rank that updates a layer writes its new weights there in place, so no weights travel
between ranks. A layer's gradients and optimizer state belong to its owner, the rank that runs
its backward (and update): gradients go to the owner's host tier as a backward group ends,
the optimizer (torch's, over parameters that alias the host weights) steps there, and its state
never moves. The modules a rank builds keep empty parameters except while their pack is on the
device (``swap_in`` points them at the device copies).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from pipedream.errors import InvariantError
from pipedream.offload import DeviceTier, HostTier, TensorClass

_EMPTY = torch.empty(0)


def weight_key(layer: int, name: str) -> tuple:
    return ("w", layer, name)


def grad_key(layer: int, name: str, replica: int | None = None) -> tuple:
    """A layer's gradient on the host; harmony_dp keeps one per replica (device) until the update."""
    return ("g", layer, name) if replica is None else ("g", layer, name, replica)


@dataclass(frozen=True)
class Replicas:
    """harmony_dp: ``count`` devices each run every pack; this one is ``index``."""
    count: int
    index: int


class PackState:
    """This rank's layers (``modules``: layer -> module, built from the per-layer seeds) over the
    shared host tier ``host`` and the device tier ``device``. ``owned``: the layers it updates.
    With ``replicas`` (harmony_dp) every replica writes its gradients of every layer to a file of
    its own that the layer's owner maps, and the owner sums them before the update."""

    def __init__(self, modules: dict[int, nn.Module], owned: set[int], host: HostTier, device: DeviceTier,
                 barrier: Callable[[], None], replicas: Replicas | None = None):
        self.modules, self.owned, self.host, self.device = modules, owned, host, device
        self.barrier, self.replicas = barrier, replicas
        self.params = {layer: list(module.named_parameters()) for layer, module in modules.items()}
        for layer in sorted(owned):   # the owner publishes the initial weights ...
            for name, param in self.params[layer]:
                host.put(weight_key(layer, name), param.detach())
        barrier()
        for layer, named in self.params.items():   # ... every other user maps them
            if layer not in owned:
                for name, param in named:
                    host.allocate(weight_key(layer, name), param.shape, param.dtype, create=False)
        barrier()
        for layer, named in self.params.items():
            for name, param in named:
                if layer in owned:
                    host.unlink(weight_key(layer, name))   # mapped everywhere: the file can go
                param.data = _EMPTY
        # trainable (requires_grad) as the model's own: checkpoints save optimizer state only for those
        self.host_params = {(layer, name): nn.Parameter(host.get(weight_key(layer, name)))
                            for layer in sorted(owned) for name, _ in self.params[layer]}
        if replicas is not None:
            self._share_gradients(barrier)

    def _grad_key(self, layer: int, name: str, replica: int | None = None) -> tuple:
        if self.replicas is None:
            return grad_key(layer, name)
        return grad_key(layer, name, self.replicas.index if replica is None else replica)

    def _share_gradients(self, barrier: Callable[[], None]) -> None:
        """harmony_dp: each replica creates its gradient files, every owner maps the other
        replicas' files of its layers, and the files go once mapped."""
        for layer, named in self.params.items():
            for name, weight in self._named_host(layer):
                self.host.allocate(self._grad_key(layer, name), weight.shape, weight.dtype)
        barrier()
        for layer in sorted(self.owned):
            for name, weight in self._named_host(layer):
                for replica in range(self.replicas.count):
                    if replica != self.replicas.index:
                        self.host.allocate(self._grad_key(layer, name, replica), weight.shape, weight.dtype,
                                           create=False)
        barrier()
        for layer, named in self.params.items():
            for name, _ in named:
                self.host.unlink(self._grad_key(layer, name))

    def final_gradients(self, layers: Iterable[int]) -> dict[tuple[int, str], torch.Tensor]:
        """The host gradients the update of ``layers`` (owned) uses. harmony_dp: collective (every
        replica calls it once per step, after its backward): the sum over the replicas, in replica
        order (each scaled its loss by one over the micro-batches of all replicas)."""
        layers = list(layers)
        if self.replicas is None:
            return {(layer, name): self.host.get(grad_key(layer, name)) for layer in layers
                    for name, _ in self.params[layer]}
        self.barrier()   # every replica's gradients are on the host
        sums = {}
        for layer in layers:
            for name, _ in self.params[layer]:
                total = self.host.get(self._grad_key(layer, name, 0)).clone()
                for replica in range(1, self.replicas.count):
                    total += self.host.get(self._grad_key(layer, name, replica))
                sums[(layer, name)] = total
        return sums

    def weight_bytes(self, layers: Iterable[int]) -> int:
        return sum(p.numel() * p.element_size() for layer in layers for _, p in self._named_host(layer))

    def _named_host(self, layer: int) -> list[tuple[str, torch.Tensor]]:
        return [(name, self.host.get(weight_key(layer, name))) for name, _ in self.params[layer]]

    def prefetch(self, layers: Iterable[int]) -> None:
        for layer in layers:
            for name, _ in self.params[layer]:
                self.device.prefetch(weight_key(layer, name), TensorClass.WEIGHTS)

    def swap_in(self, layers: Iterable[int], grads: str | None = None) -> None:
        """The pack's weights onto the device; ``grads``: "zero" (a backward task's first group)
        or "host" (a later group continues the sum) gives every parameter a device gradient."""
        for layer in layers:
            for name, param in self.params[layer]:
                param.data = self.device.swap_in(weight_key(layer, name), TensorClass.WEIGHTS)
                if grads == "zero":
                    param.grad = self.device.allocate(self._grad_key(layer, name), param.shape, param.dtype,
                                                      TensorClass.GRADIENTS)
                elif grads == "host":
                    param.grad = self.device.swap_in(self._grad_key(layer, name), TensorClass.GRADIENTS)

    def swap_out(self, layers: Iterable[int], grads: bool) -> None:
        """The pack leaves the device: weights are dropped (the host copy is current); with
        ``grads`` the accumulated gradients are written to the host tier first."""
        for layer in layers:
            for name, param in self.params[layer]:
                if grads:
                    key = self._grad_key(layer, name)
                    if param.grad is not self.device.get(key):
                        raise InvariantError(f"layer {layer} {name}: autograd replaced the gradient buffer")
                    created = key not in self.host
                    self.device.swap_out(key)
                    if created:
                        self.host.unlink(key)   # only this rank reads it: no file needed
                    param.grad = None
                param.data = _EMPTY
                self.device.swap_out(weight_key(layer, name), write_back=False)

    def update(self, layers: Iterable[int], optimizer: torch.optim.Optimizer,
               grads: dict[tuple[int, str], torch.Tensor] | None = None) -> None:
        """The optimizer step of ``layers`` on the host tier with ``grads`` (default: their host
        gradients, ``final_gradients``); the other parameters have no gradient, so the step leaves
        them alone."""
        layers = list(layers)
        if grads is None:
            grads = self.final_gradients(layers)
        stepped = []
        for layer in layers:
            if layer not in self.owned:
                raise InvariantError(f"layer {layer} is updated on a rank that does not own it")
            for name, _ in self.params[layer]:
                host_param = self.host_params[(layer, name)]
                host_param.grad = grads[(layer, name)]
                stepped.append(host_param)
        if stepped:
            optimizer.step()
        for host_param in stepped:
            host_param.grad = None

    @staticmethod
    def gradient_squares(grads: dict[tuple[int, str], torch.Tensor]) -> float:
        """Sum of the squared per-tensor L2 norms (fp64)."""
        return sum(float(torch.linalg.vector_norm(g).double()) ** 2 for g in grads.values())

    @staticmethod
    def scale_gradients(grads: dict[tuple[int, str], torch.Tensor], factor: float) -> None:
        for g in grads.values():
            g.mul_(factor)

    def owned_modules(self) -> dict[int, nn.Module]:
        """The layers this rank owns, as modules whose parameters are the host master weights the
        optimizer steps (checkpoints save and load through them: a load writes the shared host
        tier in place, so every rank that maps a layer sees it)."""
        mirrors = {}
        for layer in sorted(self.owned):
            mirror = copy.deepcopy(self.modules[layer])   # the structure and names; its own weights are empty
            for name, _ in self.params[layer]:
                owner, _, leaf = name.rpartition(".")
                mirror.get_submodule(owner)._parameters[leaf] = self.host_params[(layer, name)]
            mirrors[layer] = mirror
        return mirrors

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """``{"<layer>.<name>": tensor}`` of the layers this rank owns (host copies)."""
        return {f"{layer}.{name}": p.detach() for (layer, name), p in self.host_params.items()}

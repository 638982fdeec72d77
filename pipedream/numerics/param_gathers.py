"""The parameters' all-gathers of the distributed optimizer (``sharded_optim.ShardedOptimizer``,
which this class is a part of: it reads the optimizer's ``buckets``, ``offsets``, ``pieces``,
``group``, ``dp``, ``level`` and its shard buffers).

After each update the buckets are gathered from the ranks' shards, by default at once
(``step``), or left in flight for each layer's forward to land (``gather_before``). At zero3 the
parameters are freed at rest and a layer's forward pre-hook gathers its buckets and prefetches the
next layer's (``shard_parameters``); ``acquire``, ``prefetch`` and ``release`` serve the fully
sharded mode (``param_residency.LayerResidency``).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Iterable

import torch
from torch import nn

from models.tensor_parallel.flat_collectives import all_gather_flat


class ParameterGathers:
    """Gathering whole parameters from the shards, and freeing them again at zero3."""

    def gather_before(self, layers: Iterable[nn.Module]) -> None:
        """From now on ``step`` leaves the parameters' all-gather in flight: each of ``layers`` (every
        parameter of the optimizer belongs to one) waits, before its forward, for the buckets holding
        its parameters. The layers' forwards must go through ``Module.__call__`` (hooks)."""
        bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket.params}
        layers = list(layers)
        covered = {id(p) for layer in layers for p in layer.parameters()}
        if any(id(p) not in covered for p in self.params):
            raise ValueError("gather_before: every parameter of the optimizer must belong to one of the layers")
        for layer in layers:
            needed = tuple(sorted({bucket_of[id(p)] for p in layer.parameters() if id(p) in bucket_of}))
            if needed:
                self._hooks.append(layer.register_forward_pre_hook(partial(self._before_forward, needed, ())))
        self._overlap_gather = True

    def shard_parameters(self, chunks: Iterable[Iterable[nn.Module]]) -> None:
        """zero3: each layer of ``chunks`` (every parameter of the optimizer belongs to one) gathers,
        before its forward, the buckets holding its parameters that are not whole, and launches
        those of the next layer of its chunk (prefetch)."""
        chunks = [list(chunk) for chunk in chunks]
        bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket.params}
        covered = {id(p) for chunk in chunks for layer in chunk for p in layer.parameters()}
        if any(id(p) not in covered for p in self.params):
            raise ValueError("shard_parameters: every parameter of the optimizer must belong to one of the layers")
        for chunk in chunks:
            needs = [tuple(sorted({bucket_of[id(p)] for p in layer.parameters() if id(p) in bucket_of}, reverse=True))
                     for layer in chunk]
            for layer, needed, following in zip(chunk, needs, needs[1:] + [()]):
                if needed or following:
                    self._hooks.append(layer.register_forward_pre_hook(
                        partial(self._before_forward, needed, following)))

    def _before_forward(self, needed: tuple[int, ...], following: tuple[int, ...] = (), module: nn.Module | None = None,
                        args: Any = None) -> None:
        if self.level == 3:   # buckets in forward order (they are cut in reverse order of use)
            for index in (*needed, *following):
                self._launch_gather(index)
        if self._gathers:
            for index in needed:
                self._land_gather(index)

    def wait_parameters(self) -> None:
        """Every parameter holds the last step's update (no all-gather left in flight)."""
        for index in list(self._gathers):
            self._land_gather(index)

    def whole_parameters(self) -> None:
        """Collective over the group: every parameter whole and holding the last update (checkpoints,
        the end of training; zero3 keeps them whole until the next step's SYNC frees them)."""
        observe, self.observe = self.observe, None   # outside the steps: not a step's peak (held_bytes)
        try:
            if self.level == 3:
                self.acquire(range(len(self.buckets)))
            self.wait_parameters()
        finally:
            self.observe = observe

    def parameters_loaded(self) -> None:
        """The whole parameters were written (a checkpoint loaded into them): zero3 takes its shard
        from them (zero1/2's pieces are views of the parameters already)."""
        if self.level == 3:
            for piece in self.pieces:
                piece.view.data.copy_(piece.param.data.view(-1)[piece.begin:piece.end])

    def acquire(self, indices: Iterable[int]) -> None:
        """Collective over the group: the buckets ``indices`` whole (launched together, then landed)."""
        indices = list(indices)
        for index in indices:
            self._launch_gather(index)
        for index in indices:
            self._land_gather(index)

    def whole(self, indices: Iterable[int]) -> bool:
        """Whether every bucket of ``indices`` is gathered (a gather in flight is not)."""
        return all(index in self._present for index in indices)

    def prefetch(self, indices: Iterable[int]) -> None:
        """zero3: launches the gathers of ``indices`` (landed by the next ``acquire`` or forward)."""
        for index in indices:
            self._launch_gather(index)

    def release(self, indices: Iterable[int]) -> None:
        """zero3: frees the parameters of buckets ``indices`` (the storage, not the tensors: shapes,
        names and autograd's references stay); the rank keeps its shard in ``_master``."""
        if self.level != 3:
            return
        for index in indices:
            self._land_gather(index)   # a gather in flight would write into freed storage
            for param in self.buckets[index].params:
                param.untyped_storage().resize_(0)
            self._present.discard(index)

    def _launch_gathers(self) -> None:
        """Starts every bucket's all-gather of the updated shards, in the forward's order of use
        (the buckets are cut in reverse order of use)."""
        for piece in self.pieces:
            self._mine[piece.shard_offset:piece.shard_offset + piece.end - piece.begin].copy_(piece.view)
        for index in reversed(range(len(self.buckets))):
            bucket = self.buckets[index]
            gathered = torch.empty(bucket.per_rank * self.dp, dtype=self._mine.dtype, device=self._mine.device)
            mine = self._mine[bucket.shard_offset:bucket.shard_offset + bucket.per_rank]
            self._gathers[index] = (all_gather_flat(gathered, mine, group=self.group, async_op=True), gathered)

    def _launch_gather(self, index: int) -> None:
        """zero3: starts bucket ``index``'s all-gather from the shards, unless it is whole or on its way."""
        if index in self._present or index in self._gathers:
            return
        bucket = self.buckets[index]
        gathered = torch.empty(bucket.per_rank * self.dp, dtype=self._dtype, device=self._device)
        mine = self._master[bucket.shard_offset:bucket.shard_offset + bucket.per_rank]
        self._gathers[index] = (all_gather_flat(gathered, mine, group=self.group, async_op=True), gathered)

    @torch.no_grad()   # called from a forward pre-hook, inside a graph being recorded

    def _all_gathered(self, mine: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``mine`` (default ``_mine``), in the flat order: rank r's part of each bucket
        back in its place."""
        gathered = self._new_flat()
        all_gather_flat(gathered, self._mine if mine is None else mine, group=self.group)
        if len(self.buckets) == 1:   # one range: the ranks' parts are already in order
            return gathered
        per_rank = gathered.view(self.dp, self.shard_numel)
        flat = torch.empty(self.total, dtype=gathered.dtype, device=gathered.device)
        for bucket in self.buckets:
            parts = per_rank[:, bucket.shard_offset:bucket.shard_offset + bucket.per_rank].reshape(-1)
            flat[bucket.begin:bucket.begin + bucket.numel].copy_(parts[:bucket.numel])
        return flat

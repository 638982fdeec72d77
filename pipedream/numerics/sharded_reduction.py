"""``optim.distributed`` with ``train.overlap_grad_reduce``: the gradients reduce-scattered
bucket by bucket during the backward, into the distributed optimizer's shard."""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from pipedream.numerics.grad_buckets import Bucket, BucketedReduction, ReductionRecorder, make_bucket
from pipedream.numerics.sharded_optim import ShardedOptimizer


class ShardedReduction(BucketedReduction):
    """``optim.distributed`` with ``train.overlap_grad_reduce``: each of the optimizer's buckets is
    reduce-scattered into the shard as soon as the step's backwards have finished its gradients
    (``BucketedReduction``'s hooks and launch order), and ``finish`` (the SYNC) waits for all of
    them before the sharded step. Buckets holding ``deferred`` parameters (tied copies, summed
    across stages at the SYNC first) go last, on every replica alike, so the collectives match."""

    def __init__(self, optimizer: ShardedOptimizer, deferred: set[int], recorder: ReductionRecorder | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.optimizer = optimizer
        order = sorted(optimizer.buckets, key=lambda b: any(id(p) in deferred for p in b.params))
        self._sharded = {}
        buckets = []
        for sharded in order:
            bucket = make_bucket(sharded.params)
            self._sharded[id(bucket)] = sharded
            buckets.append(bucket)
        super().__init__([p for b in optimizer.buckets for p in b.params], optimizer.group, optimizer.dp, 0,
                         overlap=True, recorder=recorder, clock=clock, buckets=buckets, held=frozenset(deferred))

    def accumulated(self, param: torch.Tensor) -> None:
        super().accumulated(param)
        if self.optimizer.level >= 2:   # whole gradients go as soon as their shard has arrived
            self._land_completed()

    def _land_completed(self) -> None:
        for bucket in self.buckets[:self._next]:
            if not bucket.landed and bucket.work.is_completed():
                bucket.work.wait()   # done already; orders the result's stream where there is one
                bucket.completed_at = self.clock()
                self._land(bucket)
                bucket.landed = True

    def finish(self) -> None:
        super().finish()
        self.optimizer.gradients_reduced()

    def _fill_missing(self) -> None:
        """Nothing: a missing gradient reduces as zeros (``_launch``), and a landed bucket's whole
        gradients must stay dropped."""

    def held_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets if b.buffer is not None)

    def _new_buffer(self, bucket: Bucket) -> torch.Tensor:
        return self.optimizer.bucket_buffer(self._sharded[id(bucket)])

    def _collective(self, bucket: Bucket) -> dist.Work:
        return self.optimizer.reduce_scatter(self._sharded[id(bucket)], bucket.buffer)

    def _land(self, bucket: Bucket) -> None:
        self.optimizer.land(self._sharded[id(bucket)])
        bucket.buffer = None   # a gradient-sized buffer only while the buckets are in flight

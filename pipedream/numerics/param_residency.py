"""zero3 with ``optim.reshard_after_forward=true``: a chunk's parameters are whole only while one of
its actions runs. The layers' forward pre-hooks (``ShardedOptimizer.shard_parameters``) gather them
for a forward; the stage calls ``after_forward`` when the forward is done and brackets each backward
(B, W or both) with ``before_backward``/``after_backward``, which gather the chunk's buckets whole
and free them again. Every data-parallel replica of a stage runs the same actions in the same order,
so the gathers of the group match."""
from __future__ import annotations

from typing import Iterable

from torch import nn

from pipedream.numerics.sharded_optim import ShardedOptimizer


class ChunkResidency:
    def __init__(self, optimizer: ShardedOptimizer, chunks: Iterable[Iterable[nn.Module]]):
        self.optimizer = optimizer
        bucket_of = {id(p): index for index, bucket in enumerate(optimizer.buckets) for p in bucket.params}
        # per chunk, its buckets in forward order (they are cut in reverse order of use)
        self.buckets = [sorted({bucket_of[id(p)] for p in nn.ModuleList(list(chunk)).parameters()
                                if id(p) in bucket_of}, reverse=True) for chunk in chunks]

    def after_forward(self, chunk: int) -> None:
        self.optimizer.release(self.buckets[chunk])

    def before_backward(self, chunk: int) -> None:
        self.optimizer.acquire(self.buckets[chunk])

    def after_backward(self, chunk: int) -> None:
        self.optimizer.release(self.buckets[chunk])

"""A one-rank Gloo process group inside the test process, for unit tests of code that calls
``torch.distributed`` (checkpoints, engines, sharded optimizers) without starting processes."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist


@contextmanager
def world_of_one() -> Iterator[None]:
    """Rank 0 of a world of one (an in-memory store) for the body; a group already there is kept."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()

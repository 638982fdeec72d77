"""What a run's stash (the tensors each micro-batch keeps for its backward) tells the tests about
the memory savers: recomputation and sequence parallelism."""
from __future__ import annotations

from typing import Any


def stash_bytes_per_microbatch(result: dict[str, Any]) -> list[int]:
    """Per rank, from rank 0's result of a ``train_rank`` run: the bytes one micro-batch keeps
    until its backward, over all of the rank's chunks."""
    return [sum(rank["stash_bytes_per_microbatch"].values()) for rank in result["summary"]["ranks"]]


def assert_stash_grows(stashes: dict[str, list[int]]) -> None:
    """On every rank the stash grows strictly from run to run, in the order given (full <
    selective < no recomputation, say)."""
    for rank in range(len(next(iter(stashes.values())))):
        in_order = [stash[rank] for stash in stashes.values()]
        assert all(a < b for a, b in zip(in_order, in_order[1:])), f"rank {rank}: {stashes}"

"""The zigzag layout of a sequence over ``cp`` context-parallel ranks.

The sequence is cut into ``2·cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2cp-1-i``, in
that order. Under a causal mask a query at position ``p`` reads ``p + 1`` keys, so an early chunk
is cheap and a late one dear; pairing them gives every rank the same attention work."""
from __future__ import annotations

import torch
import torch.distributed as dist

from models.errors import ConfigError


def check_divisible(seq_len: int, cp: int) -> int:
    """The chunk length; raises when ``seq_len`` does not cut into ``2·cp`` equal chunks."""
    if cp < 1:
        raise ConfigError(f"context-parallel size cp={cp} is not positive: use cp >= 1")
    if seq_len % (2 * cp):
        raise ConfigError(f"sequence length {seq_len} is not divisible by 2·cp = {2 * cp} (context parallelism "
                          f"cuts it into 2·cp equal zigzag chunks): use a multiple of {2 * cp} or a smaller cp")
    return seq_len // (2 * cp)


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk numbers rank ``rank`` holds, front one first."""
    if not 0 <= rank < cp:
        raise ConfigError(f"context-parallel rank {rank} is outside 0..{cp - 1} for cp={cp}")
    return rank, 2 * cp - 1 - rank


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions (int64, in local order) rank ``rank`` holds: for position ids and rotary."""
    chunk = check_divisible(seq_len, cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(cp, rank)])


def split_zigzag(tensor: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``tensor`` along its sequence dimension ``dim``."""
    check_divisible(tensor.shape[dim], cp)
    chunks = tensor.chunk(2 * cp, dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(cp, rank)], dim)


def unsplit_zigzag(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order): the inverse of ``split_zigzag``."""
    halves = [shard.chunk(2, dim) for shard in shards]
    # chunks 0..cp-1 are the ranks' front halves in rank order, chunks cp..2cp-1 their back halves reversed
    return torch.cat([front for front, _ in halves] + [back for _, back in reversed(halves)], dim)


def gather_zigzag(shard: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """The whole sequence on every rank of ``group`` from each one's shard (all_gather; no autograd)."""
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return unsplit_zigzag(shards, dim)

"""The zigzag layout of context parallelism: every position on exactly one rank, the same causal
attention work on every rank, and split/unsplit as inverses."""
from __future__ import annotations

import pytest
import torch

from models.context_parallel import split_zigzag, unsplit_zigzag, zigzag_indices
from models.errors import ConfigError


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_position_is_held_by_exactly_one_rank(cp):
    seq_len = 8 * cp
    held = torch.cat([zigzag_indices(seq_len, cp, rank) for rank in range(cp)])
    assert torch.equal(held.sort().values, torch.arange(seq_len))


def test_rank_holds_its_front_chunk_then_the_mirrored_back_chunk():
    assert zigzag_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert zigzag_indices(4, 1, 0).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_attention_work_is_the_same_on_every_rank(cp):
    # a query at position p reads p + 1 keys under the causal mask
    work = [int((zigzag_indices(4 * cp, cp, rank) + 1).sum()) for rank in range(cp)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp, dim", [(1, 1), (2, 1), (4, 2), (3, 0)])
def test_split_then_unsplit_gives_back_the_tensor(cp, dim):
    shape = [3, 5, 7]
    shape[dim] = 2 * cp * 3
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    shards = [split_zigzag(tensor, cp, rank, dim) for rank in range(cp)]
    assert all(shard.shape[dim] == shape[dim] // cp for shard in shards)
    assert torch.equal(unsplit_zigzag(shards, dim), tensor)


def test_split_takes_the_positions_the_indices_name():
    positions = torch.arange(24).view(1, 24)
    for rank in range(3):
        assert torch.equal(split_zigzag(positions, 3, rank, 1)[0], zigzag_indices(24, 3, rank))


def test_a_sequence_that_does_not_cut_into_2cp_chunks_is_refused_in_one_line():
    with pytest.raises(ConfigError) as caught:
        zigzag_indices(30, 4, 0)
    message = str(caught.value)
    assert "\n" not in message
    assert "30" in message and "2·cp = 8" in message and "multiple of 8" in message
    with pytest.raises(ConfigError, match="not divisible by 2·cp = 4"):
        split_zigzag(torch.zeros(2, 6), 2, 0, 1)


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ConfigError, match="rank 2 is outside 0..1"):
        zigzag_indices(8, 2, 2)

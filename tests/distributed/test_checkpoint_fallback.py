"""Two ranks agree on falling back: a flipped bit in the newest checkpoint's shard makes the resumed
run load the previous one, and it still ends with exactly the weights of an uninterrupted run."""
from __future__ import annotations

import pytest
import torch

from tests.support.checkpoint_harness import losses_across_resume, train_full, train_interrupted
from tests.distributed.test_checkpoint import BASE
from tests.support.training_harness import merge_params
from tests.support.workers import run_workers


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_on_every_rank(tmp_path):
    overrides = BASE + ["parallel.pp=2", "checkpoint.every=1", "checkpoint.keep=3"]
    expected = merge_params(run_workers(train_full, 2, overrides, str(tmp_path / "full")))
    run_dir = tmp_path / "resumed"
    run_workers(train_interrupted, 2, overrides, str(run_dir), 3)
    shard = sorted((run_dir / "checkpoints" / "step_00000003").glob("*.distcp"))[-1]   # rank 1's layers
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = merge_params(run_workers(train_full, 2, overrides + ["train.resume=auto"], str(run_dir)))
    losses_across_resume(run_dir, 3, 4, resumed_after=2)   # the resume starts after step 2, not 3 nor 0
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name

"""A checkpoint write that fails part-way (the disk full: here a file-size limit, RLIMIT_FSIZE, in
both ranks, so every write past it fails with EFBIG) ends the run with one line naming the folder
and the cause; the half-written folder is gone, the previous checkpoint is intact and is the one
``train.resume=auto`` picks."""
from __future__ import annotations

import resource
import signal

import pytest

from tests.distributed.test_checkpoint import BASE
from tests.support.training_harness import _train_once
from tests.support.workers import run_workers

LIMIT = 48 << 10   # bytes: each rank's shard is larger; logs, metrics and run records stay below


def train_then_fill_the_disk(rank: int, world_size: int, overrides: list[str], run_dir: str) -> str:
    """A step and its checkpoint, then a resumed run whose second checkpoint cannot be written;
    returns the line the failure is reported as."""
    from pipedream.lifecycle.failures import failure_line
    from pipedream.runtime.distributed import init_distributed, shutdown

    init_distributed("cpu", 60)
    try:
        _train_once(rank, world_size, overrides + ["train.steps=1"], run_dir)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails (EFBIG), no signal death
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            _train_once(rank, world_size, overrides + ["train.steps=2", "train.resume=auto"], run_dir)
        except Exception as error:   # noqa: BLE001 - the line is what the test checks
            return failure_line(error, rank, 60)
        return "finished"
    finally:
        shutdown()


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path):
    from pipedream.checkpoint.integrity import checkpoint_problem
    from pipedream.checkpoint.store import complete_checkpoints

    overrides = BASE + ["parallel.pp=2", "checkpoint.every=1", "trace.enabled=false"]
    lines = run_workers(train_then_fill_the_disk, 2, overrides, str(tmp_path / "run"))
    root = tmp_path / "run" / "checkpoints"
    assert lines[0] == lines[1] and "\n" not in lines[0]
    assert lines[0].startswith(f"error: checkpoint {root / 'step_00000002'} could not be written (rank ")
    assert "File too large" in lines[0] and f"{root / 'step_00000001'} is the newest complete checkpoint" in lines[0]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]   # nothing half-written is left
    assert checkpoint_problem(root / "step_00000001") is None
    assert complete_checkpoints(root) == [root / "step_00000001"]   # what train.resume=auto loads

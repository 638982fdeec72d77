"""Workers for the checkpoint tests: a run that stops right after a checkpoint (as if killed), and
a run that resumes."""
from __future__ import annotations

from typing import Any

from tests.support.training_harness import _train_once


class Interrupted(Exception):
    pass


def train_interrupted(rank: int, world_size: int, overrides: list[str], run_dir: str, stop_after: int) -> str:
    """Trains until the checkpoint after step ``stop_after`` is saved, then stops (every rank)."""
    from pipedream.checkpoint.store import RunCheckpoints
    from pipedream.runtime.distributed import init_distributed, shutdown

    original = RunCheckpoints.after_step

    def after_step(self, steps_done: int) -> None:
        original(self, steps_done)
        if steps_done == stop_after:
            raise Interrupted

    RunCheckpoints.after_step = after_step
    init_distributed("cpu", 60)
    try:
        _train_once(rank, world_size, overrides, run_dir)
    except Interrupted:
        return "stopped"
    finally:
        RunCheckpoints.after_step = original   # the worker process runs other tests' ranks next
        shutdown()
    return "finished"


def train_full(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    from pipedream.runtime.distributed import init_distributed, shutdown
    init_distributed("cpu", 60)
    try:
        return _train_once(rank, world_size, overrides, run_dir)
    finally:
        shutdown()

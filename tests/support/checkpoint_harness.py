"""Workers for the checkpoint tests: a run that stops right after a checkpoint (as if killed), and
a run that resumes; and the losses they logged, read as logged."""
from __future__ import annotations

import json
from pathlib import Path
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


def logged_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl line by line (a resumed run appends its lines to the interrupted run's)."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def logged_losses(run_dir: str | Path, steps: int) -> list[float]:
    """The losses of an uninterrupted run, which logged steps 1..``steps`` once each, in order."""
    records = logged_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), f"{run_dir}: {[r['step'] for r in records]}"
    return [r["loss"] for r in records]


def losses_across_resume(run_dir: str | Path, stopped_after: int, steps: int,
                         resumed_after: int | None = None) -> list[float]:
    """The losses of steps 1..``steps`` of a run interrupted after step ``stopped_after`` and resumed
    from its checkpoint of step ``resumed_after`` (by default the same), checked as logged: the
    first run's lines for steps 1..``stopped_after``, then the resumed run's from step
    ``resumed_after + 1``, one per step. A resume that silently restarted from step 0 logs step 1
    again and fails here, though its losses by step (and its weights) would match."""
    resumed_after = stopped_after if resumed_after is None else resumed_after
    records = logged_records(run_dir)
    expected = [*range(1, stopped_after + 1), *range(resumed_after + 1, steps + 1)]
    assert [r["step"] for r in records] == expected, f"{run_dir}: steps logged {[r['step'] for r in records]}"
    return [r["loss"] for r in records[:resumed_after] + records[stopped_after:]]

"""Worker for the preemption tests: one run on which a single rank receives the preemption signal
after a given step, then the resumed run and an uninterrupted one, in one process group."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from tests.support.training_harness import _train_once


def signal_then_resume(rank: int, world_size: int, overrides: list[str], preempted_dir: str, reference_dir: str,
                       signalled_rank: int, signal_after: int) -> dict[str, Any]:
    """Rank ``signalled_rank`` alone signals itself right after step ``signal_after``; returns the
    preempted run's summary and what it left in its run directory, then the resumed and the
    uninterrupted runs' losses and parameters."""
    from pipedream.checkpoint.store import RunCheckpoints, complete_checkpoints
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.lifecycle.preemption import read_marker
    from pipedream.lifecycle.preemption_watch import PreemptionWatch

    original = RunCheckpoints.after_step
    original_stop = PreemptionWatch.stop
    stops: list[int] = []

    def stop(self, step: int, checkpoints: RunCheckpoints) -> Path:
        stops.append(step)
        return original_stop(self, step, checkpoints)

    def after_step(self, steps_done: int) -> None:
        original(self, steps_done)
        if rank == signalled_rank and steps_done == signal_after:
            os.kill(os.getpid(), signal.SIGUSR1)

    init_distributed("cpu", 60)
    try:
        RunCheckpoints.after_step, PreemptionWatch.stop = after_step, stop
        preempted = _train_once(rank, world_size, overrides, preempted_dir)
        RunCheckpoints.after_step = original
        run_dir = Path(preempted_dir)
        left = {"stops": list(stops), "marker": read_marker(run_dir), "summary": (run_dir / "summary.json").exists(),
                "checkpoints": [p.name for p in complete_checkpoints(run_dir / "checkpoints")]}
        resumed = _train_once(rank, world_size, [*overrides, "train.resume=auto"], preempted_dir)
        reference = _train_once(rank, world_size, overrides, reference_dir)
    finally:
        RunCheckpoints.after_step, PreemptionWatch.stop = original, original_stop
        shutdown()
    return {"preempted": preempted, "left": left, "resumed": resumed, "reference": reference}

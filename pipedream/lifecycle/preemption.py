"""The record of a preempted run (torch-free: the launcher reads it; the settings:
``pipedream.config.preemption``).

A scheduler warns a job before it ends it: SLURM sends ``preemption.signal`` (USR1) some minutes
before the time limit (``#SBATCH --signal=USR1@300``) and, with ``PreemptParameters=send_user_signal``,
when it preempts the job. Every rank then saves a checkpoint at the next step boundary
(``pipedream.lifecycle.preemption_watch``), rank 0 writes ``<run_dir>/preempted.json``, and the ranks end with
exit code 0, so torchrun never restarts them. The launcher sees the record and exits with
``preemption.requeue_exit_code``, on which the sbatch script runs ``scontrol requeue``; the requeued
job continues with ``train.resume=auto``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MARKER = "preempted.json"


def write_marker(run_dir: Path, record: dict[str, Any]) -> Path:
    path = run_dir / MARKER
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return path


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    """The record of a run that stopped for preemption, or None."""
    try:
        return json.loads((run_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def clear_marker(run_dir: Path) -> None:
    (run_dir / MARKER).unlink(missing_ok=True)

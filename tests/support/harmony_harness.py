"""Runs harmony_pp training on a rank and collects what the tests compare: the losses (rank 0),
the host copies of the layers the rank owns, and its summary record."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipedream.config.loading import compose_config


def harmony_train_rank(rank: int, world_size: int, runs: list[tuple[list[str], str]]) -> list[dict[str, Any]]:
    """Like ``training_harness.train_rank``: every (overrides, run_dir) in one process group."""
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.config.run_spec import build_run_spec
    from pipedream.trainer import train

    init_distributed("cpu", 60)
    results = []
    try:
        for overrides, run_dir in runs:
            cfg = compose_config(overrides + [f"train.run_dir={run_dir}"])
            outcome = train(build_run_spec(cfg, world_size), init_distributed("cpu", 60))
            losses = []
            if rank == 0:
                lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
                losses = [json.loads(line)["loss"] for line in lines]
            results.append({"params": {k: v.clone() for k, v in outcome.engine.host_parameters().items()},
                            "losses": losses, "summary": outcome.summary if rank == 0 else None})
    finally:
        shutdown()
    return results

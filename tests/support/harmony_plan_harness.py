"""A rank of a planned harmony_pp run: the config with ``parallel.plan=`` folded in as the training
entry point does (``plan_config.apply_plan``), then the trainer; what the tests compare."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipedream.config.loading import compose_config


def planned_harmony_rank(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    from pipedream.runtime.distributed import init_distributed, shutdown
    from pipedream.config.plan_config import apply_plan
    from pipedream.config.run_spec import build_run_spec
    from pipedream.trainer import train

    init_distributed("cpu", 60)
    try:
        cfg = apply_plan(compose_config(overrides + [f"train.run_dir={run_dir}"]))
        outcome = train(build_run_spec(cfg, world_size), init_distributed("cpu", 60))
        losses = [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()] \
            if rank == 0 else []
        return {"params": {k: v.clone() for k, v in outcome.engine.host_parameters().items()}, "losses": losses,
                "summary": outcome.summary if rank == 0 else None}
    finally:
        shutdown()

"""Run outputs on rank 0: the resolved config, metrics.jsonl per logged step, summary.json at the end."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class StepTimes:
    """Wall-clock seconds per step; the median skips warm-up steps (allocator, caches, threads)."""

    seconds: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.seconds.append(value)

    def median_after_warmup(self) -> float:
        warmup = min(5, len(self.seconds) // 5)
        steady = self.seconds[warmup:] or self.seconds
        return statistics.median(steady) if steady else float("nan")


class RunWriter:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")

    def write_config(self, text: str) -> None:
        (self.run_dir / "config.yaml").write_text(text, encoding="utf-8")

    def log_step(self, record: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        return path

    def close(self) -> None:
        self._metrics.close()

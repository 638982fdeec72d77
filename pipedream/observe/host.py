"""What a measured speed depends on, and where measured speeds are kept, without importing torch
(the planner's dry run reads them too).

Measurements (the runtime's peak FLOP/s, the planner's ``local_cpu`` matmul speed) are cached as
JSON files in ``$PIPEDREAM_CACHE_DIR`` (default ``~/.cache/pipedream``), one entry per key; deleting
a file makes the next run measure again.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

CACHE_ENV = "PIPEDREAM_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pipedream")


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``), or the architecture where that is unavailable."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def cached_flops(path: Path, key: str) -> float | None:
    value = read_cache(path).get(key, {}).get("flops")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def write_cache(path: Path, key: str, flops: float) -> None:
    """Read-modify-write through a temporary file, so a concurrent reader never sees half a file."""
    entries = read_cache(path)
    entries[key] = {"flops": flops, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)

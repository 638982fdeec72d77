"""Run outputs on rank 0 (the resolved config, metrics.jsonl per logged step, summary.json at the
end, optional TensorBoard scalars), the formulas behind the throughput metrics, and the console:
the logged step line and whether a progress bar is drawn."""
from __future__ import annotations

import json
import math
import resource
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from models.facts import flops_per_iteration

from pipedream.errors import ConfigError

TENSORBOARD_HINT = ("logging.tensorboard=true needs the tensorboard package, which is not installed: "
                    "run `.venv/bin/pip install tensorboard` or set logging.tensorboard=false")


@dataclass
class StepTimes:
    """Wall-clock seconds per step; the median skips warm-up steps (allocator, caches, threads)."""

    seconds: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.seconds.append(value)

    def warmup(self) -> int:
        return min(5, len(self.seconds) // 5)

    def median_after_warmup(self) -> float:
        steady = self.seconds[self.warmup():] or self.seconds
        return statistics.median(steady) if steady else float("nan")


def warmup_steps(total_steps: int) -> int:
    """The steps ``StepTimes`` skips, known before the run (the trace avoids them)."""
    return min(5, total_steps // 5)


def model_flops_per_iteration(model_cfg: Any, global_batch: int, seq_len: int | None, recompute: bool,
                              plugin_forward_flops: float | None = None) -> float:
    """Model FLOPs of one training iteration over the global batch (the numerator of MFU). The
    planner predicts with the same ``models.facts`` formulas, so MFU compares with its prediction.
    A plugin model gives its forward FLOPs per sample, as counted on the meta device when it was
    checked (``RunSpec.plugin_forward_flops``; backward: twice the forward)."""
    if model_cfg.get("_target_") is not None:
        if plugin_forward_flops is None:
            raise ValueError("a plugin model's FLOPs come from its check: pass plugin_forward_flops")
        return (4 if recompute else 3) * plugin_forward_flops * global_batch
    return flops_per_iteration(model_cfg, global_batch, recompute, seq_len)


@dataclass(frozen=True)
class Throughput:
    """Turns a step time into the per-step metrics; the same numbers feed metrics.jsonl and summary.json.
    A quantity the run cannot know is None (null in the JSON): tokens/s without a sequence per sample
    (``tokens_per_sample`` None: MLP, vision, plugin models), TFLOP/s and MFU when the FLOPs are
    unknown (``flops_per_iteration`` <= 0), MFU when the peak is (``peak_flops_per_device`` <= 0)."""

    global_batch: int
    tokens_per_sample: int | None
    flops_per_iteration: float
    devices: int
    peak_flops_per_device: float

    def of(self, step_time_s: float) -> dict[str, float | None]:
        tflops = (self.flops_per_iteration / step_time_s / self.devices / 1e12
                  if self.flops_per_iteration > 0 else None)
        return {"samples_per_s": self.global_batch / step_time_s,
                "tokens_per_s": (self.global_batch * self.tokens_per_sample / step_time_s
                                 if self.tokens_per_sample else None),
                "tflops_per_device": tflops,
                "mfu": (tflops * 1e12 / self.peak_flops_per_device
                        if tflops is not None and self.peak_flops_per_device > 0 else None)}


def _known(value: float | None) -> bool:
    return value is not None and not math.isnan(value)


def format_mfu(mfu: float | None) -> str:
    """``n/a`` when unknown; two significant digits below 0.1% (never a misleading ``0.0%``)."""
    if not _known(mfu):
        return "n/a"
    return f"{mfu:.1%}" if mfu == 0 or mfu >= 1e-3 else f"{mfu * 100:.2g}%"


def format_step_line(record: dict[str, Any], steps: int) -> str:
    """The console line of a logged step: tokens/s only where samples have tokens, MFU ``n/a`` when
    the FLOPs or the peak are unknown."""
    text = (f"step {record['step']:>5}/{steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"step {record['step_time_s'] * 1000:.0f} ms  {record['samples_per_s']:.1f} samples/s  ")
    if _known(record.get("tokens_per_s")):
        text += f"{record['tokens_per_s']:.0f} tokens/s  "
    text += f"MFU {format_mfu(record.get('mfu'))}"
    if "val_loss" in record:
        text += f"  val_loss {record['val_loss']:.4f}"
    return text


def progress_bar_wanted(enabled: bool, rank: int, stream: TextIO) -> bool:
    """``train.progress`` draws a bar on rank 0 only when ``stream`` is a terminal: in a pipe or a log
    file its carriage-return frames would interleave with the step lines."""
    if not enabled or rank != 0:
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # a replaced or closed stream
        return False


def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    """Peak memory of this process: the CUDA caching allocator's high-water marks on GPU, the
    resident set size high-water mark (VmHWM) on CPU."""
    if device.type == "cuda":
        return {"allocated": int(torch.cuda.max_memory_allocated(device)),
                "reserved": int(torch.cuda.max_memory_reserved(device))}
    try:
        for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
            if line.startswith("VmHWM:"):
                return {"rss": int(line.split()[1]) * 1024}
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"rss": int(maxrss if sys.platform == "darwin" else maxrss * 1024)}


def check_tensorboard(enabled: bool) -> None:
    """Fails before training (on every rank) rather than after it, when TensorBoard is missing."""
    if not enabled:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError(TENSORBOARD_HINT) from None


class RunWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = False):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._tensorboard = None
        if tensorboard:
            check_tensorboard(True)
            from torch.utils.tensorboard import SummaryWriter
            self._tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write_config(self, text: str) -> None:
        (self.run_dir / "config.yaml").write_text(text, encoding="utf-8")

    def log_step(self, record: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(f"train/{key}", value, record["step"])

    def write_summary(self, summary: dict[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        return path

    def close(self) -> None:
        self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
